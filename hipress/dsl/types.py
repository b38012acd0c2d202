"""Types, symbols and the checked Spec of the CompLL DSL (shared by the checker and the generators).

Types are strings for scalars ("float", "int32", "uint1".."uint8", "uintN": a
dynamic width from a parameter) and ``Arr`` for arrays. The tables name the built-in
functions, reducers, comparisons and operators of the language.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from hipress.dsl import ast as A
from hipress.dsl.errors import DSLError

UINTS = {"uint1": 1, "uint2": 2, "uint4": 4, "uint8": 8}
INTS = set(UINTS) | {"int32", "uintN"}
FLOATS = ("float", "double")
SCALARS = INTS | set(FLOATS)
MAX_STATE_SCALARS = 3  # CompressorState.scalars[1..3] (scalars[0] is the RNG counter)
CATEGORIES = ("quantization", "sparsification", "lowrank")
MATH1 = {"floor": "float", "ceil": "float", "round": "float", "sqrt": "float", "exp": "float", "log": "float",
         "abs": None, "signbit": "int32", "isnan": "int32", "ilogb": "int32"}
MATH2 = {"min": None, "max": None, "pow": "float", "ldexp": "float"}
REDUCERS = ("smaller", "greater", "sum", "mean", "maxabs", "count")
COMPARATORS = ("greaterAbs", "greater", "smaller")
OPERATORS = ("map", "reduce", "filter", "sort", "random", "concat", "extract", "scatter", "threshold", "decomp",
             "matmul")
MAX_HEADER_WORDS = 4


@dataclass
class Arr:
    elem: str                      # scalar type of the elements
    length: str = "n"              # "n": as many as the gradient; "var": data dependent (filter/sort);
    #                                "rows": one per row of the gradient (a per-row reduce's, maps of it)
    sparse: bool = False           # has .index (filter/sort results)
    width: Optional[A.Expr] = None  # for elem == "uintN"
    shape: Optional[Tuple[str, str]] = None  # length "mat": a matrix of the view's dimensions (row-major)

    def __str__(self):
        return f"float[{self.shape[0]}][{self.shape[1]}]" if self.shape else f"{self.elem}*"


def is_arr(t) -> bool:
    return isinstance(t, Arr)


def is_num(t) -> bool:
    return isinstance(t, str) and t in SCALARS


def bits_of(t) -> Optional[int]:
    """Packed width of an array element type (None: not a packed type)."""
    if t in UINTS:
        return UINTS[t]
    return None


def arith(*ts) -> str:
    """Result type of arithmetic on numbers: double > float > int32 (C's usual conversions)."""
    if "double" in ts:
        return "double"
    return "float" if "float" in ts else "int32"


def tname(t) -> str:
    return str(t) if t is not None else "void"


@dataclass
class Sym:
    name: str
    kind: str  # "global", "local", "field", "arg", "params", "udf", "input", "output"
    ty: object
    line: int = 0
    col: int = 0
    width: Optional[A.Expr] = None  # for uintN
    state: bool = False
    slot: int = -1                  # state: buffer index (arrays) or CompressorState.scalars index (scalars)


@dataclass
class Udf:
    func: A.Func
    ret: object
    args: List[Tuple[str, object]]
    randoms: int = 0                # random draws per call (static call sites, inlined)
    calls: List[str] = field(default_factory=list)


@dataclass
class Spec:
    name: str
    file: str
    source: str
    algo_id: int
    category: str
    error_feedback: bool
    rate: Optional[A.Expr]           # the 'rate' option (a number or an expression of parameters)
    params: List[A.ParamField]       # in ABI order (implicit seed last)
    implicit_seed: bool
    globals: Dict[str, Sym]
    udfs: Dict[str, Udf]
    encode: A.Func
    decode: Optional[A.Func]
    concat: A.Call                   # the encode's concat
    layout: List[Tuple[str, object]]  # (kind "word"|"array", type) per concat argument
    uses_random: bool
    program: A.Program
    state_arrays: List[Sym] = field(default_factory=list)   # CompressorState buffers, in order
    state_scalars: List[Sym] = field(default_factory=list)  # CompressorState.scalars[1..]
    capacity: Optional[A.Func] = None                       # bound of the data-dependent arrays' length
    view: Optional[A.View] = None                           # matrix view (rows, cols, rank) of low-rank specs
    rounds: List[A.Func] = field(default_factory=list)      # encode_round0, encode_round1, ... (multi-round)
    finish: Optional[A.Func] = None                         # decodes the sum of the last round (stateful)
    concats: Dict[str, A.Call] = field(default_factory=dict)  # entry name -> its concat

    @property
    def param_names(self) -> List[str]:
        return [p.name for p in self.params]


def default_id(name: str) -> int:
    return 64 + int(hashlib.sha256(name.encode()).hexdigest(), 16) % 192


def is_entry(name: str) -> bool:
    """Entry points: not user-defined functions."""
    return name in ("encode", "decode", "capacity", "finish") or name.startswith("encode_round")


def in_range(v: float, r: A.Range) -> bool:
    if r.values is not None:
        return any(v == float(x) for x in r.values)
    lo = float("-inf") if r.lo is None else float(r.lo)
    hi = float("inf") if r.hi is None else float(r.hi)
    return (v > lo if r.lo_open else v >= lo) and (v < hi if r.hi_open else v <= hi)


def returns(stmts) -> bool:
    if not stmts:
        return False
    last = stmts[-1]
    if isinstance(last, A.Return):
        return True
    if isinstance(last, A.If):
        return returns(last.then) and returns(last.other)
    return False


def is_constant(e) -> bool:
    return isinstance(e, A.Num) or isinstance(e, A.Unary) and e.op == "-" and isinstance(e.operand, A.Num)


def const_value(e, file="<spec>"):
    if isinstance(e, A.Num):
        return e.value
    if isinstance(e, A.Unary) and e.op == "-" and isinstance(e.operand, A.Num):
        return -e.operand.value
    raise DSLError("a constant number is expected here", file, e.line, e.col)
