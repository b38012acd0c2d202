"""Uncompressed gradients through the transport's own allreduce (issue 21): the transport
operation, the sync strategy, how make_sync chooses it, and the planner's price of it.
Ranks are threads over the loopback transport."""
import dataclasses

import pytest
import torch

from hipress import compression
from hipress.comm.coordinator import Executor
from hipress.comm.exchange import CommChain, CoordinatedExchange, DirectExchange, Exchanges
from hipress.comm.transport import loopback
from hipress.comm.transport.base import Transport, TransportError
from hipress.compression.none import NoneCompressor
from hipress.engine import Engine
from hipress.planner.cost_model import AffineCurve, CostModel, executed_allreduce
from hipress.planner.plan import chunk_bounds
from hipress.sync import AllreduceStrategy, RingStrategy, StateStore, SyncContext, make_sync, reference
from hipress.sync.allreduce import contiguous_spans


def grads_for(n, numel, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=g) for _ in range(n)]


# ------------------------------------------------------------------ the transport operation
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_loopback_allreduce_sums_in_place_identically(n):
    grads = grads_for(n, 1001, seed=n)

    def body(tr):
        x = grads[tr.rank].clone()
        tr.allreduce(x)
        return x

    out = loopback.spawn(n, body, timeout_s=30)
    exact = torch.stack(grads).double().sum(0).float()
    for x in out:
        torch.testing.assert_close(x, exact, rtol=1e-6, atol=1e-6)
        assert torch.equal(x, out[0])  # every rank holds the same bits


def test_allreduce_of_nothing_and_of_views():
    def body(tr):
        tr.allreduce(torch.empty(0))  # nothing to sum: no error
        buf = torch.full((10,), float(tr.rank + 1))
        tr.allreduce(buf[2:7])  # a contiguous view: only it changes
        return buf

    for r, buf in enumerate(loopback.spawn(3, body, timeout_s=30)):
        assert buf[2:7].tolist() == [6.0] * 5
        assert buf[:2].tolist() == buf[7:].tolist()[:2] == [float(r + 1)] * 2


@pytest.mark.parametrize("bad,match", [
    (lambda r: torch.zeros(4, dtype=torch.float64), "torch.float32"),
    (lambda r: torch.zeros(4, 2), "1-D"),
    (lambda r: torch.zeros(8)[::2], "contiguous"),
    (lambda r: torch.zeros(4, dtype=torch.uint8), "torch.float32"),
])
def test_bad_values_raise_the_same_error_on_every_rank(bad, match):
    """Rank 1 passes a bad tensor: with checking, every rank raises (rank 0 names rank 1)."""
    def body(tr):
        x = bad(tr.rank) if tr.rank == 1 else torch.zeros(4)
        try:
            tr.allreduce(x)
        except TransportError as e:
            return str(e), e.peers
        return None

    out = loopback.spawn(2, body, timeout_s=30)
    assert out[1] is not None and match in out[1][0]
    assert out[0] is not None and "rank(s) [1] passed invalid arguments" in out[0][0] and out[0][1] == [1]


def test_lengths_that_differ_between_ranks_are_refused_on_every_rank():
    def body(tr):
        try:
            tr.allreduce(torch.zeros(5 + (tr.rank == 2)))
        except TransportError as e:
            return str(e), e.peers
        return None

    for msg, peers in loopback.spawn(3, body, timeout_s=30):
        assert "element counts differ between ranks: [5, 5, 6]" in msg and 2 in peers


def _counting_meta_rounds(monkeypatch):
    """Counts the checking rounds (Transport._meta_gather) of every rank (threads share the class)."""
    calls = []
    real = Transport._meta_gather

    def counted(self, op, values):
        calls.append(op)
        return real(self, op, values)

    monkeypatch.setattr(Transport, "_meta_gather", counted)
    return calls


