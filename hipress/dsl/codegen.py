"""Code generator of the CompLL DSL: one generator, one emitter per target.

``Generator`` walks a checked spec (``checker.Spec``) once for every target: the user-defined
functions, the scalar expressions and statements, the parameter and context structs, the payload
layout (``concat`` / ``extract``), the entry points' skeletons and the C ABI wrapper. What differs
between targets is asked of the target emitter it is given:

* ``target_cpp.CppTarget``: the CPU back end. Operator calls become the optimised common operators
  of csrc/compress/ops.h where the user-defined function has a shape an operator implements exactly
  (``idioms.py``), else fused, chunked loops on the operators' thread pool; matrix views (low rank)
  are lowered by ``target_lowrank.LowRank``.
* ``codegen_cuda.CudaTarget``: the CUDA back end. Operator calls become device operators of
  csrc/compress/cuda/ops_cuda.cuh with per-element functors; the user-defined functions are
  ``__host__ __device__``.

An emitter supplies its vocabulary (names of the payload helpers, the math namespace, how an
array is copied, how a state buffer is bound) and the operator lowerings; it never walks the AST
itself. The generated translation unit exposes a tiny C ABI (``hpc_*``; docs/dsl.md) that
hipress/dsl/runtime.py loads with ctypes.
"""
from __future__ import annotations

import os
from typing import List, Optional

from hipress.dsl import ast as A
from hipress.dsl.idioms import children, is_sum
from hipress.dsl.types import UINTS, Arr, Spec, is_arr, returns
from hipress.dsl.errors import DSLError

ABI_VERSION = 3
FP = ("float", "double")


def ctype(t) -> str:
    return t if t in ("float", "double") else "int64_t"


def cxx_var_type(t) -> str:
    if t.sparse:
        return "hp::SArr"
    if t.elem == "float":
        return "hp::FArr"
    if t.elem == "int32":
        return "hp::IArr"
    return "hp::PArr"


def is_packed(t) -> bool:
    return t.elem in UINTS or t.elem == "uintN"


def read_text(name: str) -> str:
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), name)) as f:
        return f.read()


# ---- environments: how a name is spelled in each kind of function ---------------------------
class UdfEnv:
    def __init__(self):
        self.slot = 0

    def name(self, e):
        k = e.sym.kind
        return {"arg": "a_", "local": "l_"}.get(k, "c.g_") + e.id if k != "global" else "c.g_" + e.id

    def random_counter(self):
        self.slot += 1
        return f"(rc + {self.slot - 1})"

    def udf_counter(self, r):
        s = self.slot
        self.slot += r
        return f"(rc + {s})"


class EntryEnv:
    def __init__(self, which):
        self.which = which

    def name(self, e):
        k = e.sym.kind
        if k == "input":
            return "v_in"
        if k == "global":
            return "c.g_" + e.id
        if k == "builtin":
            return "c." + e.id
        if k == "dim":
            return f"static_cast<int64_t>(c.v_{e.sym.role})"
        return "l_" + e.id

    def random_counter(self):
        return "hp_next(c, 1)"

    def udf_counter(self, r):
        return f"hp_next(c, {r})" if r else "0"


class CapEnv(UdfEnv):
    """capacity(n, params): deterministic, no random draws."""

    def udf_counter(self, r):
        return "0"


# An encode's check of the caller's output buffer (``P``: the Params' name where it is emitted).
CAP_CHECK = ("if (cap < hp_max_bytes({P}, n)) throw std::invalid_argument(kName + std::string(\": output buffer "
             "has \") + std::to_string(cap) + \" bytes, needs \" + std::to_string(hp_max_bytes({P}, n)) + \" "
             "(max_encoded_bytes)\");")
CATCH = """  catch (const hipress::compress::FormatError& e) {{ return {ns}hpc_fail(e, err, errlen, 1); }}
  catch (const std::invalid_argument& e) {{ return {ns}hpc_fail(e, err, errlen, 2); }}
  catch (const std::exception& e) {{ return {ns}hpc_fail(e, err, errlen, 3); }}"""


