"""C++ code generator of the CompLL DSL (CPU back end) and CUDA source text.

The generated translation unit exposes a tiny C ABI (``hpc_*`` functions, see
ABI below) that hipress/dsl/runtime.py loads with ctypes. Operator calls are
lowered to the optimised common operators of csrc/compress/ops.h where the
user-defined function has a shape an operator implements exactly (idioms:
stochastic quantisation, sign bits, threshold ternarisation, min/max and sign
sums, table decoding of packed codes, top-k by magnitude); everything else
becomes a fused, chunked loop over the elements with the same semantics.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional

from hipress.dsl import ast as A
from hipress.dsl.checker import INTS, UINTS, Arr, Spec, bits_of, is_arr
from hipress.dsl.errors import DSLError

ABI_VERSION = 2
_PRELUDE = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "prelude.h.txt")).read()


def ctype(t) -> str:
    return t if t in ("float", "double") else "int64_t"


FP = ("float", "double")


class Gen:
    # Namespace of the math built-ins in the expression translation (the CUDA back end
    # uses its __host__ __device__ versions, csrc/compress/cuda/hp_device.h).
    MATH = "std::"

    def __init__(self, spec: Spec):
        self.s = spec
        self.out: List[str] = []
        self.tmp = 0
        self.idioms: List[str] = []  # (for --explain / tests): which operators were substituted

    def err(self, node, msg):
        raise DSLError(msg, self.s.file, getattr(node, "line", 0), getattr(node, "col", 0))

    def fresh(self, base="t"):
        self.tmp += 1
        return f"{base}{self.tmp}"

    # ---- expressions ---------------------------------------------------------------
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

    def wexpr(self, e) -> str:
        if isinstance(e, A.Num):
            return f"int64_t{{{e.value}}}"
        if isinstance(e, A.Name):
            return f"c.p->f_{e.id}"
        if isinstance(e, A.Member):
            return f"c.p->f_{e.attr}"
        ops = {"+": "hp::add", "-": "hp::sub", "*": "hp::mul", "<<": "hp::shl", ">>": "hp::shr"}
        return f"{ops[e.op]}({self.wexpr(e.left)}, {self.wexpr(e.right)})"

    def ex(self, e, env) -> str:
        t = e.ty
        if isinstance(e, A.Num):
            if e.is_float:
                return repr(float(e.value)) + "f" if "e" in repr(float(e.value)) or "." in repr(float(e.value)) \
                    else repr(float(e.value)) + ".0f"
            return f"int64_t{{{e.value}}}"
        if isinstance(e, A.Name):
            return env.name(e)
        if isinstance(e, A.Member):
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
        if isinstance(e, A.Unary):
            a = self.ex(e.operand, env)
            if e.op == "-":
                return f"(-{a})" if t in FP else f"hp::neg({a})"
            if e.op == "!":
                return f"static_cast<int64_t>(!({a}))" if e.operand.ty not in FP else \
                    f"static_cast<int64_t>(({a}) == 0)"
            return f"(~{a})"
        if isinstance(e, A.Binary):
            lt, rt = e.left.ty, e.right.ty
            a, b = self.ex(e.left, env), self.ex(e.right, env)
            if e.op in ("&&", "||"):
                ca = f"({a}) != 0.0f" if lt in FP else f"({a}) != 0"
                cb = f"({b}) != 0.0f" if rt in FP else f"({b}) != 0"
                return f"static_cast<int64_t>(({ca}) {e.op} ({cb}))"
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
        if isinstance(e, A.Cond):
            c = self.ex(e.cond, env)
            c = f"({c}) != 0.0f" if e.cond.ty in FP else f"({c}) != 0"
            return f"(({c}) ? {self.conv(self.ex(e.then, env), e.then.ty, t)} : " \
                   f"{self.conv(self.ex(e.other, env), e.other.ty, t)})"
        if isinstance(e, A.Call):
            return self.call(e, env)
        raise AssertionError(type(e))

    def call(self, e: A.Call, env) -> str:
        k = e.kind
        f = e.func
        if k == "cast":
            a = e.args[0]
            return self.conv(self.ex(a, env), a.ty, f)
        if k == "math":
            args = [self.ex(a, env) for a in e.args]
            M = self.MATH
            ts = [a.ty for a in e.args]
            if f in ("floor", "ceil", "round", "sqrt", "exp", "log"):
                return f"{M}{f}({self.conv(args[0], ts[0], e.ty)})"
            if f == "abs":
                return f"{M}fabs({args[0]})" if ts[0] in FP else f"hp::iabs({args[0]})"
            if f == "signbit":
                return f"static_cast<int64_t>({M}signbit({args[0]}))" if ts[0] in FP else \
                    f"static_cast<int64_t>(({args[0]}) < 0)"
            if f == "isnan":
                return f"static_cast<int64_t>({M}isnan({args[0]}))" if ts[0] in FP else "int64_t{0}"
            if f == "pow":
                return f"{M}pow({self.conv(args[0], ts[0], e.ty)}, {self.conv(args[1], ts[1], e.ty)})"
            if e.ty in FP:
                a, b = self.conv(args[0], ts[0], e.ty), self.conv(args[1], ts[1], e.ty)
                return f"hp::f{f}2({a}, {b})"
            return f"{M}{f}<int64_t>({args[0]}, {args[1]})"
        if k == "random":
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
                self.idioms.append("threshold -> ops::sampled_threshold")
                return (f"[&]{{ const int64_t sv = {smp}; const size_t s = sv < 0 ? 0 : static_cast<size_t>(sv); "
                        f"return hipress::compress::ops::sampled_threshold({a}.p, {a}.n, {frac}, s, c.key, "
                        f"hp_next(c, s)); }}()")
            self.err(e, f"{f} produces an array: assign it to an array variable")
        raise AssertionError(k)

    # ---- element access ------------------------------------------------------------------
    def elem(self, arr_code: str, t: Arr, i: str) -> str:
        if t.elem == "float" or t.elem == "int32":
            return f"{arr_code}.p[{i}]" if t.elem == "float" else f"static_cast<int64_t>({arr_code}.p[{i}])"
        return f"static_cast<int64_t>(hp::get_bits({arr_code}.p, {i}, {arr_code}.bits))"

    def elem_type(self, t: Arr) -> str:
        return "float" if t.elem == "float" else "int32"

    def array_code(self, e, env) -> str:
        """C++ expression for an array-valued DSL expression that is a variable or .index."""
        if isinstance(e, A.Name) or isinstance(e, A.Member):
            code = self.ex(e, env)
            if is_arr(e.ty) and e.ty.sparse and isinstance(e, A.Name):
                return f"hp::values_of({code})"
            return code
        self.err(e, "an array operand must be a variable here")

    def udf_apply(self, u, arg_codes: List[str], arg_types, ctr: str) -> str:
        args = [self.conv(c, t, at, u.func.params[k][0].width) for k, (c, t, (_, at))
                in enumerate(zip(arg_codes, arg_types, u.args))]
        return f"u_{u.func.name}(c, {ctr}{''.join(', ' + a for a in args)})"

    # ---- reduce -----------------------------------------------------------------------
    def reduce(self, e: A.Call, env) -> str:
        src, fn = e.args
        pred = None
        mapf = None
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
        st = src.ty
        acode = self.array_code(src, env)
        is_input = isinstance(src, A.Name) and src.sym.kind == "input"
        r = e.reducer
        # Idioms on the encode's input.
        if is_input and mapf is None and pred is None and r in ("smaller", "greater", "maxabs"):
            self.idioms.append(f"reduce({r}) -> ops::reduce_minmax")
            if r == "maxabs":
                return "hp::fmax2(std::fabs(hp_minmax(c, in, n).min), std::fabs(hp_minmax(c, in, n).max))"
            return f"hp_minmax(c, in, n).{'min' if r == 'smaller' else 'max'}"
        if is_input and pred is not None and r in ("mean", "sum", "count") and mapf is None:
            kind = sign_pred(pred)
            if kind:
                self.idioms.append("reduce(filter(signbit)) -> ops::reduce_sign_sums")
                s, cnt = ("neg_sum", "neg_count") if kind == "neg" else ("pos_sum", "pos_count")
                ss = "hp_signsums(c, in, n)"
                if r == "mean":
                    return f"({ss}.{cnt} ? static_cast<float>({ss}.{s} / static_cast<double>({ss}.{cnt})) : 0.0f)"
                if r == "sum":
                    return f"static_cast<float>({ss}.{s})"
                return f"hp::w32(static_cast<int64_t>({ss}.{cnt}))"
        # Generic fused loop: value(i), keep(i).
        ctr = "0"
        ety = self.elem_type(st)
        val = self.elem(acode, st, "i")
        if mapf is not None:
            if mapf.randoms:
                self.err(e, "reduce(map(..., f)) with a random f is not supported; map into a variable first")
            args = [val] + (["static_cast<int64_t>(i)"] if len(mapf.args) == 2 else [])
            val = self.udf_apply(mapf, args, [ety, "int32"], ctr)
            ety = mapf.ret if mapf.ret in FP else "int32"
        keep = "true"
        if pred is not None:
            args = [self.elem(acode, st, "i")] + (["static_cast<int64_t>(i)"] if len(pred.args) == 2 else [])
            pv = self.udf_apply(pred, args, [self.elem_type(st), "int32"], ctr)
            keep = f"(({pv}) != 0)"
        n = f"{acode}.n"
        if r in ("sum", "mean", "count"):
            red = (f"hp::reduce_chunks({n}, hp::SumAcc{{}}, [&](hp::SumAcc& a, size_t i) {{ if ({keep}) {{ "
                   f"a.s += static_cast<double>({val}); ++a.cnt; }} }}, [](hp::SumAcc& a, const hp::SumAcc& b) "
                   f"{{ a.s += b.s; a.cnt += b.cnt; }})")
            if r == "count":
                return f"hp::w32(static_cast<int64_t>({red}.cnt))"
            if r == "sum":
                return f"static_cast<float>({red}.s)" if e.ty == "float" else f"hp::w32(static_cast<int64_t>({red}.s))"
            return f"[&]{{ hp::SumAcc a = {red}; return a.cnt ? static_cast<float>(a.s / static_cast<double>(a.cnt)) : 0.0f; }}()"
        if r in ("smaller", "greater", "maxabs"):
            v = f"static_cast<float>({val})"
            if r == "maxabs":
                v = f"std::fabs({v})"
            cmp = "<" if r == "smaller" else ">"
            init = "std::numeric_limits<float>::infinity()" if r == "smaller" else \
                "-std::numeric_limits<float>::infinity()"
            red = (f"hp::reduce_chunks({n}, hp::MinAcc{{{init}, false}}, [&](hp::MinAcc& a, size_t i) {{ if ({keep}) "
                   f"{{ float v = {v}; if (v {cmp} a.v) {{ a.v = v; a.has = true; }} }} }}, "
                   f"[](hp::MinAcc& a, const hp::MinAcc& b) {{ if (b.has && (!a.has || b.v {cmp} a.v)) a = b; }})")
            res = f"[&]{{ hp::MinAcc a = {red}; return a.has ? a.v : 0.0f; }}()"
            return res if e.ty == "float" else f"hp::f2i({res})"
        # user-defined reducer
        u = self.s.udfs[fn.id]
        ct = ctype(u.ret)
        step = self.udf_apply(u, ["a.v", "x"], [u.ret, u.ret], "0")
        merge = self.udf_apply(u, ["a.v", "b.v"], [u.ret, u.ret], "0")
        x = self.conv(val, ety, u.ret)
        return (f"[&]{{ using Acc = hp::FoldAcc<{ct}>; Acc a = hp::reduce_chunks({n}, Acc{{}}, [&](Acc& a, size_t i) "
                f"{{ if ({keep}) {{ {ct} x = {x}; a.v = a.has ? {step} : x; a.has = true; }} }}, "
                f"[&](Acc& a, const Acc& b) {{ if (b.has) {{ a.v = a.has ? {merge} : b.v; a.has = true; }} }}); "
                f"return a.v; }}()")


def sign_pred(u) -> Optional[str]:
    """'neg' if the predicate is signbit(x), 'pos' if !signbit(x) (exactly)."""
    e = flatten(u)
    if e is None or len(u.args) != 1:
        return None
    x = u.args[0][0]
    if isinstance(e, A.Call) and e.func == "signbit" and is_name(e.args[0], x):
        return "neg"
    if isinstance(e, A.Unary) and e.op == "!" and isinstance(e.operand, A.Call) and e.operand.func == "signbit" \
            and is_name(e.operand.args[0], x):
        return "pos"
    return None


def abs_ge_threshold(u) -> Optional[A.Expr]:
    """T if the predicate is exactly abs(x) >= T && abs(x) > 0 (T not depending on x), else None."""
    e = flatten(u)
    if e is None or len(u.args) != 1 or not isinstance(e, A.Binary) or e.op != "&&":
        return None
    x = u.args[0][0]

    def is_abs(a):
        return isinstance(a, A.Call) and a.func == "abs" and is_name(a.args[0], x) and a.args[0].ty == "float"
    ge, gt = e.left, e.right
    if not (isinstance(ge, A.Binary) and ge.op == ">=" and is_abs(ge.left) and ge.right.ty in ("float", "int32")
            and not mentions(ge.right, x) and not has_udf_call(ge.right)):
        return None
    if not (isinstance(gt, A.Binary) and gt.op == ">" and is_abs(gt.left) and _num(gt.right, 0)):
        return None
    return ge.right


def is_name(e, name) -> bool:
    return isinstance(e, A.Name) and e.id == name and getattr(e, "sym", None) is not None and e.sym.kind == "arg"


def flatten(u) -> Optional[A.Expr]:
    """The UDF's body as one expression (locals substituted), or None if it has ifs/assignments."""
    env: Dict[str, A.Expr] = {}
    body = u.func.body
    for s in body[:-1]:
        if not isinstance(s, A.Decl) or any(init is None for _, init, _, _ in s.names):
            return None
        for name, init, _, _ in s.names:
            if s.type.base != "float" and init.ty == "float" or s.type.base != init.ty:
                return None  # an implicit conversion: not a plain substitution
            env[name] = subst(init, env)
    last = body[-1] if body else None
    if not isinstance(last, A.Return) or last.value is None:
        return None
    return subst(last.value, env)


