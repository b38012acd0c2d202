"""GRACE's quantizers (docs/grace.md) against the numpy reference (hipress/compression/reference.py):
u8bit, signsgd, signum, efsignsgd, qsgd, natural, terngrad_grace (DSL specs in hipress/dsl/specs/),
fp16 and bf16 (csrc/compress/algo_half.cc)."""
import numpy as np
import pytest
import torch

from dsl_common import DTYPES, SIZES, as_np, pbytes, threads  # noqa: F401  (threads: a fixture)
from hipress import compression as C
from hipress.compression import reference as ref
from hipress.sync.factory import resolve_strategy
from hipress.torch import momentum

H = ref.HEADER_BYTES
GRACE = ["u8bit", "signsgd", "signum", "efsignsgd", "qsgd", "natural", "terngrad_grace", "fp16", "bf16"]


def grad(n, seed=0, dtype=torch.float32, special=True):
    g = np.random.default_rng(seed).standard_normal(n).astype(np.float32) * 0.05
    if special and n > 8:  # signed zeros, a subnormal, a tiny and a large value
        g[1], g[2], g[3], g[4], g[5] = -0.0, 0.0, 3e-40, -1e-37, 7.5
    return torch.from_numpy(g).to(dtype)


def words(p):
    return ref.parse_header(pbytes(p))["words"]


def roundtrip(c, n, payload, expect):
    out = torch.full((n,), 123.0)
    c.decode(payload, out)
    np.testing.assert_array_equal(out.numpy(), expect)
    acc = torch.ones(n)
    c.decode_add(payload, acc, alpha=0.5)
    np.testing.assert_array_equal(acc.numpy(), (np.float32(1) + np.float32(0.5) * expect).astype(np.float32))
    return out


def same_but_scale(p, expect, nwords):
    """Body, header fields and all but the first nwords words exact; those (sums in double, in
    another order than numpy's) within a relative 1e-6."""
    assert pbytes(p)[H:] == expect[H:]
    a, b = ref.parse_header(pbytes(p)), ref.parse_header(expect)
    assert {k: v for k, v in a.items() if k != "words"} == {k: v for k, v in b.items() if k != "words"}
    for i in range(4):
        if i < nwords:
            assert ref.word_f32(a["words"][i]) == pytest.approx(ref.word_f32(b["words"][i]), rel=1e-6, abs=0)
        else:
            assert a["words"][i] == b["words"][i]


# ------------------------------------------------------------------ against the reference

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_signsgd_exact(n, dtype, threads):
    g = grad(n, n, dtype)
    for scale in (1.0, 0.01):
        c = C.get("signsgd", scale=scale)
        p = c.encode(g)
        expect = ref.signsgd_encode(as_np(g), scale)
        assert pbytes(p) == expect and p.numel() == c.max_encoded_bytes(n)
        roundtrip(c, n, p, ref.sign_decode(expect, n))


