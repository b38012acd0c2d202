"""CaSync strategies over the in-process loopback transport (N ranks as threads)."""
import pytest
import torch

from hipress import compression
from hipress.compression.none import NoneCompressor
from hipress.comm.coordinator import Executor
from hipress.sync.lowrank import LowRankStrategy, sent_raw
from hipress.engine import Engine
from hipress.comm.exchange import CommChain, CoordinatedExchange, DirectExchange
from hipress.sync import STRATEGIES, StateStore, SyncContext, reference
from hipress.planner.plan import chunk_bounds
from hipress.sync.base import frame, unframe
from hipress.comm.transport import loopback


def grads_for(n_ranks, numel, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) for _ in range(n_ranks)]


def counting_exchange():
    """A DirectExchange class of its own that records the name of every exchange made (``names``)."""
    class Counting(DirectExchange):
        names = []

        def _exchange(self, name, *a, **kw):
            Counting.names.append(name)
            return super()._exchange(name, *a, **kw)

    return Counting


def run_strategy(strategy, comp_factory, grads, bounds, name="w", coordinator=False, steps=1, segments=None):
    n = len(grads)
    results, states, owners = [None] * n, [None] * n, [None] * n

    def body(tr):
        eng = Engine()
        ex = None
        if coordinator:  # "one thread": a round, then its slots; "two threads": the rounds beside the data
            data = tr.split(0, key=tr.rank)
            ex = Executor(data, tr.split(0, key=tr.rank) if coordinator == "two threads" else None)
        try:
            st = StateStore(tr.rank)
            strat = LowRankStrategy() if strategy == "lowrank" else STRATEGIES[strategy]()
            exchange = CoordinatedExchange(eng, ex, range(tr.size)) if coordinator else \
                DirectExchange(eng, tr, CommChain())
            ctx = SyncContext(eng, exchange, comp_factory(), st)
            out = []
            for _ in range(steps):
                flat = grads[tr.rank].clone()
                strat.build(ctx, name, flat, bounds, shape=(len(flat), 1), segments=segments).result(timeout=30)
                out.append(flat)
            results[tr.rank], states[tr.rank] = out if steps > 1 else out[0], st
            if strategy == "ps":
                owners[tr.rank] = [strat._owner[f"{name}/p{i}"] for i, (s, e) in enumerate(bounds) if e > s]
        finally:
            if ex is not None:
                ex.close()
            eng.shutdown()

    loopback.spawn(n, body, timeout_s=60)
    return results, owners


@pytest.mark.parametrize("strategy", ["ring", "ps", "allgather"])
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("numel,k", [(0, 1), (1, 1), (5, 1), (1001, 1), (1001, 3), (4097, 4)])
def test_uncompressed_equals_exact_average(strategy, n, numel, k):
    grads = grads_for(n, numel, seed=numel + n)
    bounds = chunk_bounds(numel, k)
    results, _ = run_strategy(strategy, NoneCompressor, grads, bounds)
    exact = torch.stack(grads).double().mean(0).float()
    for r in results:
        torch.testing.assert_close(r, exact, rtol=1e-6, atol=1e-6)
    for r in results[1:]:
        assert torch.equal(r, results[0])  # every rank ends bit-identical


@pytest.mark.parametrize("n", [2, 3, 4])
def test_uncompressed_matches_reference(n):
    grads = grads_for(n, 999, seed=7)
    bounds = chunk_bounds(999, 2)
    got, owners = run_strategy("ring", NoneCompressor, grads, bounds)
    want = reference.ring(grads, NoneCompressor(), [StateStore(r) for r in range(n)], "w", bounds)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    got, owners = run_strategy("ps", NoneCompressor, grads, bounds)
    want = reference.ps(grads, NoneCompressor(), [StateStore(r) for r in range(n)], "w", bounds, owners[0])
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("algo,kw", [("onebit", {}), ("tbq", {"threshold": 0.05}), ("terngrad", {"bitwidth": 2}),
                                     ("dgc", {"ratio": 0.05}), ("graddrop", {"ratio": 0.05})])
