"""CompLL's domain-specific language (HiPress §4.3): the implementation behind
:mod:`hipress.compll`, which is the one front door (load, check, generate, build, CLI).

    from hipress import compll
    Algo = compll.load("my_algo.cll")          # check, generate C++, compile (cached), register
    c = hipress.compression.get("my_algo", bitwidth=4)

Language reference: docs/dsl.md. Modules: lexer, parser, checker (front end, errors are
DSLError with file:line:col; ``checker.check_source`` parses and checks), codegen (one
generator) with its targets (target_cpp, codegen_cuda, target_module: the built-ins of
hipress._C), build (g++/nvcc, cache), runtime (ctypes Compressor).
"""
import os as _os

from hipress.dsl.errors import DSLError

__all__ = ["DSLError", "SPEC_DIR"]

SPEC_DIR = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "specs")
