"""Lexer of the CompLL DSL: C-like tokens, // and /* */ comments, backslash-newline continuations."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

from hipress.dsl.errors import DSLError

KEYWORDS = {"param", "algorithm", "state", "void", "float", "int32", "uint1", "uint2", "uint4", "uint8", "uint",
            "double", "if", "else", "return", "view"}
SCALAR_TYPES = ("uint1", "uint2", "uint4", "uint8", "int32", "float", "double")
# Longest first.
DIGITS = "0123456789"
PUNCT = ["<<=", ">>=", "&&", "||", "==", "!=", "<=", ">=", "<<", ">>", "+=", "-=", "*=", "/=",
         "+", "-", "*", "/", "%", "<", ">", "=", "!", "~", "&", "|", "^", "?", ":", ";", ",", ".", "(", ")",
         "{", "}", "[", "]"]


@dataclass
class Token:
    kind: str  # "id", "kw", "int", "float", "op", "eof"
    text: str
    line: int
    col: int
    value: object = None


def tokenize(src: str, file: str = "<spec>") -> List[Token]:
    if not isinstance(src, str):
        raise DSLError("spec source must be text", file, 1, 1)
    toks: List[Token] = []
    i, line, col, n = 0, 1, 1, len(src)

    def err(msg, l=None, c=None):
        raise DSLError(msg, file, l or line, c or col)

    while i < n:
        ch = src[i]
        if ch == "\n":
            i += 1
            line += 1
            col = 1
            continue
        if ch in " \t\r\f\v":
            i += 1
            col += 1
            continue
        if ch == "\\":  # line continuation (as in the paper's Fig. 5)
            j = i + 1
            while j < n and src[j] in " \t\r":
                j += 1
            if j < n and src[j] == "\n":
                i = j + 1
                line += 1
                col = 1
                continue
            err("stray '\\' (a backslash may only end a line)")
        if src.startswith("//", i):
            while i < n and src[i] != "\n":
                i += 1
            continue
        if src.startswith("/*", i):
            end = src.find("*/", i + 2)
            if end < 0:
                err("unterminated /* comment")
            chunk = src[i:end + 2]
            nl = chunk.count("\n")
            if nl:
                line += nl
                col = len(chunk) - chunk.rfind("\n")
            else:
                col += len(chunk)
            i = end + 2
            continue
        if ch.isalpha() or ch == "_":
            j = i
            while j < n and (src[j].isalnum() or src[j] == "_"):
                j += 1
            word = src[i:j]
            if not word.isascii():
                err(f"identifier {word!r} has non-ASCII characters")
            toks.append(Token("kw" if word in KEYWORDS else "id", word, line, col))
            col += j - i
            i = j
            continue
        if ch in DIGITS or (ch == "." and i + 1 < n and src[i + 1] in DIGITS):
            j = i
            is_float = False
            if src.startswith(("0x", "0X"), i):
                j = i + 2
                while j < n and src[j] in "0123456789abcdefABCDEF":
                    j += 1
                if j == i + 2:
                    err("hexadecimal literal without digits")
                text = src[i:j]
                value = int(text, 16)
            else:
                while j < n and src[j] in DIGITS:
                    j += 1
                if j < n and src[j] == ".":
                    is_float = True
                    j += 1
                    while j < n and src[j] in DIGITS:
                        j += 1
                if j < n and src[j] in "eE":
                    k = j + 1
                    if k < n and src[k] in "+-":
                        k += 1
                    if k < n and src[k] in DIGITS:
                        is_float = True
                        j = k
                        while j < n and src[j] in DIGITS:
                            j += 1
                    else:
                        err("malformed exponent in number", line, col + (j - i))
                text = src[i:j]
                if j < n and src[j] in "fF" and is_float:
                    j += 1
                value = float(text) if is_float else int(text)
            if j < n and (src[j].isalnum() or src[j] == "_"):
                err(f"malformed number {src[i:j + 1]!r}")
            if not is_float and value > 2 ** 31 - 1:
                err(f"integer literal {value} does not fit int32")
            if is_float and abs(value) > 3.4028234663852886e38:
                err(f"float literal {text} is out of the range of float")
            toks.append(Token("float" if is_float else "int", src[i:j], line, col, value))
            col += j - i
            i = j
            continue
        for p in PUNCT:
            if src.startswith(p, i):
                toks.append(Token("op", p, line, col))
                i += len(p)
                col += len(p)
                break
        else:
            err(f"unexpected character {ch!r}")
    toks.append(Token("eof", "", line, col))
    return toks
