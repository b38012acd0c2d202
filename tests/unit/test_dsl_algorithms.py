"""Generated kernels (hipress/dsl/specs/*.cll) against the hand-written ones (csrc/compress/algo_*.cc)."""
import numpy as np
import pytest
import torch

from dsl_common import same_codec, same_state, threads  # noqa: F401  (compile cache, fixture)
from hipress import compll
from hipress import compression as C

SIZES = [0, 1, 2, 7, 8, 9, 31, 33, 63, 65, 1000, 4095, 4097, 65535, 65537, 200003]
CASES = [("onebit", {}), ("tbq", {"threshold": 0.05}), ("terngrad", {"bitwidth": 2}), ("terngrad", {"bitwidth": 4}),
         ("terngrad", {"bitwidth": 8}), ("terngrad", {"bitwidth": 2, "seed": 7})]


def grad(n, seed=0):
    g = np.random.default_rng(seed).standard_normal(n).astype(np.float32) * 0.05
    if n > 3:
        g[1] = -0.0  # sign bit of negative zero
        g[2] = 0.0
    return torch.from_numpy(g)


@pytest.fixture(scope="module")
def dsl():
    return {a: compll.load(a, name="dsl_" + a) for a in {c[0] for c in CASES}}


@pytest.mark.parametrize("algo,params", CASES, ids=[f"{a}-{'-'.join(map(str, p.values()))}" for a, p in CASES])
def test_generated_equals_handwritten(dsl, algo, params, threads):
    gen = C.get("dsl_" + algo, error_feedback=False, **params)
    hand = C.get(algo, error_feedback=False, **params)
    for n in SIZES:  # two steps: the RNG counter advances identically
        same_codec(gen, hand, [grad(n, seed=n), grad(n, seed=n + 1)], n, what=f"{algo} n={n}")


@pytest.mark.parametrize("algo", ["onebit", "tbq"])
def test_error_feedback_default_like_builtin(dsl, algo):
    gen, hand = C.get("dsl_" + algo), C.get(algo)
    assert type(gen).__name__ == type(hand).__name__ == "ErrorFeedback"
    g = grad(5000)
    sg, sh = gen.new_state(5000), hand.new_state(5000)
    for _ in range(3):
        assert torch.equal(gen.encode(g, sg), hand.encode(g, sh))
    assert torch.equal(sg.buffers["residual"], sh.buffers["residual"])


def test_corrupt_and_truncated_payloads_raise_valueerror(dsl):
    c = C.get("dsl_terngrad", bitwidth=2)
    g = grad(1000)
    p = c.encode(g).clone()
    out = torch.zeros(1000)
    for bad in (p[:10], p[:48], p[:-1]):
        with pytest.raises(ValueError):
            c.decode(bad, out)
    q = p.clone()
    q[20] ^= 0xFF  # header byte: checksum mismatch
    with pytest.raises(ValueError, match="corrupt"):
        c.decode(q, out)
    with pytest.raises(ValueError):
        c.decode(p, torch.zeros(999))  # element count
    with pytest.raises(ValueError, match="made by"):
        c.decode(C.get("tbq", error_feedback=False).encode(g), out)  # another algorithm
    acc = torch.ones(1000)
    with pytest.raises(ValueError):
        c.decode_add(p[:-1], acc)
    assert torch.equal(acc, torch.ones(1000))  # a rejected payload leaves the output untouched


def test_params_validated(dsl):
    with pytest.raises(ValueError, match="unknown parameter"):
        C.get("dsl_terngrad", bits=3)
    with pytest.raises(ValueError, match="1, 2, 4 or 8"):
        C.get("dsl_terngrad", bitwidth=3)
    with pytest.raises(ValueError, match="integer"):
        C.get("dsl_terngrad", bitwidth=2.5)
    with pytest.raises(ValueError, match="does not fit"):
        C.get("dsl_terngrad", bitwidth=300)


