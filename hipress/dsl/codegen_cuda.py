"""CUDA back end of the CompLL DSL: one .cu translation unit per spec.

The generated module has the CPU module's C ABI (hpc_*, see ``ABI`` below and
docs/dsl.md) with device pointers and a ``cudaStream_t``. Its encode/decode are
host code that enqueue the device-side common operators of
csrc/compress/cuda/ops_cuda.cuh on the caller's stream; every per-element
operator call becomes a functor struct (the call's scalar context ``Ctx`` and
its array views, by value) whose ``operator()`` evaluates the user-defined
functions, which are generated as ``__host__ __device__`` inline functions.
``CudaTarget`` is the emitter given to ``codegen.Generator``, which walks the
spec as for the CPU (expressions, statements, payload layout, entry points and
ABI are the generator's); this file holds only what differs on the device.

Scalars (globals, parameters, reduction results, counts) live on the host, as in
the CPU back end: a reduction or a filter count is copied back (stream
synchronisation) when the host needs it. The operator substitutions of the
CPU back end are not needed here: the generic device loops compute the same
values (one thread per packed output byte for uintK maps).

Not supported yet (a DSLError at generation): ``sort`` with a user-defined
comparison function (greaterAbs, greater and smaller are).

ABI (all pointers device pointers unless marked host):

    int hpc_abi_version(void); int hpc_target(void) /* 1: CUDA */; int hpc_num_params(void);
    int hpc_num_state_buffers(void); void hpc_set_num_threads(int) /* no-op */;
    int hpc_check_params(const double* p /*host*/, char* err, int errlen);
    int hpc_max_encoded_bytes(const double* p /*host*/, uint64_t n, uint64_t* res /*host*/, char* err, int errlen);
    int hpc_encode(const double* p /*host*/, const float* in, uint64_t n, uint8_t* out, uint64_t cap,
                   uint64_t* scalars /*host, or NULL: stateless*/, float* const* bufs /*host array of device
                   pointers*/, const uint64_t* lens /*host*/, int nbufs, uint64_t* nbytes /*host*/,
                   char* err, int errlen, void* stream /*cudaStream_t*/);
    int hpc_decode(const uint8_t* in, uint64_t bytes, float* out, uint64_t n, float alpha, int add,
                   char* err, int errlen, void* stream);

Return codes as the CPU ABI (0 ok, 1 payload error, 2 invalid argument, 3 other,
including CUDA errors). The calls return once the work is enqueued; they
synchronise the stream internally where the host needs a device value.
"""
from __future__ import annotations

import os
from typing import List

from hipress.dsl import ast as A
from hipress.dsl.types import Spec
from hipress.dsl.codegen import Generator, read_text
from hipress.dsl.errors import DSLError

PRELUDE = read_text("prelude_cuda.cu.txt")
TARGET_CUDA = 1
ORDERS = {"greaterAbs": "hpd::kGreaterAbs", "greater": "hpd::kGreater", "smaller": "hpd::kSmaller"}
CHECK_BITS = ("inline int check_bits(int64_t b, const char* what) { if (b != 1 && b != 2 && b != 4 && b != 8) throw "
              "std::invalid_argument(std::string(what) + \" must be 1, 2, 4 or 8\"); return static_cast<int>(b); }")


def view_type(t) -> str:
    if t.sparse or t.elem == "float":
        return "hpd::FView"
    if t.elem == "int32":
        return "hpd::IView"
    return "hpd::PView"


