"""GRACE's sparsifiers and hybrids (randomk, topk, threshold, adaq, dgc_grace, sketch) against the
numpy reference (hipress/compression/reference.py). docs/grace.md"""
import numpy as np
import pytest
import torch

from hipress import compression as C
from dsl_common import DTYPES, SIZES, as_np, grad, pbytes, threads  # noqa: F401  (threads: a fixture)
from hipress.compression import reference as ref
from hipress.sync.factory import resolve_strategy

H = ref.HEADER_BYTES
GRACE = ["randomk", "topk", "threshold", "adaq", "dgc_grace", "sketch"]


def roundtrip(c, g, payload):
    out = torch.full((g.numel(),), 123.0)
    c.decode(payload, out)
    acc = torch.ones(g.numel())
    c.decode_add(payload, acc)
    torch.testing.assert_close(acc, out + 1, rtol=0, atol=1e-6)
    half = torch.zeros(g.numel())
    c.decode_add(payload, half, alpha=0.5)
    torch.testing.assert_close(half, out * 0.5, rtol=0, atol=0)
    # the plain function finds the algorithm in the header
    torch.testing.assert_close(C.decompress(payload, numel=g.numel()), out, rtol=0, atol=0)
    return out


# ------------------------------------------------------------------ randomk

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_randomk_matches_reference(n, dtype, threads):
    g = grad(n, n + 11, dtype)
    c = C.RandomK(ratio=0.01, seed=3)
    st = c.new_state(n)
    st.scalars[0] = 77
    p = c.encode(g, st)
    expect = ref.randomk_encode(as_np(g), 0.01, seed=3, counter=77)
    assert pbytes(p) == expect
    assert p.numel() <= c.max_encoded_bytes(n)
    assert st.rng_counter == 77 + ref.randomk_counter_advance(n, 0.01)
    np.testing.assert_array_equal(roundtrip(c, g, p).numpy(), ref.sparse_decode(expect, n))


def test_randomk_draws_k_distinct_uniform_positions():
    n, ratio = 10000, 0.05
    c = C.RandomK(ratio=ratio)
    st = c.new_state(n)
    g = grad(n, 1) + 1.0  # no zeros: every selected element is sent
    hits = np.zeros(n)
    for _ in range(200):
        idx, val = ref.sparse_indices(pbytes(c.encode(g, st)))
        assert idx.size == int(ratio * n) and np.all(np.diff(idx.astype(np.int64)) > 0)
        np.testing.assert_array_equal(val, g.numpy()[idx])
        hits[idx] += 1
    # each position is drawn with probability ratio: 10 expected hits per position
    assert abs(hits.mean() - 10) < 1e-9 and hits.std() < 4.5 and hits.min() >= 0
    # two ranks' streams (different counters) select different positions
    a = C.RandomK(ratio=ratio).encode(g, c.new_state(n))
    st2 = c.new_state(n)
    st2.scalars[0] = 1 << 40
    b = C.RandomK(ratio=ratio).encode(g, st2)
    assert pbytes(a) != pbytes(b)


def test_randomk_positions_are_shared_by_ranks_and_differ_by_tensor():
    """GRACE draws Random-k's positions from the tensor's name and the step, so every rank
    sends the same ones; hipress's state store starts every rank's counter at rank 0's place
    for a compressor with shared_rng (a different place per tensor), and at the rank's own
    place otherwise."""
    from hipress.sync import StateStore

    n, g = 4096, grad(4096, 2) + 1.0
    comp = C.get("randomk")  # error feedback around RandomK
    assert comp.shared_rng and not C.get("qsgd").shared_rng
    stores = [StateStore(r) for r in range(3)]
    sent = [[pbytes(comp.encode(g, s.get(key, comp, n))) for key in ("a", "a", "b")] for s in stores]
    assert sent[0] == sent[1] == sent[2]          # the same positions on every rank, step after step
    assert len({sent[0][0], sent[0][1], sent[0][2]}) == 3  # a new draw each step, another per tensor
    qsgd = C.get("qsgd")
    assert pbytes(qsgd.encode(g, stores[0].get("q", qsgd, n))) != pbytes(qsgd.encode(g, stores[1].get("q", qsgd, n)))


def test_randomk_zero_values_are_not_sent():
    g = torch.zeros(1000)
    p = C.RandomK(ratio=0.5).encode(g)
    assert ref.parse_header(pbytes(p))["count"] == 0