class Generator:
    def __init__(self, spec: Spec, target):
        self.s = spec
        self.out: List[str] = []
        self.tmp = 0
        self.widths: List[A.Expr] = []
        self.idioms: List[str] = []  # (for --explain / tests): which operators were substituted
        self.t = target(self)

    def err(self, node, msg):
        raise DSLError(msg, self.s.file, getattr(node, "line", 0), getattr(node, "col", 0))

    def fresh(self, base="t"):
        self.tmp += 1
        return f"{base}{self.tmp}"

    def emit(self, line, ind=1):
        self.out.append("  " * ind + line)

    def section(self, fn, *args) -> List[str]:
        """The lines fn(*args) emits, collected apart."""
        saved, self.out = self.out, []
        try:
            fn(*args)
            return self.out
        finally:
            self.out = saved

    # ---- whole translation unit -----------------------------------------------------------
    def generate(self) -> str:
        s, t = self.s, self.t
        t.check_supported()
        self.widths = []
        protos = [self.udf_sig(u) + ";" for u in s.udfs.values()]
        udf_code = self.section(self.udfs)
        lr = t.lowrank
        enc_code = self.section(self.encode if s.view is None else lr.view_entries)
        dec_code = self.section(self.decode)
        mb_code = self.section(self.capacity) + self.section(self.max_bytes if s.view is None else lr.view_helpers) + \
            self.section(self.rate)
        parts = [t.banner(), "// Build output: never edit or commit this file.", t.prelude(),
                 self.params_struct(), self.ctx_struct(), *protos, *udf_code, *t.extra_defs(), *mb_code, *enc_code,
                 *dec_code, t.interface()]
        return "\n".join(parts) + "\n"

    def c_abi(self) -> str:
        """The C ABI (``hpc_*``) of the run-time loaded targets: hpc_* entries, and the low-rank ones for a view."""
        return self.abi() + (self.t.lowrank.view_abi() if self.s.view is not None else "")

    def udf_unit(self) -> str:
        """The parameters, the context and the user-defined functions alone, for the tests that evaluate
        the UDFs of both targets on the host (CUDA: with __host__/__device__ defined away)."""
        self.widths = []
        udfs = self.section(self.udfs)
        return "\n".join([*self.t.udf_unit_open(), self.params_struct(), self.ctx_struct(),
                          *[self.udf_sig(u) + ";" for u in self.s.udfs.values()], *udfs,
                          self.t.udf_unit_close()]) + "\n"

    # ---- expressions ------------------------------------------------------------------------
    def conv(self, code: str, frm, to, width: Optional[A.Expr] = None) -> str:
        if to == frm and to in ("float", "int32", "double") or to == frm and to in UINTS:
            return code
        if to in FP:
            return code if frm == to else f"static_cast<{to}>({code})"
        if to == "int32":
            return f"hp::f2i({code})" if frm in FP else f"hp::w32({code})"
        if to in UINTS or to == "uintN":
            bits = str(UINTS[to]) if to in UINTS else self.width(width)
            return f"hp::f2u({code}, {bits})" if frm in FP else f"hp::i2u({code}, {bits})"
        raise AssertionError((frm, to))

    def width(self, w: A.Expr) -> str:
        if w is None:
            raise AssertionError("dynamic width without expression")
        return f"static_cast<int>({self.wexpr(w)})"

    @staticmethod
    def param_code(e, num, field, binary) -> str:
        """Code of an expression of parameters (a bit width, the rate), as the checker allows them: num(value)
        of a constant, field(name) of a parameter (by name or params.name), binary(op, a, b), -a."""
        def walk(x):
            if isinstance(x, A.Num):
                return num(x.value)
            if isinstance(x, (A.Name, A.Member)):
                return field(x.id if isinstance(x, A.Name) else x.attr)
            if isinstance(x, A.Unary):
                return f"(-{walk(x.operand)})"
            return binary(x.op, walk(x.left), walk(x.right))
        return walk(e)

    def wexpr(self, e) -> str:
        ops = {"+": "hp::add", "-": "hp::sub", "*": "hp::mul", "<<": "hp::shl", ">>": "hp::shr"}
        return self.param_code(e, lambda v: f"int64_t{{{v}}}", lambda f: f"c.p->f_{f}",
                               lambda op, a, b: f"{ops[op]}({a}, {b})")

    def packed_width(self, t: Arr) -> str:
        """Bits per element of a packed array type (a run-time width is checked by make_params)."""
        if t.elem in UINTS:
            return str(UINTS[t.elem])
        self.widths.append(t.width)
        return self.width(t.width)

    @staticmethod
    def truth(code: str, ty) -> str:
        return f"({code}) != 0.0f" if ty in FP else f"({code}) != 0"

    def ex(self, e, env) -> str:
        t = e.ty
        if isinstance(e, A.Num):
            if e.is_float:
                r = repr(float(e.value))
                return r + "f" if "e" in r or "." in r else r + ".0f"
            return f"int64_t{{{e.value}}}"
        if isinstance(e, A.Name):
            return env.name(e)
        if isinstance(e, A.Member):
            return self.member(e, env)
        if isinstance(e, A.Unary):
            a = self.ex(e.operand, env)
            if e.op == "-":
                return f"(-{a})" if t in FP else f"hp::neg({a})"
            if e.op == "!":
                return f"static_cast<int64_t>(!({a}))" if e.operand.ty not in FP else \
                    f"static_cast<int64_t>(({a}) == 0)"
            return f"(~{a})"
        if isinstance(e, A.Binary):
            return self.binary(e, env)
        if isinstance(e, A.Cond):
            c = self.truth(self.ex(e.cond, env), e.cond.ty)
            return f"(({c}) ? {self.conv(self.ex(e.then, env), e.then.ty, t)} : " \
                   f"{self.conv(self.ex(e.other, env), e.other.ty, t)})"
        if isinstance(e, A.Call):
            return self.call(e, env)
        raise AssertionError(type(e))

    def member(self, e: A.Member, env) -> str:
        if hasattr(e, "field"):
            return f"c.p->f_{e.attr}"
        obj = self.ex(e.obj, env)
        if e.attr == "size":
            return f"static_cast<int64_t>({obj}.n)"
        if e.attr == "bits":
            return f"static_cast<int64_t>({obj}.bits)"
        if e.attr == "index":
            return f"hp::index_of({obj})"
        raise AssertionError(e.attr)

    def binary(self, e: A.Binary, env) -> str:
        lt, rt, t = e.left.ty, e.right.ty, e.ty
        a, b = self.ex(e.left, env), self.ex(e.right, env)
        if e.op in ("&&", "||"):
            op = e.op
            if isinstance(env, UdfEnv) and not self.draws(e.right):
                # Per element (a user function), both sides are evaluated and combined without a branch:
                # the same value (the right side is pure: no random draw, no array operator here), and a
                # loop over a predicate such as |x| > tau vectorises (TBQ's count: 6.1 -> 0.8 ms for 16 MB).
                op = "&" if op == "&&" else "|"
            return f"static_cast<int64_t>(({self.truth(a, lt)}) {op} ({self.truth(b, rt)}))"
        if e.op in ("==", "!=", "<", "<=", ">", ">="):
            ft = "double" if "double" in (lt, rt) else "float"
            if lt in FP or rt in FP:
                a, b = self.conv(a, lt, ft), self.conv(b, rt, ft)
            return f"static_cast<int64_t>(({a}) {e.op} ({b}))"
        if t in FP:
            return f"({self.conv(a, lt, t)} {e.op} {self.conv(b, rt, t)})"
        fn = {"+": "add", "-": "sub", "*": "mul", "/": "div", "%": "mod", "<<": "shl", ">>": "shr"}.get(e.op)
        if fn:
            return f"hp::{fn}({a}, {b})"
        return f"(({a}) {e.op} ({b}))"

    def draws(self, e) -> bool:
        """Whether evaluating e draws a random number (random<>() or a user function that does)."""
        if isinstance(e, A.Call) and (e.kind == "random" or e.kind == "udf" and self.s.udfs[e.func].randoms):
            return True
        return any(self.draws(c) for c in children(e))

    def call(self, e: A.Call, env) -> str:
        k = e.kind
        f = e.func
        if k == "cast":
            a = e.args[0]
            return self.conv(self.ex(a, env), a.ty, f)
        if k == "math":
            return self.math(e, env)
        if k == "random":
            return self.random(e, env)
        if k == "udf":
            u = self.s.udfs[f]
            ctr = env.udf_counter(u.randoms)
            args = [self.conv(self.ex(a, env), a.ty, at, getattr(u.func.params[i][0], "width", None))
                    for i, (a, (_, at)) in enumerate(zip(e.args, u.args))]
            return f"u_{f}(c, {ctr}{''.join(', ' + a for a in args)})"
        if k == "op":
            if f == "reduce":
                return self.reduce(e, env)
            if f == "threshold":
                a = self.array_code(e.args[0], env)
                frac = self.conv(self.ex(e.args[1], env), e.args[1].ty, "double")
                smp = self.ex(e.args[2], env)
                return (f"[&]{{ const int64_t sv = {smp}; const size_t s = sv < 0 ? 0 : static_cast<size_t>(sv); "
                        f"return {self.t.threshold(a, frac)}; }}()")
            self.err(e, f"{f} produces an array: assign it to an array variable")
        raise AssertionError(k)

    def math(self, e: A.Call, env) -> str:
        f = e.func
        args = [self.ex(a, env) for a in e.args]
        M = self.t.MATH
        ts = [a.ty for a in e.args]
        if f == "floor":  # hp::vfloor: std::floor's value, in a form loops vectorise (prelude.h.txt)
            return f"hp::vfloor({self.conv(args[0], ts[0], e.ty)})"
        if f in ("floor", "ceil", "round", "sqrt", "exp", "log"):
            return f"{M}{f}({self.conv(args[0], ts[0], e.ty)})"
        if f == "abs":
            return f"{M}fabs({args[0]})" if ts[0] in FP else f"hp::iabs({args[0]})"
        if f == "signbit":
            return f"static_cast<int64_t>({M}signbit({args[0]}))" if ts[0] in FP else \
                f"static_cast<int64_t>(({args[0]}) < 0)"
        if f == "isnan":
            return f"static_cast<int64_t>({M}isnan({args[0]}))" if ts[0] in FP else "int64_t{0}"
        if f == "ilogb":  # the helpers of prelude.h.txt / hp_device.h (exact, no libm call on the fast path)
            return f"hp::ilogb({self.conv(args[0], ts[0], 'float')})"
        if f == "ldexp":
            return f"hp::ldexp({self.conv(args[0], ts[0], 'float')}, {self.conv(args[1], ts[1], 'int32')})"
        if f == "pow":
            return f"{M}pow({self.conv(args[0], ts[0], e.ty)}, {self.conv(args[1], ts[1], e.ty)})"
        if e.ty in FP:
            a, b = self.conv(args[0], ts[0], e.ty), self.conv(args[1], ts[1], e.ty)
            return f"hp::f{f}2({a}, {b})"
        return f"{M}{f}<int64_t>({args[0]}, {args[1]})"

    def random(self, e: A.Call, env) -> str:
        ctr = env.random_counter()
        lo, hi = e.args
        if e.ty == "float":
            u = f"hp::uni(c.key, {ctr})"
            if isinstance(lo, A.Num) and lo.value == 0 and isinstance(hi, A.Num) and hi.value == 1:
                return u
            a = self.conv(self.ex(lo, env), lo.ty, "float")
            b = self.conv(self.ex(hi, env), hi.ty, "float")
            return f"({a} + ({b} - {a}) * {u})"
        a = self.conv(self.ex(lo, env), lo.ty, "int32")
        b = self.conv(self.ex(hi, env), hi.ty, "int32")
        return f"hp::rint(c.key, {ctr}, {a}, {b})"

    # ---- element access and UDF application -----------------------------------------------------
    def elem(self, arr_code: str, t: Arr, i: str) -> str:
        if t.elem == "float":
            return f"{arr_code}.p[{i}]"
        if t.elem == "int32":
            return f"static_cast<int64_t>({arr_code}.p[{i}])"
        return f"static_cast<int64_t>(hp::get_bits({arr_code}.p, {i}, {arr_code}.bits))"

    def elem_type(self, t: Arr) -> str:
        return "float" if t.elem == "float" else "int32"

    def array_code(self, e, env) -> str:
        """Code of an array-valued DSL expression that is a variable or .index."""
        if isinstance(e, A.Name) or isinstance(e, A.Member):
            code = self.ex(e, env)
            if is_arr(e.ty) and e.ty.sparse and isinstance(e, A.Name):
                return f"hp::values_of({code})"
            return code
        self.err(e, "an array operand must be a variable here")

    def src_elem(self, acode: str, st: Arr) -> str:
        """Element i of the operand acode in per-element code (the target says which variable holds it)."""
        return self.elem(self.t.ELEM_OF or acode, st, "i")

    def copy(self, dst: str, src: str, nbytes: str, fresh: bool = False) -> str:
        return (self.t.COPY_FRESH if fresh else self.t.COPY).format(dst=dst, src=src, n=nbytes)

    def udf_apply(self, u, arg_codes: List[str], arg_types, ctr: str) -> str:
        args = [self.conv(c, t, at, u.func.params[k][0].width) for k, (c, t, (_, at))
                in enumerate(zip(arg_codes, arg_types, u.args))]
        return f"u_{u.func.name}(c, {ctr}{''.join(', ' + a for a in args)})"

    def per_elem(self, u, elem_code: str, st: Arr, ctr: str = "0") -> str:
        """u applied to element i of an array of type st (and to i, when u takes the index too)."""
        args = [elem_code] + (["static_cast<int64_t>(i)"] if len(u.args) == 2 else [])
        return self.udf_apply(u, args, [self.elem_type(st), "int32"], ctr)

    # ---- reduce ---------------------------------------------------------------------------------
    def reduce(self, e: A.Call, env) -> str:
        """reduce(A, r), reduce(filter(A, p), r), reduce(map(A, f), r): the operand decomposed here, the
        reduction lowered by the target."""
        src, _ = e.args
        pred = mapf = None
        if isinstance(src, A.Call) and src.func == "filter":
            if len(src.args) == 3:
                self.err(src, "a filter inside reduce takes no cap")
            pred = self.s.udfs[src.args[1].id]
            src = src.args[0]
        elif isinstance(src, A.Call) and src.func == "map":
            mapf = self.s.udfs[src.args[1].id]
            src = src.args[0]
        if isinstance(src, A.Call):
            self.err(src, "reduce's array must be a variable, filter(variable, p) or map(variable, f)")
        if mapf is not None and mapf.randoms:
            self.err(e, "reduce(map(..., f)) with a random f is not supported; map into a variable first")
        return self.t.reduce(e, src, pred, mapf, env)

    def fused_value(self, elem_code: str, st: Arr, pred, mapf):
        """(value of element i, its type, keep-condition) of reduce's operand."""
        val, ety = elem_code, self.elem_type(st)
        if mapf is not None:
            val = self.per_elem(mapf, elem_code, st)
            ety = mapf.ret if mapf.ret in FP else "int32"
        keep = "true" if pred is None else f"(({self.per_elem(pred, elem_code, st)}) != 0)"
        return val, ety, keep

    def fold_parts(self, e: A.Call, val: str, ety, acc: str):
        """reduce with a user-defined reducer u: (C type, acc.v (+) x, a.v (+) b.v, the element as u's type)."""
        u = self.s.udfs[e.args[1].id]
        return (ctype(u.ret), self.udf_apply(u, [f"{acc}.v", "x"], [u.ret, u.ret], "0"),
                self.udf_apply(u, ["a.v", "b.v"], [u.ret, u.ret], "0"), self.conv(val, ety, u.ret))

    # ---- params / ctx ---------------------------------------------------------------------------
    def params_struct(self):
        s = self.s
        lines = ["struct Params {"]
        for f in s.params:
            lines.append(f"  {ctype(f.type.base)} f_{f.name} = {'0.0f' if f.type.base == 'float' else '0'};")
        lines.append("};")
        lines.append("Params make_params([[maybe_unused]] const double* p) {")
        lines.append("  Params P;")
        for i, f in enumerate(s.params):
            r = getattr(f, "range", None)
            if r is not None:  # declared range (in (lo, hi]) or set (in {2, 4, 8}): checked on the value given
                if r.values is not None:
                    conds = [" || ".join(f"p[{i}] == {float(v)!r}" for v in r.values)]
                else:
                    conds = []
                    if r.lo is not None:
                        conds.append(f"p[{i}] {'>' if r.lo_open else '>='} {float(r.lo)!r}")
                    if r.hi is not None:
                        conds.append(f"p[{i}] {'<' if r.hi_open else '<='} {float(r.hi)!r}")
                    elif r.lo is not None:  # (lo, inf): the value must also be finite (not inf, not NaN)
                        conds.append(f"p[{i}] <= 1.7976931348623157e308")  # DBL_MAX
                if conds:
                    lines.append(f"  if (!({' && '.join(conds)})) throw std::invalid_argument(\"{f.name} must be "
                                 f"{r.requirement()}\");")
            lines.append(f"  P.f_{f.name} = static_cast<{ctype(f.type.base)}>(p[{i}]);")
        lines.append("  [[maybe_unused]] struct { const Params* p; } c{&P};")
        seen = set()
        for w in self.widths:
            code = self.wexpr(w)
            if code in seen:
                continue
            seen.add(code)
            lines.append(f"  hp::check_bits({code}, \"the width of uint<...> (line {w.line})\");")
        lines.append("  return P;")
        lines.append("}")
        return "\n".join(lines)

    def ctx_struct(self):
        """The scalar context of a call (parameters, RNG, globals, state buffers) and its helpers."""
        s = self.s
        lines = list(self.t.ctx_head())
        for name, g in s.globals.items():
            if g.state and is_arr(g.ty):
                lines.append(f"  {self.t.STATE_ARRAY} g_{name}{self.t.STATE_INIT};  // state buffer {g.slot}"
                             f"{self.t.STATE_NOTE}")
                continue
            init = "0.0f" if g.ty == "float" else "0"
            d = next((i for dd in s.program.globals for (nm, i, _, _) in dd.names if nm == name), None)
            if d is not None:
                init = self.conv(self.ex(d, EntryEnv("const")), d.ty, g.ty, g.width)
            lines.append(f"  {ctype(g.ty)} g_{name} = {init};")
        lines.append("};")
        lines.append("[[maybe_unused]] inline uint64_t hp_next(Ctx& c, uint64_t k) { uint64_t v = c.counter; "
                     "c.counter += k; return v; }")
        lines += self.t.ctx_helpers()
        return "\n".join(lines)

    # ---- UDFs and statements ------------------------------------------------------------------------
    def udf_sig(self, u):
        args = "".join(f", [[maybe_unused]] {ctype(t)} a_{n}" for n, t in u.args)
        return (f"[[maybe_unused]] {self.t.UDF_QUAL}inline {ctype(u.ret) if u.ret else 'void'} u_{u.func.name}("
                f"[[maybe_unused]] const Ctx& c, [[maybe_unused]] uint64_t rc{args})")

    def udfs(self):
        for u in self.s.udfs.values():
            self.udf(u)

    def udf(self, u):
        if u.ret == "uintN":
            self.widths.append(u.func.ret.width)
        self.emit(self.udf_sig(u) + " {", 0)
        self.cur_ret = (u.ret, u.func.ret.width)
        self.stmts(u.func.body, UdfEnv(), 1)
        if u.ret is not None and not returns(u.func.body):
            self.emit("return 0;")
        self.emit("}", 0)

    def stmts(self, stmts, env, ind):
        i = 0
        while i < len(stmts):
            if i + 1 < len(stmts) and self.s.view is not None and self.add_matmul(stmts[i], stmts[i + 1], env, ind):
                i += 2
                continue
            self.stmt(stmts[i], env, ind)
            i += 1

    def add_matmul(self, first, then, env, ind) -> bool:
        """``X = map(X, Y, a + b);`` followed by ``Z = matmul(X, W);`` (or ``float* Z = matmul(X, W);``),
        X a state matrix: both in one pass over X (ops::add_matmul_nn, the same floats as the two
        statements). PowerSGD's error feedback and first product read the matrix once instead of twice."""
        if not (isinstance(first, A.Assign) and first.op == "=" and not getattr(first, "accumulate", False)):
            return False
        sym, call = first.target.sym, first.value
        if not (sym.state and is_arr(sym.ty) and isinstance(call, A.Call) and call.kind == "op" and call.func == "map"
                and getattr(call, "zip", False)):
            return False
        a, b, fn = call.args
        if not (isinstance(a, A.Name) and a.id == sym.name and is_sum(self.s.udfs[fn.id])):
            return False
        if isinstance(then, A.Assign) and then.op == "=" and not getattr(then, "accumulate", False):
            tsym, mm = then.target.sym, then.value
            decl = None
        elif isinstance(then, A.Decl) and len(then.names) == 1 and then.names[0][1] is not None:
            tsym, mm = then.syms[0], then.names[0][1]
            decl = then.names[0][0]
        else:
            return False
        if not (isinstance(mm, A.Call) and mm.kind == "op" and mm.func == "matmul" and not any(mm.trans)
                and isinstance(mm.args[0], A.Name) and mm.args[0].id == sym.name and is_arr(tsym.ty)
                and tsym.kind != "output" and tsym.name != sym.name and getattr(mm.args[1], "id", None) != sym.name
                and getattr(b, "id", None) != tsym.name):  # the product must not overwrite what is added
            return False
        self.idioms.append("map(X, Y, a + b); matmul(X, W) -> ops::add_matmul_nn")
        xc, yc = self.array_code(a, env), self.array_code(b, env)
        self.emit(f"if ({xc}.n != {yc}.n) throw std::logic_error(\"map: array lengths differ\");", ind)
        if decl is not None:
            self.emit(f"{cxx_var_type(tsym.ty)} l_{decl};", ind)
            tgt = f"l_{decl}"
        else:
            tgt = env.name(then.target)
        self.t.lowrank.matmul_op(tgt, tsym, mm, env, ind, add_first=yc)
        return True

    def stmt(self, st, env, ind):
        if isinstance(st, A.Decl):
            for (name, init, _, _), sym in zip(st.names, st.syms):
                if is_arr(sym.ty):
                    if sym.ty.elem == "uintN" and sym.ty.width is not None:
                        self.widths.append(sym.ty.width)
                    self.emit(f"{cxx_var_type(sym.ty)} l_{name};", ind)
                    if init is not None:
                        self.array_op(f"l_{name}", sym, init, env, ind)
                    continue
                if sym.ty == "uintN":
                    self.widths.append(sym.width)
                val = self.conv(self.ex(init, env), init.ty, sym.ty, sym.width) if init is not None else \
                    ("0.0f" if sym.ty == "float" else "0")
                self.emit(f"[[maybe_unused]] {ctype(sym.ty)} l_{name} = {val};", ind)
            return
        if isinstance(st, A.Assign):
            sym = st.target.sym
            if sym.kind == "output":
                if env.which == "encode":
                    self.concat(st.value, env, ind)
                else:
                    self.decode_out(st.value, env, ind)
                return
            tgt = env.name(st.target)
            if getattr(st, "accumulate", False):
                self.t.lowrank.matmul_op(tgt, sym, st.value, env, ind, acc=st.op)
                return
            if is_arr(sym.ty):
                self.array_op(tgt, sym, st.value, env, ind)
                return
            self.emit(f"{tgt} = {self.conv(self.ex(st.value, env), st.value.ty, sym.ty, sym.width)};", ind)
            return
        if isinstance(st, A.If):
            self.emit(f"if ({self.truth(self.ex(st.cond, env), st.cond.ty)}) {{", ind)
            self.stmts(st.then, env, ind + 1)
            if st.other:
                self.emit("} else {", ind)
                self.stmts(st.other, env, ind + 1)
            self.emit("}", ind)
            return
        if isinstance(st, A.Return):
            rt, w = self.cur_ret
            if st.value is None:
                self.emit("return;", ind)
            else:
                self.emit(f"return {self.conv(self.ex(st.value, env), st.value.ty, rt, w)};", ind)
            return
        if isinstance(st, A.ExprStmt):  # extract
            self.extract(st.expr, env, ind)
            return
        raise AssertionError(st)

    # ---- array-producing operators ----------------------------------------------------------------
    def array_op(self, tgt, sym, call: A.Call, env, ind):
        t = self.t
        if not isinstance(call, A.Call) or call.kind != "op":
            src = self.array_code(call, env)
            if sym is not None and sym.state:  # state = array: copy into the state's buffer
                self.emit(f"if ({src}.n != {tgt}.n) throw std::logic_error(\"copy: array sizes differ\");", ind)
                self.emit(f"if ({tgt}.n) {self.copy(f'const_cast<float*>({tgt}.p)', f'{src}.p', f'4 * {tgt}.n')};",
                          ind)
                return
            self.emit(f"{tgt} = {src};", ind)
            return
        f = call.func
        if f in ("matmul", "decomp"):
            lower = t.lowrank.matmul_op if f == "matmul" else t.lowrank.decomp_op
            return lower(tgt, sym, call, env, ind)
        if f == "map" and getattr(call, "zip", False):
            return self.block(ind, self.map2_op, tgt, sym, call, env)
        if f == "scatter" and getattr(call, "into", False):
            return self.block(ind, self.scatter_into, tgt, sym, call, env)
        if f == "map":
            return self.block(ind, self.map_op, tgt, sym, call, env)
        if f == "reduce" and getattr(call, "rows", False):
            return self.block(ind, self.reduce_rows_op, tgt, call, env)
        if f == "filter":
            return self.block(ind, self.filter_op, tgt, call, env)
        if f == "sort":
            return self.block(ind, self.sort_op, tgt, call, env)
        self.err(call, f"{f} cannot produce an array here")

    def block(self, ind, fn, *args):
        """fn(*args, ind + 1) inside { }."""
        self.emit("{", ind)
        fn(*args, ind + 1)
        self.emit("}", ind)

    def map_op(self, tgt, sym, call, env, ind):
        src, fn = call.args
        u = self.s.udfs[fn.id]
        st = src.ty
        acode = self.array_code(src, env)
        n = f"{acode}.n"
        r = u.randoms
        self.emit(f"[[maybe_unused]] const uint64_t base = hp_next(c, {n} * {r});" if r else
                  "[[maybe_unused]] const uint64_t base = 0;", ind)
        code = self.per_elem(u, self.src_elem(acode, st), st, f"base + i * {r}" if r else "0")
        if is_packed(call.ty):
            bits = self.packed_width(call.ty)
            # the payload's first array lies right after the header (scalars go into header words)
            first = next((a for a in self.s.concat.args if is_arr(a.ty)), None) if self.s.concat else None
            direct = (env.which == "encode" and isinstance(first, A.Name) and sym is not None and
                      first.id == sym.name and getattr(first.sym, "kind", "") == "local")
            self.emit(f"const int bits = {bits};", ind)
            self.t.map_packed(tgt, src, call.ty, u, acode, code, "out + kHeaderBytes" if direct else "nullptr", ind)
        else:
            self.t.map_plain(tgt, sym, src, u, acode, code, call.ty.elem, ind)
            if st.length == "rows":  # a map of per-row values is per row too
                self.emit(f"{tgt}.row = {acode}.row;", ind)

    def reduce_rows_op(self, tgt, call, env, ind):
        """reduce(A, sum|mean, row) or reduce(map(A, f), ...): a float array of one value per row."""
        src, _, row = call.args
        mapf = None
        if isinstance(src, A.Call):
            mapf = self.s.udfs[src.args[1].id]
            src = src.args[0]
        if mapf is not None and mapf.randoms:
            self.err(call, "reduce(map(..., f), r, row) with a random f is not supported; map into a variable first")
        acode = self.array_code(src, env)
        self.t.reduce_rows(tgt, call, src, mapf, acode, self.conv(self.ex(row, env), row.ty, "int32"), ind)

    def map2_op(self, tgt, sym, call, env, ind):
        a, b, fn = call.args
        ac, bc = self.array_code(a, env), self.array_code(b, env)
        self.emit(f"if ({ac}.n != {bc}.n) throw std::logic_error(\"map: array lengths differ\");", ind)
        self.t.map2(tgt, sym, a, self.s.udfs[fn.id], ac, bc, ind)

    def scatter_into(self, tgt, sym, call, env, ind):
        _, ix, v = call.args
        self.t.scatter_into(tgt, sym, self.array_code(ix, env), self.conv(self.ex(v, env), v.ty, "float"), ind)

    def filter_op(self, tgt, call, env, ind):
        src, fn = call.args[0], call.args[1]
        acode = self.array_code(src, env)
        cap = self.ex(call.args[2], env) if len(call.args) == 3 else f"static_cast<int64_t>({acode}.n)"
        self.t.filter(tgt, src, self.s.udfs[fn.id], acode, cap, ind)

    def pred(self, u, elem_code: str) -> str:
        """A filter's predicate u at element i (elements passed as float, as the operators read them)."""
        args = [elem_code] + (["static_cast<int64_t>(i)"] if len(u.args) == 2 else [])
        return self.udf_apply(u, args, ["float", "int32"], "0")

    def clamp_cap(self, cap: str, acode: str, ind):
        self.emit(f"const int64_t capv = {cap}; const size_t cap = capv < 0 ? 0 : std::min<size_t>("
                  f"static_cast<size_t>(capv), {acode}.n);", ind)

    def sort_op(self, tgt, call, env, ind):
        src, _, kx = call.args[:3]
        self.t.check_sort(call)
        acode = self.array_code(src, env)
        self.emit(f"const int64_t kv = {self.ex(kx, env)}; const size_t k = kv < 0 ? 0 : std::min<size_t>("
                  f"static_cast<size_t>(kv), {acode}.n);", ind)
        sample = self.ex(call.args[3], env) if len(call.args) == 4 else None
        self.t.sort(tgt, call, acode, sample, ind)

    def sample_count(self, code: str) -> str:
        return f"const int64_t sv = {code}; const size_t s = sv < 0 ? 0 : static_cast<size_t>(sv);"

    # ---- payload ---------------------------------------------------------------------------------
    def rate(self):
        """hp_rate: the nominal compressed bytes / fp32 input bytes of an instance: the spec's rate option, else
        the payload of 2^20 elements (header excluded) over 4 * 2^20 bytes."""
        self.emit("[[maybe_unused]] double hp_rate([[maybe_unused]] const Params& P) {", 0)
        if self.s.rate is None:
            self.emit("const size_t n = size_t{1} << 20;")
            self.emit("return static_cast<double>(hp_max_bytes(P, n) - kHeaderBytes) / (4.0 * static_cast<double>(n));")
        else:
            self.emit(f"return {self.rate_code(self.s.rate)};")
        self.emit("}", 0)

    def rate_code(self, e) -> str:
        return self.param_code(e, lambda v: repr(float(v)), lambda f: f"static_cast<double>(P.f_{f})",
                               lambda op, a, b: f"({a} {op} {b})")

    def capacity(self):
        f = self.s.capacity
        if f is None:
            return
        self.emit(f"int64_t hp_capacity(const Params& P, int64_t a_{f.params[0][1]}) {{", 0)
        self.emit("[[maybe_unused]] Ctx c; c.p = &P;")
        self.cur_ret = ("int32", None)
        self.stmts(f.body, CapEnv(), 1)
        self.emit("}", 0)

    def max_bytes(self):
        s = self.s
        self.emit("size_t hp_max_bytes(const Params& P, size_t n) {", 0)
        self.emit("[[maybe_unused]] Ctx c; c.p = &P;")
        if s.capacity is not None:
            self.emit("const int64_t capv = hp_capacity(P, static_cast<int64_t>(n));")
            self.emit("[[maybe_unused]] const size_t nvar = capv < 0 ? 0 : std::min<size_t>(n, "
                      "static_cast<size_t>(capv));")
        else:
            self.emit("[[maybe_unused]] const size_t nvar = n;")
        terms = ["kHeaderBytes"]
        for a in s.concat.args:
            t = a.ty
            if not is_arr(t):
                continue
            ln = "nvar" if t.length == "var" else "n"  # per-row arrays: at most n rows (rows of 1)
            if t.elem in UINTS:
                terms.append(f"hipress::compress::ops::packed_bytes({ln}, {UINTS[t.elem]})")
            elif t.elem == "uintN":
                terms.append(f"hipress::compress::ops::packed_bytes({ln}, {self.width(t.width)})")
            else:
                terms.append(f"4 * {ln}")
        self.emit("using namespace hipress::compress;")
        self.emit(f"return {' + '.join(terms)};")
        self.emit("}", 0)

    def concat(self, call, env, ind):
        """Payload: header{bits of the first packed array, count of the data-dependent arrays, scalars in
        words[]} + the arrays in order."""
        if self.s.view is not None:
            return self.t.lowrank.concat_view(call, env, ind)
        t = self.t
        arrays = [(self.array_code(a, env), a.ty) for a in call.args if is_arr(a.ty)]
        var_first = next((code for code, ty in arrays if ty.length == "var"), None)
        rows_first = next((code for code, ty in arrays if ty.length == "rows"), None)
        packed_first = next((code for code, ty in arrays if is_packed(ty)), None)
        self.emit("{", ind)
        i2 = ind + 1
        self.emit(f"{t.HEADER} h; h.algo = kAlgoId; h.numel = n;", i2)
        body = []
        for code, ty in arrays:
            if ty.length == "rows":  # the header's count holds the row length; the rows follow from it
                same = "" if code == rows_first else f"{code}.row != {rows_first}.row || "
                self.emit(f"if ({same}{code}.n != hp::row_count(n, {code}.row) || "
                          f"{code}.row > 0xffffffffu) throw std::logic_error(\"concat: a per-row array does not match the "
                          f"rows of the gradient\");", i2)
            elif ty.length == "var":
                self.emit(f"if ({code}.n != {var_first}.n) throw std::invalid_argument(\"concat: the data-dependent "
                          f"arrays of a payload must have the same length\");", i2)
            else:
                self.emit(f"if ({code}.n != n) throw std::logic_error(\"concat: array length differs from the "
                          f"gradient's\");", i2)
            body.append(self.array_bytes(code, ty))
        self.emit(f"const size_t body = {' + '.join(body) if body else '0'};", i2)
        self.emit("if (kHeaderBytes + body > cap) throw std::invalid_argument(\"output buffer too small for the "
                  "payload\");", i2)
        if packed_first:
            self.emit(f"h.bits = static_cast<uint8_t>({packed_first}.bits);", i2)
        if var_first:
            self.emit(f"h.count = static_cast<uint32_t>({var_first}.n);", i2)
        if rows_first:
            self.emit(f"h.count = static_cast<uint32_t>({rows_first}.row);", i2)
        self.emit("h.body_bytes = body;", i2)
        self.emit("size_t off = kHeaderBytes;", i2)
        w = 0
        for a in call.args:
            if not is_arr(a.ty):
                self.emit(self.header_word(w, self.ex(a, env), a.ty), i2)
                w += 1
                continue
            code = self.array_code(a, env)
            sz = self.array_bytes(code, a.ty)
            self.emit(f"if (({sz}) != 0 && static_cast<const void*>({code}.p) != static_cast<const void*>(out + off)) "
                      f"{self.copy('out + off', f'{code}.p', sz)};", i2)
            self.emit(f"off += {sz};", i2)
        self.emit(f"{t.WRITE_HEADER}(h, out);", i2)
        self.emit("total = kHeaderBytes + body;", i2)
        self.emit("}", ind)

    def array_bytes(self, code: str, t: Arr) -> str:
        return f"{self.t.PACKED_BYTES}({code}.n, {code}.bits)" if is_packed(t) else f"4 * {code}.n"

    def header_word(self, w: int, code: str, ty) -> str:
        if ty == "float":
            return self.t.FLOAT_WORD.format(w=w, v=code)
        return f"h.words[{w}] = static_cast<uint32_t>(static_cast<uint64_t>({code}));"

    def extract(self, call, env, ind):
        """Reads the encode's payload layout back, validating the header against it."""
        s = self.s
        if s.view is not None:
            return self.t.lowrank.extract_view(call, env, ind)
        t = self.t
        FE = t.FORMAT_ERROR
        layout = [a.ty for a in s.concat.args]
        self.emit(f"const {t.HEADER_READ_T} h = {t.READ_HEADER}(in, bytes, kAlgoId, n);", ind)
        packed = [ty for ty in layout if is_arr(ty) and is_packed(ty)]
        var = [ty for ty in layout if is_arr(ty) and ty.length == "var"]
        per_row = [ty for ty in layout if is_arr(ty) and ty.length == "rows"]
        self.emit("[[maybe_unused]] int bits = 0;", ind)
        if packed and packed[0].elem in UINTS:
            b = UINTS[packed[0].elem]
            self.emit(f"if (h.bits != {b}) throw {FE}(kName + std::string(\" payload: bit width \")"
                      f" + std::to_string(h.bits) + \", expected {b}\");", ind)
        elif packed:
            self.emit(f"if (h.bits != 1 && h.bits != 2 && h.bits != 4 && h.bits != 8) throw {FE}(kName + "
                      "std::string(\" payload: bit width \") + std::to_string(h.bits) + \" (1, 2, 4 or 8 "
                      "expected)\");", ind)
        else:
            self.emit(f"if (h.bits != 0) throw {FE}(kName + std::string(\" payload: unexpected bit width\"));", ind)
        if packed:
            self.emit("bits = h.bits;", ind)
        if var:
            self.emit(f"if (h.count > n) throw {FE}(kName + std::string(\" payload: \") + std::to_string(h.count)"
                      " + \" entries for \" + std::to_string(n) + \" elements\");", ind)
            self.emit("const size_t cnt = h.count;", ind)
        elif per_row:  # count is the row length: 1..n (0 for an empty tensor)
            self.emit(f"if (n ? (h.count == 0 || h.count > n) : h.count != 0) throw {FE}(kName + std::string("
                      "\" payload: row length \") + std::to_string(h.count) + \" for \" + std::to_string(n) + "
                      "\" elements (corrupt payload)\");", ind)
            self.emit("const size_t row = h.count, nrows = hp::row_count(n, row);", ind)
        else:
            self.emit(f"if (h.count != 0) throw {FE}(kName + std::string(\" payload: unexpected count\"));", ind)
        self.emit(f"if (h.kind != 0) throw {FE}(kName + std::string(\" payload: kind \") + std::to_string(h.kind)"
                  " + \", single-round payloads have kind 0\");", ind)
        sizes = []
        for ty in layout:
            if is_arr(ty):
                length = {"n": "n", "var": "cnt", "rows": "nrows"}[ty.length]
                sizes.append(f"{t.PACKED_BYTES}({length}, bits)" if is_packed(ty)
                             else f"4 * static_cast<uint64_t>({length})")
        self.emit(f"{t.EXPECT_BODY}(h, {' + '.join(sizes) if sizes else '0'}, kName.c_str());", ind)
        self.emit("size_t off = kHeaderBytes;", ind)
        w = 0
        for a, ty in zip(call.args[1:], layout):
            tgt = env.name(a)
            if getattr(a.sym, "by_extract", False):
                self.emit(f"{cxx_var_type(a.sym.ty)} {tgt};" if is_arr(ty) else f"[[maybe_unused]] {ctype(ty)} {tgt} = 0;",
                          ind)
            if not is_arr(ty):
                self.extract_word(tgt, w, ty, ind)
                w += 1
                continue
            length = {"n": "n", "var": "cnt", "rows": "nrows"}[ty.length]
            if is_packed(ty):
                self.emit(f"{tgt}.p = const_cast<uint8_t*>(in + off); {tgt}.n = {length}; {tgt}.bits = bits; "
                          f"off += {t.PACKED_BYTES}({length}, bits);", ind)
            else:  # copied: the payload offset of a 4-byte array need not be aligned
                self.emit(f"hp::alloc({tgt}, {length}); if ({length}) "
                          f"{self.copy(t.OWNED.format(a=tgt), 'in + off', f'4 * {length}', fresh=True)}; off += 4 * {length};", ind)
                if ty.length == "rows":
                    self.emit(f"{tgt}.row = row;", ind)
                    self.t.check_row_values(tgt, ind)

    def extract_word(self, tgt: str, w: int, ty, ind):
        if ty == "float":  # scales and thresholds: a forged inf/NaN would decode to inf/NaN everywhere
            self.emit(f"if ((h.words[{w}] & 0x7f800000u) == 0x7f800000u) throw {self.t.FORMAT_ERROR}(kName + "
                      f"std::string(\" payload: field {w + 1} (float) is inf or NaN\"));", ind)
            self.emit(f"{tgt} = h.f({w});", ind)
        elif ty == "int32":
            self.emit(f"{tgt} = static_cast<int64_t>(static_cast<int32_t>(h.words[{w}]));", ind)
        else:
            b = UINTS[ty]
            self.emit(f"if (h.words[{w}] >= (1u << {b})) throw {self.t.FORMAT_ERROR}(kName + std::string(\" payload: "
                      f"field {w + 1} out of range for {ty}\"));", ind)
            self.emit(f"{tgt} = static_cast<int64_t>(h.words[{w}]);", ind)

    def decode_out(self, call, env, ind):
        """decode's gradient = scatter(I, V) or gradient = map(Q, f), with decode_add's alpha / add."""
        if call.func == "matmul":
            return self.t.lowrank.matmul_op("out", None, call, env, ind, to_out=True)
        self.emit("{", ind)
        i2 = ind + 1
        if call.func == "scatter":
            ic = self.array_code(call.args[0], env)
            vc = self.array_code(call.args[1], env)
            self.emit(f"if ({ic}.n != {vc}.n) throw {self.t.FORMAT_ERROR}(kName + std::string(\" payload: index and "
                      f"value counts differ\"));", i2)
            self.t.decode_scatter(ic, vc, i2)
        elif getattr(call, "rows", False):
            src, rv, fn = call.args
            self.t.decode_map_rows(src, self.array_code(src, env), self.array_code(rv, env), self.s.udfs[fn.id], i2)
        else:
            src, fn = call.args
            u = self.s.udfs[fn.id]
            st = src.ty
            acode = self.array_code(src, env)
            if is_packed(st) and len(u.args) == 1 and not u.randoms:
                self.idioms.append("decode map(packed, f) -> table + ops::dequantize_table")
                tv = self.conv(self.udf_apply(u, ["static_cast<int64_t>(k)"], ["int32"], "0"), u.ret, "float")
                self.emit(f"const int b = {acode}.bits; float tab[256] = {{}};", i2)
                self.emit(f"for (int k = 0; k < (1 << b); ++k) tab[k] = {tv};", i2)
                self.emit(f"{self.t.OPS}dequantize_table({acode}.p, n, b, tab, alpha, add, out);", i2)
            else:
                v = self.conv(self.per_elem(u, self.src_elem(acode, st), st), u.ret, "float")
                self.t.decode_map(src, acode, v, i2)
        self.emit("}", ind)

    # ---- entry points ------------------------------------------------------------------------------
    def bind_states(self, ptr, length, ind=2):
        for g in self.s.state_arrays:
            self.emit(self.t.BIND_STATE.format(name=g.name, ptr=ptr(g), n=length(g)), ind)

    def state_setup(self):
        """Binds the caller's state (or a zero state, for a stateless call) and reads the state scalars."""
        s = self.s
        k = len(s.state_arrays)
        if k:
            self.t.zero_state_decl()
            self.emit("if (scalars) {")
            self.emit(f"if (nbufs < {k}) throw std::invalid_argument(kName + std::string(\": the state has \") + "
                      f"std::to_string(nbufs) + \" buffers, needs {k} (make it with new_state)\");", 2)
            for g in s.state_arrays:
                self.emit(f"if (lens[{g.slot}] != n || (n && !bufs[{g.slot}])) throw std::invalid_argument(kName + "
                          f"std::string(\": state buffer '{g.name}' has \") + std::to_string(lens[{g.slot}]) + "
                          f"\" elements, expected \" + std::to_string(n) + \" (state made for another tensor?)\");", 2)
                self.emit(self.t.BIND_STATE.format(name=g.name, ptr=f"bufs[{g.slot}]", n="n"), 2)
            self.emit("} else {")
            if self._state_read_without_state():
                zero = self.t.zero_state(f"{k} * n")
                self.bind_states(lambda g: f"{zero} + {g.slot} * n", lambda g: "n")
            else:  # every use is under `if (has_state)`: no zero state to allocate and clear
                self.bind_states(lambda g: "nullptr", lambda g: "0")
            self.emit("}")
        else:
            self.emit("(void)bufs; (void)lens; (void)nbufs;")
        self.read_scalars(True)

    def _state_read_without_state(self) -> bool:
        """Whether a stateless encode can touch a state array: a use outside the then-branch of
        `if (has_state)`, or any use inside a user function (conservatively). A stateless call
        of a spec that guards all its state (DGC) then skips zeroing 2n floats of scratch state
        (16 MB for a 4M-element gradient, 5x DGC's stateless encode time)."""
        s = self.s
        names = {g.name for g in s.state_arrays}

        def reads(node, skip_guarded: bool) -> bool:
            if skip_guarded and isinstance(node, A.If) and isinstance(node.cond, A.Name) and node.cond.id == "has_state":
                return reads(node.other, True)
            if isinstance(node, A.Name):
                return node.id in names
            if isinstance(node, A.Node):
                return any(reads(v, skip_guarded) for v in vars(node).values())
            if isinstance(node, (list, tuple)):
                return any(reads(x, skip_guarded) for x in node)
            return False

        return reads(s.encode.body, True) or any(reads(u.func.body, False) for u in s.udfs.values())

    def read_scalars(self, unused_note=False):
        s = self.s
        for g in s.state_scalars:
            self.emit(f"c.g_{g.name} = scalars ? hp::w32(static_cast<int64_t>(scalars[{g.slot}])) : 0;")
        if s.uses_random:
            self.emit(f"c.key = {self.t.RNG_KEY}(static_cast<uint64_t>(P.f_seed));")
            self.emit("c.counter = scalars ? scalars[kRngCounter] : 0;")
        elif unused_note and self.t.VOID_SCALARS:
            self.emit("(void)scalars;")

    def save_scalars(self):
        s = self.s
        if s.uses_random:
            self.emit("if (scalars) scalars[kRngCounter] = c.counter;")
        for g in s.state_scalars:
            self.emit(f"if (scalars) scalars[{g.slot}] = static_cast<uint64_t>(c.g_{g.name});")

    def encode(self):
        s = self.s
        self.emit("size_t hp_encode(const Params& P, const float* in, size_t n, uint8_t* out, size_t cap, "
                  "uint64_t* scalars, float* const* bufs, const uint64_t* lens, int nbufs) {", 0)
        self.emit("Ctx c; c.p = &P;")
        self.emit("c.has_state = scalars != nullptr;")
        self.state_setup()
        self.emit(CAP_CHECK.format(P="P"))
        self.emit("hp::FArr v_in; v_in.p = in; v_in.n = n;")
        self.emit("size_t total = 0;")
        self.stmts(s.encode.body, EntryEnv("encode"), 1)
        self.save_scalars()
        self.emit("return total;")
        self.emit("}", 0)

    def decode(self):
        s = self.s
        self.emit("void hp_decode(const uint8_t* in, size_t bytes, float* out, size_t n, float alpha, bool add) {", 0)
        if s.decode is None:
            self.emit("(void)in; (void)bytes; (void)out; (void)n; (void)alpha; (void)add;")
            self.emit("throw std::invalid_argument(kName + std::string(\": the spec has no decode function\"));")
            self.emit("}", 0)
            return
        self.emit(self.t.DECODE_CTX)
        if s.view is not None:
            self.t.lowrank.decode_prologue()
        self.stmts(s.decode.body, EntryEnv("decode"), 1)
        self.emit("}", 0)

    def abi(self) -> str:
        """The C ABI of every target (hipress/dsl/runtime.py); a target adds a trailing stream argument."""
        s, t = self.s, self.t
        ns = t.NS
        x = t.ABI_EXTRA
        stream = f"\n  {t.ABI_PROLOGUE}" if t.ABI_PROLOGUE else ""
        catch = CATCH.format(ns=ns)
        return f"""
}}  // namespace{t.NS_NOTE}

// ---- C ABI (hipress/dsl/runtime.py{t.ABI_NOTE}) ----
#define HPC_API extern "C" __attribute__((visibility("default")))
namespace{t.NS_NAME} {{
{t.FAIL_QUAL}int hpc_fail(const std::exception& e, char* err, int errlen, int code) {{
  if (err && errlen > 0) {{ std::strncpy(err, e.what(), static_cast<size_t>(errlen) - 1); err[errlen - 1] = 0; }}
  return code;
}}
}}{t.NS_END_NOTE}
HPC_API int hpc_abi_version() {{ return {ABI_VERSION}; }}{t.target_fn()}
HPC_API int hpc_num_params() {{ return {len(s.params)}; }}
HPC_API void hpc_set_num_threads(int t) {{ {t.SET_THREADS} }}
HPC_API int hpc_check_params(const double* p, char* err, int errlen) {{
  try {{ {ns}make_params(p); return 0; }}
  catch (const std::exception& e) {{ return {ns}hpc_fail(e, err, errlen, 2); }}
}}
HPC_API int hpc_max_encoded_bytes(const double* p, uint64_t n, uint64_t* res, char* err, int errlen) {{
  try {{ *res = {ns}hp_max_bytes({ns}make_params(p), n); return 0; }}
  catch (const std::exception& e) {{ return {ns}hpc_fail(e, err, errlen, 2); }}
}}
HPC_API int hpc_rate(const double* p, double* res, char* err, int errlen) {{
  try {{ *res = {ns}hp_rate({ns}make_params(p)); return 0; }}
  catch (const std::exception& e) {{ return {ns}hpc_fail(e, err, errlen, 2); }}
}}
HPC_API int hpc_num_state_buffers() {{ return {len(s.state_arrays)}; }}
HPC_API int hpc_encode(const double* p, const float* in, uint64_t n, uint8_t* out, uint64_t cap, uint64_t* scalars,
                       float* const* bufs, const uint64_t* lens, int nbufs, uint64_t* nbytes, char* err, int errlen{x}) {{{stream}
  try {{ *nbytes = {ns}hp_encode({ns}make_params(p), in, n, out, cap, scalars, bufs, lens, nbufs); return 0; }}
{catch}
}}
HPC_API int hpc_decode(const uint8_t* in, uint64_t bytes, float* out, uint64_t n, float alpha, int add, char* err,
                       int errlen{x}) {{{stream}
  try {{ {ns}hp_decode(in, bytes, out, n, alpha, add != 0); return 0; }}
{catch}
}}
"""


def cpp_generator(spec: Spec) -> Generator:
    from hipress.dsl.target_cpp import CppTarget
    return Generator(spec, CppTarget)


def generate_cpp(spec: Spec) -> str:
    """The CPU translation unit of a checked spec."""
    return cpp_generator(spec).generate()