@pytest.mark.parametrize("n", SIZES)
def test_signum_momentum_state(n, threads):
    c = C.get("signum")
    st = c.new_state(n)
    r = ref.SignumReference(n, 0.9)
    for step in range(4):
        g = grad(n, 10 * n + step)
        p = c.encode(g, st)
        assert pbytes(p) == r.encode(as_np(g)), f"step {step}"
        np.testing.assert_array_equal(st.buffers["momentum"].numpy(), r.m)
        roundtrip(c, n, p, ref.sign_decode(pbytes(p), n))
    g = grad(n, 3)  # without a state: the sign of the input
    assert pbytes(c.encode(g)) == ref.signum_encode_stateless(as_np(g))
    c2 = C.get("signum", momentum=0.5, scale=0.25)
    st2, r2 = c2.new_state(n), ref.SignumReference(n, 0.5, 0.25)
    for step in range(2):
        assert pbytes(c2.encode(grad(n, step), st2)) == r2.encode(as_np(grad(n, step)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_efsignsgd_matches(n, dtype, threads):
    g = grad(n, n + 1, dtype)
    c = C.get("efsignsgd", error_feedback=False)
    p = c.encode(g)
    expect = ref.efsignsgd_encode(as_np(g))
    same_but_scale(p, expect, 1)
    roundtrip(c, n, p, ref.sign_decode(pbytes(p), n))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("levels", [64, 1, 127])
def test_qsgd_identical_random_stream(n, dtype, levels, threads):
    g = grad(n, n + 2, dtype)
    c = C.get("qsgd", quantum_num=levels, seed=5)
    st = c.new_state(n)
    st.scalars[0] = 2**32 - 17  # the counter crosses a 2^32 boundary inside the call
    p = c.encode(g, st)
    norm = ref.word_f32(words(p)[0])
    same_but_scale(p, ref.qsgd_encode(as_np(g), levels, 5, 2**32 - 17), 2)
    assert pbytes(p) == ref.qsgd_encode(as_np(g), levels, 5, 2**32 - 17, norm=norm)  # given the kernel's norm
    assert st.rng_counter == 2**32 - 17 + n
    roundtrip(c, n, p, ref.qsgd_decode(pbytes(p), n))
    p2 = c.encode(g, st)
    assert pbytes(p2) == ref.qsgd_encode(as_np(g), levels, 5, 2**32 - 17 + n, norm=norm)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_natural_identical_random_stream(n, dtype, threads):
    g = grad(n, n + 3, dtype)
    c = C.get("natural", error_feedback=False, seed=3)
    st = c.new_state(n)
    st.scalars[0] = 12345
    p = c.encode(g, st)
    assert pbytes(p) == ref.natural_encode(as_np(g), 3, 12345)
    assert st.rng_counter == 12345 + n
    roundtrip(c, n, p, ref.natural_decode(pbytes(p), n))


def test_natural_special_values():
    x = np.array([0.0, -0.0, 1.0, -1.0, 2.0**18, 3.0 * 2**18, 2.0**-109, 2.0**-108, 1.5 * 2**-110, 1e-45, np.inf,
                  -np.inf, np.nan, 0.75, -3.0, 2.0**-126, 2.0**-127], np.float32)
    c = C.get("natural", error_feedback=False)
    p = c.encode(torch.from_numpy(x))
    assert pbytes(p) == ref.natural_encode(x)
    out = C.decompress(p).numpy()
    np.testing.assert_array_equal(out[[0, 1, 2, 3, 4, 5, 6, 8, 9, 12]], [0, 0, 1, -1, 2**18, 2**18, 0, 0, 0, 0])
    assert out[10] == 2**18 and out[11] == -(2**18)
    assert out[7] in (2.0**-108, 2.0**-107)
    assert out[13] in (0.5, 1.0) and out[14] in (-2.0, -4.0)
    assert out[15:].tolist() == [0, 0]  # below 2^-109: zero (GRACE's clip of the exponent)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("clip", [2.5, 0.0, 1.0])
def test_terngrad_grace_identical_random_stream(n, dtype, clip, threads):
    g = grad(n, n + 4, dtype)
    c = C.get("terngrad_grace", clip=clip, seed=2)
    st = c.new_state(n)
    st.scalars[0] = 99
    p = c.encode(g, st)
    s = ref.word_f32(words(p)[0])
    same_but_scale(p, ref.terngrad_grace_encode(as_np(g), clip, 2, 99), 1) if n < 65535 else None
    assert pbytes(p) == ref.terngrad_grace_encode(as_np(g), clip, 2, 99, scalar=s)
    assert st.rng_counter == 99 + n
    roundtrip(c, n, p, ref.terngrad_grace_decode(pbytes(p), n))
    if n and clip == 0:
        assert s == float(g.float().abs().max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_u8bit_exact(n, dtype, threads):
    g = grad(n, n + 5, dtype)
    c = C.get("u8bit", error_feedback=False)
    p = c.encode(g)
    expect = ref.u8bit_encode(as_np(g))
    assert pbytes(p) == expect and p.numel() == c.max_encoded_bytes(n)
    roundtrip(c, n, p, ref.u8bit_decode(expect, n))


def test_u8bit_every_table_entry():
    """Every table entry, and the values just below it, land in the right bin (GRACE's find_bins)."""
    t = ref.U8BIT_TABLE
    below = np.nextafter(t, np.float32(0))
    x = np.concatenate([[1.0], t, below, [0.0, 1e-7, -1.0, -0.5]]).astype(np.float32)  # max |x| = 1: scale 1
    c = C.get("u8bit", error_feedback=False)
    p = c.encode(torch.from_numpy(x))
    assert pbytes(p) == ref.u8bit_encode(x)
    codes = np.frombuffer(pbytes(p)[H:], np.uint8)
    np.testing.assert_array_equal(codes[1:129], np.arange(128))
    np.testing.assert_array_equal(codes[129:257], np.maximum(np.arange(128) - 1, 0))
    out = C.decompress(p).numpy()
    assert out[0] == t[127] and out[-2] == -t[127] and out[129 + 128] == 0
    np.testing.assert_array_equal(out[2:129], t[1:])


@pytest.mark.parametrize("name", ["fp16", "bf16"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_half_casts_exact(name, n, dtype, threads):
    g = grad(n, n + 6, dtype)
    c = C.get(name)
    p = c.encode(g)
    expect = ref.half_encode(as_np(g), name)
    assert pbytes(p) == expect and p.numel() == c.max_encoded_bytes(n) == H + 2 * n
    out = roundtrip(c, n, p, ref.half_decode(expect, n))
    half = torch.float16 if name == "fp16" else torch.bfloat16
    assert torch.equal(out, g.to(half).float())  # torch's cast (round to nearest even)


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_half_special_values(name):
    x = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-8, 65504.0, 65520.0, 3e38, 1e-40])
    c = C.get(name)
    p = c.encode(x)
    assert pbytes(p) == ref.half_encode(x.numpy(), name)
    out = C.decompress(p)
    half = torch.float16 if name == "fp16" else torch.bfloat16
    torch.testing.assert_close(out, x.to(half).float(), equal_nan=True, rtol=0, atol=0)  # torch's cast


# ------------------------------------------------------------------ 10^7 elements

@pytest.mark.parametrize("name", GRACE)
def test_ten_million_elements(name):
    n = 10_000_000
    g = grad(n, 42, special=False)
    x = g.numpy()
    c = C.get(name, error_feedback=False) if name in ("u8bit", "efsignsgd", "natural") else C.get(name)
    p = c.encode(g)
    if name == "u8bit":
        assert pbytes(p) == ref.u8bit_encode(x)
    elif name == "signsgd":
        assert pbytes(p) == ref.signsgd_encode(x)
    elif name == "signum":
        assert pbytes(p) == ref.signum_encode_stateless(x)
    elif name == "efsignsgd":
        same_but_scale(p, ref.efsignsgd_encode(x), 1)
    elif name == "qsgd":
        assert pbytes(p) == ref.qsgd_encode(x, norm=ref.word_f32(words(p)[0]))
    elif name == "natural":
        assert pbytes(p) == ref.natural_encode(x)
    elif name == "terngrad_grace":
        assert pbytes(p) == ref.terngrad_grace_encode(x, scalar=ref.word_f32(words(p)[0]))
    else:
        assert pbytes(p) == ref.half_encode(x, name)


# ------------------------------------------------------------------ properties the papers claim

@pytest.mark.parametrize("name", ["qsgd", "natural", "terngrad_grace"])
def test_stochastic_quantizers_unbiased(name):
    n, trials = 2048, 400
    g = grad(n, 7, special=False)
    if name == "terngrad_grace":  # unbiased for the clipped gradient: no clipping here
        c = C.get(name, clip=0.0, seed=1)
    else:
        c = C.get(name, error_feedback=False, seed=1) if name == "natural" else C.get(name, seed=1)
    st = c.new_state(n)
    acc = torch.zeros(n, dtype=torch.float64)
    out = torch.empty(n)
    for _ in range(trials):
        c.decode(c.encode(g, st), out)
        acc += out.double()
    err = (acc / trials - g.double()).abs()
    # per-element error std <= step / 2 (step: the gap of the two values rounded to); 5 sigma
    step = {"qsgd": float(g.norm()) / 64, "terngrad_grace": float(g.abs().max())}.get(name)
    bound = (5 * 0.5 * step / trials ** 0.5) if step else None
    if name == "natural":  # step = 2^e <= |x|
        assert float((err / g.abs().double()).max()) < 5 * 0.5 / trials ** 0.5
    else:
        assert float(err.max()) < bound
    assert abs(float((acc / trials - g.double()).mean())) < float(g.abs().mean()) / 50  # no systematic bias


def test_sign_methods_decode_to_scaled_signs():
    g = torch.tensor([0.5, -0.25, 0.0, -0.0, 2.0, -1e-30])
    s = C.get("signsgd")
    assert C.decompress(s.encode(g)).tolist() == [1, -1, 1, -1, 1, -1]
    e = C.get("efsignsgd", error_feedback=False)
    m = float(g.abs().mean())
    torch.testing.assert_close(C.decompress(e.encode(g)), torch.tensor([m, -m, m, -m, m, -m]))


@pytest.mark.parametrize("name", ["u8bit", "efsignsgd", "natural"])
def test_error_feedback_by_default_conserves(name):
    """GRACE's memory: u8bit, natural (residual), efsignsgd (its scaled residual; the same update
    for a constant learning rate): on by default; compensated input = decoded + new residual."""
    n = 5003
    c = C.get(name)
    assert isinstance(c, C.ErrorFeedback)
    st = c.new_state(n)
    for step in range(3):
        g = grad(n, 200 + step, special=False)
        old = st.buffers["residual"].clone()
        p = c.encode(g, st)
        dec = torch.empty(n)
        c.decode(p, dec)
        np.testing.assert_array_equal(st.buffers["residual"].numpy(), (old + g).numpy() - dec.numpy())


@pytest.mark.parametrize("name", GRACE)
def test_state_dict_resume_is_bit_identical(name):
    n = 3200
    c = C.get(name)
    st = c.new_state(n)
    gs = [grad(n, 300 + i, special=False) for i in range(6)]
    for g in gs[:3]:
        c.encode(g, st)
    sd = st.state_dict()
    run_a = [pbytes(c.encode(g, st)) for g in gs[3:]]
    c2 = C.get(name)
    st2 = c2.new_state(n)
    st2.load_state_dict(sd)
    assert run_a == [pbytes(c2.encode(g, st2)) for g in gs[3:]]


# ------------------------------------------------------------------ API, metadata, strategy

def test_metadata_registry_and_auto_strategy():
    info = {n: C.get(n) for n in GRACE}
    assert {n: c.category for n, c in info.items()} == {n: "quantization" for n in GRACE}
    assert not any(c.aggregatable for c in info.values()) and all(c.rounds == 1 for c in info.values())
    assert {n for n, c in info.items() if isinstance(c, C.ErrorFeedback)} == {"u8bit", "efsignsgd", "natural"}
    rates = {n: c.rate for n, c in info.items()}
    assert rates["signsgd"] == rates["signum"] == rates["efsignsgd"] == pytest.approx(1 / 32)
    assert rates["u8bit"] == rates["qsgd"] == rates["natural"] == pytest.approx(1 / 4)
    assert rates["terngrad_grace"] == pytest.approx(1 / 16) and rates["fp16"] == rates["bf16"] == 0.5
    auto = {n: resolve_strategy("auto", c) for n, c in info.items()}
    assert auto == {n: ("ring" if n in ("fp16", "bf16") else "allgather") for n in GRACE}
    assert resolve_strategy("auto", info["qsgd"], planned=True) == "ps"
    # merged sums (ring hops, PS aggregators) are re-encoded with error feedback, except by qsgd (its
    # x - Q(x) is no contraction: a residual of it diverged, PS 9.1% on digits) and the EF ones (themselves)
    merged = {n: type(c.merged).__name__ for n, c in info.items()}
    assert merged["qsgd"] == "QSGD" and info["qsgd"].merged is info["qsgd"]
    assert all(m == "ErrorFeedback" for n, m in merged.items() if n != "qsgd")
    # hipress's terngrad (HiPress's min/max form) and GRACE's stay distinct
    assert C.get("terngrad").name == "terngrad" and C.get("terngrad_grace").name == "terngrad_grace"
    for bad in ({"quantum_num": 128}, {"quantum_num": 0}):
        with pytest.raises(ValueError, match="quantum_num"):
            C.get("qsgd", **bad)
    with pytest.raises(ValueError, match="momentum"):
        C.get("signum", momentum=1.0)
    with pytest.raises(ValueError):
        C.get("signsgd", scale=0.0)
    with pytest.raises(ValueError, match="unknown parameter"):
        C.NativeCompressor("fp16", scale=1)


def test_payload_info_and_decompress_names():
    g = grad(300, 1)
    for name in GRACE:
        p = C.get(name).encode(g)
        info = C.payload_info(p)
        assert info["name"] == name and info["numel"] == 300 and info["algo"] == ref.ALGO_IDS[name]
        out = torch.empty(300)
        C.get(name).decode(p, out)
        assert torch.equal(C.decompress(p), out)


def test_signum_momentum_is_not_applied_twice():
    """momentum correction ("auto") with signum: weight decay locally, the SGD steps without
    momentum, and no velocity of hipress's (signum's state is the momentum)."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9, weight_decay=0.01)
    for name, velocity in (("signum", False), ("signsgd", True), ("qsgd", True)):
        comp = C.get(name)
        assert momentum.resolve("auto", opt, comp)
        assert momentum.in_compressor(comp) is (not velocity)
        mc = momentum.MomentumCorrection(opt, {id(p): "p"}, velocity=not momentum.in_compressor(comp))
        for _ in range(2):
            g = torch.full((3,), 0.5)
            mc.apply(p, g)
        if velocity:  # u = 0.9 * 0.51 + 0.51
            torch.testing.assert_close(g, torch.full((3,), 0.51 * 1.9))
        else:
            torch.testing.assert_close(g, torch.full((3,), 0.51))
            assert mc.velocity == {}


# ------------------------------------------------------------------ DSL built-ins ilogb / ldexp

PROBE = """
algorithm ilogb_probe(category = quantization);
param P { }
uint8 expo(float x) { return min(max(ilogb(x) + 150, 0), 255); }
float scale(uint8 c) { return ldexp(1.5, c - 150); }
void encode(float* gradient, uint8* compressed, P params) {
    uint8* codes = map(gradient, expo);
    compressed = concat(codes);
}
void decode(uint8* compressed, float* gradient) {
    extract(compressed, codes);
    gradient = map(codes, scale);
}
"""


def test_dsl_ilogb_ldexp(tmp_path):
    """ilogb: the exact exponent (subnormals included; 0 and NaN lowest, inf highest); ldexp: the
    correctly rounded 1.5 * 2^k, subnormal and overflowing results included."""
    from hipress import compll
    path = tmp_path / "ilogb_probe.cll"
    path.write_text(PROBE)
    compll.load(str(path), name="ilogb_probe")
    c = C.get("ilogb_probe")
    x = np.concatenate([np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, 3e-39, 2.0**-126, 1.0, -3.0, 2.0**100,
                                    3.4e38, 0.75]),
                        np.random.default_rng(0).standard_normal(1000).astype(np.float32) * 10.0 ** np.random.default_rng(1)
                        .integers(-40, 38, 1000)]).astype(np.float32)
    p = c.encode(torch.from_numpy(x))
    codes = np.frombuffer(pbytes(p)[H:], np.uint8).astype(np.int64)
    _, e = np.frexp(x)
    expect = np.clip(e.astype(np.int64) - 1 + 150, 0, 255)
    expect[[0, 1, 4]] = 0       # ilogb(0), ilogb(NaN): INT32_MIN
    expect[[2, 3]] = 255        # ilogb(inf): INT32_MAX
    np.testing.assert_array_equal(codes, expect)
    out = torch.empty(x.size)
    c.decode(p, out)
    np.testing.assert_array_equal(out.numpy(), np.ldexp(np.float32(1.5), codes - 150).astype(np.float32))
    assert float(out[0]) == 2.0**-149 and float(out[2]) == 1.5 * 2.0**105  # 1.5 * 2^-150 rounds to 2^-149
