"""Matrix views of the CompLL code generator (CPU target): low-rank specs.

A spec with ``view rows, cols, r = ...;`` sees the gradient as a rows x cols matrix: ``matmul`` and
``decomp`` become the hand-written PowerSGD's operators (``ops::matmul_nn/tn/nt``,
``ops::orthogonalize``), payloads carry the shape in their header, and the multi-round entry points
(``encode_round<k>``, ``finish``, the generated ``combine``) get their own C ABI (docs/dsl.md).
Used by ``target_cpp.CppTarget``; the CUDA target refuses views.
"""
from __future__ import annotations

from hipress.dsl import ast as A
from hipress.dsl.codegen import CATCH, EntryEnv, ctype
from hipress.dsl.types import is_arr


class LowRank:
    def __init__(self, gen):
        self.g = gen
        self.residual_in_free = False  # an entry's residual_in not yet given to a fused add (nn)

    def decode_prologue(self):
        """decode of a low-rank payload reads it like a round's sum (kind 0, no state)."""
        self.g.emit("const uint8_t* pin = in; const size_t pbytes = bytes;")
        self.cur_in_kind, self.cur_layout, self.cur_stateful = 0, self.g.s.concat, False

    def dim(self, name: str) -> str:
        v = self.g.s.view
        return {v.rows: "c.v_rows", v.cols: "c.v_cols", v.rank: "c.v_rank"}[name]

    def shape(self, t):
        """(rows code, cols code) of a float matrix type."""
        if t.length == "mat":
            return self.dim(t.shape[0]), self.dim(t.shape[1])
        return "c.v_rows", "c.v_cols"

    def rank_code(self, e) -> str:
        v = self.g.s.view
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
            self.g.emit(f"if ({tgt}.own.data() != {tgt}.p) {{ {tgt}.own.assign({tgt}.p, {tgt}.p + {tgt}.n); "
                      f"{tgt}.p = {tgt}.own.data(); }}", ind)
        return f"const_cast<float*>({tgt}.p)"

    def matmul_op(self, tgt, sym, call, env, ind, acc=None, to_out=False, add_first=None):
        """matmul(A, B), matmul(A.T, B), matmul(A, B.T) -> ops::matmul_nn / matmul_tn / matmul_nt (the
        hand-written kernels' operators); 'X -= matmul(A, B.T)' and the decoded gradient use matmul_nt's
        fused alpha/add. add_first (matmul(A, B) only): the code of an array added into A (a state)
        first, in the same pass (ops::add_matmul_nn; codegen's add_matmul)."""
        a, b = call.args
        ta, tb = call.trans
        an, bn = (a.obj if ta else a), (b.obj if tb else b)
        ac, bc = self.g.array_code(an, env), self.g.array_code(bn, env)
        (a0, a1), (b0, b1) = self.shape(an.ty), self.shape(bn.ty)
        self.g.emit("{", ind)
        i2 = ind + 1
        self.g.emit(f"if ({ac}.n != {a0} * {a1} || {bc}.n != {b0} * {b1}) throw std::logic_error(\"matmul: operand "
                  f"sizes differ from their shapes\");", i2)
        m, k, n = (a1, a0, b1) if ta else ((a0, a1, b0) if tb else (a0, a1, b1))
        rows_out = m
        cols_out = n
        size = f"{rows_out} * {cols_out}"
        names = {getattr(an, "id", None), getattr(bn, "id", None)}
        if tb and (to_out or acc):  # fused: C (+)= alpha * A B^T
            if to_out:
                alpha, add, dst = "alpha", "add", "out"
                self.g.emit(f"if ({size} != n) throw std::logic_error(\"matmul: the product is not the gradient's "
                          f"size\");", i2)
            else:
                alpha, add = ("1.0f" if acc == "+=" else "-1.0f"), "true"
                self.g.emit(f"if ({tgt}.n != {size}) throw std::logic_error(\"matmul: sizes differ\");", i2)
                dst = self.writable(tgt, sym, i2)
                if sym is not None and sym.name in names:
                    self.g.emit(f"std::vector<float> tmp({tgt}.p, {tgt}.p + {tgt}.n);", i2)
                    self.g.emit(f"hipress::compress::ops::matmul_nt({ac}.p, {bc}.p, tmp.data(), {m}, {k}, {n}, "
                              f"{alpha}, {add});", i2)
                    self.g.emit(f"std::memcpy({dst}, tmp.data(), 4 * tmp.size());", i2)
                    self.g.emit("}", ind)
                    return
            self.g.emit(f"hipress::compress::ops::matmul_nt({ac}.p, {bc}.p, {dst}, {m}, {k}, {n}, {alpha}, {add});", i2)
            self.g.emit("}", ind)
            return
        if sym is not None and sym.state and sym.name not in names and not acc and not to_out:
            # straight into the state's buffer (the operators never alias their output with an input)
            self.g.emit(f"if ({tgt}.n != {size}) throw std::logic_error(\"matmul: sizes differ\");", i2)
            dst = f"const_cast<float*>({tgt}.p)"
            if ta:
                self.g.emit(f"hipress::compress::ops::matmul_tn({ac}.p, {bc}.p, {dst}, {a0}, {a1}, {b1});", i2)
            elif tb:
                self.g.emit(f"hipress::compress::ops::matmul_nt({ac}.p, {bc}.p, {dst}, {a0}, {a1}, {b0}, 1.0f, false);",
                          i2)
            else:
                self.g.emit(self.nn(ac, bc, dst, a0, a1, b1, add_first), i2)
            self.g.emit("}", ind)
            return
        self.g.emit(f"std::vector<float> res({size});", i2)
        if ta:
            self.g.emit(f"hipress::compress::ops::matmul_tn({ac}.p, {bc}.p, res.data(), {a0}, {a1}, {b1});", i2)
        elif tb:
            self.g.emit(f"hipress::compress::ops::matmul_nt({ac}.p, {bc}.p, res.data(), {a0}, {a1}, {b0}, 1.0f, "
                      f"false);", i2)
        else:
            self.g.emit(self.nn(ac, bc, "res.data()", a0, a1, b1, add_first), i2)
        if to_out:
            self.g.emit("if (res.size() != n) throw std::logic_error(\"matmul: the product is not the gradient's "
                      "size\");", i2)
            self.g.emit("for (size_t i = 0; i < n; ++i) { const float v = alpha == 1.0f ? res[i] : alpha * res[i]; "
                      "if (add) out[i] += v; else out[i] = v; }", i2)
        elif acc:
            self.g.emit(f"if ({tgt}.n != res.size()) throw std::logic_error(\"matmul: sizes differ\");", i2)
            dst = self.writable(tgt, sym, i2)
            self.g.emit(f"{{ float* d = {dst}; for (size_t i = 0; i < res.size(); ++i) d[i] {acc[0]}= res[i]; }}", i2)
        elif sym is not None and sym.state:
            self.g.emit(f"if ({tgt}.n != res.size()) throw std::logic_error(\"matmul: sizes differ\");", i2)
            self.g.emit(f"if (!res.empty()) std::memcpy(const_cast<float*>({tgt}.p), res.data(), 4 * res.size());", i2)
        else:
            self.g.emit(f"{tgt}.own = std::move(res); {tgt}.p = {tgt}.own.data(); {tgt}.n = {tgt}.own.size();", i2)
        self.g.emit("}", ind)

    def nn(self, ac, bc, dst, m, k, n, add_first) -> str:
        if add_first is None:
            return f"hipress::compress::ops::matmul_nn({ac}.p, {bc}.p, {dst}, {m}, {k}, {n});"
        old = "c.residual_in" if self.residual_in_free else "nullptr"
        self.residual_in_free = False
        return (f"hipress::compress::ops::add_matmul_nn(const_cast<float*>({ac}.p), {add_first}.p, {bc}.p, {dst}, "
                f"{m}, {k}, {n}, {old});")

    def decomp_op(self, tgt, sym, call, env, ind):
        """decomp(P): ops::orthogonalize (the hand-written PowerSGD's Gram-Schmidt), in place when P = decomp(P)."""
        (x,) = call.args
        xc = self.g.array_code(x, env)
        r0, r1 = self.shape(x.ty)
        self.g.emit("{", ind)
        i2 = ind + 1
        if not (isinstance(x, A.Name) and sym is not None and x.id == sym.name):
            if sym is not None and sym.state:
                self.g.emit(f"if ({tgt}.n != {xc}.n) throw std::logic_error(\"decomp: sizes differ\");", i2)
                self.g.emit(f"if ({tgt}.n) std::memmove(const_cast<float*>({tgt}.p), {xc}.p, 4 * {tgt}.n);", i2)
            else:
                self.g.emit(f"{{ std::vector<float> cp({xc}.p, {xc}.p + {xc}.n); {tgt}.own = std::move(cp); "
                          f"{tgt}.p = {tgt}.own.data(); {tgt}.n = {tgt}.own.size(); }}", i2)
        dst = self.writable(tgt, sym if sym is not None and not sym.state and x.id == sym.name else None, i2)
        self.g.emit(f"if ({tgt}.n != {r0} * {r1}) throw std::logic_error(\"decomp: size differs from the shape\");", i2)
        self.g.idioms.append("decomp -> ops::orthogonalize")
        self.g.emit(f"hipress::compress::ops::orthogonalize({dst}, {r0}, {r1});", i2)
        self.g.emit("}", ind)

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
        self.g.emit("{", ind)
        i2 = ind + 1
        self.g.emit("if (c.v_rows > 0xffffffffULL || c.v_cols > 0xffffffffULL) throw std::invalid_argument(kName + "
                  "std::string(\": dimension >= 2^32\"));", i2)
        self.g.emit(f"Header h; h.algo = kAlgoId; h.kind = {self.cur_kind}; h.numel = n; "
                  f"h.count = static_cast<uint32_t>(c.v_rank);", i2)
        self.g.emit("h.words[0] = static_cast<uint32_t>(c.v_rows); h.words[1] = static_cast<uint32_t>(c.v_cols);", i2)
        self.g.emit(f"const size_t total_bytes = {self.layout_bytes(call)};", i2)
        self.g.emit("if (total_bytes > cap) throw std::invalid_argument(kName + std::string(\": output buffer too "
                  "small for the payload\"));", i2)
        self.g.emit("h.body_bytes = total_bytes - kHeaderBytes;", i2)
        self.g.emit("size_t off = kHeaderBytes;", i2)
        w = 2
        for a in call.args:
            if not is_arr(a.ty):
                code = self.g.ex(a, env)
                if a.ty == "float":
                    self.g.emit(f"h.set_f({w}, {code});", i2)
                else:
                    self.g.emit(f"h.words[{w}] = static_cast<uint32_t>(static_cast<uint64_t>({code}));", i2)
                w += 1
                continue
            code = self.g.array_code(a, env)
            r0, r1 = self.shape(a.ty)
            self.g.emit(f"if ({code}.n != {r0} * {r1}) throw std::logic_error(\"concat: matrix size differs from its "
                      f"shape\");", i2)
            self.g.emit(f"if ({code}.n) std::memcpy(out + off, {code}.p, 4 * {code}.n);", i2)
            self.g.emit(f"off += 4 * {code}.n;", i2)
        self.g.emit("write_header(h, out);", i2)
        self.g.emit("total = total_bytes;", i2)
        self.g.emit("}", ind)

    def extract_view(self, call, env, ind):
        """Reads a low-rank payload of the expected kind; its shape must be the state's (stateful entries) or
        consistent with n (decode, which takes the view from the header)."""
        layout = self.cur_layout
        k = self.cur_in_kind
        self.g.emit("const Header h = read_header(pin, pbytes, kAlgoId, n);", ind)
        hint = (' + (h.kind ? " (a round payload needs the state: use encode_round/finish)" : "")'
                if k == 0 else "")
        self.g.emit(f"if (h.kind != {k}) throw FormatError(kName + std::string(\" payload: expected kind {k}, got "
                  f"kind \") + std::to_string(h.kind){hint});", ind)
        self.g.emit("if (h.bits != 0) throw FormatError(kName + std::string(\" payload: unexpected bit width\"));", ind)
        self.g.emit("const uint64_t prow = h.words[0], pcol = h.words[1];", ind)
        self.g.emit("if (prow * pcol != n || h.count > std::min(prow, pcol)) throw FormatError(kName + std::string("
                  "\" payload: inconsistent shape \") + std::to_string(prow) + \" x \" + std::to_string(pcol) + "
                  "\" rank \" + std::to_string(h.count) + \" for \" + std::to_string(n) + \" elements\");", ind)
        if self.cur_stateful:
            self.g.emit("if (prow != c.v_rows || pcol != c.v_cols || h.count != c.v_rank) throw FormatError(kName + "
                      "std::string(\": payload shape does not match the state's\"));", ind)
        else:
            self.g.emit("c.v_rows = prow; c.v_cols = pcol; c.v_rank = h.count;", ind)
        self.g.emit(f"expect_body(h, {self.layout_bytes(layout)} - kHeaderBytes, kName.c_str());", ind)
        self.g.emit("size_t off = kHeaderBytes;", ind)
        w = 2
        for a, src in zip(call.args[1:], layout.args):
            t = src.ty
            tgt = env.name(a)
            if not is_arr(t):
                if getattr(a.sym, "by_extract", False):
                    self.g.emit(f"[[maybe_unused]] {ctype(t)} {tgt} = 0;", ind)
                if t == "float":
                    self.g.emit(f"{tgt} = h.f({w});", ind)
                else:
                    self.g.emit(f"{tgt} = static_cast<int64_t>(static_cast<int32_t>(h.words[{w}]));", ind)
                w += 1
                continue
            r0, r1 = self.shape(t)
            if getattr(a.sym, "by_extract", False):
                self.g.emit(f"hp::FArr {tgt};", ind)
            if a.sym.state:
                self.g.emit(f"if ({tgt}.n != {r0} * {r1}) throw std::logic_error(\"extract: state size differs\");",
                          ind)
                self.g.emit(f"if ({tgt}.n) std::memcpy(const_cast<float*>({tgt}.p), pin + off, 4 * {tgt}.n);", ind)
            else:
                self.g.emit(f"hp::alloc({tgt}, {r0} * {r1}); if ({tgt}.n) std::memcpy({tgt}.own.data(), pin + off, "
                          f"4 * {tgt}.n);", ind)
            self.g.emit(f"off += 4 * {tgt}.n;", ind)

    def view_state_setup(self, what, need_state):
        s = self.g.s
        self.g.emit("Ctx c; c.p = &P;")
        self.g.emit("c.has_state = scalars != nullptr;")
        self.g.emit("hp_view(c, P, n, rows, cols);")
        if need_state:
            self.g.emit(f"if (!scalars) throw std::invalid_argument(kName + std::string(\" {what} needs a state "
                      f"(new_state)\"));")
        k = len(s.state_arrays)
        if k:
            self.g.emit("if (scalars) {")
            self.g.emit(f"if (nbufs < {k}) throw std::invalid_argument(kName + std::string(\": the state has \") + "
                      f"std::to_string(nbufs) + \" buffers, needs {k} (make it with new_state)\");", 2)
            for g in s.state_arrays:
                self.g.emit(f"{{ const size_t len = hp_state_len(c, {g.slot}); if (lens[{g.slot}] != len || (len && "
                          f"!bufs[{g.slot}])) throw std::invalid_argument(kName + std::string(\": state buffer "
                          f"'{g.name}' has \") + std::to_string(lens[{g.slot}]) + \" elements, expected \" + "
                          f"std::to_string(len) + \" (state made for another tensor or shape?)\"); "
                          f"c.g_{g.name}.p = bufs[{g.slot}]; c.g_{g.name}.n = len; }}", 2)
            self.g.emit("} else {")
            self.g.emit(f"size_t tot = 0; for (int i = 0; i < {k}; ++i) tot += hp_state_len(c, i);", 2)
            self.g.emit("c.st_tmp.assign(tot, 0.0f); size_t o = 0;", 2)
            for g in s.state_arrays:
                self.g.emit(f"c.g_{g.name}.p = c.st_tmp.data() + o; c.g_{g.name}.n = hp_state_len(c, {g.slot}); "
                          f"o += c.g_{g.name}.n;", 2)
            self.g.emit("}")
        else:
            self.g.emit("(void)bufs; (void)lens; (void)nbufs;")
        for g in s.state_scalars:
            self.g.emit(f"c.g_{g.name} = scalars ? hp::w32(static_cast<int64_t>(scalars[{g.slot}])) : 0;")
        if s.uses_random:
            self.g.emit("c.key = rng_key(static_cast<uint64_t>(P.f_seed));")
            self.g.emit("c.counter = scalars ? scalars[kRngCounter] : 0;")

    def view_state_save(self):
        s = self.g.s
        if s.uses_random:
            self.g.emit("if (scalars) scalars[kRngCounter] = c.counter;")
        for g in s.state_scalars:
            self.g.emit(f"if (scalars) scalars[{g.slot}] = static_cast<uint64_t>(c.g_{g.name});")

    def view_entries(self):
        """hp_enc_<entry>: encode (kind 0) and encode_round<k> (kind k + 1); hp_finish."""
        s = self.g.s
        # residual_in: where the old values of the state array that the entry's first fused add
        # (map(X, Y, a + b); matmul(X, W): add_matmul) updates are, when the caller keeps them elsewhere
        # than the state's buffer (an undo log's copy); the add then writes X's buffer from them.
        sig_tail = ("size_t n, size_t rows, size_t cols, uint8_t* out, size_t cap, uint64_t* scalars, "
                    "float* const* bufs, const uint64_t* lens, int nbufs, const float* residual_in = nullptr")
        entries = [(s.encode, 0, None)] + [(f, k + 1, s.concats[s.rounds[k - 1].name] if k else None)
                                           for k, f in enumerate(s.rounds)]
        for f, kind, layout in entries:
            if layout is None:
                self.g.emit(f"size_t hp_enc_{f.name}(const Params& P, const float* in, {sig_tail}) {{", 0)
            else:
                self.g.emit(f"size_t hp_enc_{f.name}(const Params& P, const uint8_t* pin, size_t pbytes, {sig_tail}) {{",
                          0)
            self.view_state_setup(f.name, need_state=layout is not None)
            self.g.emit("c.residual_in = residual_in;")
            self.residual_in_free = True  # the entry's first fused add takes it (nn)
            self.g.emit(f"if (cap < hp_kind_bytes(c, {kind})) throw std::invalid_argument(kName + std::string(\": "
                      f"output buffer has \") + std::to_string(cap) + \" bytes, needs \" + "
                      f"std::to_string(hp_kind_bytes(c, {kind})) + \" (max_encoded_bytes)\");")
            if layout is None:
                self.g.emit("hp::FArr v_in; v_in.p = in; v_in.n = n;")
            self.g.emit("size_t total = 0;")
            self.cur_kind, self.cur_in_kind, self.cur_layout, self.cur_stateful = kind, kind - 1, layout, True
            self.cur_concat = s.concats[f.name]
            self.g.stmts(f.body, EntryEnv("encode"), 1)
            self.view_state_save()
            self.g.emit("return total;")
            self.g.emit("}", 0)
        self.g.emit("size_t hp_encode(const Params& P, const float* in, size_t n, uint8_t* out, size_t cap, "
                  "uint64_t* scalars, float* const* bufs, const uint64_t* lens, int nbufs) {", 0)
        self.g.emit("return hp_enc_encode(P, in, n, 0, 0, out, cap, scalars, bufs, lens, nbufs);  // an n x 1 view")
        self.g.emit("}", 0)
        if s.finish is not None:
            self.g.emit("void hp_finish(const Params& P, const uint8_t* pin, size_t pbytes, float* out, size_t n, "
                      "size_t rows, size_t cols, bool add, uint64_t* scalars, float* const* bufs, "
                      "const uint64_t* lens, int nbufs) {", 0)
            self.view_state_setup("finish", need_state=True)
            self.g.emit("[[maybe_unused]] const float alpha = 1.0f;")
            self.cur_in_kind, self.cur_layout, self.cur_stateful = len(s.rounds), s.concats[s.rounds[-1].name], True
            self.g.stmts(s.finish.body, EntryEnv("finish"), 1)
            self.view_state_save()
            self.g.emit("}", 0)

    def view_helpers(self):
        """hp_view (rows x cols view and rank), hp_state_len, hp_kind_bytes, hp_max_bytes (any shape: the
        largest payload over all rows x cols = n), hp_combine (sum of two round payloads)."""
        s = self.g.s
        v = s.view
        self.g.emit("void hp_view(Ctx& c, [[maybe_unused]] const Params& P, size_t n, size_t rows, size_t cols) {", 0)
        self.g.emit("if (rows == 0 && cols == 0) { rows = n; cols = n ? 1 : 0; }  // no shape: an n x 1 matrix")
        self.g.emit("if (static_cast<unsigned __int128>(rows) * cols != n) throw std::invalid_argument(kName + "
                  "std::string(\": matrix shape \") + std::to_string(rows) + \" x \" + std::to_string(cols) + "
                  "\" does not hold \" + std::to_string(n) + \" elements\");")
        self.g.emit(f"const int64_t rank = {self.rank_code(v.rank_expr)};")
        self.g.emit(f"if (rank < 0 || static_cast<uint64_t>(rank) > std::min(rows, cols)) throw std::invalid_argument("
                  f"kName + std::string(\": the rank {v.rank} = \") + std::to_string(rank) + \" is outside [0, "
                  f"min({v.rows}, {v.cols})]\");")
        self.g.emit("c.v_rows = rows; c.v_cols = cols; c.v_rank = static_cast<size_t>(rank);")
        self.g.emit("}", 0)
        self.g.emit("[[maybe_unused]] size_t hp_state_len(const Ctx& c, int slot) {", 0)
        self.g.emit("switch (slot) {")
        for g in s.state_arrays:
            r0, r1 = self.shape(g.ty)
            self.g.emit(f"case {g.slot}: return {r0} * {r1};", 2)
        self.g.emit("default: return 0;", 2)
        self.g.emit("}")
        self.g.emit("}", 0)
        self.g.emit("size_t hp_kind_bytes(const Ctx& c, int kind) {", 0)
        kinds = [s.concat] + [s.concats[f.name] for f in s.rounds]
        for k, call in enumerate(kinds):
            self.g.emit(f"if (kind == {k}) return {self.layout_bytes(call)};")
        self.g.emit("throw FormatError(kName + std::string(\" payload: unknown kind \") + std::to_string(kind));")
        self.g.emit("}", 0)
        self.g.emit("size_t hp_max_bytes(const Params& P, size_t n) {", 0)
        self.g.emit("Ctx c; c.p = &P;")
        self.g.emit("if (n == 0) { hp_view(c, P, 0, 0, 0); return hp_kind_bytes(c, 0); }")
        self.g.emit("size_t best = 0;")
        self.g.emit("for (size_t d = 1; d <= n / d; ++d) { if (n % d) continue; "
                  "hp_view(c, P, n, d, n / d); best = std::max(best, hp_kind_bytes(c, 0)); "
                  "hp_view(c, P, n, n / d, d); best = std::max(best, hp_kind_bytes(c, 0)); }")
        self.g.emit("return best;")
        self.g.emit("}", 0)
        # combine: header of a, float bodies summed in order
        self.g.emit("size_t hp_combine(const uint8_t* a, size_t ab, const uint8_t* b, size_t bb, uint8_t* out, "
                  "size_t cap) {", 0)
        self.g.emit("const Header ha = read_header(a, ab, kAlgoId, SIZE_MAX), hb = read_header(b, bb, kAlgoId, "
                  "SIZE_MAX);")
        self.g.emit("auto body = [](const Header& h) { Ctx c; const uint64_t prow = h.words[0], pcol = h.words[1]; "
                  "if (prow * pcol != h.numel || h.count > std::min(prow, pcol)) throw FormatError(kName + "
                  "std::string(\" payload: inconsistent shape\")); c.v_rows = prow; c.v_cols = pcol; "
                  "c.v_rank = h.count; return static_cast<uint64_t>(hp_kind_bytes(c, h.kind) - kHeaderBytes); };")
        self.g.emit("expect_body(ha, body(ha), kName.c_str()); expect_body(hb, body(hb), kName.c_str());")
        self.g.emit("if (ha.kind != hb.kind || ha.numel != hb.numel || ha.count != hb.count || ha.words[0] != "
                  "hb.words[0] || ha.words[1] != hb.words[1] || ha.bits || hb.bits) throw FormatError(kName + "
                  "std::string(\" combine: payloads of different rounds or shapes\"));")
        self.g.emit("if (ha.kind == 0) throw FormatError(kName + std::string(\" combine: single-process payloads "
                  "(kind 0) are not summable, only round payloads\"));")
        self.g.emit("const size_t nf = ha.body_bytes / 4;")
        self.g.emit("if (cap < kHeaderBytes + ha.body_bytes) throw std::invalid_argument(kName + std::string(\" "
                  "combine: output buffer too small\"));")
        self.g.emit("std::vector<float> x(nf), y(nf);")
        self.g.emit("if (nf) { std::memcpy(x.data(), a + kHeaderBytes, 4 * nf); std::memcpy(y.data(), b + kHeaderBytes, "
                  "4 * nf); }")
        self.g.emit("for (size_t i = 0; i < nf; ++i) x[i] += y[i];")
        self.g.emit("std::memcpy(out, a, kHeaderBytes);")
        self.g.emit("if (nf) std::memcpy(out + kHeaderBytes, x.data(), 4 * nf);")
        self.g.emit("return kHeaderBytes + ha.body_bytes;")
        self.g.emit("}", 0)

    def view_abi(self) -> str:
        s = self.g.s
        k = len(s.state_arrays)
        rounds = "".join(f"    if (round == {i}) {{ *nbytes = hp_enc_{f.name}(P, {'in' if i == 0 else 'prev'}, "
                         f"{'' if i == 0 else 'prev_bytes, '}n, rows, cols, out, cap, scalars, bufs, lens, nbufs); "
                         f"return 0; }}\n" for i, f in enumerate(s.rounds))
        catch = CATCH.format(ns="")
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