# ------------------------------------------------------------------ topk, threshold

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("ratio", [0.01, 0.3])
def test_topk_matches_reference(n, dtype, ratio, threads):
    g = grad(n, n + 5, dtype)
    c = C.TopK(ratio=ratio)
    st = c.new_state(n)
    p = c.encode(g, st)
    expect = ref.topk_encode(as_np(g), ratio)
    assert pbytes(p) == expect
    assert p.numel() <= c.max_encoded_bytes(n)
    assert ref.parse_header(expect)["count"] == ref.grace_count(ratio, n)
    assert st.rng_counter == ref.topk_counter_advance(n, 0.01)  # the sample only speeds the selection up
    np.testing.assert_array_equal(roundtrip(c, g, p).numpy(), ref.sparse_decode(expect, n))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("v", [0.01, 0.07, 1e-30])
def test_threshold_matches_reference(n, dtype, v, threads):
    g = grad(n, n + 6, dtype)
    c = C.Threshold(threshold=v)
    p = c.encode(g)
    expect = ref.threshold_encode(as_np(g), v)
    assert pbytes(p) == expect
    assert p.numel() <= c.max_encoded_bytes(n)
    np.testing.assert_array_equal(roundtrip(c, g, p).numpy(), ref.sparse_decode(expect, n))


def test_threshold_sends_every_element_reaching_v():
    g = torch.tensor([0.0, 0.01, -0.01, 0.0099, -0.5, 2.0])
    out = C.Threshold().decode(C.Threshold().encode(g), torch.zeros(6))
    assert out.tolist() == pytest.approx([0, 0.01, -0.01, 0, -0.5, 2.0])
    with pytest.raises(ValueError):
        C.Threshold(threshold=0)


# ------------------------------------------------------------------ adaq

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("ratio", [0.01, 0.2])
def test_adaq_matches_reference(n, dtype, ratio, threads):
    g = grad(n, n + 7, dtype)
    c = C.Adaq(ratio=ratio, seed=5)
    st = c.new_state(n)
    st.scalars[0] = 1234
    p = c.encode(g, st)
    expect = ref.adaq_encode(as_np(g), ratio, seed=5, counter=1234)
    ph, eh = ref.parse_header(pbytes(p)), ref.parse_header(expect)
    # selection, signs and layout exact; the two means are double sums (order may differ)
    assert pbytes(p)[H:] == expect[H:]
    assert {k: v for k, v in ph.items() if k != "words"} == {k: v for k, v in eh.items() if k != "words"}
    for i in (0, 1):
        assert ref.word_f32(ph["words"][i]) == pytest.approx(ref.word_f32(eh["words"][i]), rel=1e-6, abs=0)
    assert p.numel() <= c.max_encoded_bytes(n)
    assert st.rng_counter == 1234 + ref.adaq_counter_advance(n)
    np.testing.assert_array_equal(roundtrip(c, g, p).numpy(), ref.adaq_decode(pbytes(p), n))


def test_adaq_selects_about_ratio_of_each_sign_and_sends_their_means():
    n = 200000
    x = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    x[x > 0] *= 3  # the two signs have different scales
    g = torch.from_numpy(x)
    p = C.Adaq(ratio=0.01).encode(g)
    dec = C.Adaq().decode(p, torch.zeros(n)).numpy()
    pos, neg = dec > 0, dec < 0
    for m, part in ((pos, x > 0), (neg, x < 0)):
        k = int(np.ceil(0.01 * part.sum()))
        assert 0.8 * k <= m.sum() <= 1.25 * k
        np.testing.assert_allclose(dec[m], x[m].mean(), rtol=1e-5)  # one value per sign: the mean sent
        assert np.all(np.abs(x[m]) >= np.abs(x[part & ~m]).max())  # the largest of that sign
    assert len(np.unique(dec[pos])) == 1 and len(np.unique(dec[neg])) == 1


# ------------------------------------------------------------------ dgc_grace

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_dgc_grace_stateless_matches_reference(n, dtype, threads):
    g = grad(n, n + 8, dtype)
    c = C.DGCGrace(ratio=0.01, seed=2)
    p = c.encode(g)
    expect = ref.dgc_grace_encode_stateless(as_np(g), 0.01, seed=2)
    assert pbytes(p) == expect
    assert p.numel() <= c.max_encoded_bytes(n)
    np.testing.assert_array_equal(roundtrip(c, g, p).numpy(), ref.sparse_decode(expect, n))


@pytest.mark.parametrize("n", [1, 1000, 65537, 200003])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_dgc_grace_stateful_matches_reference(n, momentum, threads):
    c = C.DGCGrace(ratio=0.01, momentum=momentum, seed=1)
    st = c.new_state(n)
    st.scalars[0] = 50
    r = ref.DGCGraceReference(n, ratio=0.01, momentum=momentum, seed=1, counter=50)
    counts = []
    for step in range(6):
        g = grad(n, 400 + step)
        p = c.encode(g, st)
        assert pbytes(p) == r.encode(as_np(g)), f"step {step}"
        np.testing.assert_array_equal(st.buffers["momentum"].numpy(), r.u)
        np.testing.assert_array_equal(st.buffers["accum"].numpy(), r.v)
        assert st.rng_counter == r.counter
        counts.append(ref.parse_header(pbytes(p))["count"])
    if n > 100000:  # about ratio n once the threshold loop converged (GRACE's 0.7..1.3 band)
        assert all(0.7 * 0.01 * n <= k <= 1.3 * 0.01 * n for k in counts), counts


