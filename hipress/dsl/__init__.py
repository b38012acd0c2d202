"""CompLL's domain-specific language (HiPress §4.3): front end, code generator, loader.

    from hipress import compll
    Algo = compll.load("my_algo.cll")          # check, generate C++, compile (cached), register
    c = hipress.compression.get("my_algo", bitwidth=4)

Language reference: docs/dsl.md. Modules: lexer, parser, checker (front end,
errors are DSLError with file:line:col), codegen (C++ for CPU, CUDA text),
build (g++, cache), runtime (ctypes Compressor).
"""
from hipress.dsl.errors import DSLError

__all__ = ["DSLError", "parse", "check", "SPEC_DIR"]

import os as _os

SPEC_DIR = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "specs")


def parse(src: str, file: str = "<spec>"):
    from hipress.dsl.parser import parse as _p
    return _p(src, file)


def check(src: str, file: str = "<spec>", name=None):
    """Parse and type-check; returns the checked Spec (raises DSLError)."""
    from hipress.dsl.checker import check as _c
    from hipress.dsl.parser import parse as _p
    return _c(_p(src, file), src, name)
