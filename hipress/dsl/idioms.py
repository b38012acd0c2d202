"""Shape matching on user-defined functions (the CPU back end's operator substitutions).

Each matcher looks at a checked UDF (``checker.Udf``) and says whether its body is exactly the
expression an optimised common operator computes, so that the generator may call the operator
instead of the generic loop (same results). Pure functions of the AST; no code is emitted here.
"""
from __future__ import annotations

from typing import Dict, NamedTuple, Optional

from hipress.dsl import ast as A


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
    if not (isinstance(gt, A.Binary) and gt.op == ">" and is_abs(gt.left) and num(gt.right, 0)):
        return None
    return ge.right


def is_sum(u) -> bool:
    """Whether the two-argument UDF is exactly a + b (or b + a) on floats."""
    e = flatten(u)
    if e is None or not isinstance(e, A.Binary) or e.op != "+" or e.ty != "float":
        return False
    x, y = u.args[0][0], u.args[1][0]
    return is_name(e.left, x) and is_name(e.right, y) or is_name(e.left, y) and is_name(e.right, x)


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
    if isinstance(e, A.Call) and e.kind == "random":
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


def is_unit_random(e) -> bool:
    return isinstance(e, A.Call) and e.kind == "random" and e.ty == "float" and num(e.args[0], 0) and \
        num(e.args[1], 1)


def num(e, v) -> bool:
    return isinstance(e, A.Num) and e.value == v


class ScaledSigns(NamedTuple):
    row_slot: int  # the CompressorState.scalars slot of the row length (0 or beyond n: one row)


def scaled_signs(spec) -> Optional[ScaledSigns]:
    """Whether the spec is exactly onebit's shape: per row (a state scalar's length), scale =
    sqrt(mean of x * x); a sign bit per element; payload concat(bits, scales); decode
    b ? -scale : scale. Error feedback around such an algorithm has a fused form
    (ops::feedback_scaled_signs). None where the spec is anything else."""
    if spec.view is not None or spec.rounds or spec.state_arrays or spec.uses_random or spec.decode is None:
        return None
    grad, out = spec.encode.params[0][1], spec.encode.params[1][1]
    enc = spec.encode.body
    if len(enc) != 4 or not all(isinstance(s, A.Decl) and len(s.names) == 1 for s in enc[:3]):
        return None
    (ms, ms_init), (sc, sc_init), (bits, bits_init) = ((s.names[0][0], s.names[0][1]) for s in enc[:3])
    udf = spec.udfs.get
    # mean_squares = reduce(map(gradient, square), mean, row)
    if not (_call(ms_init, "reduce", 3) and _call(ms_init.args[0], "map", 2)
            and _plain(ms_init.args[0].args[0], grad) and _plain(ms_init.args[1], "mean")):
        return None
    row = ms_init.args[2]
    if not (isinstance(row, A.Name) and getattr(row, "sym", None) is not None and row.sym.kind == "global"
            and row.sym.state and row.sym.ty == "int32"):
        return None
    if not _udf_is(udf(_name(ms_init.args[0].args[1])), lambda e, x: isinstance(e, A.Binary) and e.op == "*"
                   and is_name(e.left, x[0]) and is_name(e.right, x[0])):
        return None
    # scales = map(mean_squares, root); bits = map(gradient, negative)
    if not (_call(sc_init, "map", 2) and _plain(sc_init.args[0], ms)
            and _udf_is(udf(_name(sc_init.args[1])),
                        lambda e, x: isinstance(e, A.Call) and e.func == "sqrt" and is_name(e.args[0], x[0]))):
        return None
    neg = udf(_name(bits_init.args[1])) if _call(bits_init, "map", 2) else None
    if not (neg is not None and _plain(bits_init.args[0], grad) and sign_pred(neg) == "neg"):
        return None
    # compressed = concat(bits, scales)
    last = enc[3]
    if not (isinstance(last, A.Assign) and _plain(last.target, out) and last.op == "="
            and _call(last.value, "concat", 2) and _plain(last.value.args[0], bits) and _plain(last.value.args[1], sc)):
        return None
    # decode: extract(compressed, b, s); gradient = map(b, s, unsign) with unsign(b, s) = b ? -s : s
    dec = spec.decode.body
    dgrad = spec.decode.params[1][1]
    if not (len(dec) == 2 and isinstance(dec[0], A.ExprStmt) and _call(dec[0].expr, "extract", 3)
            and isinstance(dec[1], A.Assign) and _plain(dec[1].target, dgrad) and _call(dec[1].value, "map", 3)):
        return None
    b, s = _name(dec[0].expr.args[1]), _name(dec[0].expr.args[2])
    m = dec[1].value
    if not (_plain(m.args[0], b) and _plain(m.args[1], s)):
        return None
    if not _udf_is(udf(_name(m.args[2])), lambda e, x: isinstance(e, A.Cond) and is_name(e.cond, x[0])
                   and isinstance(e.then, A.Unary) and e.then.op == "-" and is_name(e.then.operand, x[1])
                   and is_name(e.other, x[1])):
        return None
    return ScaledSigns(row.sym.slot)


def _name(e) -> Optional[str]:
    return e.id if isinstance(e, A.Name) else None


def _plain(e, name: str) -> bool:
    """e is the bare name ``name`` (a variable of the function, not a UDF's argument)."""
    return isinstance(e, A.Name) and e.id == name


def _call(e, func: str, *nargs: int) -> bool:
    return isinstance(e, A.Call) and e.func == func and len(e.args) in nargs


def _udf_is(u, test) -> bool:
    """The UDF ``u`` (None: not a UDF) has a body that is one expression for which test(expr, arg
    names) holds."""
    if u is None:
        return False
    e = flatten(u)
    return e is not None and test(e, [a for a, _ in u.args])