class CudaTarget:
    MATH = "hp::m::"
    UDF_QUAL = "__host__ __device__ "
    OPS = "hpd::"
    # payload vocabulary (csrc/compress/cuda/ops_cuda.cuh over format.h)
    HEADER = "hpd::HeaderFields"
    HEADER_READ_T = "hipress::compress::Header"
    READ_HEADER = "hpd::header_read"
    WRITE_HEADER = "hpd::header_write"
    EXPECT_BODY = "hipress::compress::expect_body"
    FORMAT_ERROR = "hipress::compress::FormatError"
    PACKED_BYTES = "hpd::packed_bytes"
    RNG_KEY = "hpd::rng_key"
    COPY = COPY_FRESH = "hpd::copy_d2d({dst}, {src}, {n})"
    OWNED = "{a}.own.get()"
    FLOAT_WORD = "h.words[{w}] = hpd::fbits({v});"
    BIND_STATE = "c.g_{name} = hpd::FView{{{ptr}, {n}}};"
    ELEM_OF = "a0"  # per-element code runs in a functor whose member a0 views the array
    # context and entry points
    STATE_ARRAY, STATE_INIT, STATE_NOTE = "hpd::FView", "{nullptr, 0}", " (device)"
    VOID_SCALARS = False
    DECODE_CTX = "[[maybe_unused]] Ctx c;"
    # C ABI: device pointers, a trailing cudaStream_t
    NS, NS_NAME, NS_NOTE, NS_END_NOTE, FAIL_QUAL = "hpgen::", " hpgen", " hpgen", "  // namespace hpgen", "inline "
    ABI_NOTE = "; pointers are device pointers except p, scalars, bufs, lens, res, nbytes"
    ABI_EXTRA = ", void* stream"
    ABI_PROLOGUE = "hpd::cur_stream() = static_cast<cudaStream_t>(stream);"
    SET_THREADS = "(void)t;"
    lowrank = None

    def __init__(self, gen):
        self.g = gen
        self.functors: List[str] = []

    # ---- translation unit ----
    def check_supported(self):
        v = self.g.s.view
        if v is not None:
            raise DSLError("the CUDA back end does not support matrix views (view, matmul, decomp) yet; "
                           "this spec builds for the CPU only", self.g.s.file, v.line, v.col)

    def banner(self) -> str:
        s = self.g.s
        return (f"// Generated by hipress-compll --target cuda from {os.path.basename(s.file)} (algorithm "
                f"'{s.name}', id {s.algo_id}).")

    def interface(self) -> str:
        """What the translation unit exposes: the C ABI that hipress/dsl/runtime.py loads with ctypes."""
        return self.g.c_abi()

    def prelude(self) -> str:
        s = self.g.s
        return (f"{PRELUDE}\nconstexpr uint8_t kAlgoId = {s.algo_id};\n[[maybe_unused]] constexpr int kRngCounter = 0;\n"
                f"const std::string kName = \"{s.name}\";")

    def extra_defs(self):
        return self.functors

    def target_fn(self) -> str:
        return f"\nHPC_API int hpc_target() {{ return {TARGET_CUDA}; }}"

    def udf_unit_open(self):
        """For a host compiler with __host__/__device__ defined away (namespace hpgen)."""
        return ['#include "compress/cuda/hp_device.h"', "#include <stdexcept>", "#include <string>",
                "namespace hpgen {", "namespace hp {", "using namespace ::hp;", CHECK_BITS, "}  // namespace hp"]

    def udf_unit_close(self) -> str:
        return "}  // namespace hpgen"

    def ctx_head(self):
        return ["// The scalar context of a call: host-side in encode/decode, copied by value into every kernel.",
                "struct PRef {", "  Params v;",
                "  __host__ __device__ const Params* operator->() const { return &v; }",
                "  PRef& operator=(const Params* q) { v = *q; return *this; }", "};",
                "struct Ctx {", "  PRef p;", "  hpd::RngKey key{};", "  uint64_t counter = 0;",
                "  int64_t has_state = 0;"]

    def ctx_helpers(self):
        return []

    def zero_state_decl(self):
        self.g.emit("hpd::DevBuf<float> st_tmp;  // zero state of a stateless call (its updates are dropped)")

    def zero_state(self, count: str) -> str:
        self.g.emit(f"st_tmp.alloc({count});", 2)
        self.g.emit(f"if (n) hpd::check(cudaMemsetAsync(st_tmp.get(), 0, {count} * sizeof(float), "
                    f"hpd::cur_stream()), \"memset\");", 2)
        return "st_tmp.get()"

    # ---- functors: the per-element code of one operator call ----
    def functor(self, members: List[str], sig: str, body: str) -> str:
        name = self.g.fresh("F")
        mem = "".join(f" {m};" for m in members)
        self.functors.append(f"struct {name} {{ Ctx c;{mem}\n  __device__ {sig} const {{ {body} }}\n}};")
        return name

    def over(self, members, sig, body, acode, *extra) -> str:
        """A functor over the array acode (member a0) and its construction from the host context."""
        f = self.functor(members, sig, body)
        return f"{f}{{c, hp::view({acode}){''.join(', ' + x for x in extra)}}}"

    # ---- scalar-valued operators ----
    def threshold(self, a: str, frac: str) -> str:
        return f"hpd::sampled_threshold({a}.p, {a}.n, {frac}, s, c.key, hp_next(c, s))"

    def reduce(self, e: A.Call, src, pred, mapf, env) -> str:
        g = self.g
        st = src.ty
        acode, vt = g.array_code(src, env), view_type(st)
        val, ety, keep = g.fused_value(g.elem(self.ELEM_OF, st, "i"), st, pred, mapf)
        n = f"{acode}.n"
        r = e.reducer
        sig = "bool operator()(size_t i, float& vf, double& vd)"
        if isinstance(src, A.Name) and src.sym.kind == "input" and pred is None and mapf is None and \
                r in ("smaller", "greater", "maxabs"):
            # What the CPU back end computes here (ops::reduce_minmax): 0 for an empty gradient, else the
            # min / max of the non-NaN elements (+-inf if there are none); maxabs from the two.
            st_ = f"hpd::reduce_stats({self.over([f'{vt} a0'], sig, f'vf = {val}; vd = 0.0; return true;', acode)}, {n})"
            res = {"smaller": "s.mn", "greater": "s.mx",
                   "maxabs": "hp::fmax2(hp::m::fabs(s.mn), hp::m::fabs(s.mx))"}[r]
            res = f"[&]{{ const hpd::Stats s = {st_}; return {n} ? {res} : 0.0f; }}()"
            return res if e.ty == "float" else f"hp::f2i({res})"
        if r in ("sum", "mean", "count", "smaller", "greater", "maxabs"):
            vf = "static_cast<float>(v)" if r != "maxabs" else "hp::m::fabs(static_cast<float>(v))"
            body = (f"if (!{keep}) return false; const auto v = {val}; vf = {vf}; vd = static_cast<double>(v); "
                    f"return true;")
            st_ = f"hpd::reduce_stats({self.over([f'{vt} a0'], sig, body, acode)}, {n})"
            if r == "count":
                return f"hp::w32(static_cast<int64_t>({st_}.cnt))"
            if r == "sum":
                return f"static_cast<float>({st_}.sum)" if e.ty == "float" else \
                    f"hp::w32(static_cast<int64_t>({st_}.sum))"
            if r == "mean":
                return (f"[&]{{ const hpd::Stats s = {st_}; return s.cnt ? static_cast<float>(s.sum / "
                        f"static_cast<double>(s.cnt)) : 0.0f; }}()")
            fld = "mn" if r == "smaller" else "mx"
            res = f"[&]{{ const hpd::Stats s = {st_}; return s.h{fld} ? s.{fld} : 0.0f; }}()"
            return res if e.ty == "float" else f"hp::f2i({res})"
        # user-defined reducer: folded per kGrain chunk on the device, chunks merged in order on the host
        ct, step, merge, x = g.fold_parts(e, val, ety, "p")
        f = self.over([f"{vt} a0"], f"void operator()(size_t b, size_t e, hpd::FoldPart<{ct}>& p)",
                      f"for (size_t i = b; i < e; ++i) {{ if ({keep}) {{ {ct} x = {x}; p.v = p.has ? {step} : x; "
                      f"p.has = 1; }} }}", acode)
        return (f"[&]{{ hpd::FoldPart<{ct}> a{{}}; for (const auto& b : hpd::fold_chunks<{ct}>({f}, {n})) {{ "
                f"if (b.has) {{ a.v = a.has ? {merge} : b.v; a.has = 1; }} }} return a.v; }}()")

    # ---- array-producing operators (inside the generator's { } block) ----
    def map_packed(self, tgt, src, out_t, u, acode, code, at, ind):
        g = self.g
        n = f"{acode}.n"
        f = self.over([f"{view_type(src.ty)} a0", "uint64_t base"], "int64_t operator()(size_t i)",
                      f"return {code};", acode, "base")
        g.emit(f"hp::PArr res; hp::alloc(res, {n}, bits, {at});", ind)
        g.emit(f"hpd::map_packed({f}, {n}, bits, res.p);", ind)
        g.emit(f"{tgt} = res;", ind)

    def map_plain(self, tgt, sym, src, u, acode, code, elem, ind):
        g = self.g
        n = f"{acode}.n"
        members = [f"{view_type(src.ty)} a0", "uint64_t base"]
        if elem == "float":
            f = self.over(members, "float operator()(size_t i)", f"return {g.conv(code, u.ret, 'float')};",
                          acode, "base")
            self.store(tgt, sym, "float", f, n, ind)
        else:
            f = self.over(members, "int32_t operator()(size_t i)",
                          f"return static_cast<int32_t>({g.conv(code, u.ret, 'int32')});", acode, "base")
            self.store(tgt, None, "int32_t", f, n, ind)

    def store(self, tgt, sym, ct, f, n, ind):
        """map_plain of functor f into the state buffer tgt (in place: each thread reads and writes its own
        element) or into a new array."""
        g = self.g
        if sym is not None and sym.state:
            g.emit(f"hpd::map_plain<float>({f}, {n}, const_cast<float*>({tgt}.p));", ind)
            return
        g.emit(f"hp::{'FArr' if ct == 'float' else 'IArr'} res; hp::alloc(res, {n});", ind)
        g.emit(f"hpd::map_plain<{ct}>({f}, {n}, res.own.get());", ind)
        g.emit(f"{tgt} = res;", ind)

    def map2(self, tgt, sym, a, u, ac, bc, ind):
        g = self.g
        code = g.udf_apply(u, ["a0.p[i]", "a1.p[i]"], ["float", "float"], "0")
        f = self.over(["hpd::FView a0", "hpd::FView a1"], "float operator()(size_t i)",
                      f"return {g.conv(code, u.ret, 'float')};", ac, f"hp::view({bc})")
        self.store(tgt, sym, "float", f, f"{ac}.n", ind)

    def scatter_into(self, tgt, sym, icode, v, ind):
        g = self.g
        g.emit(f"const float v = {v};", ind)
        if sym.state:
            g.emit(f"hpd::scatter_set(const_cast<float*>({tgt}.p), {tgt}.n, {icode}.p, {icode}.n, v);", ind)
        else:  # a local array value may be shared: scatter into a copy
            g.emit(f"hp::FArr res; hp::alloc(res, {tgt}.n); hpd::copy_d2d(res.own.get(), {tgt}.p, 4 * {tgt}.n);",
                   ind)
            g.emit(f"hpd::scatter_set(res.own.get(), res.n, {icode}.p, {icode}.n, v);", ind)
            g.emit(f"{tgt} = res;", ind)

    def filter(self, tgt, src, u, acode, cap, ind):
        g = self.g
        pred = g.pred(u, g.elem(self.ELEM_OF, src.ty, "i"))
        f = self.over([f"{view_type(src.ty)} a0"], "bool operator()(size_t i)", f"return ({pred}) != 0;", acode)
        g.clamp_cap(cap, acode, ind)
        g.emit("hp::SArr res; hp::alloc(res, cap);", ind)
        g.emit(f"res.n = hpd::filter({f}, {acode}.n, {acode}.p, cap, res.idx.get(), res.val.get());", ind)
        g.emit(f"res.stored = std::min(res.n, cap); {tgt} = res;", ind)

    def reduce_rows(self, tgt, call, src, mapf, acode, row, ind):
        self.g.err(call, "the CUDA back end does not support per-row reduce (reduce(array, f, row)) yet; this spec "
                         "builds for the CPU only")

    def check_row_values(self, tgt, ind):  # pragma: no cover - reduce_rows refuses the spec first
        raise AssertionError("per-row arrays on CUDA")

    def decode_map_rows(self, src, acode, rcode, u, ind):  # pragma: no cover - as check_row_values
        raise AssertionError("per-row arrays on CUDA")

    def check_sort(self, call):
        if call.order not in ORDERS:
            self.g.err(call, "the CUDA back end supports sort with greaterAbs, greater or smaller only (not a "
                             "comparison function yet)")

    def sort(self, tgt, call, acode, sample, ind):
        g = self.g
        if sample is not None:
            # The CPU operator uses the sample only to go faster (same result); the counter advances the same.
            g.emit(g.sample_count(sample) + " (void)hp_next(c, s);", ind)
        g.emit("hp::SArr res; hp::alloc(res, k);", ind)
        g.emit(f"res.n = res.stored = hpd::topk({acode}.p, {acode}.n, k, {ORDERS[call.order]}, res.idx.get(), "
               f"res.val.get());", ind)
        g.emit(f"{tgt} = res;", ind)

    # ---- decode's output ----
    def decode_scatter(self, ic, vc, ind):
        self.g.emit(f"hpd::scatter_decode({ic}.p, {vc}.p, {ic}.n, n, alpha, add, out, kName);", ind)

    def decode_map(self, src, acode, v, ind):
        f = self.over([f"{view_type(src.ty)} a0"], "float operator()(size_t i)", f"return {v};", acode)
        self.g.emit(f"hpd::decode_map({f}, n, alpha, add, out);", ind)


def cuda_generator(spec: Spec) -> Generator:
    return Generator(spec, CudaTarget)


def generate_cuda(spec: Spec) -> str:
    """The CUDA translation unit of a checked spec (see the module docstring for its ABI)."""
    return cuda_generator(spec).generate()
