"""The CompLL CUDA back end (hipress/dsl/codegen_cuda.py) without a GPU.

What is verified here:
  * the generated .cu of every shipped spec, the paper's Fig. 5 and a test-only spec exercising the
    remaining operators compiles with nvcc with no diagnostic at all (-Werror all-warnings, host
    -Wall -Wextra -Werror), to an object for sm_80 (compiling needs no GPU);
  * one generated library links, loads, and answers the host-side ABI (parameter checks, payload
    bounds) like the CPU library; a call that needs the GPU fails cleanly without one;
  * on the host (g++, __host__/__device__ defined away): the generated __host__ __device__ user-defined
    functions return bit-identical values to the CPU back end's for random inputs, and the device
    RNG and header serialisation equal csrc/compress/rng.h and format.h.
Nothing here runs a kernel: the kernels have not been run on a GPU by these tests.

nvcc: $HIPRESS_NVCC, PATH, $CUDA_HOME, or the pip wheels named by hipress.dsl.build.NVCC_WHEELS. Without
nvcc these tests fail (with the install command) unless HIPRESS_SKIP_CUDA_COMPILE=1.
"""
import ctypes
import os
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import dsl_common  # noqa: F401  (compile cache)
from hipress import compll, config
from hipress.dsl import build as B
from hipress.dsl import codegen  # noqa: F401
from hipress.dsl.checker import UINTS, is_arr
from hipress.dsl.codegen import cpp_generator, ctype
from hipress.dsl.codegen_cuda import cuda_generator, generate_cuda
from hipress.dsl.errors import DSLError
from hipress.dsl.runtime import param_values
from test_dsl_algorithms import FIG5, FIG5_DECODE

ARCH = config.get("HIPRESS_TEST_CUDA_ARCH")  # one arch keeps nvcc time down

# A test-only spec: the operators and expression forms the shipped specs do not use (user-defined
# fold reducer, reduce(map), filter with an index argument and a cap, sort by greater/smaller,
# random<int32>, int32 maps, scatter into and map2 on locals, math built-ins, uint<width>, decode
# through a generic map with the element index).
USER_SPEC = r"""
algorithm cudamix(category = quantization);

param MixParams {
    uint8 width = 4;
    float scale = 0.5;
    int32 keep = 3;
}

float lo, step, extra;

uint<width> quant(float x) {
    float r = (x - lo) * step;
    if (r < 0) return 0;
    return round(r + random<float>(0, 1) - 0.5);
}
float dequant(uint8 q, int32 i) { return lo + q / step + (i % 7 == 3 ? 0.001 : 0.0); }
float sq(float x) { return x * x; }
float bigger(float a, float b) { return a > b ? a : b; }
int32 positive(float x, int32 i) { return x > 0 && i % 3 != 1; }
int32 jitter(float x) { return random<int32>(0, 7) + (x < 0 ? -1 : 1); }
float mag(float x) { return sqrt(abs(x)) + exp(-abs(x)) + log(1 + abs(x)) + pow(abs(x), 0.5) + ceil(x) - floor(x); }
int32 imix(int32 a) {
    int32 b = min(a, 5) + max(a, -5) + abs(a) + (a << 2) + (a >> 1) + a % 3 + a / 2;
    return b + (a ^ 3) + (a | 1) + (a & 6) + ~a + (isnan(float(a)) ? 1 : 0) + signbit(float(-a));
}

void encode(float* gradient, uint8* compressed, MixParams params) {
    float lo0 = reduce(gradient, smaller);
    float hi = reduce(gradient, greater);
    lo = lo0;
    step = hi > lo ? ((1 << params.width) - 1) / (hi - lo) : 0.0;
    float total = reduce(map(gradient, sq), sum);
    float avg = reduce(filter(gradient, positive), mean);
    int32 npos = reduce(filter(gradient, positive), count);
    float top = reduce(gradient, bigger);
    float* big = sort(gradient, greater, params.keep);
    float* small = sort(gradient, smaller, params.keep);
    float* kept = filter(gradient, positive, params.keep);
    int32* j = map(gradient, jitter);
    int32 js = reduce(map(j, imix), sum);
    float* m = map(gradient, mag);
    m = scatter(m, big.index, 0);
    float* w = map(m, gradient, bigger);
    float ms = reduce(w, maxabs);
    extra = ms + top + total + avg + npos + js + params.scale + small.size + kept.size;
    uint<params.width>* Q = map(gradient, quant);
    compressed = concat(lo, step, extra, Q);
}

void decode(uint8* compressed, float* gradient) {
    extract(compressed, lo, step, extra, Q);
    gradient = map(Q, dequant);
}
"""

