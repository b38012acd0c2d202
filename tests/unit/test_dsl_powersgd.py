"""PowerSGD written in the DSL (hipress/dsl/specs/powersgd.cll), compiled at run time, against the
built-in generated from the same spec (hipress.compression.native.PowerSGD): same payload bytes, same
state, same decoded gradients, in a single process (encode/decode) and through the multi-round API
(encode_round/combine/finish) and the low-rank strategy on 3 ranks. Both run the same operators
(ops::matmul_*, ops::orthogonalize) in the same order, so the comparison is bitwise: no tolerance."""
import pytest
import torch

from dsl_common import same_codec, same_state, threads  # noqa: F401  (compile cache, fixture)
from hipress import compll
from hipress.compression.native import PowerSGD
from hipress.sync import StateStore, reference

SHAPES = [(0,), (1,), (2,), (7,), (1000,), (1, 1), (5, 3), (3, 5), (7, 1), (1, 9), (2, 2), (33, 65), (64, 128),
          (257, 31), (8, 4, 3), (100, 1000)]
RANKS = [1, 2, 4]


@pytest.fixture(scope="module")
def gen():
    return compll.load("powersgd", name="dsl_powersgd")


def grad(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.1


def pair(gen, rank, seed=0, ef=True):
    return gen(rank=rank, seed=seed, error_feedback=int(ef)), PowerSGD(rank=rank, seed=seed, error_feedback=ef)


@pytest.mark.parametrize("rank", RANKS)
@pytest.mark.parametrize("ef,seed", [(True, 0), (False, 7)], ids=["ef-seed0", "noef-seed7"])
def test_single_process_identical(gen, threads, rank, ef, seed):
    g_c, h_c = pair(gen, rank, seed, ef)
    for shape in SHAPES:  # the second step uses the warm-started Q and the residual
        n = int(torch.tensor(shape).prod()) if shape else 0
        same_codec(g_c, h_c, [grad(shape, seed=step + 10 * n) for step in range(2)], n, shape,
                   what=f"rank {rank} shape {shape}")


@pytest.mark.parametrize("rank", RANKS)
def test_multi_round_identical(gen, threads, rank):
    g_c, h_c = pair(gen, rank)
    assert (g_c.rounds, g_c.aggregatable, g_c.category) == (h_c.rounds, h_c.aggregatable, h_c.category) == \
        (2, True, "lowrank")
    same_rounds(g_c, h_c, f"rank {rank}")


def same_rounds(g_c, h_c, what):
    """Two workers through encode_round / combine / finish, two steps, with each compressor: the
    same bytes, sums, states and outputs."""
    for shape in SHAPES:
        n = int(torch.tensor(shape).prod()) if shape else 0
        m = (shape[0], n // shape[0]) if len(shape) > 1 else (n, 1)
        states = [[c.new_state(n, m) for _ in range(2)] for c in (g_c, h_c)]
        for step in range(2):
            grads = [grad(shape, seed=100 * step + r + n) for r in range(2)]
            sums = []
            for c, sts in zip((g_c, h_c), states):
                p = [c.encode_round(0, grads[r], sts[r]) for r in range(2)]
                ps = c.combine(p[0], p[1])
                q = [c.encode_round(1, ps, sts[r]) for r in range(2)]
                qs = c.combine(q[0], q[1])
                outs = [torch.zeros(n) for _ in range(2)]
                for r in range(2):
                    c.finish(qs, sts[r], outs[r])
                sums.append((p, ps, q, qs, outs))
            for x, y, part in zip(sums[0], sums[1], ("round 0", "sum P", "round 1", "sum Q", "finish")):
                xs, ys = (x, y) if isinstance(x, list) else ([x], [y])
                for u, v in zip(xs, ys):
                    assert torch.equal(u, v), f"{what} shape {shape} step {step}: {part} differs"
            for r in range(2):
                same_state(states[0][r], states[1][r], f"{what} shape {shape} step {step} worker {r}")
        out = torch.ones(n)
        g_c.finish(sums[0][3], states[0][0], out, add=True)
        o2 = torch.ones(n)
        h_c.finish(sums[0][3], states[1][0], o2, add=True)
        assert torch.equal(out, o2)


def test_three_rank_lowrank_reference(gen):
    """The low-rank strategy's sequential reference (hipress/sync/reference.py, what the multi-process
    optimizer test compares DistributedOptimizer with) gives the same result, bit for bit, with the
    generated and the hand-written PowerSGD, over 2 steps of state. Sums, not averages: the hand-written
    one averages its Q sum before the product (scale_sum), a generated one the product after it."""
    g_c, h_c = gen(rank=2), PowerSGD(rank=2)
    for shape in [(64, 33), (17,), (9, 5, 2)]:
        stores = {c: [StateStore(r) for r in range(3)] for c in ("gen", "hand")}
        for step in range(2):
            grads = [grad(shape, seed=1000 * step + r) for r in range(3)]
            a = reference.lowrank(grads, g_c, stores["gen"], "w", shape, average=False)
            b = reference.lowrank(grads, h_c, stores["hand"], "w", shape, average=False)
            for r in range(3):
                assert torch.equal(a[r], b[r]), f"{shape} step {step} rank {r}"
            for r in range(1, 3):
                assert torch.equal(a[r], a[0])  # every rank ends bit-identical


def test_average_taken_in_the_q_sum_or_after_the_product(gen):
    """Averaging over 3 ranks: the hand-written PowerSGD scales its Q sum (scale_sum: 4 x rank floats per
    row instead of a pass over the matrix), a generated one has no scale_sum and the decoded matrix is
    divided. Both give the sum's decode / 3 to float rounding, over 2 steps (the second warm-started from
    the scaled Q). scale_sum refuses a payload of the first round (P: its decode is not linear in it)."""
    shape = (64, 33)
    for comp, scales in ((PowerSGD(rank=2), True), (gen(rank=2), False)):
        stores = {avg: [StateStore(r) for r in range(3)] for avg in (True, False)}
        for step in range(2):
            grads = [grad(shape, seed=1000 * step + r) for r in range(3)]
            mean = reference.lowrank(grads, comp, stores[True], "w", shape)
            total = reference.lowrank(grads, comp, stores[False], "w", shape, average=False)
            for r in range(3):
                assert torch.allclose(mean[r], total[r] / 3, rtol=1e-5, atol=1e-7), f"{comp.name} step {step}"
        state = comp.new_state(64 * 33, shape)
        p_payload = comp.encode_round(0, grad(shape, seed=1), state)
        if scales:
            with pytest.raises(ValueError, match="last round"):
                comp.scale_sum(p_payload, 0.5)
        else:
            assert not comp.scale_sum(p_payload, 0.5)


def test_loopback_lowrank_strategy_matches_reference(gen):
    """LowRankStrategy over the in-process transport (3 ranks as threads) with the generated PowerSGD equals
    the sequential reference."""
    from hipress.engine import Engine
    from hipress.comm.exchange import CommChain, DirectExchange
    from hipress.sync import SyncContext
    from hipress.sync.lowrank import LowRankStrategy
    from hipress.comm.transport import loopback

    shape, nr = (40, 12), 3
    grads = [grad(shape, seed=50 + r).view(-1) for r in range(nr)]
    results = [None] * nr

    def body(tr):
        eng = Engine()
        try:
            ctx = SyncContext(eng, DirectExchange(eng, tr, CommChain()), gen(rank=2), StateStore(tr.rank))
            out = []
            for _ in range(2):
                flat = grads[tr.rank].clone()
                LowRankStrategy().build(ctx, "w", flat, [(0, flat.numel())], shape=shape).result(timeout=30)
                out.append(flat)
            results[tr.rank] = out
        finally:
            eng.shutdown()

    loopback.spawn(nr, body, timeout_s=60)
    stores = [StateStore(r) for r in range(nr)]
    for step in range(2):
        want = reference.lowrank([g.clone() for g in grads], gen(rank=2), stores, "w", shape)
        for r in range(nr):
            assert torch.equal(results[r][step], want[r]), f"step {step} rank {r}"


def test_errors(gen):
    c = gen(rank=2)
    st = c.new_state(60, (6, 10))
    p = c.encode_round(0, grad((6, 10), 1), st)
    with pytest.raises(ValueError, match="needs the state"):  # a round payload is not a single-process one
        c.decode(p, torch.zeros(60))
    q = c.encode_round(1, c.combine(p, p), st)
    with pytest.raises(ValueError, match="different rounds"):
        c.combine(p, q)
    with pytest.raises(ValueError, match="expected kind 1"):
        c.encode_round(1, q, st)
    with pytest.raises(ValueError):  # corrupt header
        bad = q.clone()
        bad[10] ^= 1
        c.finish(bad, st, torch.zeros(60))
    with pytest.raises(ValueError):  # truncated
        c.finish(q[:-4], st, torch.zeros(60))
    other = c.new_state(60, (10, 6))
    with pytest.raises(ValueError, match="shape does not match"):
        c.finish(q, other, torch.zeros(60))
    with pytest.raises(ValueError, match="needs a state"):
        c.encode_round(0, grad((6, 10), 1), None)
    with pytest.raises(ValueError, match="round must be"):
        c.encode_round(2, q, st)
    with pytest.raises(ValueError, match=r"rank must be in \[1, 4096\]"):
        gen(rank=0)
    with pytest.raises(ValueError, match=r"rank must be in \[1, 4096\]"):
        gen(rank=4097)
    with pytest.raises(ValueError, match=r"error_feedback must be in \[0, 1\]"):
        gen(error_feedback=2)
    # the hand-written decoder reads the generated payload and vice versa (byte-identical formats)
    full = c.encode(grad((6, 10), 2), c.new_state(60, (6, 10)))
    o1, o2 = torch.zeros(60), torch.zeros(60)
    c.decode(full, o1)
    PowerSGD(rank=2).decode(full, o2)
    assert torch.equal(o1, o2) and o1.abs().sum() > 0


def test_fused_error_feedback_pass_equals_the_two_statements(threads):
    """The spec's error-feedback add right before the first product is generated as one pass over
    the matrix (ops::add_matmul_nn, codegen's add_matmul). The same spec with a statement between
    them is generated as the two operators, and both give the same payload bytes and state, bit for
    bit, in one process and through the two rounds."""
    src, _ = compll.read("powersgd")
    unfused = src
    for product in ("p = matmul(matrix, q); }", "P = matmul(matrix, q); }"):  # encode, encode_round0
        line = "if (params.error_feedback) { matrix = map(matrix, gradient, add); " + product
        assert line in src
        # the same computation with an unrelated statement between the add and the product
        unfused = unfused.replace(line, line.replace("add); ", "add); step = step; "))
    assert compll.generate("powersgd", source=src).count("add_matmul_nn(") == 2
    assert "add_matmul_nn(" not in compll.generate("powersgd_unfused.cll", source=unfused, name="powersgd_unfused")
    two = compll.load("powersgd_unfused.cll", source=unfused, name="powersgd_unfused", register=False)
    for rank in RANKS:
        a, b = two(rank=rank), PowerSGD(rank=rank)
        for shape in SHAPES:
            n = int(torch.tensor(shape).prod()) if shape else 0
            same_codec(a, b, [grad(shape, seed=step + 10 * n) for step in range(2)], n, shape,
                       what=f"unfused vs fused, rank {rank} shape {shape}")
        same_rounds(two(rank=rank), PowerSGD(rank=rank), f"unfused vs fused, rank {rank}")
