"""AST of the CompLL DSL. Every node carries its source position (line, col)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple


@dataclass
class Node:
    line: int
    col: int


@dataclass
class TypeRef(Node):
    base: str                      # uint1..uint8, int32, float, void, "uint" (dynamic width), or a param block name
    width: Optional["Expr"] = None  # uint<width>
    array: bool = False             # T* or T[]
    dims: Optional[List[Tuple[str, int, int]]] = None  # state float[d0][d1]: names of the view's dimensions


# ---- expressions ---------------------------------------------------------------
@dataclass
class Expr(Node):
    pass


@dataclass
class Num(Expr):
    value: object
    is_float: bool


@dataclass
class Name(Expr):
    id: str


@dataclass
class Member(Expr):
    obj: Expr
    attr: str


@dataclass
class Unary(Expr):
    op: str
    operand: Expr


@dataclass
class Binary(Expr):
    op: str
    left: Expr
    right: Expr


@dataclass
class Cond(Expr):
    cond: Expr
    then: Expr
    other: Expr


@dataclass
class Call(Expr):
    func: str
    args: List[Expr]
    type_args: List[TypeRef] = field(default_factory=list)


# ---- statements ----------------------------------------------------------------
@dataclass
class Stmt(Node):
    pass


@dataclass
class Decl(Stmt):
    type: TypeRef
    names: List[Tuple[str, Optional[Expr], int, int]]  # (name, init, line, col)
    state: bool = False


@dataclass
class Assign(Stmt):
    target: Expr
    op: str  # "=", "+=", ...
    value: Expr


@dataclass
class If(Stmt):
    cond: Expr
    then: List[Stmt]
    other: List[Stmt]


@dataclass
class Return(Stmt):
    value: Optional[Expr]


@dataclass
class ExprStmt(Stmt):
    expr: Expr


# ---- top level -----------------------------------------------------------------
@dataclass
class ParamField(Node):
    type: TypeRef
    name: str
    default: Optional[Expr]
    range: Optional[Range] = None


@dataclass
class Range(Node):
    """A parameter's valid values: lo < / <= value < / <= hi (either bound may be None: unbounded), or, with
    ``values``, one of a set of numbers (``in {2, 4, 8}``)."""
    lo: Optional[float]
    lo_open: bool
    hi: Optional[float]
    hi_open: bool
    values: Optional[List[float]] = None

    @staticmethod
    def num(v) -> str:
        return "inf" if v is None else (str(int(v)) if float(v) == int(v) and abs(v) < 1e15 else repr(v))

    def text(self) -> str:
        if self.values is not None:
            return "{" + ", ".join(self.num(v) for v in self.values) + "}"
        return f"{'(' if self.lo_open else '['}{'-inf' if self.lo is None else self.num(self.lo)}, " \
               f"{self.num(self.hi)}{')' if self.hi_open else ']'}"

    def requirement(self) -> str:
        """What a valid value is, for 'NAME must be ...' (the hand-written kernels' wording)."""
        if self.values is not None:
            vs = [self.num(v) for v in self.values]
            return vs[0] if len(vs) == 1 else f"{', '.join(vs[:-1])} or {vs[-1]}"
        if self.lo == 0 and self.hi is None:
            return "a positive finite number" if self.lo_open else "a non-negative finite number"
        return "in " + self.text()


@dataclass
class ParamBlock(Node):
    name: str
    fields: List[ParamField]


@dataclass
class AlgoDecl(Node):
    name: str
    options: List[Tuple[str, Expr, int, int]]


@dataclass
class Func(Node):
    ret: TypeRef
    name: str
    params: List[Tuple[TypeRef, str, int, int]]
    body: List[Stmt]


@dataclass
class View(Node):
    """view rows, cols, r = rank_expr;  the gradient as a rows x cols matrix and the factors' rank r."""
    rows: str
    cols: str
    rank: str
    rank_expr: Expr


@dataclass
class Program(Node):
    file: str
    algorithm: Optional[AlgoDecl]
    params: List[ParamBlock]
    globals: List[Decl]
    funcs: List[Func]
    view: Optional[View] = None