def test_dgc_grace_masks_and_accumulates():
    n = 10000
    c = C.DGCGrace(ratio=0.01, momentum=0.9)
    st = c.new_state(n)
    g = grad(n, 9)
    p = c.encode(g, st)
    idx, _ = ref.sparse_indices(pbytes(p))
    assert idx.size > 0
    assert np.all(st.buffers["accum"].numpy()[idx] == 0) and np.all(st.buffers["momentum"].numpy()[idx] == 0)
    np.testing.assert_array_equal(st.buffers["accum"].numpy() + ref.sparse_decode(pbytes(p), n), g.numpy())


# ------------------------------------------------------------------ sketch

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("q,sample", [(64, 16384), (64, 65536), (64, 1000), (2, 0), (256, 0), (1, 0)])
def test_sketch_matches_reference(n, dtype, q, sample, threads):
    g = grad(n, n + 9, dtype)
    c = C.Sketch(quantiles=q, sample=sample, seed=6)
    st = c.new_state(n)
    st.scalars[0] = 9
    p = c.encode(g, st)
    expect = ref.sketch_encode(as_np(g), q, sample, seed=6, counter=9)
    # codes and layout exact; the bucket means are double sums (order may differ)
    assert pbytes(p)[:H] == expect[:H] and pbytes(p)[H + 4 * q:] == expect[H + 4 * q:]
    np.testing.assert_allclose(np.frombuffer(pbytes(p)[H:H + 4 * q], "<f4"),
                               np.frombuffer(expect[H:H + 4 * q], "<f4"), rtol=1e-6, atol=0)
    assert p.numel() == c.max_encoded_bytes(n)
    assert st.rng_counter == 9 + ref.sketch_counter_advance(n, sample)
    np.testing.assert_array_equal(roundtrip(c, g, p).numpy(), ref.sketch_decode(pbytes(p), n))


def test_sketch_buckets_are_quantiles_with_their_means():
    n = 64000
    x = np.random.default_rng(5).standard_normal(n).astype(np.float32)
    p = C.Sketch(quantiles=64, sample=0).encode(torch.from_numpy(x))
    codes = np.frombuffer(pbytes(p)[H + 256:], np.uint8)
    counts = np.bincount(codes, minlength=64)
    assert counts.min() >= 990 and counts.max() <= 1010  # equal-frequency buckets
    dec = C.Sketch().decode(p, torch.zeros(n)).numpy()
    for b in (0, 31, 63):
        np.testing.assert_allclose(dec[codes == b], x[codes == b].mean(), rtol=1e-5)
    assert np.all(np.diff([x[codes == b].max() for b in range(64)]) > 0)  # ordered buckets
    assert np.abs(dec - x).mean() < 0.05 * np.abs(x).mean()


def test_sketch_bad_code_is_rejected_before_writing():
    c = C.Sketch(quantiles=4, sample=0)
    p = c.encode(grad(100, 1)).clone()
    p[H + 16 + 50] = 4  # no bucket 4
    out = torch.full((100,), 7.0)
    with pytest.raises(ValueError, match="names no bucket"):
        c.decode_add(p, out)
    assert torch.all(out == 7.0)
    for bad in ({"quantiles": 0}, {"quantiles": 257}, {"quantiles": 2.5}, {"sample": -1}, {"sample": 0.5}):
        with pytest.raises(ValueError):
            C.get("sketch", **bad)


# ------------------------------------------------------------------ all of them

@pytest.mark.parametrize("name", GRACE)
def test_ten_million_elements(name, threads):
    n = 10_000_000
    g = grad(n, 42)
    x = g.numpy()
    c = C.get(name, error_feedback=False)
    p = pbytes(c.encode(g))
    if name == "randomk":
        assert p == ref.randomk_encode(x)
    elif name == "topk":
        assert p == ref.topk_encode(x)
    elif name == "threshold":
        assert p == ref.threshold_encode(x)
    elif name == "adaq":
        e = ref.adaq_encode(x)
        assert p[H:] == e[H:] and ref.parse_header(p)["count"] == ref.parse_header(e)["count"]
    elif name == "dgc_grace":
        assert p == ref.dgc_grace_encode_stateless(x)
    else:
        e = ref.sketch_encode(x)
        assert p[H + 256:] == e[H + 256:]