def test_allgather_matches_reference_and_never_reencodes(algo, kw):
    """Three ranks, two partitions, two steps (state carried): bit-identical to the oracle,
    the same on every rank; and each partition is encoded exactly once per rank and step
    (the worker's, with state): no merged sum is ever re-encoded."""
    n, numel = 3, 2001
    grads = grads_for(n, numel, seed=11)
    bounds = chunk_bounds(numel, 2)
    calls = []

    def counting():
        comp = compression.get(algo, **kw)
        encode = comp.encode

        def counted(x, state=None, out=None):
            calls.append(state is not None)
            return encode(x, state, out)

        comp.encode = counted
        return comp

    got, _ = run_strategy("allgather", counting, grads, bounds, steps=2)
    assert calls == [True] * (n * len(bounds) * 2)
    stores = [StateStore(r) for r in range(n)]
    for step in range(2):
        want = reference.allgather(grads, compression.get(algo, **kw), stores, "w", bounds)
        for r in range(n):
            assert torch.equal(got[r][step], want[r]), (algo, step, r)
            assert torch.equal(got[r][step], got[0][step])
    assert not torch.equal(got[0][0], torch.stack(grads).mean(0))  # it did compress


def test_frame_roundtrip_and_errors():
    ps = [torch.arange(k, dtype=torch.uint8) for k in (0, 3, 17)]
    buf = frame(ps)
    back = unframe(buf, 3)
    assert all(torch.equal(a, b) for a, b in zip(ps, back))
    with pytest.raises(ValueError, match="truncated|corrupt"):
        unframe(buf[:-1], 3)
    with pytest.raises(ValueError, match="trailing"):
        unframe(buf, 2)


def test_chunk_bounds():
    assert chunk_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert chunk_bounds(2, 4) == [(0, 1), (1, 2), (2, 2), (2, 2)]
    with pytest.raises(ValueError):
        chunk_bounds(3, 0)