def subst(e, env):
    if isinstance(e, A.Name) and getattr(e, "sym", None) is not None and e.sym.kind == "local" and e.id in env:
        return env[e.id]
    if isinstance(e, A.Unary):
        n = A.Unary(e.line, e.col, e.op, subst(e.operand, env))
    elif isinstance(e, A.Binary):
        n = A.Binary(e.line, e.col, e.op, subst(e.left, env), subst(e.right, env))
    elif isinstance(e, A.Cond):
        n = A.Cond(e.line, e.col, subst(e.cond, env), subst(e.then, env), subst(e.other, env))
    elif isinstance(e, A.Call):
        n = A.Call(e.line, e.col, e.func, [subst(a, env) for a in e.args], e.type_args)
        for k in ("kind", "reducer", "order"):
            if hasattr(e, k):
                setattr(n, k, getattr(e, k))
    else:
        return e
    n.ty = e.ty
    return n


def mentions(e, name) -> bool:
    if is_name(e, name):
        return True
    if isinstance(e, A.Call) and (e.kind == "random" or (e.kind == "udf")):
        if e.kind == "random":
            return True  # treat as dependent (not hoistable)
    for ch in children(e):
        if mentions(ch, name):
            return True
    return False


def children(e):
    if isinstance(e, A.Unary):
        return [e.operand]
    if isinstance(e, A.Binary):
        return [e.left, e.right]
    if isinstance(e, A.Cond):
        return [e.cond, e.then, e.other]
    if isinstance(e, A.Call):
        return list(e.args)
    if isinstance(e, A.Member):
        return [e.obj]
    return []


def has_udf_call(e) -> bool:
    if isinstance(e, A.Call) and e.kind == "udf":
        return True
    return any(has_udf_call(c) for c in children(e))


# ---- environments ---------------------------------------------------------------------
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


def cxx_var_type(t) -> str:
    if t.sparse:
        return "hp::SArr"
    if t.elem == "float":
        return "hp::FArr"
    if t.elem == "int32":
        return "hp::IArr"
    return "hp::PArr"