@pytest.mark.parametrize("name", GRACE)
def test_registry_memory_category_and_auto_strategy(name):
    c = C.get(name)
    # GRACE's pairing (Table I): residual memory (ErrorFeedback) for all but DGC, which has its own
    assert isinstance(c, C.ErrorFeedback) == (name != "dgc_grace")
    assert c.category == ("quantization" if name == "sketch" else "sparsification")
    assert not c.aggregatable and c.rounds == 1 and not c.reencode_safe
    assert resolve_strategy("auto", c) == "allgather"
    assert resolve_strategy("auto", c, planned=True) == "ps"
    assert C.payload_info(c.encode(grad(1000, 1)))["name"] == name


@pytest.mark.parametrize("name", GRACE)
def test_error_feedback_conserves(name):
    n = 5003
    c = C.get(name)
    st = c.new_state(n)
    keep = "accum" if name == "dgc_grace" else "residual"
    for step in range(4):
        g = grad(n, 200 + step)
        old = st.buffers[keep].clone()
        p = c.encode(g, st)
        dec = torch.empty(n)
        c.decode(p, dec)
        # what was not sent waits in the memory: old + g == decoded + new memory (one fp32 rounding)
        np.testing.assert_allclose(dec.numpy() + st.buffers[keep].numpy(), old.numpy() + g.numpy(), rtol=0,
                                   atol=1e-6)


@pytest.mark.parametrize("name", GRACE)
def test_state_dict_resume_is_bit_identical(name):
    n = 3200
    c = C.get(name)
    st = c.new_state(n)
    gs = [grad(n, 300 + i) for i in range(6)]
    for g in gs[:3]:
        c.encode(g, st)
    sd = st.state_dict()
    run_a = [pbytes(c.encode(g, st)) for g in gs[3:]]
    st2 = C.get(name).new_state(n)
    st2.load_state_dict(sd)
    run_b = [pbytes(c.encode(g, st2)) for g in gs[3:]]
    assert run_a == run_b
    assert torch.equal(st.scalars, st2.scalars)


# ------------------------------------------------------------------ powersgd_grace

@pytest.mark.parametrize("rank", [1, 3])
def test_powersgd_grace_single_process_matches_reference(rank):
    rows, cols = 96, 70
    c = C.PowerSGDGrace(rank=rank, seed=5)
    st = c.new_state(rows * cols, (rows, cols))
    r = ref.PowerSGDReference(rows, cols, rank, seed=5, fresh_q=True)
    for step in range(4):
        g = grad(rows * cols, 400 + step).view(rows, cols)
        p = c.encode(g, st)
        assert p.numel() == H + 4 * rank * (rows + cols) == c.max_encoded_bytes(rows * cols, (rows, cols))
        out = torch.empty(rows * cols)
        c.decode(p, out)
        np.testing.assert_allclose(out.numpy(), r.step(g.numpy()), rtol=1e-3, atol=1e-5)
        np.testing.assert_allclose(st.buffers["matrix"].numpy(), r.e.reshape(-1), rtol=1e-3, atol=1e-5)
        assert st.rng_counter == r.counter  # a new Q every step: cols * rank numbers


@pytest.mark.parametrize("world", [1, 3])
def test_powersgd_grace_two_rounds_aggregated(world):
    rows, cols, rank = 40, 33, 2
    n = rows * cols
    comps = [C.PowerSGDGrace(rank=rank, seed=8) for _ in range(world)]
    states = [c.new_state(n, (rows, cols)) for c in comps]
    refs = [ref.PowerSGDReference(rows, cols, rank, seed=8, fresh_q=True) for _ in range(world)]
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
        rp = sum(r.round0(g.numpy()) for r, g in zip(refs, gs))
        rq = sum(r.round1(rp) for r in refs)
        rout = [r.finish(rq) for r in refs]
        for o, ro in zip(outs, rout):
            np.testing.assert_allclose(o.numpy(), ro, rtol=2e-3, atol=1e-4)


def test_powersgd_grace_registry_and_payloads():
    c = C.get("powersgd_grace")
    assert not isinstance(c, C.ErrorFeedback) and c.category == "lowrank" and c.aggregatable and c.rounds == 2
    assert resolve_strategy("auto", c) == "allgather"  # single-round rule; the optimizer sends low-rank ones to the low-rank strategy
    g = grad(600, 3).view(30, 20)
    p = c.encode(g, c.new_state(600, (30, 20)))
    info = C.payload_info(p)
    assert info["name"] == "powersgd_grace" and info["count"] == 1
    out = torch.empty(600)
    c.decode(p, out)
    torch.testing.assert_close(C.decompress(p, numel=600), out, rtol=0, atol=0)
    for bad in (p[:-4].clone(), torch.cat([p, torch.zeros(4, dtype=torch.uint8)])):
        with pytest.raises(ValueError):
            c.decode(bad, torch.empty(600))