SHIPPED = ["tbq", "terngrad", "dgc", "graddrop",
           "signsgd", "signum", "efsignsgd", "qsgd", "natural", "terngrad_grace", "u8bit"]  # GRACE (docs/grace.md)
SOURCES = {s: None for s in SHIPPED}
SOURCES.update({"fig5.cll": FIG5, "fig5d.cll": FIG5 + FIG5_DECODE, "cudamix.cll": USER_SPEC})
NAMES = {"fig5.cll": "cuda_fig5", "fig5d.cll": "cuda_fig5d", "cudamix.cll": "cudamix"}
PARAMS = {"fig5.cll": {"bitwidth": 2}, "fig5d.cll": {"bitwidth": 2}, "terngrad": {"bitwidth": 4}}


def spec_of(key):
    return compll.check(key, source=SOURCES[key], name=NAMES.get(key))


@pytest.fixture(scope="module")
def nvcc():
    p = B.find_nvcc()
    if p is None:
        if config.get("HIPRESS_SKIP_CUDA_COMPILE"):
            pytest.skip("nvcc not found and HIPRESS_SKIP_CUDA_COMPILE=1")
        pytest.fail("nvcc not found: the CUDA back end tests compile the generated code. " + B.NVCC_INSTALL_HINT +
                    " (or set HIPRESS_SKIP_CUDA_COMPILE=1 to skip them)")
    return p


@pytest.fixture(scope="module")
def compiled(nvcc):
    """Every spec compiled once (objects; terngrad also as a shared library), two nvcc at a time."""
    jobs = [(k, False) for k in SOURCES] + [("terngrad", True)]

    def one(job):
        key, shared = job
        s = spec_of(key)
        try:
            return job, B.compile_cuda(generate_cuda(s), s.name, arch=ARCH, shared=shared)
        except Exception as e:  # noqa: BLE001 - reported by the test of that spec
            return job, e
    with ThreadPoolExecutor(max_workers=2) as ex:
        return dict(ex.map(one, jobs))


@pytest.mark.parametrize("key", list(SOURCES))
def test_generated_cuda_compiles_without_warnings(compiled, key):
    res = compiled[(key, False)]
    if isinstance(res, Exception):
        raise res
    assert os.path.getsize(res) > 0
    code = generate_cuda(spec_of(key))
    # The UDFs are device code, the entry points take a stream.
    assert code.count("__host__ __device__ inline") == 2 * len(spec_of(key).udfs)  # prototype + definition
    assert "void* stream" in code and "__global__" not in code  # kernels come from ops_cuda.cuh


def test_per_row_reduce_is_refused_by_the_cuda_back_end():
    """onebit's per-row scales (reduce(array, f, row)) have no device lowering yet: a DSL error naming
    it, not wrong code; onebit runs on the CPU back end."""
    with pytest.raises(DSLError, match="per-row reduce"):
        generate_cuda(compll.check("onebit"))


def test_cuda_build_is_cached(compiled):
    s = spec_of("tbq")
    path = compiled[("tbq", False)]
    mtime = os.path.getmtime(path)
    assert B.compile_cuda(generate_cuda(s), s.name, arch=ARCH, shared=False) == path
    assert os.path.getmtime(path) == mtime