def test_sizes_agreed_skips_the_checking_round_and_still_sums(monkeypatch):
    calls = _counting_meta_rounds(monkeypatch)

    def body(tr):
        x = torch.full((7,), float(tr.rank + 1))
        tr.allreduce(x, sizes_agreed=True)
        rows = torch.empty(3 * 2, dtype=torch.uint8)
        tr.allgather(torch.tensor([tr.rank, 10 + tr.rank], dtype=torch.uint8), rows, sizes_agreed=True)
        return x, rows

    for x, rows in loopback.spawn(3, body, timeout_s=30):
        assert x.tolist() == [6.0] * 7
        assert rows.tolist() == [0, 10, 1, 11, 2, 12]
    assert calls == []
    # without it, each call has its round on every rank
    loopback.spawn(3, lambda tr: tr.allreduce(torch.ones(2)), timeout_s=30)
    assert calls == ["allreduce"] * 3


def test_phases_apart_check_once_where_the_layout_was_agreed(monkeypatch):
    """dear's phases: a reduce-scatter with agree_on has one checking round for all its spans
    (the later spans' sizes follow from it); with sizes_agreed, neither phase has one."""
    calls = _counting_meta_rounds(monkeypatch)
    bounds = [(0, 40), (50, 90)]  # two spans

    def body(tr, **first):
        eng = Engine()
        try:
            ctx = SyncContext(eng, DirectExchange(eng, tr, CommChain()), NoneCompressor(), StateStore(tr.rank))
            strat, flat = AllreduceStrategy(), torch.full((90,), float(tr.rank + 1))
            strat.reduce_scatter(ctx, "w", flat, bounds, **first).result(timeout=30)
            strat.all_gather(ctx, "w", flat, bounds, sizes_agreed=True).result(timeout=30)
            return tr.rank, flat
        finally:
            eng.shutdown()

    for r, flat in loopback.spawn(3, lambda tr: body(tr, agree_on=7), timeout_s=30):
        assert flat[:40].tolist() == [2.0] * 40 and flat[50:].tolist() == [2.0] * 40  # the mean of 1, 2, 3
        assert flat[40:50].tolist() == [r + 1.0] * 10  # between the spans: untouched
    assert calls == ["alltoallv"] * 3
    calls.clear()
    loopback.spawn(3, lambda tr: body(tr, sizes_agreed=True), timeout_s=30)
    assert calls == []
    calls.clear()
    loopback.spawn(3, body, timeout_s=30)  # nothing agreed: each span of the reduce-scatter checks
    assert calls == ["alltoallv"] * 6


def test_agree_on_that_differs_is_refused_on_every_rank_before_data_moves():
    def body(tr):
        x = torch.ones(4)
        try:
            tr.allreduce(x, agree_on=111 if tr.rank != 1 else 222)
        except TransportError as e:
            return str(e), e.peers, x.tolist()
        return None

    for msg, peers, x in loopback.spawn(3, body, timeout_s=30):
        assert "ranks disagree on what the sizes follow from (agree_on): [111, 222, 111]" in msg and 1 in peers
        assert x == [1.0] * 4  # nothing was summed


def test_alltoallv_agree_on_that_differs_is_refused_on_every_rank():
    def body(tr):
        recv = torch.zeros(3 * 4, dtype=torch.uint8)
        try:
            tr.alltoallv(torch.ones(3 * 4, dtype=torch.uint8), [4] * 3, recv, [4] * 3, agree_on=5 + (tr.rank == 2))
        except TransportError as e:
            return str(e), e.peers, recv.tolist()
        return None

    for msg, peers, recv in loopback.spawn(3, body, timeout_s=30):
        assert "ranks disagree on what the sizes follow from (agree_on): [5, 5, 6]" in msg and 2 in peers
        assert recv == [0] * 12  # nothing moved


def test_a_rank_that_never_arrives_is_named():
    def body(tr):
        if tr.rank == 1:
            return None  # leaves without taking part
        try:
            tr.allreduce(torch.ones(3))
        except TransportError as e:
            return e.peers
        return "no error"

    assert loopback.spawn(2, body, timeout_s=10)[0] == [1]


def test_a_transport_without_a_native_allreduce_says_so():
    class NoSum(loopback.LoopbackTransport):
        _raw_allreduce = Transport._raw_allreduce

    tr = NoSum(loopback.LoopbackWorld(1), 0)
    assert not tr.has_allreduce and loopback.LoopbackTransport(loopback.LoopbackWorld(1), 0).has_allreduce
    with pytest.raises(NotImplementedError, match="has no allreduce"):
        tr.allreduce(torch.ones(2))


