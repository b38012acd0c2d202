"""Recursive-descent parser of the CompLL DSL (grammar: docs/dsl.md)."""
from __future__ import annotations

from typing import List, Optional

from hipress.dsl import ast as A
from hipress.dsl.errors import DSLError
from hipress.dsl.lexer import SCALAR_TYPES, Token, tokenize

TYPE_KWS = set(SCALAR_TYPES) | {"void", "uint"}
MAX_DEPTH = 100
# Binary operator precedence (C's), higher binds tighter.
BINARY = [
    ("||",), ("&&",), ("|",), ("^",), ("&",), ("==", "!="), ("<", "<=", ">", ">="), ("<<", ">>"), ("+", "-"),
    ("*", "/", "%"),
]
ASSIGN_OPS = ("=", "+=", "-=", "*=", "/=")


class Parser:
    def __init__(self, src: str, file: str = "<spec>"):
        self.file = file
        self.toks: List[Token] = tokenize(src, file)
        self.i = 0
        self.depth = 0

    # ---- helpers ----
    @property
    def tok(self) -> Token:
        return self.toks[self.i]

    def peek(self, k=1) -> Token:
        return self.toks[min(self.i + k, len(self.toks) - 1)]

    def error(self, msg, tok: Optional[Token] = None):
        t = tok or self.tok
        raise DSLError(msg, self.file, t.line, t.col)

    def describe(self, t: Token) -> str:
        return "end of file" if t.kind == "eof" else f"'{t.text}'"

    def at(self, text, kind=None) -> bool:
        t = self.tok
        return t.text == text and t.kind in ((kind,) if kind else ("op", "kw"))

    def accept(self, text) -> Optional[Token]:
        if self.at(text):
            t = self.tok
            self.i += 1
            return t
        return None

    def expect(self, text, what=None) -> Token:
        if not self.at(text):
            self.error(f"expected '{text}'{' ' + what if what else ''}, found {self.describe(self.tok)}")
        t = self.tok
        self.i += 1
        return t

    def ident(self, what="a name") -> Token:
        t = self.tok
        if t.kind != "id":
            if t.kind == "kw":
                self.error(f"'{t.text}' is a reserved word, expected {what}")
            self.error(f"expected {what}, found {self.describe(t)}")
        self.i += 1
        return t

    def enter(self):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            self.error(f"nesting deeper than {MAX_DEPTH} levels")

    def leave(self):
        self.depth -= 1

    # ---- types ----
    def at_type(self) -> bool:
        return self.tok.kind == "kw" and self.tok.text in TYPE_KWS

    def type_ref(self, allow_struct=False) -> A.TypeRef:
        t = self.tok
        if t.kind == "kw" and t.text in TYPE_KWS:
            self.i += 1
            width = None
            if t.text == "uint":
                self.expect("<", "after 'uint' (write uint<width>)")
                width = self.binary(len(BINARY) - 2)  # additive level: '>' ends the width
                self.expect(">", "to close uint<width>")
            ref = A.TypeRef(t.line, t.col, t.text, width)
        elif allow_struct and t.kind == "id":
            self.i += 1
            ref = A.TypeRef(t.line, t.col, t.text)
        else:
            self.error(f"expected a type, found {self.describe(t)}")
        if self.accept("*"):
            ref.array = True
        return ref

    # ---- top level ----
    def program(self) -> A.Program:
        prog = A.Program(1, 1, self.file, None, [], [], [])
        while self.tok.kind != "eof":
            t = self.tok
            if self.at("algorithm", "kw"):
                if prog.algorithm is not None:
                    self.error("a spec has at most one 'algorithm' declaration")
                prog.algorithm = self.algorithm()
            elif self.at("param", "kw"):
                prog.params.append(self.param_block())
            elif self.at("view", "kw"):
                if prog.view is not None:
                    self.error("a spec has at most one 'view' declaration")
                prog.view = self.view()
            elif self.at("state", "kw"):
                self.i += 1
                ty = self.type_ref()
                if self.at("["):
                    ty.dims = self.dims()
                d = self.decl_rest(ty)
                d.state = True
                d.line, d.col = t.line, t.col
                prog.globals.append(d)
            elif self.at_type() or t.kind == "id":
                ty = self.type_ref(allow_struct=True)
                name = self.ident("a function or variable name")
                if self.at("("):
                    prog.funcs.append(self.func(ty, name))
                else:
                    self.i -= 1
                    prog.globals.append(self.decl_rest(ty))
            else:
                self.error(f"expected a declaration (param, algorithm, a global or a function), found "
                           f"{self.describe(t)}")
        return prog

    def algorithm(self) -> A.AlgoDecl:
        t = self.expect("algorithm")
        name = self.ident("the algorithm name")
        opts = []
        if self.accept("("):
            if not self.at(")"):
                while True:
                    k = self.ident("an option name (id, category, error_feedback, rate)")
                    self.expect("=")
                    opts.append((k.text, self.expr(), k.line, k.col))
                    if not self.accept(","):
                        break
            self.expect(")")
        self.expect(";", "after the algorithm declaration")
        return A.AlgoDecl(t.line, t.col, name.text, opts)

    def view(self) -> A.View:
        t = self.expect("view")
        names = [self.ident("the number of rows")]
        for what in ("the number of columns", "the rank's name"):
            self.expect(",", "in 'view rows, cols, r = rank;'")
            names.append(self.ident(what))
        self.expect("=", "after the rank's name (view rows, cols, r = rank;)")
        e = self.expr()
        self.expect(";", "after the view declaration")
        return A.View(t.line, t.col, names[0].text, names[1].text, names[2].text, e)

    def dims(self):
        """[d0][d1] of a state matrix: each a name of the view (rows, cols or the rank)."""
        out = []
        while self.accept("["):
            d = self.ident("a dimension of the view (its rows, cols or rank name)")
            out.append((d.text, d.line, d.col))
            self.expect("]", "after a dimension")
        if len(out) > 2:
            self.error("a state matrix has two dimensions: state float[d0][d1] name;")
        return out

    def bound(self):
        neg = bool(self.accept("-"))
        t = self.tok
        if t.kind == "id" and t.text == "inf":
            self.i += 1
            return None, neg
        if t.kind not in ("int", "float"):
            self.error(f"expected a number (or inf) in a parameter range, found {self.describe(t)}")
        self.i += 1
        return (-t.value if neg else t.value), neg

    def param_range(self) -> A.Range:
        t = self.tok
        if self.accept("{"):  # a set of values: in {2, 4, 8}
            values = []
            while True:
                v, _ = self.bound()
                if v is None:
                    self.error("a set of parameter values holds numbers (no inf)", t)
                values.append(v)
                if not self.accept(","):
                    break
            self.expect("}", "to close the set of parameter values")
            return A.Range(t.line, t.col, None, True, None, True, values)
        if not (self.at("(") or self.at("[")):
            self.error(f"expected '(' or '[' to open a parameter range (e.g. in (0, 1]) or '{{' to open a set of "
                       f"values (in {{2, 4, 8}}), found {self.describe(t)}")
        lo_open = self.tok.text == "("
        self.i += 1
        lo, lneg = self.bound()
        if lo is None and not lneg:
            self.error("the lower bound of a range is a number or -inf", t)
        self.expect(",", "between the bounds of a range")
        hi, hneg = self.bound()
        if hi is None and hneg:
            self.error("the upper bound of a range is a number or inf", t)
        if not (self.at(")") or self.at("]")):
            self.error(f"expected ')' or ']' to close the parameter range, found {self.describe(self.tok)}")
        hi_open = self.tok.text == ")"
        self.i += 1
        return A.Range(t.line, t.col, lo, lo_open or lo is None, hi, hi_open or hi is None)

    def param_block(self) -> A.ParamBlock:
        t = self.expect("param")
        name = self.ident("the parameter block name")
        self.expect("{")
        fields = []
        while not self.at("}"):
            if self.tok.kind == "eof":
                self.error("unterminated param block: expected '}'")
            ty = self.type_ref()
            while True:
                f = self.ident("a parameter name")
                default = self.expr() if self.accept("=") else None
                rng = None
                if self.tok.kind == "id" and self.tok.text == "in":  # valid range: in (0, 1]
                    self.i += 1
                    rng = self.param_range()
                fields.append(A.ParamField(f.line, f.col, ty, f.text, default, rng))
                if not self.accept(","):
                    break
            self.expect(";", "after a parameter")
        self.expect("}")
        self.accept(";")
        return A.ParamBlock(t.line, t.col, name.text, fields)

    def func(self, ret: A.TypeRef, name: Token) -> A.Func:
        self.expect("(")
        params = []
        if not self.at(")"):
            while True:
                ty = self.type_ref(allow_struct=True)
                p = self.ident("a parameter name")
                params.append((ty, p.text, p.line, p.col))
                if not self.accept(","):
                    break
        self.expect(")", "to close the parameter list")
        body = self.block()
        return A.Func(ret.line, ret.col, ret, name.text, params, body)

    def block(self) -> List[A.Stmt]:
        self.expect("{")
        self.enter()
        out = []
        while not self.at("}"):
            if self.tok.kind == "eof":
                self.error("unexpected end of file: expected '}'")
            out.append(self.stmt())
        self.expect("}")
        self.leave()
        return out

    def decl_rest(self, ty: A.TypeRef) -> A.Decl:
        names = []
        while True:
            n = self.ident("a variable name")
            init = self.expr() if self.accept("=") else None
            names.append((n.text, init, n.line, n.col))
            if not self.accept(","):
                break
        self.expect(";", "after a declaration")
        return A.Decl(ty.line, ty.col, ty, names)

    # ---- statements ----
    def stmt(self) -> A.Stmt:
        t = self.tok
        if self.at("{"):
            self.error("nested blocks are not supported (use if/else)")
        if self.at("if", "kw"):
            self.i += 1
            self.expect("(")
            c = self.expr()
            self.expect(")")
            then = self.block() if self.at("{") else [self.stmt()]
            other = []
            if self.accept("else"):
                other = self.block() if self.at("{") else [self.stmt()]
            return A.If(t.line, t.col, c, then, other)
        if self.at("return", "kw"):
            self.i += 1
            v = None if self.at(";") else self.expr()
            self.expect(";", "after return")
            return A.Return(t.line, t.col, v)
        if t.kind == "id" and t.text in ("for", "while", "do", "goto"):
            self.error(f"'{t.text}' loops are not part of the DSL: the operators (map, reduce, filter, ...) iterate")
        if self.at_type() and not (self.peek().text == "(" and t.text != "uint"):
            return self.decl_rest(self.type_ref())
        e = self.expr()
        if self.tok.kind == "op" and self.tok.text in ASSIGN_OPS:
            op = self.tok.text
            self.i += 1
            v = self.expr()
            self.expect(";", "after an assignment")
            return A.Assign(t.line, t.col, e, op, v)
        self.expect(";", "after an expression")
        return A.ExprStmt(t.line, t.col, e)

    # ---- expressions ----
    def expr(self) -> A.Expr:
        self.enter()
        c = self.binary(0)
        if self.at("?"):
            q = self.tok
            self.i += 1
            a = self.expr()
            self.expect(":", "in a conditional expression")
            b = self.expr()
            c = A.Cond(q.line, q.col, c, a, b)
        self.leave()
        return c

    def binary(self, level) -> A.Expr:
        if level >= len(BINARY):
            return self.unary()
        left = self.binary(level + 1)
        while self.tok.kind == "op" and self.tok.text in BINARY[level]:
            t = self.tok
            self.i += 1
            right = self.binary(level + 1)
            left = A.Binary(t.line, t.col, t.text, left, right)
        return left

    def unary(self) -> A.Expr:
        t = self.tok
        if t.kind == "op" and t.text in ("-", "!", "~", "+"):
            self.i += 1
            self.enter()
            e = self.unary()
            self.leave()
            return e if t.text == "+" else A.Unary(t.line, t.col, t.text, e)
        return self.postfix()

    def postfix(self) -> A.Expr:
        e = self.primary()
        while True:
            if self.at("."):
                self.i += 1
                a = self.ident("a member name")
                e = A.Member(a.line, a.col, e, a.text)
            elif self.at("["):
                self.error("indexing is not part of the DSL: use map/filter/reduce over arrays")
            else:
                return e

    def primary(self) -> A.Expr:
        t = self.tok
        if t.kind in ("int", "float"):
            self.i += 1
            return A.Num(t.line, t.col, t.value, t.kind == "float")
        if self.at("("):
            self.i += 1
            e = self.expr()
            self.expect(")")
            return e
        if t.kind == "kw" and t.text in SCALAR_TYPES and self.peek().text == "(":  # cast: float(x)
            self.i += 1
            return A.Call(t.line, t.col, t.text, self.call_args())
        if t.kind == "id":
            self.i += 1
            targs = []
            # name<type>(...) : explicit type argument, e.g. random<float>(0, 1)
            if self.at("<") and self.peek().kind == "kw" and self.peek().text in TYPE_KWS and \
                    self.peek(2).text in (">", "*", "<"):
                self.i += 1
                targs.append(self.type_ref())
                self.expect(">", "to close the type argument")
                if not self.at("("):
                    self.error("a type argument must be followed by a call")
            if self.at("("):
                return A.Call(t.line, t.col, t.text, self.call_args(), targs)
            return A.Name(t.line, t.col, t.text)
        self.error(f"expected an expression, found {self.describe(t)}")

    def call_args(self) -> List[A.Expr]:
        self.expect("(")
        args = []
        if not self.at(")"):
            while True:
                args.append(self.expr())
                if not self.accept(","):
                    break
        self.expect(")", "to close the call")
        return args


def parse(src: str, file: str = "<spec>") -> A.Program:
    """Parse a spec into an AST; raises DSLError."""
    try:
        return Parser(src, file).program()
    except RecursionError:
        raise DSLError("spec nested too deeply", file, 1, 1) from None
