"""Type checker of the CompLL DSL.

Annotates the AST in place (``expr.ty``, ``expr.sym``, ``call.kind``) and returns a
``Spec`` that the code generator consumes. Every error is a DSLError with the
position of the offending node.

Types are strings for scalars ("float", "int32", "uint1".."uint8", "uintN": a
dynamic width from a parameter) and ``Arr`` for arrays.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

from hipress.dsl import ast as A
from hipress.dsl.check_expr import ExprTyper
from hipress.dsl.check_ops import OperatorTyper
from hipress.dsl.errors import DSLError
from hipress.dsl.types import (CATEGORIES, COMPARATORS, FLOATS, MATH1, MATH2, MAX_HEADER_WORDS, MAX_STATE_SCALARS,
                               OPERATORS, REDUCERS, SCALARS, UINTS, Arr, Spec, Sym, Udf, bits_of, const_value,
                               default_id, in_range, is_arr, is_constant, is_entry, is_num, returns, tname)


class Checker(ExprTyper, OperatorTyper):
    def __init__(self, prog: A.Program, source: str, name: Optional[str]):
        self.p = prog
        self.file = prog.file
        self.source = source
        self.name = name
        self.globals: Dict[str, Sym] = {}
        self.fields: Dict[str, A.ParamField] = {}
        self.blocks: Dict[str, A.ParamBlock] = {}
        self.funcs: Dict[str, A.Func] = {}
        self.udfs: Dict[str, Udf] = {}
        self.uses_random = False

    def err(self, node, msg):
        raise DSLError(msg, self.file, getattr(node, "line", 0), getattr(node, "col", 0))

    # ---- types -------------------------------------------------------------------
    def resolve(self, t: A.TypeRef, where: str):
        if t.base == "void":
            if t.array:
                self.err(t, "'void*' is not a DSL type")
            return None
        if t.base == "uint":
            self.check_width(t.width)
            return Arr("uintN", width=t.width) if t.array else "uintN"
        if t.base in SCALARS:
            return Arr(t.base) if t.array else t.base
        if t.base in self.blocks:
            if t.array:
                self.err(t, "a param block cannot be an array")
            return ("params", t.base)
        self.err(t, f"unknown type '{t.base}' in {where}")

    def param_expr(self, root: A.Expr, ops, what: str, other: str, integer: bool, unknown: str,
                   names: Optional[Dict[str, Optional[str]]] = None, members: bool = False, minmax: bool = False,
                   neg: bool = False, float_const: str = ""):
        """Checks an expression of the parameters (a bit width, the view's rank, the rate): constants (integers
        only if `integer`), parameters by name (and params.x with `members`; integer ones only if `integer`),
        the names of `names` (None: allowed, else the error), the binary operators `ops`, -a with `neg`,
        min/max(a, b) with `minmax`. what: 'a bit width must be an integer'-style wording for float
        parameters, and for float constants unless float_const says otherwise; unknown: the error for another name ('{}': the name); other: for anything
        else."""
        names = names or {}

        def field(node, name, msg):
            if name not in self.fields:
                self.err(node, msg.format(name))
            if integer and self.fields[name].type.base in FLOATS:
                self.err(node, f"parameter '{name}' is a float; {what}")

        def walk(e):
            if isinstance(e, A.Num):
                if integer and e.is_float:
                    self.err(e, float_const or what)
            elif isinstance(e, A.Name):
                if e.id in names:
                    if names[e.id]:
                        self.err(e, names[e.id])
                else:
                    field(e, e.id, unknown)
            elif members and isinstance(e, A.Member) and isinstance(e.obj, A.Name):
                field(e, e.attr, "'{}' is not a parameter")
            elif isinstance(e, A.Binary) and e.op in ops:
                walk(e.left)
                walk(e.right)
            elif neg and isinstance(e, A.Unary) and e.op == "-":
                walk(e.operand)
            elif minmax and isinstance(e, A.Call) and e.func in ("min", "max") and not e.type_args:
                if len(e.args) != 2:
                    self.err(e, f"{e.func}(a, b) takes two values")
                for a in e.args:
                    walk(a)
            else:
                self.err(e, other)
        walk(root)

    def check_width(self, w: A.Expr):
        """A dynamic bit width: an expression of parameters and integer constants."""
        self.param_expr(w, ("+", "-", "*", "<<", ">>"), "a bit width must be an integer",
                        "a bit width may only use parameters, integer constants and + - * << >>", True,
                        "'{}' in a bit width is not a parameter (widths depend on parameters only)", members=True)

    # ---- program -----------------------------------------------------------------
    def run(self) -> Spec:
        p = self.p
        for b in p.params:
            if b.name in self.blocks:
                self.err(b, f"param block '{b.name}' declared twice")
            self.blocks[b.name] = b
        for b in p.params:
            for f in b.fields:
                if f.name in self.fields:
                    self.err(f, f"parameter '{f.name}' declared twice")
                if f.type.array or f.type.base not in SCALARS:
                    self.err(f.type, f"parameter '{f.name}' must have a scalar type "
                                     f"(uint1, uint2, uint4, uint8, int32, float or double)")
                self.fields[f.name] = f
        for b in p.params:
            for f in b.fields:
                if f.default is not None:
                    if not isinstance(f.default, A.Num) and not (isinstance(f.default, A.Unary) and
                                                                 f.default.op == "-" and
                                                                 isinstance(f.default.operand, A.Num)):
                        self.err(f.default, "a parameter default must be a number")
                    v = const_value(f.default)
                    if f.type.base not in FLOATS and float(v) != int(v):
                        self.err(f.default, f"parameter '{f.name}' is an integer; its default {v} is not")
                    if f.type.base in UINTS and not 0 <= v < (1 << UINTS[f.type.base]):
                        self.err(f.default, f"default {v} does not fit {f.type.base}")
                if f.range is not None:
                    self.check_range(f)
        self.view_decl(p.view)
        self.state_arrays: List[Sym] = []
        self.state_scalars: List[Sym] = []
        for d in p.globals:
            ty = self.resolve(d.type, "a global declaration")
            if d.state:
                self.state_decl(d, ty)
                continue
            if ty is None or isinstance(ty, tuple) or is_arr(ty):
                self.err(d.type, "globals must be scalars (uint1..uint8, int32, float, double); per-tensor arrays "
                                 "are declared 'state float* name;'")
            for name, init, line, col in d.names:
                if name in self.dims:
                    raise DSLError(f"'{name}' is a dimension of the view", self.file, line, col)
                self.declare_global(name, ty, line, col, d.type.width)
                if init is not None:
                    if not isinstance(init, (A.Num, A.Unary)):
                        self.err(init, "a global's initial value must be a constant")
                    const_value(init)
                    self.expr(init, {}, "const")
        for f in p.funcs:
            if f.name in self.funcs or f.name in self.globals or f.name in self.fields or f.name in self.dims:
                self.err(f, f"'{f.name}' is defined twice")
            if f.name in OPERATORS or f.name in MATH1 or f.name in MATH2 or f.name in REDUCERS or \
                    f.name in COMPARATORS:
                self.err(f, f"'{f.name}' is a built-in name and cannot be redefined")
            self.funcs[f.name] = f
        if "has_state" in self.funcs or "has_state" in self.globals:
            self.err(self.funcs.get("has_state") or self.p, "'has_state' is a built-in name")
        if "encode" not in self.funcs:
            self.err(p, "a spec needs an 'encode' function: void encode(float* gradient, uint8* compressed, "
                        "Params params)")
        # UDF signatures first (they may call each other), then bodies.
        for f in p.funcs:
            if is_entry(f.name):
                continue
            ret = self.resolve(f.ret, f"the return type of '{f.name}'")
            if is_arr(ret) or isinstance(ret, tuple):
                self.err(f.ret, f"user-defined function '{f.name}' must return a scalar (it is applied per element)")
            args = []
            for ty, name, line, col in f.params:
                at = self.resolve(ty, f"parameter '{name}' of '{f.name}'")
                if at is None or is_arr(at) or isinstance(at, tuple):
                    self.err(ty, f"parameters of user-defined functions are scalars; '{name}' is not")
                args.append((name, at))
            self.udfs[f.name] = Udf(f, ret, args)
        for name, u in self.udfs.items():
            scope = {}
            for (an, at), (ty, _, line, col) in zip(u.args, u.func.params):
                if an in scope:
                    self.err(ty, f"parameter '{an}' declared twice")
                scope[an] = Sym(an, "arg", at, line, col, ty.width)
            self.cur_udf = u
            self.block(u.func.body, scope, "udf", u.ret)
            if u.ret is not None and not returns(u.func.body):
                self.err(u.func, f"'{name}' must end with a return statement on every path")
        self.check_recursion()
        for u in self.udfs.values():
            u.randoms = self.count_randoms(u.func.name, set())
        self.capacity = self.funcs.get("capacity")
        if self.capacity is not None:
            self.check_capacity(self.capacity)
        enc = self.funcs["encode"]
        self.concats: Dict[str, A.Call] = {}
        self.cur_entry = "encode"
        self.encode_params = self.entry(enc, "encode", [("float", True), ("uint8", True)])
        dec = self.funcs.get("decode")
        self.concat = None
        scope = dict(self.encode_params)
        self.block(enc.body, scope, "encode", None)
        if self.concat is None:
            self.err(enc, "encode must assign the payload: compressed = concat(...);")
        self.concats["encode"] = self.concat
        enc_concat = self.concat
        rounds, fin = self.multi_round()
        self.concat = enc_concat
        if dec is not None:
            self.cur_entry = "decode"
            self.layout_of = enc_concat
            dscope = self.entry(dec, "decode", [("uint8", True), ("float", True)])
            self.extracted = False
            self.decoded = False
            self.block(dec.body, dscope, "decode", None)
            if not self.extracted:
                self.err(dec, "decode must read the payload: extract(compressed, ...);")
            if not self.decoded:
                self.err(dec, "decode must write the gradient: gradient = map(...) or gradient = scatter(...);")
        self.rounds, self.finish = rounds, fin
        return self.spec(enc, dec)

    def multi_round(self):
        """encode_round0 (from the gradient), encode_round<k> (from the sum over ranks of round k-1's payloads)
        and finish (decodes the sum of the last round): the multi-round API of aggregatable compressors."""
        names = {f.name: f for f in self.p.funcs if is_entry(f.name) and f.name.startswith("encode_round")}
        fin = self.funcs.get("finish")
        if not names and fin is None:
            return [], None
        for name, f in names.items():
            k = name[len("encode_round"):]
            if not k.isdigit() or str(int(k)) != k:
                self.err(f, f"'{name}': multi-round entries are encode_round0, encode_round1, ...")
        if self.view is None:
            self.err(next(iter(names.values()), fin), "multi-round entries need the matrix view: declare "
                                                      "'view rows, cols, r = ...;'")
        rounds = []
        while f"encode_round{len(rounds)}" in names:
            rounds.append(names[f"encode_round{len(rounds)}"])
        if len(rounds) != len(names):
            missing = f"encode_round{len(rounds)}"
            self.err(names[sorted(names, key=lambda n: int(n[len('encode_round'):]))[-1]],
                     f"'{missing}' is missing (rounds are numbered from 0 without gaps)")
        if not rounds:
            self.err(fin, "finish needs the rounds it finishes: encode_round0, encode_round1, ...")
        if fin is None:
            self.err(rounds[-1], "a multi-round spec needs 'void finish(uint8* sum, float* gradient, Params params)' "
                                 "(decodes the sum of the last round)")
        prev = None
        for k, f in enumerate(rounds):
            self.cur_entry = f.name
            self.layout_of = prev
            if k == 0:
                scope = self.entry(f, f.name, [("float", True), ("uint8", True)])
            else:
                scope = self.entry(f, f.name, [("uint8", True), ("uint8", True)], roles=("payload", "output"))
            self.concat = None
            self.extracted = False
            self.block(f.body, scope, "encode", None)
            if self.concat is None:
                self.err(f, f"{f.name} must assign its payload: compressed = concat(...);")
            if k > 0 and not self.extracted:
                self.err(f, f"{f.name} must read the sum of round {k - 1}: extract({f.params[0][1]}, ...);")
            for a in self.concat.args:
                if not (is_arr(a.ty) and self.shape_of(a.ty) is not None):
                    self.err(a, "a round's payload is summed across ranks (combine): it holds float matrices only")
            self.concats[f.name] = self.concat
            prev = self.concat
        self.cur_entry = "finish"
        self.layout_of = prev
        scope = self.entry(fin, "finish", [("uint8", True), ("float", True)], roles=("payload", "output"))
        self.extracted = False
        self.decoded = False
        self.block(fin.body, scope, "finish", None)
        if not self.extracted:
            self.err(fin, f"finish must read the sum of the last round: extract({fin.params[0][1]}, ...);")
        if not self.decoded:
            self.err(fin, "finish must write the gradient: gradient = matmul(...) or map(...);")
        return rounds, fin

    def spec(self, enc, dec) -> Spec:
        opts = {}
        name = self.name
        if self.p.algorithm:
            name = name or self.p.algorithm.name
            for k, v, line, col in self.p.algorithm.options:
                if k in opts:
                    raise DSLError(f"option '{k}' given twice", self.file, line, col)
                if k == "category":
                    if not isinstance(v, A.Name) or v.id not in CATEGORIES:
                        self.err(v, f"category must be one of {', '.join(CATEGORIES)}")
                    opts[k] = v.id
                elif k == "rate" and not is_constant(v):
                    self.rate_expr(v)
                    opts[k] = v
                elif k in ("id", "error_feedback", "rate"):
                    val = const_value(v, self.file)
                    if k == "id" and (val != int(val) or not 1 <= val <= 255):
                        self.err(v, "id must be an integer in [1, 255] (ids below 64 are the built-ins')")
                    if k == "error_feedback" and val not in (0, 1):
                        self.err(v, "error_feedback must be 0 or 1")
                    if k == "rate" and not 0 < val <= 64:
                        self.err(v, "rate must be in (0, 64]")
                    opts[k] = v if k == "rate" else val
                else:
                    raise DSLError(f"unknown algorithm option '{k}' (id, category, error_feedback, rate)",
                                   self.file, line, col)
        if not name:
            name = os.path.splitext(os.path.basename(self.file))[0] if self.file not in ("", "<spec>") else "spec"
        params = [f for b in self.p.params for f in b.fields]
        implicit_seed = self.uses_random and "seed" not in self.fields
        if implicit_seed:
            params.append(A.ParamField(0, 0, A.TypeRef(0, 0, "float"), "seed", A.Num(0, 0, 0, False)))
        layout = [(("array" if is_arr(a.ty) else "word"), a.ty) for a in self.concat.args]
        return Spec(name=name, file=self.file, source=self.source, algo_id=int(opts.get("id", default_id(name))),
                    category=opts.get("category", "quantization"), error_feedback=bool(opts.get("error_feedback", 0)),
                    rate=opts.get("rate"), params=params, implicit_seed=implicit_seed, globals=self.globals,
                    udfs=self.udfs, encode=enc, decode=dec, concat=self.concat, layout=layout,
                    uses_random=self.uses_random, program=self.p, state_arrays=self.state_arrays,
                    state_scalars=self.state_scalars, capacity=self.capacity, view=self.view,
                    rounds=self.rounds, finish=self.finish, concats=self.concats)

    def rate_expr(self, e):
        """rate = an expression of the parameters (by name), numbers, + - * / and parentheses: the nominal
        rate of an instance (e.g. rate = 2 * ratio), computed in double."""
        self.param_expr(e, ("+", "-", "*", "/"), "", "the rate is a number or an expression of parameters, numbers "
                        "and + - * /", False, "'{}' in the rate is not a parameter", neg=True)

    def state_decl(self, d: A.Decl, ty):
        """'state float* a;' (a CompressorState buffer of the gradient's size, updated in place) or
        'state int32 s;' (a CompressorState scalar); both persist per tensor across encode calls."""
        if d.type.dims is not None:
            if d.type.base != "float" or d.type.array:
                self.err(d.type, "a state matrix holds floats: 'state float[d0][d1] name;'")
            if self.view is None:
                self.err(d.type, "a state matrix needs the matrix view: declare 'view rows, cols, r = ...;' first")
            if len(d.type.dims) != 2:
                self.err(d.type, "a state matrix has two dimensions: 'state float[d0][d1] name;'")
            for dn, line, col in d.type.dims:
                if dn not in self.dims:
                    raise DSLError(f"'{dn}' is not a dimension of the view ({', '.join(self.dims)})", self.file,
                                   line, col)
            ty = self.mat((d.type.dims[0][0], d.type.dims[1][0]))
        elif is_arr(ty):
            if ty.elem != "float":
                self.err(d.type, "a state array holds floats: 'state float* name;'")
        elif ty not in ("int32",):
            self.err(d.type, "state is 'state float* name;' (a per-tensor buffer) or 'state int32 name;' "
                             "(a per-tensor counter)")
        for name, init, line, col in d.names:
            if init is not None:
                self.err(init, f"state '{name}' cannot have an initial value (new state is zero)")
            if name == "has_state":
                raise DSLError("'has_state' is a built-in name", self.file, line, col)
            if name in self.dims:
                raise DSLError(f"'{name}' is a dimension of the view", self.file, line, col)
            self.declare_global(name, ty if is_arr(ty) else ty, line, col)
            sym = self.globals[name]
            sym.state = True
            if is_arr(ty):
                if len(self.state_arrays) >= 7:
                    raise DSLError("at most 7 state arrays (the error-feedback residual takes the 8th buffer)",
                                   self.file, line, col)
                sym.slot = len(self.state_arrays)
                self.state_arrays.append(sym)
            else:
                if len(self.state_scalars) >= MAX_STATE_SCALARS:
                    raise DSLError(f"at most {MAX_STATE_SCALARS} state scalars (CompressorState.scalars[1..3]; "
                                   f"[0] is the RNG counter)", self.file, line, col)
                sym.slot = 1 + len(self.state_scalars)
                self.state_scalars.append(sym)

    def check_range(self, f: A.ParamField):
        """'in (lo, hi]': a non-empty interval; the default, if any, must lie in it."""
        r = f.range
        lo = float("-inf") if r.lo is None else float(r.lo)
        hi = float("inf") if r.hi is None else float(r.hi)
        if r.values is None and not (lo < hi or lo == hi and not r.lo_open and not r.hi_open):
            self.err(r, f"the range {r.text()} of '{f.name}' is empty")
        if f.default is not None:
            v = float(const_value(f.default))
            if not in_range(v, r):
                self.err(f.default, f"the default {const_value(f.default)} of '{f.name}' is outside its range "
                                    f"{r.text()}")

    def view_decl(self, v: Optional[A.View]):
        """view rows, cols, r = expr;  rank expression of rows, cols, integer parameters and constants."""
        self.view = v
        self.dims: Dict[str, str] = {}
        if v is None:
            return
        for role, name in (("rows", v.rows), ("cols", v.cols), ("rank", v.rank)):
            if name in self.dims:
                self.err(v, f"the view's dimensions need three different names ('{name}' twice)")
            if name in self.fields:
                self.err(v, f"'{name}' is a parameter; the view's dimensions need other names")
            self.dims[name] = role

        self.param_expr(v.rank_expr, ("+", "-", "*"), "the rank is an integer expression",
                        "the rank may only use the view's rows and cols, integer parameters, integer constants, "
                        "+ - * and min/max", True, f"'{{}}' in the rank is not a parameter, '{v.rows}' or '{v.cols}'",
                        names={v.rows: None, v.cols: None, v.rank: f"the rank '{v.rank}' cannot be defined by itself"},
                        minmax=True, float_const="the rank is an integer expression (no float constants)")

    def shape_of(self, t) -> Optional[Tuple[str, str]]:
        """Matrix shape of a float array: its own, or rows x cols for the gradient's size (with a view)."""
        if not is_arr(t) or t.elem != "float":
            return None
        if t.length == "mat":
            return t.shape
        if t.length == "n" and self.view is not None:
            return (self.view.rows, self.view.cols)
        return None

    def mat(self, shape) -> Arr:
        if self.view is not None and shape == (self.view.rows, self.view.cols):
            return Arr("float", "n")
        return Arr("float", "mat", shape=shape)

    def check_capacity(self, f: A.Func):
        """int32 capacity(int32 n, P params): the most elements a data-dependent (filter/sort) array of the
        payload holds for an n-element gradient (max_encoded_bytes); default n."""
        if f.ret.base != "int32" or f.ret.array or len(f.params) != 2 or f.params[0][0].base != "int32" or \
                f.params[0][0].array or f.params[1][0].base not in self.blocks:
            self.err(f, "capacity has the signature 'int32 capacity(int32 n, Params params)'")
        scope = {f.params[0][1]: Sym(f.params[0][1], "arg", "int32", f.params[0][2], f.params[0][3]),
                 f.params[1][1]: Sym(f.params[1][1], "params", ("params", f.params[1][0].base), f.params[1][2],
                                     f.params[1][3])}
        self.block(f.body, scope, "capacity", "int32")
        if not returns(f.body):
            self.err(f, "'capacity' must end with a return statement on every path")

    def declare_global(self, name, ty, line, col, width=None):
        if name in self.globals or name in self.fields and False:
            raise DSLError(f"global '{name}' declared twice", self.file, line, col)
        self.globals[name] = Sym(name, "global", ty, line, col, width)

    def entry(self, f: A.Func, which: str, want, roles=("input", "output")):
        if f.ret.base != "void" or f.ret.array:
            self.err(f.ret, f"{which} returns void (its result is the '{'compressed' if which == 'encode' else 'gradient'}'"
                            " argument)")
        sig = {"decode": "void decode(uint8* compressed, float* gradient)",
               "finish": "void finish(uint8* sum, float* gradient, Params params)",
               "encode": "void encode(float* gradient, uint8* compressed, Params params)",
               "encode_round0": "void encode_round0(float* gradient, uint8* compressed, Params params)"}.get(
            which, f"void {which}(uint8* sum, uint8* compressed, Params params)")
        if len(f.params) not in (2, 3):
            self.err(f, f"{which} takes 2 or 3 arguments: {sig}")
        scope = {}
        for k, (ty, name, line, col) in enumerate(f.params):
            if name in scope:
                raise DSLError(f"argument '{name}' declared twice", self.file, line, col)
            if k < 2:
                base, arr = want[k]
                if ty.base != base or not ty.array:
                    self.err(ty, f"argument {k + 1} of {which} must be {base}*: {sig}")
                role = roles[k]
                scope[name] = Sym(name, role, Arr(base), line, col)
            else:
                if ty.base not in self.blocks or ty.array:
                    self.err(ty, f"argument 3 of {which} must be a param block (declared with 'param')")
                scope[name] = Sym(name, "params", ("params", ty.base), line, col)
        return scope

    def check_recursion(self):
        def visit(name, stack):
            if name in stack:
                f = self.udfs[name].func
                self.err(f, f"'{name}' is recursive ({' -> '.join(stack + [name])}); the DSL has no recursion")
            for c in self.udfs[name].calls:
                visit(c, stack + [name])
        for n in self.udfs:
            visit(n, [])

    def count_randoms(self, name, seen):
        u = self.udfs[name]
        n = getattr(u, "_direct_randoms", 0)
        for c in u.calls:
            n += self.count_randoms(c, seen)
        return n

    # ---- statements --------------------------------------------------------------
    def block(self, stmts, scope, ctx, ret):
        scope = dict(scope)
        for s in stmts:
            self.stmt(s, scope, ctx, ret)

    def lookup(self, node, name, scope):
        if name in scope:
            return scope[name]
        if name in self.globals:
            return self.globals[name]
        if name == "has_state":
            return Sym(name, "builtin", "int32")
        if name in self.dims:
            sym = Sym(name, "dim", "int32")
            sym.role = self.dims[name]
            return sym
        if name in self.udfs or name in REDUCERS or name in COMPARATORS:
            return Sym(name, "udf", "function")
        if name in self.fields:
            self.err(node, f"'{name}' is a parameter: write params.{name} (via encode's param argument) or copy it "
                           f"into a global in encode")
        self.err(node, f"'{name}' is not declared")

    def stmt(self, s, scope, ctx, ret):
        if isinstance(s, A.Decl):
            if s.state:
                self.err(s, "'state' is only allowed for globals")
            ty = self.resolve(s.type, "a declaration")
            if ty is None or isinstance(ty, tuple):
                self.err(s.type, "variables must have a scalar or array type")
            if is_arr(ty) and ctx == "udf":
                self.err(s.type, "arrays cannot be declared inside a user-defined function (it runs per element)")
            for name, init, line, col in s.names:
                if name in scope and scope[name].kind in ("local", "arg", "input", "output", "params"):
                    raise DSLError(f"'{name}' is declared twice", self.file, line, col)
                if name in self.udfs:
                    raise DSLError(f"'{name}' is a function name", self.file, line, col)
                sym = Sym(name, "local", ty, line, col, s.type.width)
                if isinstance(init, A.Call) and init.func == "scatter" and len(init.args) == 3:
                    raise DSLError("scatter(array, index, value) updates an existing array in place: "
                                   "'a = scatter(a, index, value);'", self.file, init.line, init.col)
                if init is not None:
                    self.assign_value(sym, init, scope, ctx, s)
                elif is_arr(ty) and ctx not in ("decode", "encode"):
                    raise DSLError(f"array '{name}' must be initialised by an operator (map, filter, sort, ...)",
                                   self.file, line, col)
                scope[name] = sym
            s.syms = [scope[n] for n, _, _, _ in s.names]
            return
        if isinstance(s, A.Assign):
            if not isinstance(s.target, A.Name):
                self.err(s.target, "only variables can be assigned")
            sym = self.lookup(s.target, s.target.id, scope)
            s.target.sym = sym
            s.target.ty = sym.ty
            if sym.kind == "output" and ctx == "encode":
                if s.op != "=" or not (isinstance(s.value, A.Call) and s.value.func == "concat"):
                    self.err(s, f"the payload '{sym.name}' is assigned with '{sym.name} = concat(...);'")
                if self.concat is not None:
                    self.err(s, "the payload is assigned twice (one concat per encode)")
                if self.depth_if:
                    self.err(s, "concat must not be inside an if")
                self.concat_stmt(s.value, scope)
                return
            if sym.kind == "output" and ctx in ("decode", "finish"):
                if s.op != "=" or not (isinstance(s.value, A.Call) and s.value.func in ("map", "scatter", "matmul")):
                    self.err(s, f"the gradient '{sym.name}' is written with '{sym.name} = map(...)', "
                                f"'{sym.name} = scatter(...)' or '{sym.name} = matmul(...)'")
                if self.decoded:
                    self.err(s, "the gradient is written twice")
                if self.depth_if:
                    self.err(s, "the gradient must not be written inside an if")
                self.decoded = True
                vt = self.expr(s.value, scope, ctx)
                if not is_arr(vt) or vt.elem != "float" or vt.length != "n":
                    self.err(s.value, f"the decoded gradient must be a float array of the gradient's size, got {vt}")
                return
            if sym.kind in ("input", "params", "udf", "field", "builtin", "dim", "payload"):
                self.err(s.target, f"'{sym.name}' is read-only")
            if sym.state and ctx not in ("encode", "finish"):
                self.err(s.target, f"the state '{sym.name}' is updated in encode only"
                                   f"{' (decode must work from the payload alone)' if ctx == 'decode' else ''}")
            if s.op in ("+=", "-=") and is_arr(sym.ty) and isinstance(s.value, A.Call) and \
                    s.value.func == "matmul":  # A -= matmul(B, C): accumulate a product (PowerSGD's residual)
                if sym.kind not in ("global", "local"):
                    self.err(s.target, f"'{sym.name}' cannot be updated")
                vt = self.expr(s.value, scope, ctx)
                if self.shape_of(sym.ty) is None or self.shape_of(sym.ty) != self.shape_of(vt):
                    self.err(s.value, f"'{sym.name} {s.op} matmul(...)' needs a product of its shape "
                                      f"({sym.ty}), got {vt}")
                s.accumulate = True
                return
            if sym.state and is_arr(sym.ty) and not (s.op == "=" and (isinstance(s.value, A.Call) and
                                                                      s.value.func in ("map", "scatter", "matmul",
                                                                                       "decomp") or
                                                                      isinstance(s.value, A.Name))):
                self.err(s.value, f"the state array '{sym.name}' is updated in place: '{sym.name} = map(...);', "
                                  f"'{sym.name} = scatter({sym.name}, index, value);', '{sym.name} = matmul(...);', "
                                  f"'{sym.name} = decomp({sym.name});' or copied from an array of its shape")
            if isinstance(s.value, A.Call) and s.value.func == "scatter" and len(s.value.args) == 3 and \
                    not (isinstance(s.value.args[0], A.Name) and s.value.args[0].id == s.target.id):
                self.err(s.value, f"scatter(array, index, value) updates its array in place: write "
                                  f"'{s.target.id} = scatter({s.target.id}, index, value);'")
            if sym.kind == "global" and ctx == "udf":
                self.err(s.target, f"user-defined functions cannot write the global '{sym.name}' (they run in "
                                   f"parallel over elements); write it in encode or decode")
            if s.op != "=" and (is_arr(sym.ty)):
                self.err(s, f"'{s.op}' does not apply to arrays (except 'A += matmul(...)' and 'A -= matmul(...)')")
            if s.op != "=":
                v = A.Binary(s.line, s.col, s.op[0], A.Name(s.target.line, s.target.col, s.target.id), s.value)
                s.value = v
                s.op = "="
            self.assign_value(sym, s.value, scope, ctx, s)
            return
        if isinstance(s, A.If):
            ct = self.expr(s.cond, scope, ctx)
            if not is_num(ct):
                self.err(s.cond, f"an if condition must be a number, got {tname(ct)}")
            self.depth_if += 1
            self.block(s.then, scope, ctx, ret)
            self.block(s.other, scope, ctx, ret)
            self.depth_if -= 1
            return
        if isinstance(s, A.Return):
            if ctx not in ("udf", "capacity"):
                self.err(s, f"return is not allowed in {ctx} (it ends by writing its output argument)")
            if ret is None:
                if s.value is not None:
                    self.err(s, "a void function returns no value")
                return
            if s.value is None:
                self.err(s, "missing return value")
            vt = self.expr(s.value, scope, ctx)
            if not is_num(vt):
                self.err(s.value, f"cannot return {tname(vt)} from a function returning {ret}")
            return
        if isinstance(s, A.ExprStmt):
            e = s.expr
            if isinstance(e, A.Call) and e.func == "extract":
                if ctx not in ("decode", "finish") and not (ctx == "encode" and self.cur_entry.startswith(
                        "encode_round") and self.cur_entry != "encode_round0"):
                    self.err(e, "extract is used in decode (and in finish and encode_round1, 2, ... on the summed "
                                "payload of the previous round)")
                if self.extracted:
                    self.err(e, "extract is called twice")
                if self.depth_if:
                    self.err(e, "extract must not be inside an if")
                self.extract_stmt(e, scope, ctx)
                return
            self.err(s, "an expression statement has no effect (assign its value or call extract)")
        self.err(s, "unsupported statement")

    depth_if = 0

    def assign_value(self, sym, value, scope, ctx, node):
        vt = self.expr(value, scope, ctx)
        if is_arr(sym.ty):
            if not is_arr(vt):
                self.err(value, f"cannot assign {tname(vt)} to the array '{sym.name}' ({sym.ty})")
            if vt.elem != sym.ty.elem and not (vt.elem == "uintN" or sym.ty.elem == "uintN"):
                self.err(value, f"cannot assign a {vt} array to '{sym.name}' ({sym.ty}): element types differ")
            if sym.ty.elem == "uintN" and vt.elem in UINTS or sym.ty.elem in UINTS and vt.elem == "uintN":
                self.err(value, f"cannot mix the dynamic width uint<...> and a fixed width ({vt} vs {sym.ty})")
            if sym.kind == "local" and not hasattr(sym, "_assigned"):
                sym._assigned = True
                sym.ty = Arr(sym.ty.elem, vt.length, vt.sparse, sym.ty.width or vt.width, vt.shape)
            elif sym.ty.length != vt.length or sym.ty.shape != vt.shape:
                if sym.ty.length == "mat" or vt.length == "mat":
                    self.err(value, f"'{sym.name}' is {sym.ty}; this array is {vt}")
                self.err(value, f"'{sym.name}' holds an array of {'the gradient size' if sym.ty.length == 'n' else 'a data dependent size'}; this one differs")
            return
        if is_arr(vt) or vt == "function" or vt is None or isinstance(vt, tuple):
            self.err(value, f"cannot assign {tname(vt) if vt != 'function' else 'a function'} to '{sym.name}' "
                            f"({tname(sym.ty)})")

    # ---- concat / extract ----------------------------------------------------------
    def concat_stmt(self, call: A.Call, scope):
        if call.type_args:
            self.err(call, "concat takes no type argument")
        if not call.args:
            self.err(call, "concat needs at least one value")
        words = 0
        for a in call.args:
            t = self.expr(a, scope, "encode")
            if is_arr(t):
                if t.elem == "uintN" or bits_of(t.elem):
                    pass
                elif t.elem not in ("float", "int32"):
                    self.err(a, f"cannot concat an array of {t.elem}")
                continue
            if not is_num(t):
                self.err(a, f"cannot concat {tname(t)}")
            if t == "double":
                self.err(a, "the header words are 32 bits: concat float(x) or int32(x), not a double")
            words += 1
            if words > MAX_HEADER_WORDS:
                self.err(a, f"concat stores at most {MAX_HEADER_WORDS} scalars (the header's words); "
                            f"this is scalar number {words}")
        if self.view is not None:  # low-rank payloads: the header's words 0, 1 and count hold rows, cols, rank
            for a in call.args:
                if is_arr(a.ty) and self.shape_of(a.ty) is None:
                    self.err(a, f"a spec with a matrix view sends float matrices (or scalars), not {a.ty}")
            if words > MAX_HEADER_WORDS - 2:
                self.err(call, f"with a matrix view, concat stores at most {MAX_HEADER_WORDS - 2} scalars (header "
                               f"words 0 and 1 hold rows and cols)")
        per_row = [a for a in call.args if is_arr(a.ty) and a.ty.length == "rows"]
        if per_row and any(is_arr(a.ty) and a.ty.length == "var" for a in call.args):
            self.err(per_row[0], "a payload holds per-row arrays or data-dependent arrays, not both (the header's "
                                 "count holds the row length of one and the length of the other)")
        for a in per_row:
            if a.ty.elem != "float":
                self.err(a, f"a per-row array in a payload holds floats, not {a.ty.elem}")
        packed = [a for a in call.args if is_arr(a.ty) and (a.ty.elem == "uintN" or bits_of(a.ty.elem))]
        widths = {(a.ty.elem if a.ty.elem != "uintN" else "dyn") for a in packed}
        if len(widths) > 1:
            self.err(packed[-1], "all packed (uint1..uint8) arrays of a payload must have the same width "
                                 "(the header has one 'bits' field)")
        self.concat = call

    def extract_stmt(self, call: A.Call, scope, ctx="decode"):
        src = getattr(self, "layout_of", None) or self.concat
        who = "encode's concat" if src is self.concats.get("encode", self.concat) else \
            f"the concat of {[k for k, v in self.concats.items() if v is src][0]}"
        if len(call.args) < 2:
            self.err(call, f"extract(compressed, v1, v2, ...) names the values of {who}, in order")
        first = call.args[0]
        if not isinstance(first, A.Name) or self.lookup(first, first.id, scope).kind not in ("input", "payload"):
            self.err(first, "the first argument of extract is the entry's payload argument")
        first.sym = scope[first.id]
        first.ty = first.sym.ty
        layout = [a.ty for a in src.args]
        rest = call.args[1:]
        if len(rest) != len(layout):
            self.err(call, f"extract names {len(rest)} values, {who} has {len(layout)}")
        for a, et in zip(rest, layout):
            if not isinstance(a, A.Name):
                self.err(a, "extract's arguments after the payload are variable names")
            if a.id in scope or a.id in self.globals:
                sym = scope.get(a.id) or self.globals[a.id]
                if sym.kind not in ("local", "global"):
                    self.err(a, f"'{a.id}' cannot receive an extracted value")
                if sym.state and ctx not in ("encode", "finish"):
                    self.err(a, f"decode cannot use the state '{a.id}': it must decode any payload from the "
                                f"payload alone")
                st = sym.ty
                ok = (is_arr(st) and is_arr(et) and (st.elem == et.elem or {st.elem, et.elem} <= {"uintN"})) or \
                     (is_num(st) and is_num(et) and st == et)
                if ok and is_arr(st) and (sym.state or st.length == "mat") and self.shape_of(st) != self.shape_of(et):
                    ok = False
                if not ok:
                    self.err(a, f"'{a.id}' is {tname(st)} but {who} has {tname(et)} at this position")
                if is_arr(st) and not sym.state:
                    sym.ty = Arr(et.elem, et.length, False, et.width, et.shape)
            else:  # declared by extract with the concat's type
                if a.id in self.dims or a.id in self.udfs:
                    self.err(a, f"'{a.id}' is a {'dimension of the view' if a.id in self.dims else 'function'}")
                sym = Sym(a.id, "local", Arr(et.elem, et.length, False, et.width, et.shape) if is_arr(et) else et,
                          a.line, a.col)
                sym.by_extract = True
                scope[a.id] = sym
            a.sym = sym
            a.ty = sym.ty
        self.extracted = True
        call.ty = None


def check(prog: A.Program, source: str = "", name: Optional[str] = None) -> Spec:
    """Type-check a parsed spec; returns the Spec the code generator consumes."""
    try:
        return Checker(prog, source, name).run()
    except RecursionError:
        raise DSLError("spec nested too deeply", prog.file, 1, 1) from None


def check_source(src: str, file: str = "<spec>", name: Optional[str] = None) -> Spec:
    """Parses and type-checks spec text; returns the checked Spec (raises DSLError)."""
    from hipress.dsl.parser import parse

    return check(parse(src, file), src, name)