# ------------------------------------------------------------------ the strategy
def test_contiguous_spans():
    assert contiguous_spans([(0, 3), (3, 7), (7, 7), (9, 12)]) == [(0, 7), (9, 12)]
    assert contiguous_spans([(0, 0)]) == []
    assert contiguous_spans(chunk_bounds(1001, 4)) == [(0, 1001)]


def run_allreduce(grads, bounds, average=True, steps=1, wire=torch.float32):
    n = len(grads)

    def body(tr):
        eng = Engine()
        try:
            ctx = SyncContext(eng, DirectExchange(eng, tr, CommChain()), NoneCompressor(), StateStore(tr.rank))
            strat = AllreduceStrategy(average=average, wire=wire)
            out = []
            for _ in range(steps):
                flat = grads[tr.rank].clone()
                strat.build(ctx, "w", flat, bounds).result(timeout=30)
                out.append(flat)
            return out[-1], eng.counters(), out, strat
        finally:
            eng.shutdown()

    return loopback.spawn(n, body, timeout_s=60)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("average", [True, False])
def test_bf16_on_the_wire_is_the_sum_of_bf16_roundings(n, average):
    """wire=bf16: each rank's gradient rounded to bf16, summed (in bf16, rank order on loopback),
    copied back to fp32, then divided. Also over a gap in the partitions (two collectives)."""
    numel = 2049
    grads = grads_for(n, numel, seed=7 + n)
    bounds = [(0, 1000), (1000, 1000), (1200, 2049)]  # a gap: elements 1000..1199 are not synced
    out = run_allreduce(grads, bounds, average=average, steps=2, wire=torch.bfloat16)
    want = grads[0].to(torch.bfloat16)
    for g in grads[1:]:
        want = want + g.to(torch.bfloat16)
    want = want.float() / (n if average else 1)
    for r, (flat, _, steps, strat) in enumerate(out):
        assert flat.dtype == torch.float32
        assert torch.equal(flat[:1000], want[:1000]) and torch.equal(flat[1200:], want[1200:])
        assert torch.equal(flat[1000:1200], grads[r][1000:1200])  # outside the partitions: untouched
        assert torch.equal(steps[0], steps[1])  # the reused bf16 buffer carries nothing over
        assert len(strat._scratch) == 1
        # within bf16's rounding of the exact average (2^-8 relative per value, n values)
        exact = torch.stack(grads).double().sum(0).float() / (n if average else 1)
        torch.testing.assert_close(flat[1200:], exact[1200:], rtol=0, atol=n * 2 ** -8 * 4)


def test_make_sync_refuses_a_wire_dtype_the_backend_cannot_sum():
    class Fp32Only(loopback.LoopbackTransport):
        allreduce_dtypes = (torch.float32,)

    eng = Engine()
    try:
        tr = Fp32Only(loopback.LoopbackWorld(1), 0)
        ex = _exchanges(eng, tr)
        with pytest.raises(ValueError, match="does not sum torch.bfloat16"):
            make_sync(eng, ex, NoneCompressor(), "ring", StateStore(0), True, False, 1, True, wire=torch.bfloat16)
        assert make_sync(eng, ex, NoneCompressor(), "ring", StateStore(0), True, False, 1, True).strategy.wire \
            == torch.float32
    finally:
        eng.shutdown()


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("numel,k", [(0, 1), (1, 1), (1001, 1), (4097, 4)])
def test_strategy_equals_exact_average(n, numel, k):
    grads = grads_for(n, numel, seed=numel + n)
    out = run_allreduce(grads, chunk_bounds(numel, k))
    exact = torch.stack(grads).double().mean(0).float()
    for flat, *_ in out:
        torch.testing.assert_close(flat, exact, rtol=1e-6, atol=1e-6)
        assert torch.equal(flat, out[0][0])