def test_cuda_library_host_abi_matches_cpu(compiled):
    path = compiled[("terngrad", True)]
    if isinstance(path, Exception):
        raise path
    lib = ctypes.CDLL(path)
    s = spec_of("terngrad")
    assert lib.hpc_target() == 1 and lib.hpc_abi_version() == codegen.ABI_VERSION
    err = ctypes.create_string_buffer(512)
    for bw in (2, 4, 8):
        p = (ctypes.c_double * 2)(*param_values(s, {"bitwidth": bw}))
        assert lib.hpc_check_params(p, err, 512) == 0
        ref = compll.load("terngrad", name="dsl_terngrad", register=False)(bitwidth=bw)
        for n in (0, 1, 7, 4097, 1 << 20):
            res = ctypes.c_uint64()
            assert lib.hpc_max_encoded_bytes(p, ctypes.c_uint64(n), ctypes.byref(res), err, 512) == 0
            assert res.value == ref.max_encoded_bytes(n)
    bad = (ctypes.c_double * 2)(3, 0)  # a width of 3 is rejected (in {2, 4, 8}) as by the CPU library
    assert lib.hpc_check_params(bad, err, 512) == 2 and b"bitwidth must be 2, 4 or 8" in err.value
    if not torch.cuda.is_available():
        # No GPU (or driver): the first CUDA call fails and the error comes back as a message.
        lib.hpc_encode.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint64] + \
            [ctypes.c_void_p] * 3 + [ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p]
        p = (ctypes.c_double * 2)(*param_values(s, {}))
        nb = ctypes.c_uint64()
        rc = lib.hpc_encode(p, 256, 100, 256, 1000, None, None, None, 0, ctypes.byref(nb), err, 512, None)
        assert rc == 3 and b"CUDA error" in err.value, (rc, err.value)


