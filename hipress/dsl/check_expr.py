"""Expression typing of the CompLL checker: names, members, arithmetic, casts, built-in and
user-defined calls. Annotates ``expr.ty``, ``expr.sym`` and ``call.kind``; operator calls are typed by
``check_ops.OperatorTyper``. A mixin of ``checker.Checker`` (its scopes, symbols and error reporting).
"""
from __future__ import annotations

from hipress.dsl import ast as A
from hipress.dsl.types import COMPARATORS, FLOATS, MATH1, MATH2, OPERATORS, REDUCERS, SCALARS, Arr, Sym, arith, \
    bits_of, is_arr, is_num, tname


class ExprTyper:
    def expr(self, e, scope, ctx):
        t = self._expr(e, scope, ctx)
        e.ty = t
        return t

    def _expr(self, e, scope, ctx):
        if isinstance(e, A.Num):
            return "float" if e.is_float else "int32"
        if isinstance(e, A.Name):
            if ctx == "const":
                self.err(e, "a constant is expected here")
            sym = self.lookup(e, e.id, scope)
            e.sym = sym
            if sym.state and ctx == "decode":
                self.err(e, f"decode cannot use the state '{e.id}': it must decode any payload from the payload "
                            f"alone (put what it needs into concat)")
            if sym.kind == "builtin" and ctx != "encode":
                self.err(e, f"'{e.id}' is available in encode only")
            if sym.kind == "dim" and ctx not in ("encode", "decode", "finish"):
                self.err(e, f"'{e.id}' is a dimension of the view, known in the entry points only")
            if sym.kind == "payload":
                self.err(e, f"'{e.id}' is the summed payload of the previous round: read it with "
                            f"extract({e.id}, ...)")
            if ctx == "capacity" and sym.kind == "global":
                self.err(e, f"capacity cannot read the global '{e.id}' (it sees only n and the parameters)")
            if ctx == "udf" and sym.kind == "params":
                self.err(e, "parameters are not visible in user-defined functions; copy them into globals")
            if sym.kind == "params":
                self.err(e, f"'{e.id}' is a param block: use {e.id}.<name>")
            if sym.kind == "output":
                self.err(e, f"'{e.id}' is the output; it can only be assigned")
            return sym.ty
        if isinstance(e, A.Member):
            if isinstance(e.obj, A.Name):
                sym = self.lookup(e.obj, e.obj.id, scope)
                e.obj.sym = sym
                if sym.state and ctx == "decode":
                    self.err(e, f"decode cannot use the state '{e.obj.id}'")
                if sym.kind == "params":
                    if ctx == "decode":
                        self.err(e, "decode cannot read parameters: it must decode any payload from the header "
                                    "alone (put what it needs into concat)")
                    if e.attr not in self.fields:
                        self.err(e, f"'{e.attr}' is not a parameter (parameters: {', '.join(self.fields) or 'none'})")
                    e.obj.ty = sym.ty
                    e.field = self.fields[e.attr]
                    base = self.fields[e.attr].type.base
                    return base
            ot = self.expr(e.obj, scope, ctx)
            if is_arr(ot):
                if e.attr == "size":
                    return "int32"
                if e.attr == "index":
                    if not ot.sparse:
                        self.err(e, "only arrays made by filter or sort have an .index")
                    return Arr("int32", ot.length)
                if e.attr == "bits":
                    if not (ot.elem == "uintN" or bits_of(ot.elem)):
                        self.err(e, ".bits is the width of a packed uint array")
                    return "int32"
                if e.attr == "T":
                    self.err(e, "'.T' (transpose) is only allowed on an argument of matmul")
                self.err(e, f"arrays have .size{', .index' if ot.sparse else ''}; not .{e.attr}")
            self.err(e, f"{tname(ot)} has no member '{e.attr}'")
        if isinstance(e, A.Unary):
            t = self.expr(e.operand, scope, ctx)
            if not is_num(t):
                self.err(e, f"operator '{e.op}' needs a number, got {tname(t)}")
            if e.op == "~" and t in FLOATS:
                self.err(e, "operator '~' needs an integer")
            if e.op == "!":
                return "int32"
            return arith(t)
        if isinstance(e, A.Binary):
            a = self.expr(e.left, scope, ctx)
            b = self.expr(e.right, scope, ctx)
            for side, t in ((e.left, a), (e.right, b)):
                if not is_num(t):
                    self.err(side, f"operator '{e.op}' needs numbers, got {tname(t) if t != 'function' else 'a function'}")
            if e.op in ("%", "<<", ">>", "&", "|", "^"):
                if a in FLOATS or b in FLOATS:
                    self.err(e, f"operator '{e.op}' needs integers, got {a} and {b}")
                return "int32"
            if e.op in ("==", "!=", "<", "<=", ">", ">=", "&&", "||"):
                return "int32"
            return arith(a, b)
        if isinstance(e, A.Cond):
            c = self.expr(e.cond, scope, ctx)
            a = self.expr(e.then, scope, ctx)
            b = self.expr(e.other, scope, ctx)
            for side, t in ((e.cond, c), (e.then, a), (e.other, b)):
                if not is_num(t):
                    self.err(side, f"'?:' needs numbers, got {tname(t) if t != 'function' else 'a function'}")
            return arith(a, b)
        if isinstance(e, A.Call):
            return self.call(e, scope, ctx)
        self.err(e, "unsupported expression")

    def udf_arg(self, e, scope, nargs, what):
        if not isinstance(e, A.Name) or e.id not in self.udfs:
            self.err(e, f"{what} takes a user-defined function here (a name defined in the spec)")
        u = self.udfs[e.id]
        if len(u.args) not in nargs:
            self.err(e, f"'{e.id}' takes {len(u.args)} argument(s); {what} calls it with "
                        f"{' or '.join(str(n) for n in nargs)}")
        e.ty = "function"
        e.sym = Sym(e.id, "udf", "function")
        return u

    def unary_number(self, e: A.Call, scope, ctx, kind: str, arity_msg: str, type_msg: str):
        """A call of one numeric argument (a cast or a one-argument math function): its argument's type.
        type_msg has '{}' for the argument's type."""
        e.kind = kind
        if len(e.args) != 1:
            self.err(e, arity_msg)
        t = self.expr(e.args[0], scope, ctx)
        if not is_num(t):
            self.err(e.args[0], type_msg.format(tname(t)))
        return t

    def call(self, e: A.Call, scope, ctx):
        f = e.func
        nargs = len(e.args)
        if ctx == "const":
            self.err(e, "a constant is expected here")
        if f in SCALARS:  # cast
            self.unary_number(e, scope, ctx, "cast", f"the cast {f}(x) takes one value", "cannot convert {} to " + f)
            return f
        if f in MATH1:
            t = self.unary_number(e, scope, ctx, "math", f"{f}(x) takes one value", f + " needs a number, got {}")
            if t == "double" and MATH1[f] == "float":
                return "double"
            return MATH1[f] or arith(t)
        if f in MATH2:
            e.kind = "math"
            if nargs != 2:
                self.err(e, f"{f}(a, b) takes two values")
            ts = [self.expr(a, scope, ctx) for a in e.args]
            for a, t in zip(e.args, ts):
                if not is_num(t):
                    self.err(a, f"{f} needs numbers, got {tname(t)}")
            if f == "pow" and "double" in ts:
                return "double"
            return MATH2[f] or arith(*ts)
        if f == "random":
            e.kind = "random"
            if len(e.type_args) != 1 or e.type_args[0].base not in ("float", "int32") or e.type_args[0].array:
                self.err(e, "random needs its type: random<float>(a, b) or random<int32>(a, b)")
            if nargs != 2:
                self.err(e, "random<T>(a, b) takes the bounds a and b (result in [a, b))")
            for a in e.args:
                if not is_num(self.expr(a, scope, ctx)):
                    self.err(a, "random's bounds are numbers")
            if ctx not in ("udf", "encode"):
                self.err(e, f"random is available in encode and in user-defined functions, not in {ctx}")
            self.uses_random = True
            if ctx == "udf":
                self.cur_udf._direct_randoms = getattr(self.cur_udf, "_direct_randoms", 0) + 1
            else:
                e.slot = None
            return e.type_args[0].base
        if f in self.udfs:
            e.kind = "udf"
            u = self.udfs[f]
            if nargs != len(u.args):
                self.err(e, f"'{f}' takes {len(u.args)} argument(s), {nargs} given")
            for a, (an, at) in zip(e.args, u.args):
                t = self.expr(a, scope, ctx)
                if not is_num(t):
                    self.err(a, f"argument '{an}' of '{f}' is a number, got {tname(t) if t != 'function' else 'a function'}")
            if ctx == "udf":
                self.cur_udf.calls.append(f)
            elif ctx in ("decode", "capacity") and u.randoms:
                self.err(e, f"'{f}' draws random numbers; {ctx} is deterministic")
            elif ctx == "encode" and u.randoms:
                self.uses_random = True
            if u.ret is None:
                self.err(e, f"'{f}' returns void and has no value")
            return u.ret
        if f in ("concat", "extract"):
            self.err(e, f"{f} is a statement of its own: "
                        f"{'compressed = concat(...);' if f == 'concat' else 'extract(compressed, a, b, ...);'}")
        if f in OPERATORS:
            if ctx == "capacity":
                self.err(e, "capacity computes a number from n and the parameters; it cannot call operators")
            if ctx == "udf":
                self.err(e, f"the operator {f} works on whole arrays; it cannot be called from a user-defined "
                            f"function (which runs per element)")
            e.kind = "op"
            return getattr(self, "op_" + f)(e, scope, ctx)
        if f in REDUCERS or f in COMPARATORS:
            self.err(e, f"'{f}' is a built-in function for reduce/sort; it cannot be called directly")
        if f in self.funcs:
            self.err(e, f"'{f}' cannot be called")
        self.err(e, f"unknown function '{f}'")
