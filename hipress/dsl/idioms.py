"""Shape matching on user-defined functions (the CPU back end's operator substitutions).

Each matcher looks at a checked UDF (``checker.Udf``) and says whether its body is exactly the
expression an optimised common operator computes, so that the generator may call the operator
instead of the generic loop (same results). Pure functions of the AST; no code is emitted here.
"""
from __future__ import annotations

from typing import Dict, Optional

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