@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("average", [True, False])
def test_into_writes_the_result_into_the_gradients_themselves(wire, average):
    """into=[(offset, tensor)]: the result goes to the fused gradients (shaped as they are), the
    same values the strategy otherwise leaves in flat; K touching partitions are still one span.
    into that does not tile the bucket is refused."""
    n, shapes = 3, [(3, 5), (7,), (2, 2, 4)]
    numel = sum(torch.Size(s).numel() for s in shapes)
    grads = grads_for(n, numel, seed=11)
    want = run_allreduce(grads, chunk_bounds(numel, 2), average=average, wire=wire)[0][0]

    def body(tr):
        eng = Engine()
        try:
            ctx = SyncContext(eng, DirectExchange(eng, tr, CommChain()), NoneCompressor(), StateStore(tr.rank))
            strat = AllreduceStrategy(average=average, wire=wire)
            dsts, into, off = [], [], 0
            for shape in shapes:
                dsts.append(torch.full(shape, float("nan")))
                into.append((off, dsts[-1]))
                off += dsts[-1].numel()
            strat.build(ctx, "w", grads[tr.rank].clone(), chunk_bounds(numel, 2), into=into).result(timeout=30)
            with pytest.raises(ValueError, match="must tile the whole gradient"):
                strat.build(ctx, "x", grads[tr.rank].clone(), [(0, numel)], into=into[:2])
            return torch.cat([d.reshape(-1) for d in dsts])
        finally:
            eng.shutdown()

    for got in loopback.spawn(n, body, timeout_s=60):
        assert torch.equal(got, want)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("average", [True, False])
def test_phases_apart_are_the_exact_sum_identical_on_every_rank(n, average):
    """strategy "dear"'s two phases over the backend's collectives: after the reduce-scatter each
    rank's chunk of each span holds the average (or sum); after the all-gather every rank holds
    the owners' bits, with a gap in the partitions left untouched and chunks of unequal sizes.
    Two steps with other gradients: the scratch kept between steps carries nothing over."""
    numel = 1003
    steps = [grads_for(n, numel, seed=11 + n), grads_for(n, numel, seed=211 + n)]
    bounds = [(0, 500), (500, 500), (600, 1003)]  # elements 500..599 are not synced

    def body(tr):
        eng = Engine()
        try:
            ctx = SyncContext(eng, DirectExchange(eng, tr, CommChain()), NoneCompressor(), StateStore(tr.rank))
            strat = AllreduceStrategy(average=average)
            out = []
            for grads in steps:
                flat = grads[tr.rank].clone()
                strat.reduce_scatter(ctx, "w", flat, bounds).result(timeout=30)
                reduced = flat.clone()
                strat.all_gather(ctx, "w", flat, bounds).result(timeout=30)
                out.append((reduced, flat))
            return out
        finally:
            eng.shutdown()

    out = loopback.spawn(n, body, timeout_s=60)
    for step, grads in enumerate(steps):
        exact = torch.stack(grads).double().sum(0).float()
        for r, per_step in enumerate(out):
            reduced, flat = per_step[step]
            for s, e in [(0, 500), (600, 1003)]:
                cs, ce = chunk_bounds(e - s, n)[r]
                want = exact[s:e] / (n if average else 1)
                torch.testing.assert_close(reduced[s + cs:s + ce], want[cs:ce], rtol=1e-6, atol=1e-6)
                torch.testing.assert_close(flat[s:e], want, rtol=1e-6, atol=1e-6)
                assert torch.equal(flat[s + cs:s + ce], reduced[s + cs:s + ce])  # sent as the owner holds it
                assert torch.equal(flat[s:e], out[0][step][1][s:e])  # the owner's bits on every rank
            assert torch.equal(flat[500:600], grads[r][500:600])


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("large", [True, False])
def test_phases_apart_keep_large_scratch_between_steps(n, large):
    """dear's receive buffer is allocated once per gradient where it is as large as malloc maps
    afresh each call (MMAP_BYTES, lowered here), and per step below it; the all-gather sends the
    owner's chunk from its place, without a buffer."""
    grads = grads_for(n, 1003, seed=5)

    def body(tr):
        eng = Engine()
        try:
            ctx = SyncContext(eng, DirectExchange(eng, tr, CommChain()), NoneCompressor(), StateStore(tr.rank))
            strat = AllreduceStrategy()
            if large:
                strat.MMAP_BYTES = 4 * 300  # every chunk here has at least 334 elements
            ptrs = []
            for _ in range(2):
                flat = grads[tr.rank].clone()
                strat.reduce_scatter(ctx, "w", flat, [(0, 1003)]).result(timeout=30)
                strat.all_gather(ctx, "w", flat, [(0, 1003)]).result(timeout=30)
                ptrs.append(sorted(t.data_ptr() for t in strat._scratch.values()))
            return ptrs
        finally:
            eng.shutdown()

    for first, second in loopback.spawn(n, body, timeout_s=60):
        assert first == second and len(first) == (1 if large else 0)


