"""Every native CompLL algorithm against the numpy reference (hipress/compression/reference.py)."""
import math

import numpy as np
import pytest
import torch

from hipress import compression as C
from dsl_common import SIZES, as_np, grad, pbytes, threads  # noqa: F401  (threads: a fixture)
from hipress.compression import reference as ref

H = ref.HEADER_BYTES


def roundtrip(c, g, payload):
    out = torch.full((g.numel(),), 123.0)
    c.decode(payload, out)
    acc = torch.ones(g.numel())
    c.decode_add(payload, acc)
    torch.testing.assert_close(acc, out + 1, rtol=0, atol=1e-6)
    return out


# ------------------------------------------------------------------ quantization

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("params", [{"threshold": 0.04}, {}, {"relative": 0.7}], ids=["fixed", "relative", "relative0.7"])
def test_tbq_exact(n, dtype, params, threads):
    g = grad(n, n, dtype)
    c = C.get("tbq", error_feedback=False, **params)
    p = c.encode(g)
    expect = ref.tbq_encode(as_np(g), **params)
    assert pbytes(p) == expect
    assert p.numel() <= c.max_encoded_bytes(n)
    np.testing.assert_array_equal(roundtrip(c, g, p).numpy(), ref.tbq_decode(expect, n))


def test_tbq_scale_is_the_rms_of_the_elements_sent():
    """What the decode gives for a sent element: the root mean square of the sent ones (not
    tau, not their mean |g|), so an error-feedback residual drains; below tau: 0. tau relative
    to the tensor's mean |g|."""
    g = torch.tensor([0.5, -0.1, 3.0, -5.0, 0.2, 0.0])  # mean |g| 1.4667: tau 2.2 (relative 1.5)
    out = C.get("tbq", error_feedback=False).decode(C.get("tbq", error_feedback=False).encode(g), torch.zeros(6))
    rms = math.sqrt((3.0 ** 2 + 5.0 ** 2) / 2)  # 4.1231, where the mean magnitude is 4
    torch.testing.assert_close(out, torch.tensor([0, 0, rms, -rms, 0, 0]))
    fixed = C.get("tbq", error_feedback=False, threshold=0.3)
    out = fixed.decode(fixed.encode(g), torch.zeros(6))
    rms = math.sqrt((0.25 + 9 + 25) / 3)
    torch.testing.assert_close(out, torch.tensor([rms, 0, rms, -rms, 0, 0]))


def test_onebit_keeps_the_norm():
    """onebit decodes to +-||g||_2 / sqrt(n) by sign: the decoded vector has g's norm (1-bit
    Adam's scale), where Seide's two means (here 1.75 and -2.5) would shrink it."""
    g = torch.tensor([0.5, 3.0, -1.0, -4.0])
    c = C.get("onebit", error_feedback=False)
    out = c.decode(c.encode(g), torch.zeros(4))
    scale = math.sqrt((0.25 + 9 + 1 + 16) / 4)
    torch.testing.assert_close(out, torch.tensor([scale, scale, -scale, -scale]))
    torch.testing.assert_close(out.norm(), g.norm())


def onebit_state(c, n: int, row: int):
    """A state whose row length (the kernel's counter 'row', scalars[1]) is row."""
    st = c.new_state(n)
    st.scalars[1] = row
    return st