class CppGen(Gen):
    def emit(self, line, ind=1):
        self.out.append("  " * ind + line)

    def generate(self) -> str:
        s = self.s
        self.widths: List[A.Expr] = []
        body: List[str] = []
        self.out = body
        # UDFs
        protos = []
        for name, u in s.udfs.items():
            protos.append(self.udf_sig(u) + ";")
        for name, u in s.udfs.items():
            self.udf(u)
        udf_code = list(self.out)
        self.out = []
        if s.view is not None:
            self.view_entries()
        else:
            self.encode()
        enc_code = list(self.out)
        self.out = []
        self.decode()
        dec_code = list(self.out)
        self.out = []
        self.capacity()
        if s.view is not None:
            self.view_helpers()
        else:
            self.max_bytes()
        mb_code = list(self.out)
        parts = [f"// Generated by hipress-compll from {os.path.basename(s.file)} (algorithm '{s.name}', id "
                 f"{s.algo_id}).", "// Build output: never edit or commit this file.", _PRELUDE]
        parts.append(self.params_struct())
        parts.append(self.ctx_struct())
        parts += protos
        parts += udf_code
        parts += mb_code + enc_code + dec_code
        parts.append(self.abi())
        if s.view is not None:
            parts.append(self.view_abi())
        return "\n".join(parts) + "\n"

    # ---- params / ctx ----
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
            if r is not None:  # declared range (in (lo, hi]): checked on the value given, like the hand-written
                conds = []
                if r.lo is not None:
                    conds.append(f"p[{i}] {'>' if r.lo_open else '>='} {float(r.lo)!r}")
                if r.hi is not None:
                    conds.append(f"p[{i}] {'<' if r.hi_open else '<='} {float(r.hi)!r}")
                if conds:
                    lines.append(f"  if (!({' && '.join(conds)})) throw std::invalid_argument(\"{f.name} must be in "
                                 f"{r.text()}\");")
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
        s = self.s
        lines = ["struct Ctx {", "  const Params* p = nullptr;", "  hipress::compress::RngKey key{};",
                 "  uint64_t counter = 0;", "  bool mm_done = false;", "  hipress::compress::ops::MinMax mm{};",
                 "  bool ss_done = false;", "  hipress::compress::ops::SignSums ss{};"]
        lines.append("  int64_t has_state = 0;")
        if s.view is not None:
            lines.append("  size_t v_rows = 0, v_cols = 0, v_rank = 0;  // the matrix view and the factors' rank")
        lines.append("  std::vector<float> st_tmp;  // zero state of a stateless call (its updates are dropped)")
        for name, g in s.globals.items():
            if g.state and is_arr(g.ty):
                lines.append(f"  hp::FArr g_{name};  // state buffer {g.slot}")
                continue
            init = "0.0f" if g.ty == "float" else "0"
            d = next((i for dd in s.program.globals for (nm, i, _, _) in dd.names if nm == name), None)
            if d is not None:
                v = d.ty if False else None
                init = self.conv(self.ex(d, EntryEnv("const")), d.ty, g.ty, g.width)
            lines.append(f"  {ctype(g.ty)} g_{name} = {init};")
        lines.append("};")
        lines.append("[[maybe_unused]] inline uint64_t hp_next(Ctx& c, uint64_t k) { uint64_t v = c.counter; "
                     "c.counter += k; return v; }")
        lines.append("[[maybe_unused]] inline const hipress::compress::ops::MinMax& hp_minmax(Ctx& c, const float* in, "
                     "size_t n) { if (!c.mm_done) { c.mm = hipress::compress::ops::reduce_minmax(in, n); "
                     "c.mm_done = true; } return c.mm; }")
        lines.append("[[maybe_unused]] inline const hipress::compress::ops::SignSums& hp_signsums(Ctx& c, const float* "
                     "in, size_t n) { if (!c.ss_done) { c.ss = hipress::compress::ops::reduce_sign_sums(in, n); "
                     "c.ss_done = true; } return c.ss; }")
        return "\n".join(lines)

    # ---- UDFs ----
    def udf_sig(self, u):
        args = "".join(f", [[maybe_unused]] {ctype(t)} a_{n}" for n, t in u.args)
        return (f"[[maybe_unused]] inline {ctype(u.ret) if u.ret else 'void'} u_{u.func.name}("
                f"[[maybe_unused]] const Ctx& c, [[maybe_unused]] uint64_t rc{args})")

    def udf(self, u):
        if u.ret == "uintN":
            self.widths.append(u.func.ret.width)
        self.emit(self.udf_sig(u) + " {", 0)
        env = UdfEnv()
        self.cur_ret = (u.ret, u.func.ret.width)
        self.stmts(u.func.body, env, 1)
        if u.ret is not None and not _ends_in_return(u.func.body):
            self.emit("return 0;")
        self.emit("}", 0)

    # ---- statements ----
    def stmts(self, stmts, env, ind):
        for st in stmts:
            self.stmt(st, env, ind)

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
                self.matmul_op(tgt, sym, st.value, env, ind, acc=st.op)
                return
            if is_arr(sym.ty):
                self.array_op(tgt, sym, st.value, env, ind)
                return
            self.emit(f"{tgt} = {self.conv(self.ex(st.value, env), st.value.ty, sym.ty, sym.width)};", ind)
            return
        if isinstance(st, A.If):
            c = self.ex(st.cond, env)
            c = f"({c}) != 0.0f" if st.cond.ty in FP else f"({c}) != 0"
            self.emit(f"if ({c}) {{", ind)
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

    # ---- array-producing operators ----
    def array_op(self, tgt, sym, call: A.Call, env, ind):
        if not isinstance(call, A.Call) or call.kind != "op":
            src = self.array_code(call, env)
            if sym is not None and sym.state:  # state = array: copy into the state's buffer
                self.emit(f"if ({src}.n != {tgt}.n) throw std::logic_error(\"copy: array sizes differ\");", ind)
                self.emit(f"if ({tgt}.n) std::memmove(const_cast<float*>({tgt}.p), {src}.p, 4 * {tgt}.n);", ind)
                return
            self.emit(f"{tgt} = {src};", ind)
            return
        f = call.func
        if f == "matmul":
            return self.matmul_op(tgt, sym, call, env, ind)
        if f == "decomp":
            return self.decomp_op(tgt, sym, call, env, ind)
        if f == "map" and getattr(call, "zip", False):
            self.map2_op(tgt, sym, call, env, ind)
        elif f == "scatter" and getattr(call, "into", False):
            self.scatter_into(tgt, sym, call, env, ind)
        elif f == "map":
            self.map_op(tgt, sym, call, env, ind)
        elif f == "filter":
            self.filter_op(tgt, call, env, ind)
        elif f == "sort":
            self.sort_op(tgt, call, env, ind)
        else:
            self.err(call, f"{f} cannot produce an array here")

    def map_op(self, tgt, sym, call, env, ind):
        src, fn = call.args
        u = self.s.udfs[fn.id]
        st = src.ty
        acode = self.array_code(src, env)
        out_t = call.ty
        n = f"{acode}.n"
        self.emit("{", ind)
        i2 = ind + 1
        r = u.randoms
        self.emit(f"[[maybe_unused]] const uint64_t base = hp_next(c, {n} * {r});" if r else
                  "[[maybe_unused]] const uint64_t base = 0;", i2)
        elem = self.elem(acode, st, "i")
        args = [elem] + (["static_cast<int64_t>(i)"] if len(u.args) == 2 else [])
        call_code = self.udf_apply(u, args, [self.elem_type(st), "int32"], f"base + i * {r}" if r else "0")
        is_input = isinstance(src, A.Name) and src.sym.kind == "input"
        if out_t.elem in UINTS or out_t.elem == "uintN":
            bits = str(UINTS[out_t.elem]) if out_t.elem in UINTS else self.width(out_t.width)
            if out_t.elem == "uintN":
                self.widths.append(out_t.width)
            # the payload's first array lies right after the header (scalars go into header words)
            first = next((a for a in self.s.concat.args if is_arr(a.ty)), None) if self.s.concat else None
            direct = (env.which == "encode" and isinstance(first, A.Name) and sym is not None and
                      first.id == sym.name and getattr(first.sym, "kind", "") == "local")
            at = "out + kHeaderBytes" if direct else "nullptr"
            self.emit(f"const int bits = {bits};", i2)
            self.emit(f"hp::alloc({tgt}, {n}, bits, {at});", i2)
            idiom = self.map_idiom(u, is_input and st.elem == "float", out_t, acode, tgt, i2) if True else None
            if not idiom:
                self.emit(f"hp::map_packed({n}, bits, {tgt}.p, [&](size_t i) {{ return {call_code}; }});", i2)
        elif out_t.elem == "float" and sym is not None and sym.state:  # in place
            self.emit(f"hp::map_plain({n}, const_cast<float*>({tgt}.p), [&](size_t i) {{ return {call_code}; }});",
                      i2)
        elif out_t.elem == "float":
            self.emit(f"hp::alloc({tgt}, {n});", i2)
            self.emit(f"hp::map_plain({n}, {tgt}.own.data(), [&](size_t i) {{ return {call_code}; }});", i2)
        else:
            self.emit(f"hp::alloc({tgt}, {n});", i2)
            self.emit(f"hp::map_plain({n}, {tgt}.own.data(), [&](size_t i) {{ return static_cast<int32_t>("
                      f"{self.conv(call_code, u.ret, 'int32')}); }});", i2)
        self.emit("}", ind)

    def map_idiom(self, u, on_float_input, out_t, acode, tgt, ind) -> bool:
        if not on_float_input or len(u.args) != 1:
            return False
        e = flatten(u)
        if e is None:
            return False
        x = u.args[0][0]
        env = UdfEnv()
        # stochastic rounding: floor((x - A) * B + random<float>(0, 1)) -> ops::quantize_stochastic
        if isinstance(e, A.Call) and e.func == "floor" and u.randoms == 1:
            s = e.args[0]
            if isinstance(s, A.Binary) and s.op == "+" and s.ty == "float" and _is_unit_random(s.right) and \
                    isinstance(s.left, A.Binary) and s.left.op == "*" and s.left.ty == "float" and \
                    isinstance(s.left.left, A.Binary) and s.left.left.op == "-" and \
                    is_name(s.left.left.left, x) and s.left.left.left.ty == "float" and \
                    not mentions(s.left.left.right, x) and not mentions(s.left.right, x) and \
                    not has_udf_call(s.left.left.right) and not has_udf_call(s.left.right):
                a = self.conv(self.ex(s.left.left.right, env), s.left.left.right.ty, "float")
                b = self.conv(self.ex(s.left.right, env), s.left.right.ty, "float")
                self.idioms.append("map(floor((x-a)*b+random)) -> ops::quantize_stochastic")
                self.emit(f"hipress::compress::ops::quantize_stochastic({acode}.p, {acode}.n, {a}, {b}, bits, c.key, "
                          f"base, {tgt}.p);", ind)
                return True
        if u.randoms:
            return False
        # sign bits: signbit(x) as uint1 -> ops::pack_signbits
        if isinstance(e, A.Call) and e.func == "signbit" and is_name(e.args[0], x) and out_t.elem == "uint1" and \
                e.args[0].ty == "float":
            self.idioms.append("map(signbit) -> ops::pack_signbits")
            self.emit(f"hipress::compress::ops::pack_signbits({acode}.p, {acode}.n, {tgt}.p);", ind)
            return True
        # threshold ternary: x > T ? 1 : (x < -T ? 2 : 0) as uint2 -> ops::threshold_ternary_codes
        if isinstance(e, A.Cond) and out_t.elem == "uint2" and isinstance(e.cond, A.Binary) and e.cond.op == ">" \
                and is_name(e.cond.left, x) and e.cond.left.ty == "float" and _num(e.then, 1) and \
                isinstance(e.other, A.Cond) and _num(e.other.other, 0) and _num(e.other.then, 2) and \
                isinstance(e.other.cond, A.Binary) and e.other.cond.op == "<" and is_name(e.other.cond.left, x) \
                and isinstance(e.other.cond.right, A.Unary) and e.other.cond.right.op == "-":
            t1, t2 = e.cond.right, e.other.cond.right.operand
            if not mentions(t1, x) and not has_udf_call(t1) and t1.ty == "float" and t2.ty == "float" and \
                    self.ex(t1, env) == self.ex(t2, env):
                self.idioms.append("map(x > t ? 1 : x < -t ? 2 : 0) -> ops::threshold_ternary_codes")
                self.emit(f"hipress::compress::ops::threshold_ternary_codes({acode}.p, {acode}.n, "
                          f"{self.ex(t1, env)}, {tgt}.p);", ind)
                return True
        return False

    def map2_op(self, tgt, sym, call, env, ind):
        a, b, fn = call.args
        u = self.s.udfs[fn.id]
        ac, bc = self.array_code(a, env), self.array_code(b, env)
        self.emit("{", ind)
        i2 = ind + 1
        self.emit(f"if ({ac}.n != {bc}.n) throw std::logic_error(\"map: array lengths differ\");", i2)
        in_place = sym is not None and sym.state or (isinstance(a, A.Name) and a.id == sym.name)
        if in_place:
            self.emit(f"float* dst = const_cast<float*>({tgt}.p);", i2)
            if not sym.state:  # a local that may alias another array: copy on write
                self.emit(f"if ({tgt}.own.data() != {tgt}.p) {{ {tgt}.own.assign({tgt}.p, {tgt}.p + {tgt}.n); "
                          f"{tgt}.p = {tgt}.own.data(); dst = {tgt}.own.data(); }}", i2)
        else:
            self.emit(f"std::vector<float> res({ac}.n);", i2)
            self.emit("float* dst = res.data();", i2)
        idiom = None
        if in_place and isinstance(a, A.Name) and a.id == sym.name:
            idiom = self.map2_idiom(u, ac, bc, i2)
        if not idiom:
            code = self.udf_apply(u, [f"{ac}.p[i]", f"{bc}.p[i]"], ["float", "float"], "0")
            self.emit(f"hp::map_plain({ac}.n, dst, [&](size_t i) {{ return {code}; }});", i2)
        if not in_place:
            self.emit(f"{tgt}.own = std::move(res); {tgt}.p = {tgt}.own.data(); {tgt}.n = {ac}.n;", i2)
        self.emit("}", ind)

    def map2_idiom(self, u, ac, bc, ind) -> bool:
        """In place A = map(A, B, f): f = a + b -> ops::add; f = k * a + b -> ops::axpby (same rounding)."""
        e = flatten(u)
        if e is None or not isinstance(e, A.Binary) or e.op != "+" or e.ty != "float":
            return False
        x, y = u.args[0][0], u.args[1][0]
        env = UdfEnv()
        if is_name(e.left, x) and is_name(e.right, y) or is_name(e.left, y) and is_name(e.right, x):
            self.idioms.append("map(A, B, a + b) -> ops::add")
            self.emit(f"hipress::compress::ops::add(dst, {bc}.p, {ac}.n);", ind)
            return True
        m = e.left
        if is_name(e.right, y) and isinstance(m, A.Binary) and m.op == "*" and m.ty == "float":
            k = m.left if is_name(m.right, x) else (m.right if is_name(m.left, x) else None)
            if k is not None and k.ty == "float" and not mentions(k, x) and not mentions(k, y) and \
                    not has_udf_call(k):
                self.idioms.append("map(A, B, k * a + b) -> ops::axpby")
                self.emit(f"hipress::compress::ops::axpby(dst, {self.ex(k, env)}, {bc}.p, 1.0f, {ac}.n);", ind)
                return True
        return False

    def scatter_into(self, tgt, sym, call, env, ind):
        _, ix, v = call.args
        icode = self.array_code(ix, env)
        self.emit("{", ind)
        i2 = ind + 1
        self.emit(f"float* dst = const_cast<float*>({tgt}.p);", i2)
        if not sym.state:
            self.emit(f"if ({tgt}.own.data() != {tgt}.p) {{ {tgt}.own.assign({tgt}.p, {tgt}.p + {tgt}.n); "
                      f"{tgt}.p = {tgt}.own.data(); dst = {tgt}.own.data(); }}", i2)
        self.emit(f"const float v = {self.conv(self.ex(v, env), v.ty, 'float')};", i2)
        self.emit(f"for (size_t j = 0; j < {icode}.n; ++j) {{ const int64_t ix = {icode}.p[j]; "
                  f"if (ix >= 0 && static_cast<uint64_t>(ix) < {tgt}.n) dst[ix] = v; }}", i2)
        self.emit("}", ind)

    def filter_op(self, tgt, call, env, ind):
        src, fn = call.args[0], call.args[1]
        u = self.s.udfs[fn.id]
        acode = self.array_code(src, env)
        cap = self.ex(call.args[2], env) if len(call.args) == 3 else f"static_cast<int64_t>({acode}.n)"
        thr = abs_ge_threshold(u)
        if thr is not None and src.ty.elem == "float":
            self.idioms.append("filter(|x| >= t && |x| > 0) -> ops::filter_abs_ge")
            self.emit("{", ind)
            self.emit(f"const int64_t capv = {cap}; const size_t cap = capv < 0 ? 0 : std::min<size_t>("
                      f"static_cast<size_t>(capv), {acode}.n);", ind + 1)
            self.emit(f"{tgt}.idx.resize(cap); {tgt}.val.resize(cap);", ind + 1)
            self.emit(f"const size_t cnt = hipress::compress::ops::filter_abs_ge({acode}.p, {acode}.n, "
                      f"{self.conv(self.ex(thr, UdfEnv()), thr.ty, 'float')}, {tgt}.idx.data(), {tgt}.val.data(), "
                      f"cap);", ind + 1)
            self.emit(f"if (cnt < cap) {{ {tgt}.idx.resize(cnt); {tgt}.val.resize(cnt); }}", ind + 1)
            self.emit(f"{tgt}.n = cnt;", ind + 1)
            self.emit("}", ind)
            return
        args = [self.elem(acode, src.ty, "i")] + (["static_cast<int64_t>(i)"] if len(u.args) == 2 else [])
        pred = self.udf_apply(u, args, ["float", "int32"], "0")
        self.emit("{", ind)
        self.emit(f"const int64_t capv = {cap}; const size_t cap = capv < 0 ? 0 : static_cast<size_t>(capv);", ind + 1)
        self.emit(f"{tgt}.idx.clear(); {tgt}.val.clear(); size_t cnt = 0;", ind + 1)
        self.emit(f"for (size_t i = 0; i < {acode}.n; ++i) {{ if (({pred}) != 0) {{ if (cnt < cap) {{ "
                  f"{tgt}.idx.push_back(static_cast<uint32_t>(i)); {tgt}.val.push_back({acode}.p[i]); }} ++cnt; }} }}",
                  ind + 1)
        self.emit(f"{tgt}.n = cnt;", ind + 1)
        self.emit("}", ind)

    def sort_op(self, tgt, call, env, ind):
        src, order, kx = call.args[:3]
        acode = self.array_code(src, env)
        self.emit("{", ind)
        self.emit(f"const int64_t kv = {self.ex(kx, env)}; const size_t k = kv < 0 ? 0 : std::min<size_t>("
                  f"static_cast<size_t>(kv), {acode}.n);", ind + 1)
        self.emit(f"{tgt}.idx.assign(k, 0); {tgt}.val.assign(k, 0.0f);", ind + 1)
        if call.order == "greaterAbs" and len(call.args) == 4:
            self.idioms.append("sort(greaterAbs, k, samples) -> ops::topk_abs_exact (sampled threshold)")
            self.emit(f"const int64_t sv = {self.ex(call.args[3], env)}; const size_t s = sv < 0 ? 0 : "
                      f"static_cast<size_t>(sv);", ind + 1)
            self.emit(f"{tgt}.n = hipress::compress::ops::topk_abs_exact({acode}.p, {acode}.n, k, {tgt}.idx.data(), "
                      f"{tgt}.val.data(), s, c.key, hp_next(c, s));", ind + 1)
        elif call.order == "greaterAbs":
            self.idioms.append("sort(greaterAbs, k) -> ops::topk_abs_exact")
            self.emit(f"{tgt}.n = hipress::compress::ops::topk_abs_exact({acode}.p, {acode}.n, k, {tgt}.idx.data(), "
                      f"{tgt}.val.data(), 0);", ind + 1)
        else:
            if call.order == "greater":
                cmp = "x > y"
            elif call.order == "smaller":
                cmp = "x < y"
            else:
                u = self.s.udfs[order.id]
                cmp = f"({self.udf_apply(u, ['x', 'y'], ['float', 'float'], '0')}) != 0"
            self.emit(f"std::vector<uint32_t> ord({acode}.n); for (size_t i = 0; i < ord.size(); ++i) ord[i] = "
                      f"static_cast<uint32_t>(i);", ind + 1)
            self.emit(f"auto before = [&](uint32_t a, uint32_t b) {{ float x = {acode}.p[a], y = {acode}.p[b]; "
                      f"if ({cmp}) return true; {{ float t = x; x = y; y = t; }} if ({cmp}) return false; "
                      f"return a < b; }};", ind + 1)
            self.emit("std::partial_sort(ord.begin(), ord.begin() + static_cast<std::ptrdiff_t>(k), ord.end(), before);",
                      ind + 1)
            self.emit("std::sort(ord.begin(), ord.begin() + static_cast<std::ptrdiff_t>(k));", ind + 1)
            self.emit(f"for (size_t j = 0; j < k; ++j) {{ {tgt}.idx[j] = ord[j]; {tgt}.val[j] = {acode}.p[ord[j]]; }}",
                      ind + 1)
            self.emit(f"{tgt}.n = k;", ind + 1)
        self.emit("}", ind)

    # ---- payload layout ----
    def layout_sizes(self, args_codes, types, n_code, cnt_code):
        """C++ expressions of each array's payload bytes."""
        out = []
        for code, t in zip(args_codes, types):
            if not is_arr(t):
                out.append(None)
                continue
            length = n_code if t.length == "n" else cnt_code
            if t.elem in UINTS or t.elem == "uintN":
                out.append(f"hipress::compress::ops::packed_bytes({length}, {code}.bits)" if code else None)
            else:
                out.append(f"4 * static_cast<size_t>({length})")
        return out

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
            self.emit("[[maybe_unused]] const size_t nvar = capv < 0 ? 0 : std::min<size_t>(n, static_cast<size_t>(capv));")
        else:
            self.emit("[[maybe_unused]] const size_t nvar = n;")
        terms = ["kHeaderBytes"]
        for a in s.concat.args:
            t = a.ty
            if not is_arr(t):
                continue
            ln = "nvar" if t.length == "var" else "n"
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
        s = self.s
        if s.view is not None:
            return self.concat_view(call, env, ind)
        codes = []
        for a in call.args:
            if is_arr(a.ty):
                codes.append(self.array_code(a, env))
            else:
                codes.append(self.ex(a, env))
        self.emit("{", ind)
        i2 = ind + 1
        self.emit("Header h; h.algo = kAlgoId; h.numel = n;", i2)
        body = []
        var_first = None
        packed_first = None
        for code, a in zip(codes, call.args):
            t = a.ty
            if not is_arr(t):
                continue
            if t.length == "var" and var_first is None:
                var_first = code
            if (t.elem in UINTS or t.elem == "uintN") and packed_first is None:
                packed_first = code
        for code, a in zip(codes, call.args):
            t = a.ty
            if not is_arr(t):
                continue
            if t.length == "var":
                self.emit(f"if ({code}.n != {var_first}.n) throw std::invalid_argument(\"concat: the data-dependent "
                          f"arrays of a payload must have the same length\");", i2)
            else:
                self.emit(f"if ({code}.n != n) throw std::logic_error(\"concat: array length differs from the "
                          f"gradient's\");", i2)
            if t.elem in UINTS or t.elem == "uintN":
                body.append(f"hipress::compress::ops::packed_bytes({code}.n, {code}.bits)")
            else:
                body.append(f"4 * {code}.n")
        self.emit(f"const size_t body = {' + '.join(body) if body else '0'};", i2)
        self.emit("if (kHeaderBytes + body > cap) throw std::invalid_argument(\"output buffer too small for the "
                  "payload\");", i2)
        if packed_first:
            self.emit(f"h.bits = static_cast<uint8_t>({packed_first}.bits);", i2)
        if var_first:
            self.emit(f"h.count = static_cast<uint32_t>({var_first}.n);", i2)
        self.emit("h.body_bytes = body;", i2)
        w = 0
        self.emit("size_t off = kHeaderBytes;", i2)
        for code, a, bsz in zip(codes, call.args, [None] * len(codes)):
            t = a.ty
            if not is_arr(t):
                if t == "float":
                    self.emit(f"h.set_f({w}, {code});", i2)
                else:
                    self.emit(f"h.words[{w}] = static_cast<uint32_t>(static_cast<uint64_t>({code}));", i2)
                w += 1
                continue
            if t.elem in UINTS or t.elem == "uintN":
                sz = f"hipress::compress::ops::packed_bytes({code}.n, {code}.bits)"
            else:
                sz = f"4 * {code}.n"
            self.emit(f"if (({sz}) != 0 && static_cast<const void*>({code}.p) != static_cast<const void*>(out + off)) "
                      f"std::memmove(out + off, {code}.p, {sz});", i2)
            self.emit(f"off += {sz};", i2)
        self.emit("write_header(h, out);", i2)
        self.emit("total = kHeaderBytes + body;", i2)
        self.emit("}", ind)

    def extract(self, call, env, ind):
        s = self.s
        if s.view is not None:
            return self.extract_view(call, env, ind)
        rest = call.args[1:]
        layout = [a.ty for a in s.concat.args]
        self.emit("const Header h = read_header(in, bytes, kAlgoId, n);", ind)
        packed = [t for t in layout if is_arr(t) and (t.elem in UINTS or t.elem == "uintN")]
        var = [t for t in layout if is_arr(t) and t.length == "var"]
        self.emit("[[maybe_unused]] int bits = 0;", ind)
        if packed:
            t = packed[0]
            if t.elem in UINTS:
                self.emit(f"if (h.bits != {UINTS[t.elem]}) throw FormatError(kName + std::string(\" payload: bit width \")"
                          f" + std::to_string(h.bits) + \", expected {UINTS[t.elem]}\");", ind)
            else:
                self.emit("if (h.bits != 1 && h.bits != 2 && h.bits != 4 && h.bits != 8) throw FormatError(kName + "
                          "std::string(\" payload: bit width \") + std::to_string(h.bits) + \" (1, 2, 4 or 8 "
                          "expected)\");", ind)
            self.emit("bits = h.bits;", ind)
        elif True:
            self.emit("if (h.bits != 0) throw FormatError(kName + std::string(\" payload: unexpected bit width\"));",
                      ind)
        if var:
            self.emit("if (h.count > n) throw FormatError(kName + std::string(\" payload: \") + std::to_string(h.count)"
                      " + \" entries for \" + std::to_string(n) + \" elements\");", ind)
        else:
            self.emit("if (h.count != 0) throw FormatError(kName + std::string(\" payload: unexpected count\"));", ind)
        self.emit("const size_t cnt = h.count;", ind) if var else None
        sizes = []
        for t in layout:
            if not is_arr(t):
                continue
            length = "n" if t.length == "n" else "cnt"
            sizes.append(f"hipress::compress::ops::packed_bytes({length}, bits)" if (t.elem in UINTS or
                                                                                   t.elem == "uintN")
                         else f"4 * static_cast<uint64_t>({length})")
        self.emit(f"expect_body(h, {' + '.join(sizes) if sizes else '0'}, kName.c_str());", ind)
        self.emit("size_t off = kHeaderBytes;", ind)
        w = 0
        for a, t in zip(rest, layout):
            tgt = env.name(a)
            if getattr(a.sym, "by_extract", False):
                self.emit(f"{cxx_var_type(a.sym.ty) if is_arr(t) else ctype(t)} {tgt}{'' if is_arr(t) else ' = 0'};"
                          f"{'' if is_arr(t) else ' (void)' + tgt + ';'}", ind)
            if not is_arr(t):
                if t == "float":
                    self.emit(f"{tgt} = h.f({w});", ind)
                elif t == "int32":
                    self.emit(f"{tgt} = static_cast<int64_t>(static_cast<int32_t>(h.words[{w}]));", ind)
                else:
                    b = UINTS[t]
                    self.emit(f"if (h.words[{w}] >= (1u << {b})) throw FormatError(kName + std::string(\" payload: "
                              f"field {w + 1} out of range for {t}\"));", ind)
                    self.emit(f"{tgt} = static_cast<int64_t>(h.words[{w}]);", ind)
                w += 1
                continue
            length = "n" if t.length == "n" else "cnt"
            if t.elem in UINTS or t.elem == "uintN":
                self.emit(f"{tgt}.p = const_cast<uint8_t*>(in + off); {tgt}.n = {length}; {tgt}.bits = bits; "
                          f"off += hipress::compress::ops::packed_bytes({length}, bits);", ind)
            else:
                self.emit(f"hp::alloc({tgt}, {length}); if ({length}) std::memcpy({tgt}.own.data(), in + off, "
                          f"4 * {length}); off += 4 * {length};", ind)

    def decode_out(self, call, env, ind):
        if call.func == "matmul":
            return self.matmul_op("out", None, call, env, ind, to_out=True)
        self.emit("{", ind)
        i2 = ind + 1
        if call.func == "scatter":
            ic = self.array_code(call.args[0], env)
            vc = self.array_code(call.args[1], env)
            self.emit(f"if ({ic}.n != {vc}.n) throw FormatError(kName + std::string(\" payload: index and value "
                      f"counts differ\"));", i2)
            self.emit(f"for (size_t j = 0; j < {ic}.n; ++j) {{ int64_t ix = {ic}.p[j]; if (ix < 0 || static_cast<"
                      f"uint64_t>(ix) >= n || (j > 0 && ix <= {ic}.p[j - 1])) throw FormatError(kName + std::string("
                      f"\" payload: index \") + std::to_string(ix) + \" at position \" + std::to_string(j) + "
                      f"\" is out of range or not ascending (corrupt payload)\"); }}", i2)
            self.emit("if (!add) std::memset(out, 0, n * sizeof(float));", i2)
            self.emit(f"hipress::compress::ops::scatter(reinterpret_cast<const uint32_t*>({ic}.p), {vc}.p, {ic}.n, "
                      f"alpha, true, out);", i2)
            self.emit("}", ind)
            return
        src, fn = call.args
        u = self.s.udfs[fn.id]
        st = src.ty
        acode = self.array_code(src, env)
        if (st.elem in UINTS or st.elem == "uintN") and len(u.args) == 1 and not u.randoms:
            self.idioms.append("decode map(packed, f) -> table + ops::dequantize_table")
            tv = self.conv(self.udf_apply(u, ["static_cast<int64_t>(k)"], ["int32"], "0"), u.ret, "float")
            self.emit(f"const int b = {acode}.bits; float tab[256] = {{}};", i2)
            self.emit(f"for (int k = 0; k < (1 << b); ++k) tab[k] = {tv};", i2)
            self.emit(f"hipress::compress::ops::dequantize_table({acode}.p, n, b, tab, alpha, add, out);", i2)
        else:
            args = [self.elem(acode, st, "i")] + (["static_cast<int64_t>(i)"] if len(u.args) == 2 else [])
            v = self.conv(self.udf_apply(u, args, [self.elem_type(st), "int32"], "0"), u.ret, "float")
            self.emit("parallel_range(n, hipress::compress::ops::kGrain, [&](size_t b, size_t e) { for (size_t i = b; "
                      f"i < e; ++i) {{ float v = {v}; if (alpha != 1.0f) v = alpha * v; if (add) out[i] += v; "
                      "else out[i] = v; } });", i2)
        self.emit("}", ind)

    # ---- entry points ----
    def encode(self):
        s = self.s
        self.emit("size_t hp_encode(const Params& P, const float* in, size_t n, uint8_t* out, size_t cap, "
                  "uint64_t* scalars, float* const* bufs, const uint64_t* lens, int nbufs) {", 0)
        self.emit("Ctx c; c.p = &P;")
        self.emit("c.has_state = scalars != nullptr;")
        k = len(s.state_arrays)
        if k:
            self.emit("if (scalars) {")
            self.emit(f"if (nbufs < {k}) throw std::invalid_argument(kName + std::string(\": the state has \") + "
                      f"std::to_string(nbufs) + \" buffers, needs {k} (make it with new_state)\");", 2)
            for g in s.state_arrays:
                self.emit(f"if (lens[{g.slot}] != n || (n && !bufs[{g.slot}])) throw std::invalid_argument(kName + "
                          f"std::string(\": state buffer '{g.name}' has \") + std::to_string(lens[{g.slot}]) + "
                          f"\" elements, expected \" + std::to_string(n) + \" (state made for another tensor?)\");", 2)
                self.emit(f"c.g_{g.name}.p = bufs[{g.slot}]; c.g_{g.name}.n = n;", 2)
            self.emit("} else {")
            self.emit(f"c.st_tmp.assign({k} * n, 0.0f);", 2)
            for g in s.state_arrays:
                self.emit(f"c.g_{g.name}.p = c.st_tmp.data() + {g.slot} * n; c.g_{g.name}.n = n;", 2)
            self.emit("}")
        else:
            self.emit("(void)bufs; (void)lens; (void)nbufs;")
        for g in s.state_scalars:
            self.emit(f"c.g_{g.name} = scalars ? hp::w32(static_cast<int64_t>(scalars[{g.slot}])) : 0;")
        if s.uses_random:
            self.emit("c.key = rng_key(static_cast<uint64_t>(P.f_seed));")
            self.emit("c.counter = scalars ? scalars[kRngCounter] : 0;")
        else:
            self.emit("(void)scalars;")
        self.emit("if (cap < hp_max_bytes(P, n)) throw std::invalid_argument(kName + std::string(\": output buffer "
                  "has \") + std::to_string(cap) + \" bytes, needs \" + std::to_string(hp_max_bytes(P, n)) + \" "
                  "(max_encoded_bytes)\");")
        self.emit("hp::FArr v_in; v_in.p = in; v_in.n = n;")
        self.emit("size_t total = 0;")
        self.stmts(s.encode.body, EntryEnv("encode"), 1)
        if s.uses_random:
            self.emit("if (scalars) scalars[kRngCounter] = c.counter;")
        for g in s.state_scalars:
            self.emit(f"if (scalars) scalars[{g.slot}] = static_cast<uint64_t>(c.g_{g.name});")
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
        self.emit("Ctx c;")
        if s.view is not None:
            self.emit("const uint8_t* pin = in; const size_t pbytes = bytes;")
            self.cur_in_kind, self.cur_layout, self.cur_stateful = 0, s.concat, False
        env = EntryEnv("decode")
        self.stmts(s.decode.body, env, 1)
        self.emit("}", 0)

    def abi(self) -> str:
        s = self.s
        return f"""
}}  // namespace

// ---- C ABI (hipress/dsl/runtime.py) ----
#define HPC_API extern "C" __attribute__((visibility("default")))
namespace {{
int hpc_fail(const std::exception& e, char* err, int errlen, int code) {{
  if (err && errlen > 0) {{ std::strncpy(err, e.what(), static_cast<size_t>(errlen) - 1); err[errlen - 1] = 0; }}
  return code;
}}
}}
HPC_API int hpc_abi_version() {{ return {ABI_VERSION}; }}
HPC_API int hpc_num_params() {{ return {len(s.params)}; }}
HPC_API void hpc_set_num_threads(int t) {{ hipress::compress::set_num_threads(t); }}
HPC_API int hpc_check_params(const double* p, char* err, int errlen) {{
  try {{ make_params(p); return 0; }}
  catch (const std::exception& e) {{ return hpc_fail(e, err, errlen, 2); }}
}}
HPC_API int hpc_max_encoded_bytes(const double* p, uint64_t n, uint64_t* res, char* err, int errlen) {{
  try {{ *res = hp_max_bytes(make_params(p), n); return 0; }}
  catch (const std::exception& e) {{ return hpc_fail(e, err, errlen, 2); }}
}}
HPC_API int hpc_num_state_buffers() {{ return {len(s.state_arrays)}; }}
HPC_API int hpc_encode(const double* p, const float* in, uint64_t n, uint8_t* out, uint64_t cap, uint64_t* scalars,
                       float* const* bufs, const uint64_t* lens, int nbufs, uint64_t* nbytes, char* err, int errlen) {{
  try {{ *nbytes = hp_encode(make_params(p), in, n, out, cap, scalars, bufs, lens, nbufs); return 0; }}
  catch (const hipress::compress::FormatError& e) {{ return hpc_fail(e, err, errlen, 1); }}
  catch (const std::invalid_argument& e) {{ return hpc_fail(e, err, errlen, 2); }}
  catch (const std::exception& e) {{ return hpc_fail(e, err, errlen, 3); }}
}}
HPC_API int hpc_decode(const uint8_t* in, uint64_t bytes, float* out, uint64_t n, float alpha, int add, char* err,
                       int errlen) {{
  try {{ hp_decode(in, bytes, out, n, alpha, add != 0); return 0; }}
  catch (const hipress::compress::FormatError& e) {{ return hpc_fail(e, err, errlen, 1); }}
  catch (const std::invalid_argument& e) {{ return hpc_fail(e, err, errlen, 2); }}
  catch (const std::exception& e) {{ return hpc_fail(e, err, errlen, 3); }}
}}
"""

    # ---- low-rank specs: matrix view, matmul/decomp, multi-round entries ----------------------------
    def dim(self, name: str) -> str:
        v = self.s.view
        return {v.rows: "c.v_rows", v.cols: "c.v_cols", v.rank: "c.v_rank"}[name]

    def shape(self, t):
        """(rows code, cols code) of a float matrix type."""
        if t.length == "mat":
            return self.dim(t.shape[0]), self.dim(t.shape[1])
        return "c.v_rows", "c.v_cols"

    def rank_code(self, e) -> str:
        v = self.s.view
        if isinstance(e, A.Num):
            return f"int64_t{{{e.value}}}"
        if isinstance(e, A.Name):
            if e.id == v.rows:
                return "static_cast<int64_t>(rows)"
            if e.id == v.cols:
                return "static_cast<int64_t>(cols)"
            return f"static_cast<int64_t>(P.f_{e.id})"
        if isinstance(e, A.Call):
            return f"std::{e.func}<int64_t>({self.rank_code(e.args[0])}, {self.rank_code(e.args[1])})"
        fn = {"+": "add", "-": "sub", "*": "mul"}[e.op]
        return f"hp::{fn}({self.rank_code(e.left)}, {self.rank_code(e.right)})"

    def writable(self, tgt, sym, ind) -> str:
        """Pointer to write an array variable in place (a local that may alias another array is copied first)."""
        if sym is not None and not sym.state:
            self.emit(f"if ({tgt}.own.data() != {tgt}.p) {{ {tgt}.own.assign({tgt}.p, {tgt}.p + {tgt}.n); "
                      f"{tgt}.p = {tgt}.own.data(); }}", ind)
        return f"const_cast<float*>({tgt}.p)"

    def matmul_op(self, tgt, sym, call, env, ind, acc=None, to_out=False):
        """matmul(A, B), matmul(A.T, B), matmul(A, B.T) -> ops::matmul_nn / matmul_tn / matmul_nt (the
        hand-written kernels' operators); 'X -= matmul(A, B.T)' and the decoded gradient use matmul_nt's
        fused alpha/add."""
        a, b = call.args
        ta, tb = call.trans
        an, bn = (a.obj if ta else a), (b.obj if tb else b)
        ac, bc = self.array_code(an, env), self.array_code(bn, env)
        (a0, a1), (b0, b1) = self.shape(an.ty), self.shape(bn.ty)
        self.emit("{", ind)
        i2 = ind + 1
        self.emit(f"if ({ac}.n != {a0} * {a1} || {bc}.n != {b0} * {b1}) throw std::logic_error(\"matmul: operand "
                  f"sizes differ from their shapes\");", i2)
        m, k, n = (a1, a0, b1) if ta else ((a0, a1, b0) if tb else (a0, a1, b1))
        rows_out = m
        cols_out = n
        size = f"{rows_out} * {cols_out}"
        names = {getattr(an, "id", None), getattr(bn, "id", None)}
        if tb and (to_out or acc):  # fused: C (+)= alpha * A B^T
            if to_out:
                alpha, add, dst = "alpha", "add", "out"
                self.emit(f"if ({size} != n) throw std::logic_error(\"matmul: the product is not the gradient's "
                          f"size\");", i2)
            else:
                alpha, add = ("1.0f" if acc == "+=" else "-1.0f"), "true"
                self.emit(f"if ({tgt}.n != {size}) throw std::logic_error(\"matmul: sizes differ\");", i2)
                dst = self.writable(tgt, sym, i2)
                if sym is not None and sym.name in names:
                    self.emit(f"std::vector<float> tmp({tgt}.p, {tgt}.p + {tgt}.n);", i2)
                    self.emit(f"hipress::compress::ops::matmul_nt({ac}.p, {bc}.p, tmp.data(), {m}, {k}, {n}, "
                              f"{alpha}, {add});", i2)
                    self.emit(f"std::memcpy({dst}, tmp.data(), 4 * tmp.size());", i2)
                    self.emit("}", ind)
                    return
            self.emit(f"hipress::compress::ops::matmul_nt({ac}.p, {bc}.p, {dst}, {m}, {k}, {n}, {alpha}, {add});", i2)
            self.emit("}", ind)
            return
        if sym is not None and sym.state and sym.name not in names and not acc and not to_out:
            # straight into the state's buffer (the operators never alias their output with an input)
            self.emit(f"if ({tgt}.n != {size}) throw std::logic_error(\"matmul: sizes differ\");", i2)
            dst = f"const_cast<float*>({tgt}.p)"
            if ta:
                self.emit(f"hipress::compress::ops::matmul_tn({ac}.p, {bc}.p, {dst}, {a0}, {a1}, {b1});", i2)
            elif tb:
                self.emit(f"hipress::compress::ops::matmul_nt({ac}.p, {bc}.p, {dst}, {a0}, {a1}, {b0}, 1.0f, false);",
                          i2)
            else:
                self.emit(f"hipress::compress::ops::matmul_nn({ac}.p, {bc}.p, {dst}, {a0}, {a1}, {b1});", i2)
            self.emit("}", ind)
            return
        self.emit(f"std::vector<float> res({size});", i2)
        if ta:
            self.emit(f"hipress::compress::ops::matmul_tn({ac}.p, {bc}.p, res.data(), {a0}, {a1}, {b1});", i2)
        elif tb:
            self.emit(f"hipress::compress::ops::matmul_nt({ac}.p, {bc}.p, res.data(), {a0}, {a1}, {b0}, 1.0f, "
                      f"false);", i2)
        else:
            self.emit(f"hipress::compress::ops::matmul_nn({ac}.p, {bc}.p, res.data(), {a0}, {a1}, {b1});", i2)
        if to_out:
            self.emit("if (res.size() != n) throw std::logic_error(\"matmul: the product is not the gradient's "
                      "size\");", i2)
            self.emit("for (size_t i = 0; i < n; ++i) { const float v = alpha == 1.0f ? res[i] : alpha * res[i]; "
                      "if (add) out[i] += v; else out[i] = v; }", i2)
        elif acc:
            self.emit(f"if ({tgt}.n != res.size()) throw std::logic_error(\"matmul: sizes differ\");", i2)
            dst = self.writable(tgt, sym, i2)
            self.emit(f"{{ float* d = {dst}; for (size_t i = 0; i < res.size(); ++i) d[i] {acc[0]}= res[i]; }}", i2)
        elif sym is not None and sym.state:
            self.emit(f"if ({tgt}.n != res.size()) throw std::logic_error(\"matmul: sizes differ\");", i2)
            self.emit(f"if (!res.empty()) std::memcpy(const_cast<float*>({tgt}.p), res.data(), 4 * res.size());", i2)
        else:
            self.emit(f"{tgt}.own = std::move(res); {tgt}.p = {tgt}.own.data(); {tgt}.n = {tgt}.own.size();", i2)
        self.emit("}", ind)

    def decomp_op(self, tgt, sym, call, env, ind):
        """decomp(P): ops::orthogonalize (the hand-written PowerSGD's Gram-Schmidt), in place when P = decomp(P)."""
        (x,) = call.args
        xc = self.array_code(x, env)
        r0, r1 = self.shape(x.ty)
        self.emit("{", ind)
        i2 = ind + 1
        if not (isinstance(x, A.Name) and sym is not None and x.id == sym.name):
            if sym is not None and sym.state:
                self.emit(f"if ({tgt}.n != {xc}.n) throw std::logic_error(\"decomp: sizes differ\");", i2)
                self.emit(f"if ({tgt}.n) std::memmove(const_cast<float*>({tgt}.p), {xc}.p, 4 * {tgt}.n);", i2)
            else:
                self.emit(f"{{ std::vector<float> cp({xc}.p, {xc}.p + {xc}.n); {tgt}.own = std::move(cp); "
                          f"{tgt}.p = {tgt}.own.data(); {tgt}.n = {tgt}.own.size(); }}", i2)
        dst = self.writable(tgt, sym if sym is not None and not sym.state and x.id == sym.name else None, i2)
        self.emit(f"if ({tgt}.n != {r0} * {r1}) throw std::logic_error(\"decomp: size differs from the shape\");", i2)
        self.idioms.append("decomp -> ops::orthogonalize")
        self.emit(f"hipress::compress::ops::orthogonalize({dst}, {r0}, {r1});", i2)
        self.emit("}", ind)

    def layout_bytes(self, call, dims=None) -> str:
        terms = ["kHeaderBytes"]
        for a in call.args:
            if is_arr(a.ty):
                r0, r1 = self.shape(a.ty)
                if dims:
                    r0, r1 = dims[r0], dims[r1]
                terms.append(f"4 * {r0} * {r1}")
        return " + ".join(terms)

    def concat_view(self, call, env, ind):
        """Low-rank payload: header{kind, count = rank, words = rows, cols, scalars...} + the float matrices."""
        self.emit("{", ind)
        i2 = ind + 1
        self.emit("if (c.v_rows > 0xffffffffULL || c.v_cols > 0xffffffffULL) throw std::invalid_argument(kName + "
                  "std::string(\": dimension >= 2^32\"));", i2)
        self.emit(f"Header h; h.algo = kAlgoId; h.kind = {self.cur_kind}; h.numel = n; "
                  f"h.count = static_cast<uint32_t>(c.v_rank);", i2)
        self.emit("h.words[0] = static_cast<uint32_t>(c.v_rows); h.words[1] = static_cast<uint32_t>(c.v_cols);", i2)
        self.emit(f"const size_t total_bytes = {self.layout_bytes(call)};", i2)
        self.emit("if (total_bytes > cap) throw std::invalid_argument(kName + std::string(\": output buffer too "
                  "small for the payload\"));", i2)
        self.emit("h.body_bytes = total_bytes - kHeaderBytes;", i2)
        self.emit("size_t off = kHeaderBytes;", i2)
        w = 2
        for a in call.args:
            if not is_arr(a.ty):
                code = self.ex(a, env)
                if a.ty == "float":
                    self.emit(f"h.set_f({w}, {code});", i2)
                else:
                    self.emit(f"h.words[{w}] = static_cast<uint32_t>(static_cast<uint64_t>({code}));", i2)
                w += 1
                continue
            code = self.array_code(a, env)
            r0, r1 = self.shape(a.ty)
            self.emit(f"if ({code}.n != {r0} * {r1}) throw std::logic_error(\"concat: matrix size differs from its "
                      f"shape\");", i2)
            self.emit(f"if ({code}.n) std::memcpy(out + off, {code}.p, 4 * {code}.n);", i2)
            self.emit(f"off += 4 * {code}.n;", i2)
        self.emit("write_header(h, out);", i2)
        self.emit("total = total_bytes;", i2)
        self.emit("}", ind)

    def extract_view(self, call, env, ind):
        """Reads a low-rank payload of the expected kind; its shape must be the state's (stateful entries) or
        consistent with n (decode, which takes the view from the header)."""
        layout = self.cur_layout
        k = self.cur_in_kind
        self.emit("const Header h = read_header(pin, pbytes, kAlgoId, n);", ind)
        hint = (' + (h.kind ? " (a round payload needs the state: use encode_round/finish)" : "")'
                if k == 0 else "")
        self.emit(f"if (h.kind != {k}) throw FormatError(kName + std::string(\" payload: expected kind {k}, got "
                  f"kind \") + std::to_string(h.kind){hint});", ind)
        self.emit("if (h.bits != 0) throw FormatError(kName + std::string(\" payload: unexpected bit width\"));", ind)
        self.emit("const uint64_t prow = h.words[0], pcol = h.words[1];", ind)
        self.emit("if (prow * pcol != n || h.count > std::min(prow, pcol)) throw FormatError(kName + std::string("
                  "\" payload: inconsistent shape \") + std::to_string(prow) + \" x \" + std::to_string(pcol) + "
                  "\" rank \" + std::to_string(h.count) + \" for \" + std::to_string(n) + \" elements\");", ind)
        if self.cur_stateful:
            self.emit("if (prow != c.v_rows || pcol != c.v_cols || h.count != c.v_rank) throw FormatError(kName + "
                      "std::string(\": payload shape does not match the state's\"));", ind)
        else:
            self.emit("c.v_rows = prow; c.v_cols = pcol; c.v_rank = h.count;", ind)
        self.emit(f"expect_body(h, {self.layout_bytes(layout)} - kHeaderBytes, kName.c_str());", ind)
        self.emit("size_t off = kHeaderBytes;", ind)
        w = 2
        for a, src in zip(call.args[1:], layout.args):
            t = src.ty
            tgt = env.name(a)
            if not is_arr(t):
                if getattr(a.sym, "by_extract", False):
                    self.emit(f"{ctype(t)} {tgt} = 0; (void){tgt};", ind)
                if t == "float":
                    self.emit(f"{tgt} = h.f({w});", ind)
                else:
                    self.emit(f"{tgt} = static_cast<int64_t>(static_cast<int32_t>(h.words[{w}]));", ind)
                w += 1
                continue
            r0, r1 = self.shape(t)
            if getattr(a.sym, "by_extract", False):
                self.emit(f"hp::FArr {tgt};", ind)
            if a.sym.state:
                self.emit(f"if ({tgt}.n != {r0} * {r1}) throw std::logic_error(\"extract: state size differs\");",
                          ind)
                self.emit(f"if ({tgt}.n) std::memcpy(const_cast<float*>({tgt}.p), pin + off, 4 * {tgt}.n);", ind)
            else:
                self.emit(f"hp::alloc({tgt}, {r0} * {r1}); if ({tgt}.n) std::memcpy({tgt}.own.data(), pin + off, "
                          f"4 * {tgt}.n);", ind)
            self.emit(f"off += 4 * {tgt}.n;", ind)

    def view_state_setup(self, what, need_state):
        s = self.s
        self.emit("Ctx c; c.p = &P;")
        self.emit("c.has_state = scalars != nullptr;")
        self.emit("hp_view(c, P, n, rows, cols);")
        if need_state:
            self.emit(f"if (!scalars) throw std::invalid_argument(kName + std::string(\" {what} needs a state "
                      f"(new_state)\"));")
        k = len(s.state_arrays)
        if k:
            self.emit("if (scalars) {")
            self.emit(f"if (nbufs < {k}) throw std::invalid_argument(kName + std::string(\": the state has \") + "
                      f"std::to_string(nbufs) + \" buffers, needs {k} (make it with new_state)\");", 2)
            for g in s.state_arrays:
                self.emit(f"{{ const size_t len = hp_state_len(c, {g.slot}); if (lens[{g.slot}] != len || (len && "
                          f"!bufs[{g.slot}])) throw std::invalid_argument(kName + std::string(\": state buffer "
                          f"'{g.name}' has \") + std::to_string(lens[{g.slot}]) + \" elements, expected \" + "
                          f"std::to_string(len) + \" (state made for another tensor or shape?)\"); "
                          f"c.g_{g.name}.p = bufs[{g.slot}]; c.g_{g.name}.n = len; }}", 2)
            self.emit("} else {")
            self.emit(f"size_t tot = 0; for (int i = 0; i < {k}; ++i) tot += hp_state_len(c, i);", 2)
            self.emit("c.st_tmp.assign(tot, 0.0f); size_t o = 0;", 2)
            for g in s.state_arrays:
                self.emit(f"c.g_{g.name}.p = c.st_tmp.data() + o; c.g_{g.name}.n = hp_state_len(c, {g.slot}); "
                          f"o += c.g_{g.name}.n;", 2)
            self.emit("}")
        else:
            self.emit("(void)bufs; (void)lens; (void)nbufs;")
        for g in s.state_scalars:
            self.emit(f"c.g_{g.name} = scalars ? hp::w32(static_cast<int64_t>(scalars[{g.slot}])) : 0;")
        if s.uses_random:
            self.emit("c.key = rng_key(static_cast<uint64_t>(P.f_seed));")
            self.emit("c.counter = scalars ? scalars[kRngCounter] : 0;")

    def view_state_save(self):
        s = self.s
        if s.uses_random:
            self.emit("if (scalars) scalars[kRngCounter] = c.counter;")
        for g in s.state_scalars:
            self.emit(f"if (scalars) scalars[{g.slot}] = static_cast<uint64_t>(c.g_{g.name});")

    def view_entries(self):
        """hp_enc_<entry>: encode (kind 0) and encode_round<k> (kind k + 1); hp_finish."""
        s = self.s
        sig_tail = ("size_t n, size_t rows, size_t cols, uint8_t* out, size_t cap, uint64_t* scalars, "
                    "float* const* bufs, const uint64_t* lens, int nbufs")
        entries = [(s.encode, 0, None)] + [(f, k + 1, s.concats[s.rounds[k - 1].name] if k else None)
                                           for k, f in enumerate(s.rounds)]
        for f, kind, layout in entries:
            if layout is None:
                self.emit(f"size_t hp_enc_{f.name}(const Params& P, const float* in, {sig_tail}) {{", 0)
            else:
                self.emit(f"size_t hp_enc_{f.name}(const Params& P, const uint8_t* pin, size_t pbytes, {sig_tail}) {{",
                          0)
            self.view_state_setup(f.name, need_state=layout is not None)
            self.emit(f"if (cap < hp_kind_bytes(c, {kind})) throw std::invalid_argument(kName + std::string(\": "
                      f"output buffer has \") + std::to_string(cap) + \" bytes, needs \" + "
                      f"std::to_string(hp_kind_bytes(c, {kind})) + \" (max_encoded_bytes)\");")
            if layout is None:
                self.emit("hp::FArr v_in; v_in.p = in; v_in.n = n;")
            self.emit("size_t total = 0;")
            self.cur_kind, self.cur_in_kind, self.cur_layout, self.cur_stateful = kind, kind - 1, layout, True
            self.cur_concat = s.concats[f.name]
            self.stmts(f.body, EntryEnv("encode"), 1)
            self.view_state_save()
            self.emit("return total;")
            self.emit("}", 0)
        self.emit("size_t hp_encode(const Params& P, const float* in, size_t n, uint8_t* out, size_t cap, "
                  "uint64_t* scalars, float* const* bufs, const uint64_t* lens, int nbufs) {", 0)
        self.emit("return hp_enc_encode(P, in, n, 0, 0, out, cap, scalars, bufs, lens, nbufs);  // an n x 1 view")
        self.emit("}", 0)
        if s.finish is not None:
            self.emit("void hp_finish(const Params& P, const uint8_t* pin, size_t pbytes, float* out, size_t n, "
                      "size_t rows, size_t cols, bool add, uint64_t* scalars, float* const* bufs, "
                      "const uint64_t* lens, int nbufs) {", 0)
            self.view_state_setup("finish", need_state=True)
            self.emit("[[maybe_unused]] const float alpha = 1.0f;")
            self.cur_in_kind, self.cur_layout, self.cur_stateful = len(s.rounds), s.concats[s.rounds[-1].name], True
            self.stmts(s.finish.body, EntryEnv("finish"), 1)
            self.view_state_save()
            self.emit("}", 0)

    def view_helpers(self):
        """hp_view (rows x cols view and rank), hp_state_len, hp_kind_bytes, hp_max_bytes (any shape: the
        largest payload over all rows x cols = n), hp_combine (sum of two round payloads)."""
        s = self.s
        v = s.view
        self.emit("void hp_view(Ctx& c, [[maybe_unused]] const Params& P, size_t n, size_t rows, size_t cols) {", 0)
        self.emit("if (rows == 0 && cols == 0) { rows = n; cols = n ? 1 : 0; }  // no shape: an n x 1 matrix")
        self.emit("if (static_cast<unsigned __int128>(rows) * cols != n) throw std::invalid_argument(kName + "
                  "std::string(\": matrix shape \") + std::to_string(rows) + \" x \" + std::to_string(cols) + "
                  "\" does not hold \" + std::to_string(n) + \" elements\");")
        self.emit(f"const int64_t rank = {self.rank_code(v.rank_expr)};")
        self.emit(f"if (rank < 0 || static_cast<uint64_t>(rank) > std::min(rows, cols)) throw std::invalid_argument("
                  f"kName + std::string(\": the rank {v.rank} = \") + std::to_string(rank) + \" is outside [0, "
                  f"min({v.rows}, {v.cols})]\");")
        self.emit("c.v_rows = rows; c.v_cols = cols; c.v_rank = static_cast<size_t>(rank);")
        self.emit("}", 0)
        self.emit("[[maybe_unused]] size_t hp_state_len(const Ctx& c, int slot) {", 0)
        self.emit("switch (slot) {")
        for g in s.state_arrays:
            r0, r1 = self.shape(g.ty)
            self.emit(f"case {g.slot}: return {r0} * {r1};", 2)
        self.emit("default: return 0;", 2)
        self.emit("}")
        self.emit("}", 0)
        self.emit("size_t hp_kind_bytes(const Ctx& c, int kind) {", 0)
        kinds = [s.concat] + [s.concats[f.name] for f in s.rounds]
        for k, call in enumerate(kinds):
            self.emit(f"if (kind == {k}) return {self.layout_bytes(call)};")
        self.emit("throw FormatError(kName + std::string(\" payload: unknown kind \") + std::to_string(kind));")
        self.emit("}", 0)
        self.emit("size_t hp_max_bytes(const Params& P, size_t n) {", 0)
        self.emit("Ctx c; c.p = &P;")
        self.emit("if (n == 0) { hp_view(c, P, 0, 0, 0); return hp_kind_bytes(c, 0); }")
        self.emit("size_t best = 0;")
        self.emit("for (size_t d = 1; d <= n / d; ++d) { if (n % d) continue; "
                  "hp_view(c, P, n, d, n / d); best = std::max(best, hp_kind_bytes(c, 0)); "
                  "hp_view(c, P, n, n / d, d); best = std::max(best, hp_kind_bytes(c, 0)); }")
        self.emit("return best;")
        self.emit("}", 0)
        # combine: header of a, float bodies summed in order
        self.emit("size_t hp_combine(const uint8_t* a, size_t ab, const uint8_t* b, size_t bb, uint8_t* out, "
                  "size_t cap) {", 0)
        self.emit("const Header ha = read_header(a, ab, kAlgoId, SIZE_MAX), hb = read_header(b, bb, kAlgoId, "
                  "SIZE_MAX);")
        self.emit("auto body = [](const Header& h) { Ctx c; const uint64_t prow = h.words[0], pcol = h.words[1]; "
                  "if (prow * pcol != h.numel || h.count > std::min(prow, pcol)) throw FormatError(kName + "
                  "std::string(\" payload: inconsistent shape\")); c.v_rows = prow; c.v_cols = pcol; "
                  "c.v_rank = h.count; return static_cast<uint64_t>(hp_kind_bytes(c, h.kind) - kHeaderBytes); };")
        self.emit("expect_body(ha, body(ha), kName.c_str()); expect_body(hb, body(hb), kName.c_str());")
        self.emit("if (ha.kind != hb.kind || ha.numel != hb.numel || ha.count != hb.count || ha.words[0] != "
                  "hb.words[0] || ha.words[1] != hb.words[1] || ha.bits || hb.bits) throw FormatError(kName + "
                  "std::string(\" combine: payloads of different rounds or shapes\"));")
        self.emit("if (ha.kind == 0) throw FormatError(kName + std::string(\" combine: single-process payloads "
                  "(kind 0) are not summable, only round payloads\"));")
        self.emit("const size_t nf = ha.body_bytes / 4;")
        self.emit("if (cap < kHeaderBytes + ha.body_bytes) throw std::invalid_argument(kName + std::string(\" "
                  "combine: output buffer too small\"));")
        self.emit("std::vector<float> x(nf), y(nf);")
        self.emit("if (nf) { std::memcpy(x.data(), a + kHeaderBytes, 4 * nf); std::memcpy(y.data(), b + kHeaderBytes, "
                  "4 * nf); }")
        self.emit("for (size_t i = 0; i < nf; ++i) x[i] += y[i];")
        self.emit("std::memcpy(out, a, kHeaderBytes);")
        self.emit("if (nf) std::memcpy(out + kHeaderBytes, x.data(), 4 * nf);")
        self.emit("return kHeaderBytes + ha.body_bytes;")
        self.emit("}", 0)

    def view_abi(self) -> str:
        s = self.s
        k = len(s.state_arrays)
        rounds = "".join(f"    if (round == {i}) {{ *nbytes = hp_enc_{f.name}(P, {'in' if i == 0 else 'prev'}, "
                         f"{'' if i == 0 else 'prev_bytes, '}n, rows, cols, out, cap, scalars, bufs, lens, nbufs); "
                         f"return 0; }}\n" for i, f in enumerate(s.rounds))
        catch = """  catch (const hipress::compress::FormatError& e) { return hpc_fail(e, err, errlen, 1); }
  catch (const std::invalid_argument& e) { return hpc_fail(e, err, errlen, 2); }
  catch (const std::exception& e) { return hpc_fail(e, err, errlen, 3); }"""
        fin = ""
        if s.finish is not None:
            fin = f"""HPC_API int hpc_finish(const double* p, const uint8_t* in, uint64_t bytes, float* out, uint64_t n, uint64_t rows,
                       uint64_t cols, int add, uint64_t* scalars, float* const* bufs, const uint64_t* lens, int nbufs,
                       char* err, int errlen) {{
  try {{ hp_finish(make_params(p), in, bytes, out, n, rows, cols, add != 0, scalars, bufs, lens, nbufs); return 0; }}
{catch}
}}
HPC_API int hpc_combine(const uint8_t* a, uint64_t ab, const uint8_t* b, uint64_t bb, uint8_t* out, uint64_t cap,
                        uint64_t* nbytes, char* err, int errlen) {{
  try {{ *nbytes = hp_combine(a, ab, b, bb, out, cap); return 0; }}
{catch}
}}
"""
        return f"""// ---- low-rank entries (matrix view rows x cols; rows = cols = 0: an n x 1 matrix) ----
HPC_API int hpc_rounds() {{ return {len(s.rounds)}; }}
HPC_API int hpc_view(const double* p, uint64_t n, uint64_t rows, uint64_t cols, uint64_t* dims, uint64_t* sizes,
                     int nsizes, char* err, int errlen) {{
  try {{
    const Params P = make_params(p);
    Ctx c; c.p = &P;
    hp_view(c, P, n, rows, cols);
    dims[0] = c.v_rows; dims[1] = c.v_cols; dims[2] = c.v_rank;
    for (int i = 0; i < nsizes && i < {k}; ++i) sizes[i] = hp_state_len(c, i);
    return 0;
  }}
{catch}
}}
HPC_API int hpc_kind_bytes(const double* p, uint64_t n, uint64_t rows, uint64_t cols, int kind, uint64_t* res,
                           char* err, int errlen) {{
  try {{
    const Params P = make_params(p);
    if (rows == 0 && cols == 0 && kind == 0) {{ *res = hp_max_bytes(P, n); return 0; }}
    Ctx c; c.p = &P;
    hp_view(c, P, n, rows, cols);
    *res = hp_kind_bytes(c, kind);
    return 0;
  }}
{catch}
}}
HPC_API int hpc_encode_round(const double* p, int round, const float* in, const uint8_t* prev, uint64_t prev_bytes,
                             uint64_t n, uint64_t rows, uint64_t cols, uint8_t* out, uint64_t cap, uint64_t* scalars,
                             float* const* bufs, const uint64_t* lens, int nbufs, uint64_t* nbytes, char* err,
                             int errlen) {{
  try {{
    const Params P = make_params(p);
    (void)prev; (void)prev_bytes;
    if (round < 0) {{ *nbytes = hp_enc_encode(P, in, n, rows, cols, out, cap, scalars, bufs, lens, nbufs); return 0; }}
{rounds}    throw std::invalid_argument(kName + std::string(": round must be in [0, {len(s.rounds)}) (then finish)"));
  }}
{catch}
}}
{fin}"""


def _ends_in_return(stmts):
    from hipress.dsl.checker import returns
    return returns(stmts)


def _is_unit_random(e) -> bool:
    return isinstance(e, A.Call) and e.kind == "random" and e.ty == "float" and _num(e.args[0], 0) and \
        _num(e.args[1], 1)


def _num(e, v) -> bool:
    return isinstance(e, A.Num) and e.value == v


def generate_cpp(spec: Spec) -> str:
    g = CppGen(spec)
    code = g.generate()
    head = (f"\nnamespace {{\nconstexpr uint8_t kAlgoId = {spec.algo_id};\nconstexpr int kRngCounter = 0;\n"
            f"const std::string kName = \"{spec.name}\";\n}}  // namespace\n")
    marker = "}  // namespace hp\n"
    code = code.replace(marker, marker + "using namespace hipress::compress;\n" + head.replace("namespace {\n", "")
                        .replace("}  // namespace\n", ""), 1)
    return code