def test_cli_target_cuda_prints_cuda():
    r = subprocess.run([sys.executable, "-m", "hipress.compll", "--target", "cuda", "tbq"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "__host__ __device__" in r.stdout and "hpc_encode" in r.stdout and "cudaStream_t" in r.stdout


def test_cpu_only_compressor_refuses_cuda_tensor():
    f = compll.load("onebit", name="dsl_onebit_cpu_only", register=False)
    c = f()
    if c._cuda is not None:
        pytest.skip("a CUDA library was built (GPU present)")

    class FakeCuda(torch.Tensor):  # a CPU tensor that claims to be on a GPU
        @property
        def is_cuda(self):
            return True
    g = torch.zeros(8).as_subclass(FakeCuda)
    with pytest.raises(ValueError, match="no CUDA library was built"):
        c.encode(g)


def test_unsupported_sort_order_is_a_dsl_error():
    src = USER_SPEC.replace("sort(gradient, smaller, params.keep)", "sort(gradient, bigger, params.keep)")
    s = compll.check("cmp.cll", source=src, name="cudamix_cmp")
    with pytest.raises(compll.DSLError, match="CUDA back end supports sort"):
        generate_cuda(s)


# ---- host checks of the __host__ __device__ code ----------------------------------------------
SHIM = "-D__host__=", "-D__device__="

RNG_CHECK = r"""
#include "compress/cuda/hp_device.h"
#include "compress/format.h"
#include "compress/rng.h"
namespace hc = hipress::compress;
// Counts mismatches between the device RNG / header and rng.h / format.h; *sum gets a digest of the
// values so the caller can tell that something was computed.
extern "C" uint64_t rng_check(uint64_t seeds, uint64_t per, uint64_t* sum) {
  uint64_t bad = 0, s = 0;
  const uint64_t bases[] = {0, 1, 0xfffffff0ULL, 0x100000000ULL - 3, 0x123456789abULL, ~0ULL - 100};
  for (uint64_t seed = 0; seed < seeds; ++seed) {
    hc::RngKey a = hc::rng_key(seed * 0x9e3779b97f4a7c15ULL + seed);
    hpd::RngKey b = hpd::rng_key(seed * 0x9e3779b97f4a7c15ULL + seed);
    bad += a.k0 != b.k0 || a.k1 != b.k1;
    for (uint64_t base : bases)
      for (uint64_t j = 0; j < per; ++j) {
        uint64_t ctr = base + j;
        uint32_t x = hc::rng_u32(a, ctr), y = hpd::rng_u32(b, ctr);
        bad += x != y;
        bad += hc::u32_to_unit(x) != hpd::u32_to_unit(y);
        uint32_t n = static_cast<uint32_t>(j * 2654435761u + 1);
        bad += hc::u32_to_index(x, n) != hpd::u32_to_index(y, n);
        s += y;
      }
  }
  *sum = s;
  return bad;
}
extern "C" uint64_t header_check(uint64_t trials, uint64_t seed) {
  uint64_t bad = 0;
  for (uint64_t t = 0; t < trials; ++t) {
    hc::RngKey k = hc::rng_key(seed + t);
    auto r = [&](uint64_t i) { return hc::rng_u32(k, i); };
    hc::Header h;
    hpd::HeaderFields f;
    h.algo = f.algo = static_cast<uint8_t>(r(0));
    h.bits = f.bits = static_cast<uint8_t>(r(1));
    h.kind = f.kind = static_cast<uint8_t>(r(2));
    h.count = f.count = r(3);
    h.numel = f.numel = (static_cast<uint64_t>(r(4)) << 32) | r(5);
    h.body_bytes = f.body_bytes = (static_cast<uint64_t>(r(6)) << 32) | r(7);
    for (int w = 0; w < 4; ++w) h.words[w] = f.words[w] = r(8 + w);
    uint8_t a[48], b[48];
    hc::write_header(h, a);
    hpd::header_serialize(f, b);
    bad += std::memcmp(a, b, 48) != 0;
  }
  return bad;
}
"""


def _dispatcher(spec, fname, ns, keyfn):
    """extern "C" fname(k, params, seed, globals, rc, args, res): calls UDF k with the given context."""
    glob = [(n, g.ty) for n, g in spec.globals.items() if not is_arr(g.ty)]
    lines = [f'extern "C" int {fname}(int k, const double* params, uint64_t seed, const double* gl, uint64_t rc, '
             'const double* args, double* res) {',
             f"  {ns}Params P = {ns}make_params(params); {ns}Ctx c; c.p = &P; c.key = {keyfn}(seed);",
             "  (void)gl; (void)rc; (void)args; (void)res;"]
    for j, (n, t) in enumerate(glob):
        lines.append(f"  c.g_{n} = static_cast<{ctype(t)}>(gl[{j}]);")
    for k, u in enumerate(spec.udfs.values()):
        a = "".join(f", static_cast<{ctype(t)}>(args[{i}])" for i, (_, t) in enumerate(u.args))
        lines.append(f"  if (k == {k}) {{ *res = static_cast<double>({ns}u_{u.func.name}(c, rc{a})); return 0; }}")
    lines += ["  return 1;", "}"]
    return "\n".join(lines) + "\n"


def _cpu_udf_unit(spec, fname):
    return cpp_generator(spec).udf_unit() + _dispatcher(spec, fname, "", "rng_key")


def _cuda_udf_unit(spec, tag):
    code = cuda_generator(spec).udf_unit().replace("namespace hpgen", f"namespace hpgen_{tag}")
    return code + _dispatcher(spec, f"cuda_eval_{tag}", f"hpgen_{tag}::", "hpd::rng_key")


@pytest.fixture(scope="module")
def host_lib(tmp_path_factory):
    """One shared library: RNG/header checks, and per spec the CPU and the CUDA-host UDFs (separate TUs)."""
    d = tmp_path_factory.mktemp("cuda_host")
    files = []
    (d / "rng.cc").write_text(RNG_CHECK)
    files.append(str(d / "rng.cc"))
    for i, key in enumerate(SOURCES):
        s = spec_of(key)
        cpu = d / f"cpu{i}.cc"
        cpu.write_text(_cpu_udf_unit(s, f"cpu_eval_{i}"))
        cu = d / f"cuda{i}.cc"
        cu.write_text(_cuda_udf_unit(s, str(i)))
        files += [str(cpu), str(cu)]
    so = d / "host.so"
    flags = ["-std=c++17", "-O1", "-ffp-contract=off", "-fPIC", "-Wall", "-Wextra", "-Werror", *SHIM,
             f"-I{B.csrc_dir()}"]

    def run(cmd):
        p = subprocess.run(cmd, capture_output=True, text=True)
        assert p.returncode == 0 and not p.stderr.strip(), p.stderr[-4000:]

    with ThreadPoolExecutor(max_workers=2) as ex:  # one compiler per unit, two at a time
        list(ex.map(run, [[B.cxx(), *flags, "-c", f, "-o", f + ".o"] for f in files]))
    run([B.cxx(), "-shared", *[f + ".o" for f in files], "-o", str(so)])
    return ctypes.CDLL(str(so))


def test_device_rng_and_header_equal_cpu(host_lib):
    host_lib.rng_check.restype = ctypes.c_uint64
    host_lib.header_check.restype = ctypes.c_uint64
    digest = ctypes.c_uint64()
    assert host_lib.rng_check(ctypes.c_uint64(64), ctypes.c_uint64(300), ctypes.byref(digest)) == 0
    assert digest.value != 0
    assert host_lib.header_check(ctypes.c_uint64(2000), ctypes.c_uint64(11)) == 0


def _bits(x):
    return "nan" if x != x else struct.pack("<d", x)


@pytest.mark.parametrize("key", list(SOURCES))
def test_host_device_udfs_equal_cpu_backend(host_lib, key):
    i = list(SOURCES).index(key)
    s = spec_of(key)
    if not s.udfs:
        pytest.skip("no user-defined functions")
    cpu_eval, cuda_eval = getattr(host_lib, f"cpu_eval_{i}"), getattr(host_lib, f"cuda_eval_{i}")
    for f in (cpu_eval, cuda_eval):
        f.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint64,
                      ctypes.c_void_p, ctypes.POINTER(ctypes.c_double)]
        f.restype = ctypes.c_int
    rng = np.random.default_rng(1234 + i)
    params = (ctypes.c_double * max(1, len(s.params)))(*param_values(s, PARAMS.get(key, {})))
    glob = [g.ty for g in s.globals.values() if not is_arr(g.ty)]
    specials = [0.0, -0.0, 1.0, -1.0, 0.5, 1e-30, -3e38, 3e38, float("inf"), float("-inf"), float("nan"), 2.5, -2.5]

    def value(t):
        if t in ("float", "double"):
            if rng.random() < 0.2:
                return float(rng.choice(specials))
            return float(rng.standard_normal() * 10.0 ** int(rng.integers(-3, 3)))
        if t in UINTS:
            return float(rng.integers(0, 1 << UINTS[t]))
        return float(rng.integers(-300, 300))
    for k, u in enumerate(s.udfs.values()):
        results = set()
        for _ in range(400):
            g = (ctypes.c_double * max(1, len(glob)))(*[value(t if t in ("float", "double", "int32") else "int32")
                                                        for t in glob])
            args = (ctypes.c_double * max(1, len(u.args)))(*[value(t) for _, t in u.args])
            seed, rc = int(rng.integers(0, 1 << 40)), int(rng.integers(0, 1 << 62))
            a, b = ctypes.c_double(), ctypes.c_double()
            assert cpu_eval(k, params, seed, g, rc, args, ctypes.byref(a)) == 0
            assert cuda_eval(k, params, seed, g, rc, args, ctypes.byref(b)) == 0
            assert _bits(a.value) == _bits(b.value), (u.func.name, list(args), list(g), a.value, b.value)
            results.add(_bits(a.value))
        assert len(results) > 1, f"{u.func.name}: constant over random inputs (harness not exercising it?)"


def test_matrix_view_specs_are_rejected_with_a_located_error():
    """PowerSGD-like specs (view, matmul, decomp) have no CUDA back end yet: a DSL error at the view."""
    from hipress.dsl import SPEC_DIR, DSLError
    from hipress.dsl.checker import check_source as check
    with open(os.path.join(SPEC_DIR, "powersgd.cll")) as f:
        spec = check(f.read(), "powersgd.cll")
    with pytest.raises(DSLError, match=r"powersgd.cll:\d+:\d+: error: the CUDA back end does not support matrix"):
        generate_cuda(spec)