FIG5 = r"""
param EncodeParams{
     uint8 bitwidth; // assume bitwidth = 2 for clarity
}
float min, max, gap;
uint2 floatToUint(float elem) {
     float r = (elem - min) / gap;
    return floor(r + random<float>(0, 1));
}
void encode(float* gradient, uint8* compressed, \
        EncodeParams params) {
    min = reduce(gradient, smaller);
    max = reduce(gradient, greater);
    gap = (max - min) / ((1 << params.bitwidth) - 1);
    uint8 tail = gradient.size % (1 << params.
         bitwidth);
    uint2* Q = map(gradient, floatToUint);
    compressed = concat(params.bitwidth, tail, \
         min, max, Q);
}
"""
FIG5_DECODE = """
float uintToFloat(uint2 q) { return min + q * gap; }
void decode(uint8* compressed, float* gradient) {
    uint8 bw, tl;
    extract(compressed, bw, tl, min, max, Q);
    gap = (max - min) / ((1 << bw) - 1);
    gradient = map(Q, uintToFloat);
}
"""


def test_paper_figure5_compiles_as_printed():
    f = compll.load("fig5.cll", source=FIG5, name="fig5_terngrad")
    c = C.get("fig5_terngrad", bitwidth=2)
    g = grad(4097)
    p = c.encode(g)
    info = C.payload_info(p)
    assert info["bits"] == 2 and info["numel"] == 4097 and info["body_bytes"] == (4097 * 2 + 7) // 8
    with pytest.raises(ValueError, match="no decode"):
        c.decode(p, torch.zeros(4097))
    assert f.spec.algo_id >= 64


def test_paper_figure5_with_decode_is_unbiased_and_close_to_handwritten():
    compll.load("fig5d.cll", source=FIG5 + FIG5_DECODE, name="fig5d")
    c = C.get("fig5d", bitwidth=2)
    hand = C.get("terngrad", bitwidth=2)
    g = grad(200003)
    out, ref = torch.empty(200003), torch.empty(200003)
    c.decode(c.encode(g), out)
    hand.decode(hand.encode(g), ref)
    gap = float(g.max() - g.min()) / 3
    assert float((out - g).abs().max()) <= gap * 1.0001
    # Same random stream, division instead of a reciprocal: codes differ only where rounding flips.
    assert float((out != ref).float().mean()) < 1e-3
    assert abs(float(out.mean() - g.mean())) < 0.01 * gap


# ---- stateful sparsifiers: GradDrop (residual via error feedback), DGC (momentum, accumulation, step) ----
SPARSE = [("graddrop", {}), ("graddrop", {"ratio": 0.001, "seed": 3}), ("graddrop", {"ratio": 0.3, "sample_ratio": 0.5}),
          ("dgc", {}), ("dgc", {"ratio": 0.01, "warmup_steps": 3, "seed": 5}),
          ("dgc", {"ratio": 0.3, "momentum": 0.5, "sample_ratio": 0.5, "warmup_steps": 1})]


@pytest.fixture(scope="module")
def dsl_sparse():
    return {a: compll.load(a, name="dsl_" + a) for a in ("graddrop", "dgc")}


@pytest.mark.parametrize("algo,params", SPARSE, ids=[f"{a}-{'-'.join(map(str, p.values()))}" for a, p in SPARSE])
def test_generated_sparse_equals_handwritten(dsl_sparse, algo, params, threads):
    gen = C.get("dsl_" + algo, error_feedback=False, **params)
    hand = C.get(algo, error_feedback=False, **params)
    for n in SIZES:  # state (momentum, accumulation, step, RNG counter) carried over three steps
        same_codec(gen, hand, [grad(n, seed=n + step) for step in range(3)], n, what=f"{algo} n={n}")


@pytest.mark.parametrize("algo", ["graddrop", "dgc"])
def test_generated_sparse_state_dict_round_trip(dsl_sparse, algo):
    params = {"warmup_steps": 4} if algo == "dgc" else {}
    gen, hand = C.get("dsl_" + algo, **params), C.get(algo, **params)
    # ErrorFeedback for graddrop (registry default), none for dgc (it accumulates itself)
    assert (type(gen).__name__ == "ErrorFeedback") == (type(hand).__name__ == "ErrorFeedback") == (algo == "graddrop")
    n = 65537
    sg, sh = gen.new_state(n), hand.new_state(n)
    for step in range(2):
        assert torch.equal(gen.encode(grad(n, step), sg), hand.encode(grad(n, step), sh))
    sd = sg.state_dict()
    resumed = gen.new_state(n)
    resumed.load_state_dict(sd)
    same_state(resumed, sh)
    for step in range(2, 4):
        a = gen.encode(grad(n, step), resumed)
        assert torch.equal(a, gen.encode(grad(n, step), sg))
        assert torch.equal(a, hand.encode(grad(n, step), sh))
    same_state(resumed, sh)