def assert_onebit_payload(p: bytes, expect: bytes, n: int):
    """Header and sign bits exact; the per-row scales (float sums of squares, accumulated in double in
    both, in another order) to 1e-6."""
    assert ref.parse_header(p) == ref.parse_header(expect)
    nbits = H + (n + 7) // 8
    assert p[:nbits] == expect[:nbits]
    np.testing.assert_allclose(np.frombuffer(p[nbits:], np.float32), np.frombuffer(expect[nbits:], np.float32),
                               rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("row", [0, 1, 64, 65, 1000])
def test_onebit_matches(n, dtype, row, threads):
    """Every row length, also ones that do not divide n (a shorter last row) or exceed it (one row)."""
    g = grad(n, n + 1, dtype)
    c = C.get("onebit", error_feedback=False)
    p = c.encode(g, onebit_state(c, n, row))
    expect = ref.onebit_encode(as_np(g), row)
    assert_onebit_payload(pbytes(p), expect, n)
    assert ref.parse_header(expect)["count"] == (0 if n == 0 else (row if 0 < row < n else n))
    dec = roundtrip(c, g, p).numpy()
    np.testing.assert_array_equal(dec, ref.onebit_decode(pbytes(p), n))
    if n:  # decoded values are exactly +-(their row's scale)
        x = as_np(g)
        length = row if 0 < row < n else n
        scales = np.frombuffer(pbytes(p)[H + (n + 7) // 8:], np.float32)
        np.testing.assert_array_equal(np.abs(dec), np.repeat(scales, length)[:n])
        assert np.all((dec < 0) == (np.signbit(x) & (x != 0)) | (dec == 0) | (x == 0))


def test_onebit_scale_per_row_keeps_each_rows_norm():
    """With a 2-D shape each row of at least MIN_ROW elements gets its own +-||row||_2 / sqrt(len):
    a small row is not sent on the scale of a large one. Rows shorter than MIN_ROW, 1-D tensors,
    rows=False and a stateless encode use one scale."""
    c = C.get("onebit", error_feedback=False)
    m = C.OneBit.MIN_ROW
    g = torch.cat([torch.full((m,), 0.01), torch.full((m,), -3.0)]).reshape(2, m)
    g[0, 0] = -0.01
    out = c.decode(c.encode(g, c.new_state(g.numel(), g.shape)), torch.zeros(2 * m)).reshape(2, m)
    torch.testing.assert_close(out.norm(dim=1), g.norm(dim=1))
    assert out[0, 0] == pytest.approx(-0.01) and out[1, 0] == pytest.approx(-3.0)
    one = math.sqrt((m * 0.01 ** 2 + m * 9) / (2 * m))
    flat = C.get("onebit", rows=False, error_feedback=False)
    for st in (None, c.new_state(2 * m), flat.new_state(2 * m, g.shape), c.new_state(2 * m, (4, m // 2))):
        o = c.decode(c.encode(g, st), torch.zeros(2 * m))
        torch.testing.assert_close(o.abs(), torch.full((2 * m,), one))
    assert c.row_length(2 * m, (2, m)) == m and c.row_length(2 * m, (4, m // 2)) == 0
    assert c.row_length(2 * m, (2 * m,)) == 0 and c.row_length(2 * m, None) == 0


def test_onebit_per_row_payload_is_validated():
    """A payload whose row length (header count) does not fit its element count, whose scales are
    not finite, or whose body is cut is a ValueError, and the output is untouched."""
    c = C.get("onebit", error_feedback=False)
    n, row = 300, 100
    g = grad(n, 3)
    p = pbytes(c.encode(g, onebit_state(c, n, row)))
    h = ref.parse_header(p)
    body = p[H:]

    def forged(count=h["count"], body=body):
        return torch.frombuffer(bytearray(ref.make_header("onebit", n, len(body), bits=1, count=count) + body),
                                dtype=torch.uint8)

    out = torch.full((n,), 7.0)
    for bad, what in [(forged(count=0), "row length"), (forged(count=n + 1), "row length"),
                      (forged(count=99), "body"), (forged(body=body[:-4]), "body"),
                      (forged(body=body[:-4] + np.float32(np.inf).tobytes()), "inf or NaN"),
                      (forged(body=body[:-4] + np.float32(np.nan).tobytes()), "inf or NaN")]:
        with pytest.raises(ValueError):
            c.decode(bad, out)
        assert torch.all(out == 7.0), what
    c.decode(forged(), out)  # the unforged bytes decode
    np.testing.assert_array_equal(out.numpy(), ref.onebit_decode(p, n))


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("n", SIZES)
def test_terngrad_identical_random_stream(n, bits, threads):
    g = grad(n, n + 2)
    c = C.TernGrad(bitwidth=bits, seed=11)
    st = c.new_state(n)
    st.scalars[0] = 2**32 - 37  # the counter crosses a 2^32 boundary inside the call
    p = c.encode(g, st)
    expect = ref.terngrad_encode(as_np(g), bits, seed=11, counter=2**32 - 37)
    assert pbytes(p) == expect
    assert st.rng_counter == 2**32 - 37 + n
    np.testing.assert_array_equal(roundtrip(c, g, p).numpy(), ref.terngrad_decode(expect, n))
    # next step uses the next stretch of the stream
    p2 = c.encode(g, st)
    assert pbytes(p2) == ref.terngrad_encode(as_np(g), bits, seed=11, counter=2**32 - 37 + n)


def test_terngrad_unbiased_and_bounded():
    n = 4096
    g = grad(n, 5)
    c = C.TernGrad(bitwidth=2, seed=3)
    st = c.new_state(n)
    acc = torch.zeros(n, dtype=torch.float64)
    trials = 400
    out = torch.empty(n)
    for _ in range(trials):
        c.decode(c.encode(g, st), out)
        assert out.min() >= g.min() - 1e-6 and out.max() <= g.max() + 1e-6
        acc += out.double()
    mean = acc / trials
    gap = float(g.max() - g.min()) / 3
    # each decoded value has std <= gap/2: the mean of 400 is within ~5 sigma = gap/8
    assert float((mean - g.double()).abs().max()) < gap / 8
    assert abs(float((mean - g.double()).mean())) < gap / 100  # no systematic bias


def test_terngrad_seed_changes_stream():
    g = grad(1000, 1)
    a = C.TernGrad(seed=1).encode(g)
    b = C.TernGrad(seed=2).encode(g)
    assert pbytes(a)[H:] != pbytes(b)[H:]
    assert pbytes(C.TernGrad(seed=1).encode(g)) == pbytes(a)


def test_terngrad_constant_tensor():
    g = torch.full((100,), 0.25)
    out = torch.empty(100)
    C.TernGrad().decode(C.TernGrad().encode(g), out)
    assert torch.equal(out, g)


# ------------------------------------------------------------------ sparsification

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n", SIZES)
def test_dgc_stateless_is_exact_topk(n, dtype, threads):
    g = grad(n, n + 3, dtype)
    c = C.DGC(ratio=0.01)
    p = c.encode(g)
    expect = ref.dgc_encode_stateless(as_np(g), 0.01)
    assert pbytes(p) == expect
    assert len(pbytes(p)) == H + 8 * ref.count_for(0.01, n)  # fixed size: ring-friendly
    np.testing.assert_array_equal(roundtrip(c, g, p).numpy(), ref.sparse_decode(expect, n))


@pytest.mark.parametrize("n", [1, 1000, 65537, 200003])
def test_dgc_stateful_matches_reference_with_warmup(n, threads):
    c = C.DGC(ratio=0.001, momentum=0.9, warmup_steps=34)
    st = c.new_state(n)
    r = ref.DGCReference(n, ratio=0.001, momentum=0.9, warmup_steps=34)
    sizes = []
    for step in range(36):
        g = grad(n, 100 + step)
        p = c.encode(g, st)
        assert pbytes(p) == r.encode(as_np(g)), f"step {step}"
        np.testing.assert_array_equal(st.buffers["momentum"].numpy(), r.u)
        np.testing.assert_array_equal(st.buffers["accum"].numpy(), r.v)
        sizes.append(p.numel())
        assert p.numel() <= c.max_encoded_bytes(n)
    assert st.step == 36
    if n > 1000:  # the warm-up schedule: 25%, 6.25%, 1.56%, 0.4% then 0.1%, the stages in the ratio
        # 4 : 16 : 64 : 256 of the 34 warm-up steps (0.4, 1.6, 6.4, 25.6 steps: ending at 1, 2, 9, 34)
        stages = [(0, 0.25), (1, 0.0625), (2, 0.015625), (8, 0.015625), (9, 0.00390625), (33, 0.00390625),
                  (34, 0.001), (35, 0.001)]
        assert [sizes[s] for s, _ in stages] == [H + 8 * ref.count_for(d, n) for _, d in stages]


@pytest.mark.parametrize("n", [1, 1000, 65537])
def test_dgc_summands_scale_every_density_like_the_reference(n, threads):
    """summands = m (a merged sum of m ranks, Compressor.for_sum_of): every step's density, warm-up
    stages included, is m times larger, at most 1; the payload stays within max_encoded_bytes."""
    c = C.DGC(ratio=0.001, warmup_steps=34, summands=3)
    st = c.new_state(n)
    r = ref.DGCReference(n, ratio=0.001, warmup_steps=34, summands=3)
    for step in range(36):
        g = grad(n, 300 + step)
        p = c.encode(g, st)
        assert pbytes(p) == r.encode(as_np(g)), f"step {step}"
        np.testing.assert_array_equal(st.buffers["accum"].numpy(), r.v)
        assert p.numel() <= c.max_encoded_bytes(n)
    assert not st.buffers["momentum"].any()  # momentum 0: v accumulates g itself, u is not kept
    assert [r.density(s) for s in (0, 1, 35)] == [0.75, 0.1875, 0.003]


def test_dgc_default_warmup_stages_last_six_times_their_delay():
    """The default warm-up (docs/convergence.md, causes 9 and 14): 25% for 24 steps, 6.25% for 96,
    1.56% for 384, 0.39% for 1536, then the ratio 0.1%: each stage lasts 6 / density steps. The
    reference's default is the same schedule."""
    n = 20000
    c = C.DGC()
    st = c.new_state(n)
    expect = {0: 0.25, 23: 0.25, 24: 0.0625, 119: 0.0625, 120: 0.015625, 503: 0.015625, 504: 0.00390625,
              2039: 0.00390625, 2040: 0.001, 2041: 0.001}
    r = ref.DGCReference(n)
    assert {s: r.density(s) for s in expect} == expect
    g = grad(n, 5)
    for step in range(2042):
        p = c.encode(g, st)
        if step in expect:
            assert p.numel() == H + 8 * ref.count_for(expect[step], n), f"step {step}"
    assert c.max_encoded_bytes(n) == H + 8 * ref.count_for(0.25, n)


def test_dgc_momentum_masking_and_accumulation():
    n = 10000
    c = C.DGC(ratio=0.01)
    st = c.new_state(n)
    g = grad(n, 9)
    p = c.encode(g, st)
    idx, val = ref.sparse_indices(pbytes(p))
    assert np.all(st.buffers["accum"].numpy()[idx] == 0) and np.all(st.buffers["momentum"].numpy()[idx] == 0)
    # what was not sent is kept: accum + sent == g (first step: u = g, v = g)
    dense = ref.sparse_decode(pbytes(p), n)
    np.testing.assert_array_equal(st.buffers["accum"].numpy() + dense, g.numpy())


def test_dgc_own_momentum_is_not_applied_twice():
    """DGC with its own momentum (the paper's in-compressor form, with factor masking) takes the
    optimizer's momentum correction's place: no velocity of hipress's on top (a velocity of a
    velocity); with momentum 0 (the default) the optimizer's velocity is what DGC accumulates."""
    from hipress.torch import momentum
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    for comp, velocity in ((C.get("dgc", momentum=0.9), False), (C.get("dgc"), True)):
        assert momentum.resolve("auto", opt, comp)
        assert momentum.in_compressor(comp) is (not velocity)
        mc = momentum.MomentumCorrection(opt, {id(p): "p"}, velocity=not momentum.in_compressor(comp))
        for _ in range(2):
            g = torch.full((3,), 0.5)
            mc.apply(p, g)
        torch.testing.assert_close(g, torch.full((3,), 0.5 * 1.9 if velocity else 0.5))
    assert C.get("dgc", momentum=0.9).merged.momentum == 0  # merged sums are re-selected without momentum


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", SIZES)
def test_graddrop_matches_reference(n, dtype, threads):
    g = grad(n, n + 4, dtype)
    c = C.GradDrop(ratio=0.01, seed=4, warmup_steps=0)  # the paper's plain form
    st = c.new_state(n)
    st.scalars[0] = 99
    p = c.encode(g, st)
    expect = ref.graddrop_encode(as_np(g), 0.01, 0.01, seed=4, counter=99)
    assert pbytes(p) == expect
    assert p.numel() <= c.max_encoded_bytes(n)
    assert st.rng_counter == 99 + ref.graddrop_sample_size(n, 0.01)
    np.testing.assert_array_equal(roundtrip(c, g, p).numpy(), ref.sparse_decode(expect, n))


@pytest.mark.parametrize("summands", [1, 3])
@pytest.mark.parametrize("n", [1, 1000, 65537, 200003])
def test_graddrop_stateful_matches_reference_with_warmup(n, summands, threads):
    """Over the warm-up's stages and past its end: the kernel's payloads, RNG counter and step
    equal the reference's, and every payload fits max_encoded_bytes (sized for the 25% stage).
    summands = m (a merged sum of m ranks): every density m times larger, at most 1."""
    c = C.GradDrop(ratio=0.01, seed=3, warmup_steps=34, summands=summands)
    st = c.new_state(n)
    r = ref.GradDropReference(n, ratio=0.01, warmup_steps=34, seed=3, summands=summands)
    counts = []
    for step in range(36):
        g = grad(n, 300 + step)
        p = c.encode(g, st)
        assert pbytes(p) == r.encode(as_np(g)), f"step {step}"
        assert (st.rng_counter, st.step) == (r.counter, r.step)
        assert p.numel() <= c.max_encoded_bytes(n)
        counts.append(ref.parse_header(pbytes(p))["count"])
    assert st.step == 36
    if n > 1000:  # 25% at step 0, 6.25% at 1, 1.56% at 2-8, the 0.39% stage (9-33) and after at the 1% ratio
        for s, d in [(0, 0.25), (1, 0.0625), (2, 0.015625), (8, 0.015625), (9, 0.01), (33, 0.01), (35, 0.01)]:
            d = min(1.0, d * summands)
            assert 0.5 * d * n < counts[s] <= 2 * ref.count_for(d, n), f"step {s}"


def test_graddrop_default_warmup_stages_last_six_times_their_delay():
    """The default warm-up (docs/convergence.md, cause 13): 25% for 24 steps, 6.25% for 96,
    1.56% for 384, then the ratio 1% (the 0.39% stage is below it); a state-less encode is the
    plain form at the ratio; max_encoded_bytes covers the first stage's 2k."""
    n = 20000
    c = C.GradDrop()
    st = c.new_state(n)
    expect = {0: 0.25, 23: 0.25, 24: 0.0625, 119: 0.0625, 120: 0.015625, 503: 0.015625, 504: 0.01,
              2039: 0.01, 2040: 0.01}
    g = grad(n, 5)
    for step in range(2041):
        counter = st.rng_counter
        p = c.encode(g, st)
        if step in expect:
            assert ref.warmup_density(0.01, 2040, step) == expect[step], f"step {step}"
            assert pbytes(p) == ref.graddrop_encode(g.numpy(), 0.01, counter=counter, density=expect[step])
    assert c.max_encoded_bytes(n) == H + 8 * 2 * ref.count_for(0.25, n)
    assert C.GradDrop(warmup_steps=0).max_encoded_bytes(n) == H + 8 * 2 * ref.count_for(0.01, n)
    assert pbytes(c.encode(g)) == ref.graddrop_encode(g.numpy(), 0.01)


def test_graddrop_keeps_about_one_percent():
    n = 1_000_000
    p = C.GradDrop(ratio=0.01).encode(grad(n, 1))
    k = ref.parse_header(pbytes(p))["count"]
    assert 0.006 * n < k <= 0.02 * n


def test_graddrop_cap_on_bad_estimate():
    # a sample that sees only zeros would keep everything nonzero: the payload stays at 2k
    n = 100000
    g = torch.zeros(n)
    g[::50] = 1.0  # 2% nonzero, all equal: the threshold is 1.0 or 0
    c = C.GradDrop(ratio=0.005)
    p = c.encode(g)
    assert ref.parse_header(pbytes(p))["count"] <= 2 * ref.count_for(0.005, n)
    assert pbytes(p) == ref.graddrop_encode(g.numpy(), 0.005)


def test_graddrop_state_dict_carries_the_warmup_step():
    """Resuming from state_dict() continues the warm-up where it was (the step is saved with the
    RNG counter); a state whose step were lost (0) would send the 25% stage's payload again."""
    n = 20000
    c = C.get("graddrop", warmup_steps=340)  # the registry's form: error feedback around it
    st = c.new_state(n)
    for step in range(6):  # 25% for steps 0-3, then 6.25%
        c.encode(grad(n, 40 + step), st)
    assert st.step == 6
    resumed = c.new_state(n)
    resumed.load_state_dict(st.state_dict())
    step_lost = c.new_state(n)
    step_lost.load_state_dict(st.state_dict())
    step_lost.scalars[1] = 0
    g = grad(n, 46)
    p_cont, p_res, p_lost = c.encode(g, st), c.encode(g, resumed), c.encode(g, step_lost)
    assert torch.equal(p_res, p_cont)
    assert torch.equal(resumed.buffers["residual"], st.buffers["residual"])
    assert (resumed.rng_counter, resumed.step) == (st.rng_counter, 7)
    count = lambda p: ref.parse_header(pbytes(p))["count"]  # noqa: E731
    assert count(p_cont) <= 2 * ref.count_for(0.0625, n) < count(p_lost)


# ------------------------------------------------------------------ 10^7 elements

@pytest.mark.parametrize("name", ["tbq", "terngrad", "dgc", "graddrop", "onebit"])
def test_ten_million_elements(name, threads):
    n = 10_000_000
    g = grad(n, 42)
    x = g.numpy()
    if name == "tbq":
        c = C.TBQ(0.05)
        assert pbytes(c.encode(g)) == ref.tbq_encode(x, 0.05)
    elif name == "terngrad":
        c = C.TernGrad(4, seed=9)
        assert pbytes(c.encode(g)) == ref.terngrad_encode(x, 4, seed=9)
    elif name == "dgc":
        c = C.DGC(ratio=0.001)
        assert pbytes(c.encode(g)) == ref.dgc_encode_stateless(x, 0.001)
    elif name == "graddrop":
        c = C.GradDrop(ratio=0.01)
        assert pbytes(c.encode(g)) == ref.graddrop_encode(x, 0.01)
    else:
        c = C.OneBit()
        assert_onebit_payload(pbytes(c.encode(g)), ref.onebit_encode(x), n)
        assert_onebit_payload(pbytes(c.encode(g, onebit_state(c, n, 1000))), ref.onebit_encode(x, 1000), n)


# ------------------------------------------------------------------ error feedback

@pytest.mark.parametrize("name,params", [("onebit", {}), ("tbq", {"threshold": 0.03}), ("graddrop", {"ratio": 0.05}),
                                         ("terngrad", {"bitwidth": 2}), ("dgc", {"ratio": 0.05})])
@pytest.mark.parametrize("beta,gamma", [(1.0, 1.0), (0.9, 0.5)])
def test_error_feedback_conserves_and_matches_reference(name, params, beta, gamma):
    n = 5003
    c = C.get(name, error_feedback=True, beta=beta, gamma=gamma, **params)
    assert isinstance(c, C.ErrorFeedback)
    st = c.new_state(n)
    r_ref = np.zeros(n, np.float32)
    for step in range(4):
        g = grad(n, 200 + step)
        old = st.buffers["residual"].clone()
        p = c.encode(g, st)
        dec = torch.empty(n)
        c.decode(p, dec)
        new = st.buffers["residual"]
        comp = np.float32(beta) * old.numpy() + np.float32(gamma) * g.numpy() if (beta, gamma) != (1, 1) \
            else old.numpy() + g.numpy()
        # conservation: compensated input = decoded + new residual (one fp32 rounding)
        np.testing.assert_allclose(dec.numpy() + new.numpy(), comp, rtol=0, atol=1e-6)
        np.testing.assert_array_equal(new.numpy(), comp - dec.numpy())
        if name in ("tbq", "graddrop"):  # stateless inner algorithms: whole step equals the reference
            enc = (lambda x: ref.tbq_encode(x, 0.03)) if name == "tbq" else \
                (lambda x, s=step: ref.graddrop_encode(x, 0.05, counter=s * ref.graddrop_sample_size(n, 0.01),
                                                       density=ref.warmup_density(0.05, 2040, s)))
            decf = ref.tbq_decode if name == "tbq" else ref.sparse_decode
            payload, r_ref = ref.error_feedback_step(enc, decf, g.numpy(), r_ref, beta, gamma)
            assert pbytes(p) == payload
            np.testing.assert_array_equal(new.numpy(), r_ref)


@pytest.mark.parametrize("n,row", [(5003, 0), (5003, 1000), (5003, 1024), (4096 * 40 + 3, 4096),
                                   ((1 << 16) * 3 + 5, 0), ((1 << 16) * 2 + 24, 70000), (8, 8), (1, 0)])
@pytest.mark.parametrize("beta,gamma", [(1.0, 1.0), (0.9, 0.5)])
@pytest.mark.parametrize("residual_in", [False, True])
def test_onebit_error_feedback_fused_is_the_three_steps(n, row, beta, gamma, residual_in, threads):
    """onebit's fused error feedback (ops::feedback_scaled_signs, the DSL's scaled-signs idiom) gives
    the payload and residual of compensate, onebit's own encode and residual -= decode, bit for bit:
    one row, rows of 8k elements, rows off a byte (1000: the three steps themselves), rows longer
    than a chunk, the residual in the state or passed apart (residual_in), 1 and 2 threads."""
    ef = C.get("onebit", error_feedback=True, beta=beta, gamma=gamma)
    bare = C.get("onebit", error_feedback=False)
    st, bare_st = onebit_state(ef, n, row), onebit_state(bare, n, row)
    r = np.zeros(n, np.float32)
    for step in range(3):
        g = grad(n, 300 + step) * (1 + step)
        comp = np.float32(beta) * r + np.float32(gamma) * g.numpy()
        expect = bare.encode(torch.from_numpy(comp), bare_st)
        dec = torch.zeros(n)
        bare.decode(expect, dec)
        r = comp - dec.numpy()
        if residual_in:  # the old residual apart; the state's buffer only receives the new one
            old = st.buffers["residual"].clone()
            st.buffers["residual"].fill_(7.0)
            p = ef.encode(g, st, residual_in=old)
        else:
            p = ef.encode(g, st)
        assert pbytes(p) == pbytes(expect)
        np.testing.assert_array_equal(st.buffers["residual"].numpy(), r)


@pytest.mark.parametrize("row", [0, 1024])
def test_onebit_error_feedback_fused_rejects_a_non_finite_scale(row):
    """A NaN in the compensated gradient makes its row's scale NaN: the fused encode raises the
    error the decode of that payload would."""
    ef = C.get("onebit", error_feedback=True)
    g = grad(4096, 1)
    g[5] = float("nan")
    with pytest.raises(C.PayloadError, match="inf or NaN"):
        ef.encode(g, onebit_state(ef, 4096, row))


def test_error_feedback_generic_python_compressor():
    class Half(C.Compressor):
        """A user compressor: sends fp16 values."""
        name, category, rate = "half", "quantization", 0.5

        def max_encoded_bytes(self, numel, shape=None):
            return 2 * numel

        def encode(self, grad, state=None, out=None):
            return grad.reshape(-1).to(torch.float16).view(torch.uint8).clone()

        def decode(self, payload, out):
            out.copy_(payload.view(torch.float16).to(torch.float32).view(out.shape))
            return out

    C.register("half_test", Half, error_feedback=True, overwrite=True)
    c = C.get("half_test")
    assert isinstance(c, C.ErrorFeedback) and c._native is None
    st = c.new_state(100)
    g = grad(100, 1) * 1000 + 0.001
    p = c.encode(g, st)
    dec = torch.empty(100)
    c.decode(p, dec)
    torch.testing.assert_close(dec + st.buffers["residual"], g, rtol=0, atol=1e-3)
    assert float(st.buffers["residual"].abs().max()) > 0


# ------------------------------------------------------------------ state_dict

@pytest.mark.parametrize("name", ["onebit", "tbq", "terngrad", "dgc", "graddrop", "powersgd"])
def test_state_dict_resume_is_bit_identical(name):
    shape = (64, 50)
    n = 3200
    c = C.get(name)
    st = c.new_state(n, shape)
    gs = [grad(n, 300 + i).view(shape) for i in range(6)]
    for g in gs[:3]:
        c.encode(g, st)
    sd = st.state_dict()
    run_a = [pbytes(c.encode(g, st)) for g in gs[3:]]
    final_a = st.state_dict()
    c2 = C.get(name)
    st2 = c2.new_state(n, shape)
    st2.load_state_dict(sd)
    run_b = [pbytes(c2.encode(g, st2)) for g in gs[3:]]
    assert run_a == run_b
    for k in final_a["buffers"]:
        assert torch.equal(final_a["buffers"][k], st2.buffers[k])
    assert torch.equal(final_a["scalars"], st2.scalars)
    with pytest.raises(ValueError):
        c.new_state(n + 1, None).load_state_dict(sd)


# ------------------------------------------------------------------ PowerSGD

def test_powersgd_single_process_matches_reference():
    rows, cols, rank = 96, 70, 4
    c = C.PowerSGD(rank=rank, seed=5)
    st = c.new_state(rows * cols, (rows, cols))
    r = ref.PowerSGDReference(rows, cols, rank, seed=5)
    for step in range(4):
        g = grad(rows * cols, 400 + step).view(rows, cols)
        p = c.encode(g, st)
        assert p.numel() == H + 4 * rank * (rows + cols) == c.max_encoded_bytes(rows * cols, (rows, cols))
        out = torch.empty(rows * cols)
        c.decode(p, out)
        expect = r.step(g.numpy())
        np.testing.assert_allclose(out.numpy(), expect, rtol=1e-3, atol=1e-5)
        np.testing.assert_allclose(st.buffers["matrix"].numpy(), r.e.reshape(-1), rtol=1e-3, atol=1e-5)


def test_powersgd_exact_for_low_rank_input():
    rows, cols = 50, 40
    a = np.random.default_rng(0).standard_normal((rows, 2)).astype(np.float32)
    b = np.random.default_rng(1).standard_normal((2, cols)).astype(np.float32)
    g = torch.from_numpy(a @ b)
    c = C.PowerSGD(rank=2)
    st = c.new_state(g.numel(), g.shape)
    out = torch.empty(g.numel())
    c.decode(c.encode(g, st), out)
    torch.testing.assert_close(out.view(rows, cols), g, rtol=1e-3, atol=1e-3)
    assert float(st.buffers["matrix"].abs().max()) < 1e-3  # residual ~ 0


@pytest.mark.parametrize("world", [1, 3])
def test_powersgd_two_rounds_aggregated(world):
    rows, cols, rank = 40, 33, 3
    n = rows * cols
    comps = [C.PowerSGD(rank=rank, seed=8) for _ in range(world)]
    states = [c.new_state(n, (rows, cols)) for c in comps]
    refs = [ref.PowerSGDReference(rows, cols, rank, seed=8) for _ in range(world)]
    for step in range(3):
        gs = [grad(n, 1000 * step + w).view(rows, cols) for w in range(world)]
        ps = [c.encode_round(0, g, s) for c, g, s in zip(comps, gs, states)]
        assert comps[0].aggregatable and comps[0].rounds == 2
        psum = ps[0].clone()
        for p in ps[1:]:
            psum = comps[0].combine(psum, p, out=psum)
        qs = [c.encode_round(1, psum, s) for c, s in zip(comps, states)]
        qsum = qs[0].clone()
        for q in qs[1:]:
            qsum = comps[0].combine(qsum, q)
        outs = [c.finish(qsum, s, torch.empty(n)) for c, s in zip(comps, states)]
        # reference
        rp = sum(r.round0(g.numpy()) for r, g in zip(refs, gs))
        rq = sum(r.round1(rp) for r in refs)
        rout = [r.finish(rq) for r in refs]
        for o, ro in zip(outs, rout):
            np.testing.assert_allclose(o.numpy(), ro, rtol=2e-3, atol=1e-4)
        for o in outs[1:]:
            assert torch.equal(o, outs[0])  # all ranks decode the same sum
    with pytest.raises(ValueError):
        comps[0].combine(ps[0], qs[0])  # different rounds


def test_powersgd_vector_and_empty():
    c = C.PowerSGD(rank=4)
    g = grad(10, 1)
    out = torch.empty(10)
    c.decode(c.encode(g), out)
    torch.testing.assert_close(out, g, rtol=1e-4, atol=1e-5)  # n x 1 with rank 1 is exact (up to rounding)
    e = torch.zeros(0)
    p = c.encode(e)
    c.decode(p, torch.empty(0))


# ------------------------------------------------------------------ API and metadata

def test_metadata_and_registry():
    builtin = ["dgc", "graddrop", "onebit", "powersgd", "tbq", "terngrad"]
    assert set(builtin) <= set(C.available())
    info = {n: C.get(n) for n in builtin}
    assert {n: c.category for n, c in info.items()} == {
        "onebit": "quantization", "tbq": "quantization", "terngrad": "quantization",
        "dgc": "sparsification", "graddrop": "sparsification", "powersgd": "lowrank"}
    assert [n for n, c in info.items() if c.aggregatable] == ["powersgd"]
    assert info["powersgd"].rounds == 2 and info["tbq"].rounds == 1
    assert info["onebit"].rate == pytest.approx(1 / 32)
    assert C.TernGrad(bitwidth=4).rate == pytest.approx(4 / 32)
    assert isinstance(info["tbq"], C.ErrorFeedback) and not isinstance(info["terngrad"], C.ErrorFeedback)
    with pytest.raises(ValueError, match="unknown compressor"):
        C.get("nope")
    with pytest.raises(TypeError):
        C.get("tbq", treshold=1)
    with pytest.raises(ValueError, match="unknown parameter"):
        C.NativeCompressor("tbq", treshold=1)
    with pytest.raises(ValueError):
        C.TernGrad(bitwidth=3)
    with pytest.raises(ValueError):
        C.register("tbq", C.TBQ)


def test_out_buffer_and_plain_functions():
    g = grad(1000, 3)
    c = C.TBQ(0.02)
    buf = torch.empty(c.max_encoded_bytes(1000) + 10, dtype=torch.uint8)
    p = c.encode(g, out=buf)
    assert p.data_ptr() == buf.data_ptr()
    with pytest.raises(ValueError):
        c.encode(g, out=torch.empty(10, dtype=torch.uint8))
    q = C.compress(g, "terngrad", bitwidth=8)
    assert C.payload_info(q)["name"] == "terngrad" and C.payload_info(q)["numel"] == 1000
    d = C.decompress(q)
    assert float((d - g).abs().max()) <= float(g.max() - g.min()) / 255 + 1e-6
    # fp16 output buffers and 2-D shapes work
    out16 = torch.empty(20, 50, dtype=torch.float16)
    c.decode(p, out16)
    torch.testing.assert_close(out16.float().view(-1), C.decompress(p), rtol=1e-3, atol=1e-4)
    with pytest.raises(ValueError):
        c.decode(p, torch.empty(999))  # wrong element count


@pytest.mark.parametrize("name", [n for n in C.registry.available() if not C.get(n).lowrank])
def test_encoded_bytes_is_what_every_encode_returns(name):
    """Where a compressor reports its payload size in advance (encoded_bytes), every payload it and
    its merged forms encode has that size: sizes (an empty chunk too) and shapes (onebit's rows), three steps of state
    (error feedback's residual grows), values from 1e-3 to 1e3. The strategies send such payloads
    without a size message, so a wrong size would fail the sync."""
    torch.manual_seed(0)
    comp = C.get(name)
    known = 0
    for n, shape in [(0, None), (1, None), (7, None), (37, None), (4099, None), (65536, None), (6400, (100, 64)),
                     (640, (10, 64)), (300, (10, 30))]:
        for c in (comp, comp.merged_for(3)):
            want = c.encoded_bytes(n, shape)
            state = c.new_state(n, shape)
            for step in range(3):
                p = c.encode(torch.randn(n) * 10.0 ** (3 * step - 3), state)
                assert want is None or p.numel() == want, (n, shape, step, p.numel(), want)
            known += want is not None
    fixed = {"bf16", "efsignsgd", "fp16", "natural", "none", "onebit", "qsgd", "signsgd", "signum", "sketch", "tbq",
             "terngrad", "terngrad_grace", "u8bit"}
    assert known == (18 if name in fixed else 0)  # the quantizers say it; sparsifiers and adaptive formats never


def _bits(t):
    return t.view(torch.int32).clone()


@pytest.mark.parametrize("name", [n for n in C.available() if not C.get(n).lowrank])
@pytest.mark.parametrize("scale", [0.05, 1e-37], ids=["normal", "subnormal"])
def test_decode_divided_is_decode_then_div(name, scale, monkeypatch):
    """decode_divided (a strategy's average folded into its decode) keeps the bits, signed zeros
    and subnormal results included, of decode followed by div_; a power of two takes the native
    one-pass form (the base class's decode-then-divide is not called), another divisor divides."""
    from hipress.sync.base import decode_payload

    c = C.get(name)
    g = grad(65537, 5) * scale / 0.05
    g[:7] = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 3e-39, -3e-39, 0.0])
    payload = c.encode(g, c.new_state(g.numel()))
    base = C.Compressor.decode_divided
    for divisor in range(1, 9):
        want = c.decode(payload, torch.empty(g.numel())).div_(divisor)
        native = divisor & (divisor - 1) == 0 and isinstance(getattr(c, "inner", c), C.NativeCompressor)

        def fallback(self, *a, native=native):
            assert not native, "a power of two should decode and divide in one native pass"
            return base(self, *a)

        monkeypatch.setattr(C.Compressor, "decode_divided", fallback)
        got = c.decode_divided(payload, torch.full((g.numel(),), 7.0), divisor)
        monkeypatch.setattr(C.Compressor, "decode_divided", base)
        assert torch.equal(_bits(got), _bits(want)), (name, divisor)
        via = decode_payload(c, payload, torch.full((g.numel(),), 7.0), divisor=divisor)
        assert torch.equal(_bits(via), _bits(want)), (name, divisor)


def test_decode_payload_divides_a_dense_fallback_and_refuses_a_divided_add():
    """A sparsifier's payload sent as its fp32 values (no_larger_than_dense) is divided as a
    decoded one would be; a divisor with add= is refused (it would divide the sum's other terms)."""
    from hipress.sync.base import decode_payload, no_larger_than_dense

    c = C.get("dgc", ratio=0.9)
    g = grad(1000, 2)
    payload = no_larger_than_dense(c, c.encode(g), g.numel())
    assert payload.numel() == 4 * g.numel()  # the dense form
    want = c.decode(c.encode(g), torch.empty(1000)).div_(3)
    assert torch.equal(_bits(decode_payload(c, payload, torch.empty(1000), divisor=3)), _bits(want))
    with pytest.raises(ValueError, match="divisor"):
        decode_payload(c, payload, torch.zeros(1000), add=True, divisor=2)
