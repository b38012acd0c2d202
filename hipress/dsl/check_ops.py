"""Operator signatures of the CompLL checker: map, reduce, filter, sort, threshold, scatter, matmul,
decomp. Each ``op_<name>`` checks a call's arguments and returns its result type (an ``Arr`` for the
array-producing operators). A mixin of ``checker.Checker``.
"""
from __future__ import annotations

from hipress.dsl import ast as A
from hipress.dsl.types import COMPARATORS, INTS, REDUCERS, Arr, is_arr, is_num, tname


class OperatorTyper:
    def array_arg(self, e, scope, ctx, what):
        t = self.expr(e, scope, ctx)
        if not is_arr(t):
            self.err(e, f"{what} needs an array, got {tname(t) if t != 'function' else 'a function'}")
        return t

    def op_map(self, e, scope, ctx):
        if len(e.args) == 3 and isinstance(e.args[1], A.Name) and e.args[1].id not in self.udfs:
            return self.op_map2(e, scope, ctx)
        if len(e.args) != 2:
            self.err(e, "map(array, udf) takes an array and a user-defined function (or map(array, array, udf) "
                        "with a function of two elements)")
        at = self.array_arg(e.args[0], scope, ctx, "map")
        u = self.udf_arg(e.args[1], scope, (1, 2), "map")
        if len(u.args) == 2 and u.args[1][1] != "int32":
            self.err(e.args[1], f"the second argument of '{u.func.name}' receives the element index (int32)")
        if u.ret is None:
            self.err(e.args[1], f"'{u.func.name}' returns nothing; map needs a value per element")
        if ctx in ("decode", "finish") and u.randoms:
            self.err(e.args[1], f"'{u.func.name}' draws random numbers; {ctx} is deterministic")
        if u.ret == "double":
            self.err(e.args[1], f"'{u.func.name}' returns a double; arrays hold float, int32 or uintK elements")
        if u.randoms:
            self.uses_random = True
        width = u.func.ret.width if u.ret == "uintN" else None
        if u.ret == "uintN" and ctx == "decode":
            self.err(u.func.ret, "decode cannot produce a dynamic-width array")
        return Arr(u.ret, at.length, False, width, at.shape if u.ret == "float" else None) \
            if at.length != "mat" or u.ret == "float" else self.err(e.args[1], "map over a matrix gives floats")

    def op_map2(self, e, scope, ctx):
        """map(A, B, f): f(A[i], B[i]) for two float arrays of the gradient's size (zip); in decode,
        map(codes, R, f) with R an array of one value per row (a per-row reduce's, extracted):
        f(codes[i], R[row of i])."""
        if ctx == "decode":
            return self.op_map_rows(e, scope, ctx)
        if ctx != "encode":
            self.err(e, "map(array, array, udf) is used in encode")
        for a in e.args[:2]:
            t = self.array_arg(a, scope, ctx, "map")
            if t.elem != "float" or t.length != "n":
                self.err(a, "map(array, array, udf) combines float arrays of the gradient's size")
        u = self.udf_arg(e.args[2], scope, (2,), "map(array, array, udf)")
        if u.ret != "float":
            self.err(e.args[2], f"'{u.func.name}' must return a float (map(array, array, udf) makes a float array)")
        if u.randoms:
            self.err(e.args[2], "map(array, array, udf) takes a deterministic function")
        e.zip = True
        return Arr("float", "n")

    def op_map_rows(self, e, scope, ctx):
        at = self.array_arg(e.args[0], scope, ctx, "map")
        rt = self.array_arg(e.args[1], scope, ctx, "map")
        if at.length != "n" or rt.length != "rows" or rt.elem != "float":
            self.err(e, "in decode, map(codes, row_values, udf) takes an array of the gradient's size and a float "
                        "array of one value per row (from a per-row reduce)")
        u = self.udf_arg(e.args[2], scope, (2,), "map(codes, row_values, udf)")
        if u.randoms:
            self.err(e.args[2], f"'{u.func.name}' draws random numbers; decode is deterministic")
        if u.ret not in ("float", "int32") and u.ret not in INTS:
            self.err(e.args[2], f"'{u.func.name}' must return a number")
        e.rows = True
        return Arr("float", "n")

    def op_threshold(self, e, scope, ctx):
        """threshold(A, fraction, samples): estimated magnitude threshold keeping `fraction` of A, the
        ceil(fraction * samples)-th largest |A[j]| over `samples` random positions j (with replacement)."""
        if len(e.args) != 3:
            self.err(e, "threshold(array, fraction, samples) takes a float array, the fraction to keep and the "
                        "sample size")
        if ctx != "encode":
            self.err(e, "threshold is used in encode")
        at = self.array_arg(e.args[0], scope, ctx, "threshold")
        if at.elem != "float" or at.length != "n":
            self.err(e.args[0], "threshold estimates over a float array of the gradient's size")
        if not is_num(self.expr(e.args[1], scope, ctx)):
            self.err(e.args[1], "threshold's fraction is a number")
        if self.expr(e.args[2], scope, ctx) not in INTS:
            self.err(e.args[2], "threshold's sample size is an integer")
        self.uses_random = True
        return "float"

    def op_reduce(self, e, scope, ctx):
        if len(e.args) == 3:
            return self.op_reduce_rows(e, scope, ctx)
        if len(e.args) != 2:
            self.err(e, f"reduce(array, f) takes an array and a reducer ({', '.join(REDUCERS)} or a user-defined "
                        f"function of two values)")
        at = self.array_arg(e.args[0], scope, ctx, "reduce")
        r = e.args[1]
        if isinstance(r, A.Name) and r.id in REDUCERS and r.id not in self.udfs:
            r.ty = "function"
            e.reducer = r.id
            if r.id == "count":
                return "int32"
            if r.id == "mean":
                return "float"
            if r.id == "maxabs":
                return "float" if at.elem == "float" else "int32"
            return "float" if at.elem == "float" else "int32"
        u = self.udf_arg(r, scope, (2,), "reduce")
        e.reducer = None
        if u.randoms:
            self.err(r, "a reducer cannot draw random numbers")
        if u.ret is None or is_arr(u.ret):
            self.err(r, "a reducer returns a value")
        return u.ret

    def op_reduce_rows(self, e, scope, ctx):
        """reduce(A, sum|mean, row): one value per row of `row` elements of A (the last row may be shorter;
        row <= 0 or >= the length: the whole array is one row), a float array of per-row values."""
        if ctx != "encode":
            self.err(e, "a per-row reduce(array, f, row) is used in encode")
        src = e.args[0]
        inner = src.args[0] if isinstance(src, A.Call) and src.func == "map" and len(src.args) == 2 else src
        at = self.array_arg(src, scope, ctx, "reduce")
        if at.length != "n" or at.elem != "float" or not isinstance(inner, A.Name):
            self.err(src, "a per-row reduce takes a float array of the gradient's size (a variable or map(variable, f))")
        r = e.args[1]
        if not (isinstance(r, A.Name) and r.id in ("sum", "mean") and r.id not in self.udfs):
            self.err(r, "a per-row reduce sums: its reducer is sum or mean")
        r.ty = "function"
        e.reducer = r.id
        if self.expr(e.args[2], scope, ctx) not in INTS:
            self.err(e.args[2], "reduce's row length is an integer")
        e.rows = True
        return Arr("float", "rows")

    def op_filter(self, e, scope, ctx):
        if len(e.args) not in (2, 3):
            self.err(e, "filter(array, udf[, cap]) takes an array, a predicate and optionally a maximum count")
        if ctx != "encode":
            self.err(e, "filter is used in encode")
        at = self.array_arg(e.args[0], scope, ctx, "filter")
        if at.elem != "float" or at.length != "n":
            self.err(e.args[0], "filter selects from a float array of the gradient's size")
        u = self.udf_arg(e.args[1], scope, (1, 2), "filter")
        if u.randoms:
            self.err(e.args[1], "a filter predicate cannot draw random numbers")
        if len(e.args) == 3:
            t = self.expr(e.args[2], scope, ctx)
            if t not in INTS:
                self.err(e.args[2], "filter's cap is an integer")
        return Arr("float", "var", True)

    def op_sort(self, e, scope, ctx):
        if len(e.args) not in (3, 4):
            self.err(e, "sort(array, order, k[, samples]) keeps the first k elements in the given order "
                        f"({', '.join(COMPARATORS)} or a user-defined comparison of two values)")
        if ctx != "encode":
            self.err(e, "sort is used in encode")
        at = self.array_arg(e.args[0], scope, ctx, "sort")
        if at.elem != "float" or at.length != "n":
            self.err(e.args[0], "sort selects from a float array of the gradient's size")
        c = e.args[1]
        if isinstance(c, A.Name) and c.id in COMPARATORS and c.id not in self.udfs:
            c.ty = "function"
            e.order = c.id
        else:
            u = self.udf_arg(c, scope, (2,), "sort")
            e.order = None
            if u.randoms:
                self.err(c, "a comparison cannot draw random numbers")
        t = self.expr(e.args[2], scope, ctx)
        if t not in INTS:
            self.err(e.args[2], "sort's k is an integer")
        if len(e.args) == 4:  # sampled threshold first: only the candidates above it are ranked
            if e.order != "greaterAbs":
                self.err(e.args[3], "a sample size (sort's 4th argument) needs the order greaterAbs")
            if self.expr(e.args[3], scope, ctx) not in INTS:
                self.err(e.args[3], "sort's sample size is an integer")
            self.uses_random = True
        return Arr("float", "var", True)

    def op_scatter(self, e, scope, ctx):
        if ctx == "encode" and len(e.args) == 3:  # A = scatter(A, index, value): A[index[j]] = value
            at = self.array_arg(e.args[0], scope, ctx, "scatter")
            if at.elem != "float" or at.length != "n":
                self.err(e.args[0], "scatter(array, index, value) writes into a float array of the gradient's size")
            it = self.array_arg(e.args[1], scope, ctx, "scatter")
            if it.elem != "int32":
                self.err(e.args[1], f"scatter's index is an int32 array (s.index), got {it}")
            if not is_num(self.expr(e.args[2], scope, ctx)):
                self.err(e.args[2], "scatter(array, index, value) writes one number")
            e.into = True
            return Arr("float", "n")
        if ctx != "decode":
            self.err(e, "scatter is used in decode (gradient = scatter(index, values);) or in encode as "
                        "A = scatter(A, index, value);")
        if len(e.args) != 2:
            self.err(e, "scatter(index, values) takes an int32 array of indices and a float array of values")
        it = self.array_arg(e.args[0], scope, ctx, "scatter")
        vt = self.array_arg(e.args[1], scope, ctx, "scatter")
        if it.elem != "int32" or vt.elem != "float":
            self.err(e, f"scatter(index, values) takes int32* and float*, got {it} and {vt}")
        return Arr("float", "n")

    def op_random(self, e, scope, ctx):  # pragma: no cover - handled in call()
        self.err(e, "random<T>(a, b)")

    def matrix_operand(self, e, scope, ctx, what):
        trans = isinstance(e, A.Member) and e.attr == "T"
        t = self.expr(e.obj, scope, ctx) if trans else self.expr(e, scope, ctx)
        if trans:
            e.ty = t
        sh = self.shape_of(t)
        if sh is None:
            self.err(e, f"{what} takes float matrices (the gradient, state matrices, matmul results), got "
                        f"{tname(t) if t != 'function' else 'a function'}")
        if trans and not isinstance(e.obj, A.Name):
            self.err(e, "'.T' applies to a matrix variable")
        if not trans and not isinstance(e, A.Name):
            self.err(e, f"{what}'s operands are matrix variables (assign the inner product to a variable first)")
        return ((sh[1], sh[0]) if trans else sh), trans

    def op_matmul(self, e, scope, ctx):
        """matmul(A, B) with A or B optionally transposed (X.T): the row-major matrix product."""
        if self.view is None:
            self.err(e, "matmul needs the matrix view: declare 'view rows, cols, r = ...;'")
        if len(e.args) != 2:
            self.err(e, "matmul(A, B) multiplies two matrices (either may be transposed: A.T)")
        (a0, a1), ta = self.matrix_operand(e.args[0], scope, ctx, "matmul")
        (b0, b1), tb = self.matrix_operand(e.args[1], scope, ctx, "matmul")
        if ta and tb:
            self.err(e, "matmul(A.T, B.T) is not supported (it is matmul(B, A) transposed)")
        if a1 != b0:
            self.err(e, f"matmul: inner dimensions differ ({a0} x {a1} times {b0} x {b1})")
        e.trans = (ta, tb)
        return self.mat((a0, b1))

    def op_decomp(self, e, scope, ctx):
        """decomp(P): Gram-Schmidt orthonormalisation of P's columns (PowerSGD)."""
        if self.view is None:
            self.err(e, "decomp needs the matrix view: declare 'view rows, cols, r = ...;'")
        if len(e.args) != 1:
            self.err(e, "decomp(P) orthonormalises the columns of one matrix")
        sh, _ = self.matrix_operand(e.args[0], scope, ctx, "decomp")
        if isinstance(e.args[0], A.Member):
            self.err(e.args[0], "decomp takes a matrix variable, not a transpose")
        return self.mat(sh)