def test_generated_state_buffers_checked(dsl_sparse):
    gen = C.get("dsl_dgc")
    st = gen.new_state(100)
    with pytest.raises(ValueError, match="state was made for"):
        gen.encode(grad(99), st)
    from hipress.compression.base import CompressorState
    with pytest.raises(ValueError, match="differ"):
        gen.encode(grad(100), CompressorState("dsl_dgc", 100, None, {"accum": 100, "momentum": 100}))


@pytest.mark.parametrize("algo", ["dgc", "graddrop"])
def test_param_ranges_like_handwritten(dsl_sparse, algo):
    """'double ratio = ... in (0, 1];' in the spec: the generated hpc_check_params rejects what the
    hand-written constructor rejects, with the same message, and accepts the rest."""
    for key in ("ratio", "sample_ratio"):
        for bad in (0.0, -0.5, 1.0000001, 2.0):
            with pytest.raises(ValueError, match=rf"{key} must be in \(0, 1\]") as e:
                C.get("dsl_" + algo, error_feedback=False, **{key: bad})
            assert str(e.value).startswith(f"dsl_{algo}: ")
            with pytest.raises(ValueError, match=rf"{key} must be in \(0, 1\]"):
                C.get(algo, error_feedback=False, **{key: bad})
        for good in (1.0, 0.5, 1e-6):
            gen = C.get("dsl_" + algo, error_feedback=False, **{key: good})
            hand = C.get(algo, error_feedback=False, **{key: good})
            g = grad(5000, seed=3)
            assert torch.equal(gen.encode(g), hand.encode(g))


def test_param_ranges_tbq_terngrad(dsl):
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match=r"threshold must be in \(0, inf\)"):
            C.get("dsl_tbq", error_feedback=False, threshold=bad)
        with pytest.raises(ValueError):
            C.get("tbq", error_feedback=False, threshold=bad)
    for bad in (0, 1, 3, 16):  # the hand-written accepts 2, 4, 8 only; so does the spec (range + width check)
        with pytest.raises(ValueError):
            C.get("dsl_terngrad", bitwidth=bad)
        with pytest.raises(ValueError):
            C.get("terngrad", bitwidth=bad)
    for ok in (2, 4, 8):
        C.get("dsl_terngrad", bitwidth=ok)


def test_param_range_kinds_and_default_checked():
    from hipress.dsl import DSLError, check
    src = ("param P {{ {decl} }}\nfloat t;\nuint1 f(float x) {{ return x > t; }}\n"
           "void encode(float* g, uint8* c, P p) {{ t = p.a; uint1* q = map(g, f); c = concat(q); }}")
    lib = compll.load("ranges.cll", source=src.format(decl="float a = 0.5 in [-1, 1), b = 3 in (2, inf); "
                                                          "int32 k = 0 in [-inf, 4];"), name="dsl_ranges_t")
    for kw in ({"a": -1.0}, {"a": 0.999}, {"b": 2.0001}, {"b": 1e30}, {"k": -1000}, {"k": 4}):
        lib(**kw)
    for kw, msg in (({"a": 1.0}, r"a must be in \[-1, 1\)"), ({"a": -1.01}, r"a must be in \[-1, 1\)"),
                    ({"b": 2.0}, r"b must be in \(2, inf\)"), ({"k": 5}, r"k must be in \(-inf, 4\]")):
        with pytest.raises(ValueError, match=msg):
            lib(**kw)
    with pytest.raises(DSLError, match="outside its range") as e:
        check(src.format(decl="float a = 2 in (0, 1];"), "t.cll")
    assert (e.value.line, e.value.col) == (1, 21)
    with pytest.raises(DSLError, match="is empty"):
        check(src.format(decl="float a = 1 in (1, 1];"), "t.cll")