def test_into_refuses_what_its_native_pass_cannot_write():
    eng = Engine()
    try:
        tr = loopback.LoopbackTransport(loopback.LoopbackWorld(1), 0)
        ctx = SyncContext(eng, DirectExchange(eng, tr, CommChain()), NoneCompressor(), StateStore(0))
        flat = torch.zeros(6)
        with pytest.raises(ValueError, match="contiguous fp32 CPU"):
            AllreduceStrategy().build(ctx, "g", flat, [(0, 6)], into=[(0, torch.zeros(6, dtype=torch.float64))])
        with pytest.raises(ValueError, match="contiguous fp32 CPU"):
            AllreduceStrategy().build(ctx, "g", flat, [(0, 6)], into=[(0, torch.zeros(12)[::2])])
        with pytest.raises(ValueError, match="must tile"):
            AllreduceStrategy().build(ctx, "g", flat, [(0, 6)], into=[(3, torch.zeros(6))])
    finally:
        eng.shutdown()


def test_strategy_issues_one_collective_per_bucket_whatever_k():
    """K partitions that touch are one allreduce (one comm task), not K."""
    grads = grads_for(3, 4097)
    for flat, stats, *_ in run_allreduce(grads, chunk_bounds(4097, 4), average=False):
        torch.testing.assert_close(flat, torch.stack(grads).sum(0), rtol=1e-6, atol=1e-6)
        assert stats["comm"]["tasks_run"] == 1, stats