@pytest.mark.parametrize("mode", ["one thread", "two threads"])
@pytest.mark.parametrize("strategy", ["ring", "ps", "allgather"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_coordinator_gives_identical_results(strategy, n, mode):
    """The same sync with and without the global coordinator: bit-identical results
    (uncompressed and TBQ with error feedback, over two steps so state is exercised)."""
    grads = grads_for(n, 3001, seed=n)
    bounds = chunk_bounds(3001, 3)
    for factory in (NoneCompressor, lambda: compression.get("tbq", threshold=0.05)):
        direct, _ = run_strategy(strategy, factory, grads, bounds, steps=2)
        coord, _ = run_strategy(strategy, factory, grads, bounds, coordinator=mode, steps=2)
        for a, b in zip(direct, coord):
            for x, y in zip(a, b):
                assert torch.equal(x, y)


@pytest.mark.parametrize("mode", ["one thread", "two threads"])
def test_coordinator_lowrank_identical(mode):
    grads = [g.view(-1) for g in grads_for(3, 64 * 16, seed=1)]
    factory = lambda: compression.get("powersgd", rank=2)  # noqa: E731
    direct, _ = run_strategy("lowrank", factory, grads, [(0, 1024)])
    coord, _ = run_strategy("lowrank", factory, grads, [(0, 1024)], coordinator=mode)
    for a, b in zip(direct, coord):
        assert torch.equal(a, b)


@pytest.mark.parametrize("n", [2, 3])
def test_lowrank_fused_bucket_equals_one_sync_per_matrix(n):
    """A buffer of several matrices (a 1-D bias among them) in one low-rank sync: one
    exchange per round, and per matrix bit for bit what syncing it alone gives, over two
    steps (warm-started Q and error feedback carried); both equal the reference."""
    shapes = [(16, 8), (16,), (4, 3, 5), (1, 1), (0, 7), (9, 2)]
    numels = [int(torch.tensor(sh).prod()) for sh in shapes]
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    segments = list(zip(offsets, numels, shapes))
    total = sum(numels)
    steps = [[torch.randn(total, generator=torch.Generator().manual_seed(10 * s + r)) for r in range(n)]
             for s in range(2)]
    comp = lambda: compression.get("powersgd", rank=2)  # noqa: E731
    fused, alone = [None] * n, [None] * n

    def body(tr):
        eng = Engine()
        try:
            chain = CommChain()
            ctx_f, ctx_a = (SyncContext(eng, DirectExchange(eng, tr, chain), comp(), StateStore(tr.rank)) for _ in range(2))
            strat = LowRankStrategy()
            got_f, got_a = [], []
            for grads in steps:
                flat = grads[tr.rank].clone()
                strat.build(ctx_f, "b", flat, [(0, total)], segments=segments).result(timeout=30)
                got_f.append(flat)
                one = grads[tr.rank].clone()
                for i, (off, numel, sh) in enumerate(segments):
                    strat.build(ctx_a, f"m{i}", one[off:off + numel], [(0, numel)], shape=sh).result(timeout=30)
                got_a.append(one)
            fused[tr.rank], alone[tr.rank] = got_f, got_a
        finally:
            eng.shutdown()

    loopback.spawn(n, body, timeout_s=60)
    stores = [StateStore(r) for r in range(n)]
    for s, grads in enumerate(steps):
        want = reference.lowrank(grads, comp(), stores, "b", None, segments=segments)
        for r in range(n):
            assert torch.equal(fused[r][s], alone[r][s]), (s, r)
            torch.testing.assert_close(fused[r][s], want[r], rtol=1e-6, atol=1e-6)
        assert not torch.equal(fused[0][s], torch.stack(grads).mean(0))  # it did compress


def test_lowrank_fused_bucket_exchanges_once_per_round():
    Counting = counting_exchange()

    def body(tr):
        eng = Engine()
        try:
            ctx = SyncContext(eng, Counting(eng, tr, CommChain()), compression.get("powersgd", rank=2), StateStore(tr.rank))
            flat = torch.randn(3 * 64)
            segments = [(0, 64, (8, 8)), (64, 64, (64,)), (128, 64, (4, 16))]
            LowRankStrategy().build(ctx, "b", flat, [(0, 192)], segments=segments).result(timeout=30)
        finally:
            eng.shutdown()

    loopback.spawn(2, body, timeout_s=60)
    assert sorted(set(Counting.names)) == ["allgather.b.r0", "allgather.b.r1"] and len(Counting.names) == 4


def test_lowrank_sends_tensors_its_factors_do_not_shrink_raw_in_one_round():
    """PowerSGD's rank-r factors of a 1-D tensor (n x 1), or of a matrix with r columns, take no fewer
    bytes than the tensor: such tensors are summed as they are. A bucket of only them (a bias before a
    layer that has a bucket of its own) takes one round instead of two, keeps no state, and ends as
    the exact sum in rank order over N."""
    psgd, acp = compression.get("powersgd", rank=2), compression.get("acpsgd", rank=2)
    assert sent_raw(psgd, 64, (64,)) and sent_raw(psgd, 64, (32, 2)) and sent_raw(psgd, 64, None)
    assert not sent_raw(psgd, 64 * 64, (64, 64))
    assert not sent_raw(acp, 64, (64,))  # one round: nothing to save, its factor is sent

    Counting = counting_exchange()

    n, segments = 3, [(0, 64, (64,)), (64, 64, (32, 2))]
    grads = grads_for(n, 128, seed=4)
    results, saved = [None] * n, [None] * n

    def body(tr):
        eng = Engine()
        try:
            ctx = SyncContext(eng, Counting(eng, tr, CommChain()), compression.get("powersgd", rank=2),
                              StateStore(tr.rank))
            flat = grads[tr.rank].clone()
            LowRankStrategy().build(ctx, "b", flat, [(0, 128)], segments=segments).result(timeout=30)
            results[tr.rank], saved[tr.rank] = flat, ctx.states.state_dict()
        finally:
            eng.shutdown()

    loopback.spawn(n, body, timeout_s=60)
    assert Counting.names == ["allgather.b.r0"] * n
    want = grads[0].clone()
    for g in grads[1:]:
        want += g
    want /= n
    for r in range(n):
        assert torch.equal(results[r], want), r
        assert saved[r] == {}


def test_ps_owners_spread_a_gradients_partitions_over_distinct_aggregators():
    from hipress.sync.ps import PSStrategy

    ps = PSStrategy()
    assert ps.owners([("big/p0", 1000)], 4) == [0]        # rank 0 now carries 1000 bytes
    assert ps.owners([("small/p0", 10)], 4) == [1]
    # the least loaded rank (2) would take both partitions by bytes alone; distinct ranks first
    assert ps.owners([("g/p0", 100), ("g/p1", 100)], 4) == [2, 3]
    assert ps.owners([("g/p0", 100), ("g/p1", 100)], 4) == [2, 3]  # kept once chosen
    # K > N: ceil(K/N) partitions on the busiest aggregator, every rank used
    got = ps.owners([(f"h/p{i}", 10) for i in range(6)], 4)
    assert sorted(got.count(r) for r in range(4)) == [1, 1, 2, 2]
    # unequal partitions (a fused bucket of blocks of four tensors, each its own partition) spread
    # by bytes: no rank takes every block's large tensor
    blocks = [(f"f/p{i}", 36864 if i % 4 == 3 else 384) for i in range(56)]
    got = PSStrategy().owners(blocks, 4)
    per_rank = [sum(b for (_, b), o in zip(blocks, got) if o == r) for r in range(4)]
    assert max(per_rank) <= 1.2 * sum(per_rank) / 4, per_rank


def test_ranks_draw_independent_random_numbers_unless_aggregatable():
    """The same gradient on two ranks: TernGrad's stochastic rounding differs (independent
    streams, so the rounding noise averages out over ranks), and so does the same key on one
    rank under another name; PowerSGD's payloads are combined in compressed form, so its
    random initial Q is the same on every rank."""
    g = torch.randn(4096, generator=torch.Generator().manual_seed(3))
    tern = compression.get("terngrad")
    a, b = (StateStore(r).get("w/p0/c0", tern, g.numel()) for r in (0, 1))
    start_b = b.rng_counter
    assert a.rng_counter != start_b
    assert StateStore(0).get("w/p0/c1", tern, 1).rng_counter != a.rng_counter
    # deterministic: a restarted job draws the same numbers
    assert StateStore(1).get("w/p0/c0", tern, g.numel()).rng_counter == start_b
    assert not torch.equal(tern.encode(g, a), tern.encode(g, b))
    psgd = compression.get("powersgd", rank=2)
    x, y = (StateStore(r).get("m", psgd, 64, (8, 8)) for r in (0, 1))
    assert x.rng_counter == y.rng_counter == 0


def test_merged_sums_are_reencoded_with_error_feedback():
    """Every re-encode of a merged sum keeps a residual: compressors whose state is already
    one (error feedback, DGC's accumulation without momentum, none) re-encode with
    themselves; others (TernGrad) through ErrorFeedback; DGC with in-compressor momentum
    re-selects with accumulation only (a sum already carries the momentum)."""
    from hipress.compression.error_feedback import ErrorFeedback

    for name in ("onebit", "tbq", "graddrop", "dgc", "none"):
        c = compression.get(name)
        assert c.merged is c, name
    t = compression.get("terngrad")
    assert isinstance(t.merged, ErrorFeedback) and t.merged.inner is t and t.merged is t.merged
    d = compression.get("dgc", momentum=0.9, ratio=0.01)
    assert d.merged.momentum == 0 and d.merged.params["ratio"] == d.params["ratio"]
    # what the aggregator's re-encode drops is kept: decode(payload) + residual == input
    x = torch.randn(1000)
    st = StateStore(0).get("agg", t.merged, x.numel())
    out = torch.zeros(1000)
    t.merged.decode(t.merged.encode(x, st), out)
    torch.testing.assert_close(out + st.buffers["residual"], x, rtol=0, atol=1e-5)


def test_sparsifiers_reencode_a_sum_at_the_density_of_its_union():
    """A merged sum of m ranks' selections is re-selected at m times the density (cause 11),
    one compressor per count, each in its merged form; quantizers re-encode as before."""
    from hipress.compression.error_feedback import ErrorFeedback

    d = compression.get("dgc", ratio=0.01, momentum=0.9)
    assert d.merged_for(4).params["summands"] == 4 and d.merged_for(4).momentum == 0
    assert d.merged_for(4) is d.merged_for(4) and d.for_sum_of(1) is d
    t = compression.get("topk", ratio=0.01, beta=0.5)
    m = t.merged_for(3)
    assert isinstance(m, ErrorFeedback) and m.beta == 0.5 and m.inner.params["ratio"] == pytest.approx(0.03)
    # GradDrop, like DGC, scales every density of its warm-up by the count (summands; at most all)
    assert compression.get("graddrop", ratio=0.4).merged_for(3).inner.params["summands"] == 3
    for name in ("onebit", "terngrad", "none"):
        c = compression.get(name)
        assert c.merged_for(4) is c.merged, name
    # DGC keeps (ratio x m) of a sum: 4 ranks' 1% is 4%, also during its warm-up stages (x m each)
    n, x = 10000, torch.randn(10000)
    for warmup, density in ((0, 0.04), (1360, 1.0)):
        c = compression.get("dgc", ratio=0.01, warmup_steps=warmup).merged_for(4)
        nnz = (c.decode(c.encode(x, c.new_state(n)), torch.zeros(n)) != 0).sum().item()
        assert nnz == round(density * n), (warmup, nnz)


@pytest.mark.parametrize("strategy", ["ring", "ps"])
@pytest.mark.parametrize("algo,kw", [("dgc", {"ratio": 0.02, "warmup_steps": 0}), ("topk", {"ratio": 0.02})])
def test_merged_sums_keep_the_density_of_the_union(strategy, algo, kw):
    """Four ranks: bit-identical to the oracle over two steps, and the result holds more than one
    rank's k per chunk (it would be cut back to k, 2%, if merged sums were re-selected at k)."""
    n, numel = 4, 4000
    grads = grads_for(n, numel, seed=5)
    bounds = [(0, numel)]
    got, _ = run_strategy(strategy, lambda: compression.get(algo, **kw), grads, bounds, steps=2)
    stores = [StateStore(r) for r in range(n)]
    for step in range(2):
        oracle = reference.ring if strategy == "ring" else \
            (lambda g, c, st, name, b: reference.ps(g, c, st, name, b, [0]))
        want = oracle(grads, compression.get(algo, **kw), stores, "w", bounds)
        for r in range(n):
            assert torch.equal(got[r][step], want[r]), (step, r)
    assert (got[0][0] != 0).sum().item() > 2 * 0.02 * numel


def record_receives(monkeypatch) -> list:
    """Every receive the strategies make from now on, as (its max_bytes bound, bytes received):
    the transports' sendrecv_alloc and alltoallv_alloc (one entry per source) wrapped."""
    from hipress.comm.transport.base import Transport
    seen = []
    real_sr, real_a2a = Transport.sendrecv_alloc, Transport.alltoallv_alloc

    def sendrecv_alloc(self, send_buf, dst, src, max_bytes=None):
        got = real_sr(self, send_buf, dst, src, max_bytes=max_bytes)
        seen.append((max_bytes, got.numel()))
        return got

    def alltoallv_alloc(self, send_buf, send_counts, max_bytes=None):
        buf, rc = real_a2a(self, send_buf, send_counts, max_bytes=max_bytes)
        seen.extend((None if max_bytes is None else max_bytes[src], c) for src, c in enumerate(rc))
        return buf, rc

    monkeypatch.setattr(Transport, "sendrecv_alloc", sendrecv_alloc)
    monkeypatch.setattr(Transport, "alltoallv_alloc", alltoallv_alloc)
    return seen


@pytest.mark.parametrize("strategy", ["ring", "ps"])
def test_a_sparse_sum_denser_than_half_travels_as_fp32(monkeypatch, strategy):
    """DGC in its warm-up's first stage keeps 25%: four ranks' sum is re-encoded at 100%, whose sparse
    form (a value and an index, 8 bytes an element) is twice the fp32 it stands for. It travels as
    fp32 instead: bit-identical to the oracle (which decodes the sparse form), and no message
    received is larger than the fp32 of its elements (and a frame's length)."""
    seen = record_receives(monkeypatch)
    n, numel = 4, 4000
    grads, bounds = grads_for(n, numel, seed=9), [(0, numel)]
    got, owners = run_strategy(strategy, lambda: compression.get("dgc"), grads, bounds, steps=2)
    stores = [StateStore(r) for r in range(n)]
    for step in range(2):
        want = (reference.ring(grads, compression.get("dgc"), stores, "w", bounds) if strategy == "ring" else
                reference.ps(grads, compression.get("dgc"), stores, "w", bounds, owners[0]))
        for r in range(n):
            assert torch.equal(got[r][step], want[r]), (step, r)
    element_bytes = 4 * (numel // n if strategy == "ring" else numel)
    largest = max(c for _, c in seen)
    assert largest <= 8 + element_bytes, (largest, element_bytes)
    # more than half the elements arrived (the union of four 25% selections, re-encoded at 100%):
    # in the sparse form that is more than 4 bytes an element
    assert (got[0][0] != 0).sum().item() > numel // 2


def test_dense_form_of_a_sparse_payload_decodes_from_any_offset():
    """no_larger_than_dense keeps a payload below 4 bytes an element and turns a denser one into
    the fp32 it decodes to; decode_payload reads that form from an unaligned place in a frame as
    well (records follow odd-sized ones), sets or adds; a quantizer's payload is never touched."""
    from hipress.sync.base import decode_payload, no_larger_than_dense
    n, x = 1000, torch.randn(1000)
    sparse = compression.get("dgc", ratio=0.01)
    small = sparse.encode(x)
    assert no_larger_than_dense(sparse, small, n) is small
    dense_sparse = compression.get("dgc", ratio=0.9)
    big = dense_sparse.encode(x)
    want = dense_sparse.decode(big, torch.zeros(n))
    sent = no_larger_than_dense(dense_sparse, big, n)
    assert big.numel() > 4 * n and sent.numel() == 4 * n
    record = unframe(frame([torch.zeros(3, dtype=torch.uint8), sent]), 2)[1]
    assert record.storage_offset() % 4 != 0  # after two 8-byte lengths and 3 bytes
    assert torch.equal(decode_payload(dense_sparse, record, torch.zeros(n)), want)
    assert torch.equal(decode_payload(dense_sparse, record, torch.ones(n), add=True), want + 1)
    onebit = compression.get("onebit")
    p = onebit.encode(x)
    assert no_larger_than_dense(onebit, p, n) is p


@pytest.mark.parametrize("strategy,algo,kw", [("ring", "dgc", {"ratio": 0.05}), ("ring", "adaq", {}),
                                              ("ps", "graddrop", {"ratio": 0.05}), ("allgather", "adaq", {}),
                                              ("lowrank", "powersgd", {"rank": 2})])
def test_strategies_bound_what_peers_send(monkeypatch, strategy, algo, kw):
    """Every receive the strategies make is bounded by the receiver's own max_encoded_bytes
    (framed where they frame), never unbounded, and the bound admits what peers really send."""
    seen = record_receives(monkeypatch)
    n, numel = 3, 2000
    bounds = chunk_bounds(numel, 2)
    run_strategy(strategy, lambda: compression.get(algo, **kw), grads_for(n, numel, seed=3), bounds)
    received = [(b, c) for b, c in seen if c > 0]
    assert received and all(b is not None and c <= b for b, c in received), received
    comp = compression.get(algo, **kw)
    if strategy == "ring":  # exactly the chunk's max_encoded_bytes (a merged sum's of n ranks where larger)
        chunk_max = {max(comp.max_encoded_bytes(e - s), comp.merged_for(n).max_encoded_bytes(e - s))
                     for s0, e0 in bounds for s, e in chunk_bounds(e0 - s0, n)}
        assert {b for b, _ in received} <= chunk_max


@pytest.mark.parametrize("strategy", ["ring", "ps", "allgather"])
@pytest.mark.parametrize("algo", ["terngrad", "onebit", "tbq"])
def test_payloads_of_known_size_go_without_their_sizes_first(monkeypatch, strategy, algo):
    """Quantizers whose payload size follows from the partition (encoded_bytes) move each ring hop,
    each PS gather and broadcast and each all-gather, as one exchange of exactly those bytes, with no sizes sent
    first, and the sync ends with the same bits as when the sizes travel (3 ranks: chunks of
    unequal length; 2 partitions, one of whole rows of a matrix (onebit's per-row scales); 2 steps
    of error feedback)."""
    from hipress.comm.exchange import Exchange
    from hipress.comm.transport.base import Transport
    from hipress.sync import ps, ring

    real_allgather = Exchange.allgather

    grads, bounds = grads_for(3, 2001, seed=5), [(0, 1280), (1280, 2001)]
    calls = {"sized": 0, "exchange": []}
    real_sr, real_a2a, real_ex = Transport.sendrecv_alloc, Transport.alltoallv_alloc, Transport.exchange

    def sendrecv_alloc(self, *a, **kw):
        calls["sized"] += 1
        return real_sr(self, *a, **kw)

    def alltoallv_alloc(self, *a, **kw):
        calls["sized"] += 1
        return real_a2a(self, *a, **kw)

    def exchange(self, sends, recvs):
        calls["exchange"].append(sorted(b.numel() for b in recvs.values()))
        return real_ex(self, sends, recvs)

    monkeypatch.setattr(Transport, "sendrecv_alloc", sendrecv_alloc)
    monkeypatch.setattr(Transport, "alltoallv_alloc", alltoallv_alloc)
    monkeypatch.setattr(Transport, "exchange", exchange)

    def run():
        return run_strategy(strategy, lambda: compression.get(algo), grads, bounds, steps=2,
                            segments=[(0, 1280, (20, 64)), (1280, 721, (721,))])[0]

    fast = run()
    assert calls["sized"] == 0
    # per rank and step: ring, 2 partitions x (2 reduce-scatter + 2 all-gather hops); PS, a gather and a
    # broadcast; allgather, one
    hops = {"ring": 2 * 4, "ps": 2, "allgather": 1}[strategy]
    assert len(calls["exchange"]) == 3 * 2 * hops
    comp = compression.get(algo)
    if strategy == "ring":
        sizes = {comp.encoded_bytes(e - s) for s0, e0 in bounds for s, e in chunk_bounds(e0 - s0, 3)}
        assert len(sizes) > 1 and {c for got in calls["exchange"] for c in got} == sizes
    if algo == "onebit":  # a scale per row of the matrix's partition (PS), one per chunk (ring)
        assert comp.encoded_bytes(1280, (20, 64)) == comp.encoded_bytes(1280) + 4 * 19

    monkeypatch.setattr(ring, "known_sizes", lambda *a: None)  # the sizes travel first, as for sparsifiers
    monkeypatch.setattr(ps, "known_frames", lambda *a: None)
    monkeypatch.setattr(Exchange, "allgather", lambda self, *a, size=None, **kw: real_allgather(self, *a, **kw))
    slow = run()
    assert calls["sized"] == 3 * 2 * hops
    for f, s in zip(fast, slow):
        for a, b in zip(f, s):
            assert torch.equal(a, b)


@pytest.mark.parametrize("algo", ["onebit", "terngrad"])
def test_known_sizes_hold_for_empty_ring_chunks(monkeypatch, algo):
    """More ranks than elements: the ring's empty chunks still travel (a header alone for onebit)
    with the sizes both ends computed, and the result is the one the sized path gives."""
    from hipress.sync import ring

    grads = grads_for(4, 2, seed=1)
    fast, _ = run_strategy("ring", lambda: compression.get(algo), grads, [(0, 2)])
    monkeypatch.setattr(ring, "known_sizes", lambda *a: None)
    slow, _ = run_strategy("ring", lambda: compression.get(algo), grads, [(0, 2)])
    assert all(torch.equal(a, b) for a, b in zip(fast, slow))


@pytest.mark.parametrize("strategy", ["ring", "ps"])
def test_a_payload_of_another_size_than_agreed_fails_before_it_is_sent(monkeypatch, strategy):
    """A compressor whose encoded_bytes is wrong fails the sync on every rank with the sizes
    named, before anything is sent (so no peer is left waiting for bytes that never come)."""
    from hipress.compression.native import TernGrad

    monkeypatch.setattr(TernGrad, "encoded_bytes", lambda self, numel, shape=None: self.max_encoded_bytes(numel) + 1)
    with pytest.raises(Exception, match=r"which expects \d+ \(the compressor's encoded_bytes\): nothing was sent"):
        run_strategy(strategy, lambda: compression.get("terngrad"), grads_for(2, 100), [(0, 100)])


def test_state_store_discard_drops_in_use_and_restored_states():
    comp = compression.get("onebit")
    st = StateStore(0)
    for k in ("a/p0/worker", "a/p1/worker", "ab/p0/worker", "b/p0/worker"):
        st.get(k, comp, 4)
    restored = StateStore(0)
    restored.load_state_dict(st.state_dict())
    for store in (st, restored):
        assert store.discard("a/") == 2
        assert sorted(store.state_dict()) == ["ab/p0/worker", "b/p0/worker"]
    st.undo_log.enabled = True  # a discarded state is not restored by an undo either
    st.get("c/p0/worker", comp, 4)
    st.get("b/p0/worker", comp, 4)
    st.discard("c/")
    st.discard("b/")
    st.undo()
    assert sorted(st.state_dict()) == ["ab/p0/worker"]


@pytest.mark.parametrize("mode", ["one thread", "two threads"])
def test_coordinator_closes_promptly_with_a_step_given_up(mode):
    """An exchange declared and planned, whose payload never comes (its task's dependency never
    finishes: a step given up), holds neither its sender nor its receiver at shutdown (close()
    raises if the executor still runs when its timeout passes; the receiver would otherwise wait
    in its transfer until the transport's timeout)."""
    def body(tr):
        eng = Engine()
        data = tr.split(0, key=tr.rank)
        ex = Executor(data, tr.split(0, key=tr.rank) if mode == "two threads" else None)
        exchange = CoordinatedExchange(eng, ex, range(tr.size))
        never = eng.submit_deferred("never", lambda completion: None)  # nobody completes it
        done = exchange.sendrecv("first", lambda: torch.ones(3), (tr.rank + 1) % tr.size, lambda t: None,
                                 (tr.rank - 1) % tr.size)
        done.result(timeout=30)
        # rank 0 -> rank 1 only: rank 1's slot only receives, from a rank that will never send
        exchange.bulk("given up", {1: lambda: torch.ones(3)} if tr.rank == 0 else {},
                      {0: lambda t: None} if tr.rank == 1 else {}, deps=[never] if tr.rank == 0 else [])
        ex.close(timeout=20)
        return ex.stats["messages"]

    assert loopback.spawn(3, body, timeout_s=60) == [1, 1, 1]  # each rank's first message moved, no other