def test_compressed_and_plain_buckets_share_one_order_of_communication():
    """A ring-compressed bucket and an allreduce bucket submitted on one chain, in the same
    order on every rank, both arrive: the compressed one as its reference, the plain one exact."""
    n = 3
    comp_grads, plain_grads = grads_for(n, 600, seed=1), grads_for(n, 777, seed=2)
    bounds_c, bounds_p = chunk_bounds(600, 2), chunk_bounds(777, 1)
    comp = lambda: compression.get("tbq", threshold=0.05)  # noqa: E731

    def body(tr):
        eng = Engine()
        try:
            exchange = DirectExchange(eng, tr, CommChain())
            st = StateStore(tr.rank)
            c = SyncContext(eng, exchange, comp(), st)
            p = SyncContext(eng, exchange, NoneCompressor(), st)
            a, b = comp_grads[tr.rank].clone(), plain_grads[tr.rank].clone()
            h1 = RingStrategy().build(c, "a", a, bounds_c)
            h2 = AllreduceStrategy().build(p, "b", b, bounds_p)
            h1.result(timeout=30)
            h2.result(timeout=30)
            return a, b
        finally:
            eng.shutdown()

    out = loopback.spawn(n, body, timeout_s=60)
    want = reference.ring(comp_grads, comp(), [StateStore(r) for r in range(n)], "a", bounds_c)
    exact = torch.stack(plain_grads).double().mean(0).float()
    for r, (a, b) in enumerate(out):
        torch.testing.assert_close(a, want[r], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b, exact, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ make_sync's choice
def _exchanges(eng, tr, coordinated_with=None, beside=False):
    chain = CommChain()
    d = DirectExchange(eng, tr, chain)
    direct = Exchanges(d, d, d)
    if coordinated_with is not None:
        ex = CoordinatedExchange(eng, coordinated_with, range(tr.size))
        return Exchanges(ex, ex, ex, plain=direct if beside else None)
    return direct


@pytest.mark.parametrize("mode", ["direct", "coordinated", "coordinated, direct beside"])
def test_make_sync_sends_uncompressed_gradients_through_the_allreduce_where_it_can(mode):
    def body(tr):
        eng = Engine()
        executor = Executor(tr.split(0, key=tr.rank)) if mode != "direct" else None
        try:
            ex = _exchanges(eng, tr, executor, beside=mode.endswith("beside"))
            st = StateStore(tr.rank)

            def kind(comp, strategy, **kw):
                sync = make_sync(eng, ex, comp, strategy, st, True, False, tr.size, True, **kw)
                return sync.strategy.name, type(sync.ctx.exchange).__name__[:6]

            return (kind(NoneCompressor(), "ring"), kind(NoneCompressor(), "ps"),
                    kind(NoneCompressor(), "ring", plain_allreduce=False),
                    kind(compression.get("tbq", threshold=0.05), "ring"))
        finally:
            if executor is not None:
                executor.close()
            eng.shutdown()

    got = loopback.spawn(2, body, timeout_s=60)[0]
    if mode == "coordinated":  # the coordinator plans point-to-point messages: the named strategies run them
        assert got == (("ring", "Coordi"), ("ps", "Coordi"), ("ring", "Coordi"), ("ring", "Coordi"))
    elif mode == "direct":
        assert got == (("allreduce", "Direct"), ("allreduce", "Direct"), ("ring", "Direct"), ("ring", "Direct"))
    else:  # uncompressed sums by the allreduce of the direct exchanges beside the coordinator
        assert got == (("allreduce", "Direct"), ("allreduce", "Direct"), ("ring", "Coordi"), ("ring", "Coordi"))


@pytest.mark.parametrize("coordinated", [False, True])
def test_gather_rows_gives_every_rank_every_row_in_order(coordinated):
    """The optimizer's per-step agreement where the backend has no control transport: queued on
    the comm chain (direct) or planned by the coordinator, twice in a row (a step after a step)."""
    def body(tr):
        eng = Engine()
        executor = Executor(tr.split(0, key=tr.rank)) if coordinated else None
        try:
            ex = _exchanges(eng, tr, executor).world
            tables = []
            for step in range(2):
                row = torch.tensor([tr.rank, step, 7, 100 + tr.rank], dtype=torch.uint8)
                table = torch.empty(tr.size * 4, dtype=torch.uint8)
                ex.gather_rows("step agreement", row, table).result(timeout=30)
                tables.append(table.view(tr.size, 4).tolist())
            return tables
        finally:
            if executor is not None:
                executor.close()
            eng.shutdown()

    for tables in loopback.spawn(3, body, timeout_s=60):
        for step, table in enumerate(tables):
            assert table == [[r, step, 7, 100 + r] for r in range(3)]


def test_local_aggregation_sums_the_host_with_the_allreduce():
    """4 ranks on 2 "hosts": the host phase is an allreduce; uncompressed across hosts too."""
    n = 4
    grads = grads_for(n, 501, seed=3)

    def body(tr):
        eng = Engine()
        try:
            local, cross = tr.split(tr.rank // 2), tr.split(tr.rank % 2)
            chain = CommChain()
            ex = Exchanges(DirectExchange(eng, tr, chain), DirectExchange(eng, local, chain),
                           DirectExchange(eng, cross, chain))
            sync = make_sync(eng, ex, NoneCompressor(), "ring", StateStore(tr.rank), True, True, n,
                             local.rank == 0)
            flat = grads[tr.rank].clone()
            sync.build("w", flat, chunk_bounds(501, 2)).result(timeout=30)
            return sync.strategy.local_sum.name, sync.strategy.cross.name, flat
        finally:
            eng.shutdown()

    exact = torch.stack(grads).double().mean(0).float()
    for local_name, cross_name, flat in loopback.spawn(n, body, timeout_s=60):
        assert (local_name, cross_name) == ("allreduce", "allreduce")
        torch.testing.assert_close(flat, exact, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ the planner
def _model(**kw):
    send = AffineCurve(1e-4, 1e-9)  # 0.1 ms + 1 GB/s
    return CostModel(send, AffineCurve(1e-5, 1e-10), AffineCurve(1e-5, 1e-10), 4, "ring", "quantization", 1 / 16,
                     enc_plain=AffineCurve(0.0, 0.0), dec_plain=AffineCurve(0.0, 1e-10), task_s=2e-5, **kw)


def test_planner_prices_the_plain_path_as_one_collective():
    m = 8 << 20
    model = _model(plain_allreduce=True)
    want = 2 * 3 * model.send(m / 4) + 2e-5 + model.dec_plain(m)
    assert executed_allreduce(model.send, model.dec_plain, model.task_s, m, 4) == pytest.approx(want)
    assert all(model.t_sync(m, False, k) == pytest.approx(want) for k in (1, 2, 4))
    # hipress's own ring pays a task hand-off per step and, with K partitions, K times the latency
    assert _model().t_sync(m, False, 4) > want
    d = model.decide(m)
    assert d.t_orig == pytest.approx(want) and d.k_orig == 1
    assert model.t_sync(m, True, 2) == _model().t_sync(m, True, 2)  # the compressed branch is unchanged


def test_planner_prices_the_plain_path_with_the_measured_allreduce():
    """A profile with the backend's allreduce measured (curve A) prices the plain branch with it:
    A(m) + o + pass(m) for fp32 and A(m/2) + o + pass(m) for bf16 (cast in the copy), whatever the
    transfer curve says; without A the transfers price it (test above)."""
    m = 8 << 20
    measured = AffineCurve(5e-3, 2e-8)  # 5 ms + 50 MB/s: far from the ring the transfer curve gives
    model = _model(plain_allreduce=True, plain16=True, allreduce=measured)
    want = measured(m) + 2e-5 + model.dec_plain(m)
    assert model.t_sync(m, False, 1) == pytest.approx(want)
    want16 = measured(m / 2) + 2e-5 + model.dec_plain(m)
    assert model.t_sync(m, False, 1, bf16=True) == pytest.approx(want16)
    assert model.decide(m, bf16=None).bf16  # half the bytes, at no other cost
    assert _model(plain_allreduce=True).t_sync(m, False, 1) < want  # the transfers' ring: much faster
    assert model.t_sync(m, True, 2) == _model().t_sync(m, True, 2)  # the compressed branch is unchanged


def test_planner_prices_a_small_plain_bucket_as_its_share_of_a_fused_one():
    """With plain_fusion_bytes F, an uncompressed bucket of m < F bytes costs m / F of one
    allreduce of F (runs of them are fused before they are sent), so the allreduce's fixed
    costs no longer push small buckets into compression; at F and above, and for the fused
    bucket itself (Plan.regroup_uncompressed), the bucket is priced alone."""
    from hipress.planner.plan import Overrides, make_plan

    f = 25 << 20
    alone, fused = _model(plain_allreduce=True), _model(plain_allreduce=True, plain_fusion_bytes=f)
    for m in (1 << 10, 1 << 20):
        assert fused.t_sync(m, False, 1) == pytest.approx(m / f * alone.t_sync(f, False, 1))
        assert fused.t_sync(m, True, 2) == alone.t_sync(m, True, 2)  # the compressed branch is unchanged
    assert fused.t_sync(f, False, 1) == alone.t_sync(f, False, 1)
    assert fused.t_sync(2 * f, False, 1) == alone.t_sync(2 * f, False, 1)
    m = 1 << 20  # with 1 ms per transfer and 1 GB/s, one MiB alone is cheaper compressed
    slow = dict(send=AffineCurve(1e-3, 1e-9), plain_allreduce=True)
    alone, fused = (dataclasses.replace(_model(), **slow, plain_fusion_bytes=b) for b in (0, f))
    assert alone.decide(m).compress and not fused.decide(m).compress
    plan = make_plan([("a", m), ("b", m)], fused, Overrides())
    plan.regroup_uncompressed(["a", "b"], [("ab", 2 * m, 2)])
    assert plan["ab"].t_pred == pytest.approx(alone.t_sync(2 * m, False, 1))
    with pytest.raises(ValueError, match="plain_fusion_bytes"):
        _model(plain_allreduce=True, plain_fusion_bytes=-1)


def test_planner_compresses_less_when_the_plain_path_is_cheaper():
    """Where compressing barely beats hipress's ring, the allreduce wins instead."""
    slow_ring = _model(plain_allreduce=False)
    fast = _model(plain_allreduce=True)
    decided = [(slow_ring.decide(m).compress, fast.decide(m).compress) for m in (1 << 10, 1 << 16, 1 << 20, 1 << 24)]
    assert all(f <= s for s, f in decided)  # never compresses more with the cheaper plain path
