"""fuse_uncompressed: after planning, runs of buckets the plan leaves uncompressed become
DDP's buckets of the plain limit (one allreduce each), and the plan's entries follow."""
import pytest
import torch

from hipress.compression.none import NoneCompressor
from hipress.planner import AffineCurve, CostModel
from hipress.planner.plan import Overrides, make_plan
from hipress.torch.optimizer import _Bucket, fuse_uncompressed, fusion_buckets


def setup(force, sizes=(100, 100, 100, 100, 100, 900), **model_kw):
    named = [(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]
    buckets = fusion_buckets(named, NoneCompressor(), 1)  # one bucket per parameter (each >= 1 byte)
    model = CostModel(AffineCurve(10, 1), AffineCurve(3, 0.5), AffineCurve(2, 0.25), 4, "ring", "quantization", 0.25,
                      **model_kw)
    plan = make_plan([(b.name, 4 * b.numel) for b in buckets], model, Overrides(force=force))
    return buckets, plan


def layout(buckets):
    return [[n for n, _ in b.params] for b in buckets]


def test_runs_fuse_up_to_the_limit_and_compressed_buckets_stay():
    # backward order is p5..p0; p2 compressed splits the uncompressed runs
    force = {f"p{i}": i == 2 for i in range(6)}
    buckets, plan = setup(force)
    out = fuse_uncompressed(buckets, plan, 4 * 200, first_limit=4 * 100)
    # p5, the first bucket of backward, reaches its limit alone (DDP's rule); p4 + p3 reach 200
    # elements; p2 (compressed) stays; p1 + p0 fuse
    assert layout(out) == [["p5"], ["p4", "p3"], ["p2"], ["p1", "p0"]]
    assert [plan.entry(b.name, b.numel).compress for b in out] == [False, False, True, False]
    assert [e.name for e in plan] == [b.name for b in out]   # the plan's order is the buckets'
    merged = plan[out[1].name]
    assert merged.nbytes == 4 * 200 and merged.k == 1 and merged.reason == "fused: 2 uncompressed"
    assert merged.t_orig == pytest.approx(plan.model.t_sync(800, False, 1))  # planned for its size
    assert "p4" not in plan and "p3" not in plan
    assert out[1].flat is not None and out[1].flat.numel() == 200 and not out[1].in_place
    assert out[0] is buckets[0] and out[2] is buckets[3]
    # a run too long for one bucket: p4 p3 | p1 p0 with p2 uncompressed too at limit 300
    buckets, plan = setup({f"p{i}": False for i in range(6)})
    assert layout(fuse_uncompressed(buckets, plan, 4 * 300, first_limit=4 * 100)) == \
        [["p5"], ["p4", "p3", "p2"], ["p1", "p0"]]


def test_the_first_bucket_takes_what_crosses_its_limit():
    # p5 (50) is below the first limit: p4 (900) joins it, as DDP's first bucket takes the
    # gradient that crosses 1 MiB; the rest fill the next up to the limit, the crossing one included
    force = {f"p{i}": False for i in range(6)}
    buckets, plan = setup(force, sizes=(100, 100, 100, 100, 900, 50))
    assert layout(fuse_uncompressed(buckets, plan, 4 * 250, first_limit=4 * 100)) == \
        [["p5", "p4"], ["p3", "p2", "p1"], ["p0"]]
    assert [e.name for e in plan] == ["fused[p5..p4]", "fused[p3..p1]", "p0"]


def test_a_bucket_at_the_limit_stays_alone_in_place():
    force = {f"p{i}": False for i in range(6)}
    buckets, plan = setup(force, sizes=(100, 100, 100, 100, 900, 50))
    out = fuse_uncompressed(buckets, plan, 4 * 900, first_limit=4 * 50)
    assert layout(out) == [["p5"], ["p4"], ["p3", "p2", "p1", "p0"]]
    assert out[1].in_place


def test_fusion_buckets_keeps_the_first_bucket_small():
    named = [(f"p{i}", torch.nn.Parameter(torch.zeros(100))) for i in range(6)]
    assert layout(fusion_buckets(named, NoneCompressor(), 4 * 300, first_bucket_bytes=4 * 100)) == \
        [["p5"], ["p4", "p3", "p2"], ["p1", "p0"]]
    assert layout(fusion_buckets(named, NoneCompressor(), 4 * 300)) == [["p5", "p4", "p3"], ["p2", "p1", "p0"]]


@pytest.mark.parametrize("seed", range(20))
def test_the_plain_path_buckets_are_ddps(seed):
    # With a first bucket size (the uncompressed path), the layout is the one torch's DDP computes
    # for the same gradients in backward order (its Reducer's assignment, not a copy of its rule).
    g = torch.Generator().manual_seed(seed)
    sizes = [int(x) for x in torch.randint(1, 600, (int(torch.randint(1, 15, (1,), generator=g)),), generator=g)]
    named = [(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]
    order = list(reversed(range(len(sizes))))
    ddp, _ = torch.distributed._compute_bucket_assignment_by_size([torch.zeros(sizes[i]) for i in order],
                                                                   [4 * 100, 4 * 300])
    assert layout(fusion_buckets(named, NoneCompressor(), 4 * 300, first_bucket_bytes=4 * 100)) == \
        [[f"p{order[j]}" for j in bucket] for bucket in ddp]


def test_a_large_gradient_closes_the_bucket_being_filled_first():
    # Buckets keep backward's order: p3 (large, alone) comes after p4, not before a bucket that
    # holds p4 and would only be complete once p1 is.
    named = [(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate((50, 50, 50, 400, 50, 50))]
    assert layout(fusion_buckets(named, NoneCompressor(), 4 * 300)) == [["p5", "p4"], ["p3"], ["p2", "p1", "p0"]]


def test_a_run_is_regrouped_by_gradients_not_by_the_plans_buckets():
    # The plan's buckets are larger than DDP's first bucket (a plan over 4 MiB buckets): p5 p4 p3
    # and p2 p1 p0, neither compressed. DDP's layout cuts by gradients: p5 alone first (100
    # elements reach the first limit), then up to 300.
    named = [(f"p{i}", torch.nn.Parameter(torch.zeros(100))) for i in range(6)]
    buckets = fusion_buckets(named, NoneCompressor(), 4 * 300)
    assert layout(buckets) == [["p5", "p4", "p3"], ["p2", "p1", "p0"]]
    model = CostModel(AffineCurve(10, 1), AffineCurve(3, 0.5), AffineCurve(2, 0.25), 4, "ring", "quantization", 0.25)
    plan = make_plan([(b.name, 4 * b.numel) for b in buckets], model,
                     Overrides(force={b.name: False for b in buckets}))
    out = fuse_uncompressed(buckets, plan, 4 * 300, first_limit=4 * 100)
    assert layout(out) == [["p5"], ["p4", "p3", "p2"], ["p1", "p0"]]
    assert [e.name for e in plan] == [b.name for b in out] == ["p5", "fused[p4..p2]", "fused[p1..p0]"]
    assert out[0].in_place and plan["p5"].nbytes == 400 and plan["fused[p4..p2]"].reason == "fused: 3 uncompressed"


def test_regroup_refuses_compressed_scattered_or_uncovered_entries():
    buckets, plan = setup({"p0": True, "p1": False, "p2": False, "p3": False})
    with pytest.raises(ValueError, match="none compressed"):
        plan.regroup_uncompressed(["p1", "p0"], [("x", 800, 2)])
    with pytest.raises(ValueError, match="not consecutive"):
        plan.regroup_uncompressed(["p3", "p1"], [("x", 800, 2)])
    with pytest.raises(ValueError, match="do not cover"):
        plan.regroup_uncompressed(["p2", "p1"], [("x", 400, 1)])



def bf16_model(**kw):
    # a send costs 1000 + 1 per byte; a memory pass 5 + 0.01 per byte. Over 2(N-1) = 6 sends:
    # fp32 6(1000 + m/4) + pass(m); bf16 6(1000 + m/8) + pass(m) (cast in the copy): bf16 at any size
    return CostModel(AffineCurve(1000, 1), AffineCurve(3, 0.5), AffineCurve(2, 0.25), 4, "ring", "quantization",
                     0.25, dec_plain=AffineCurve(5, 0.01), plain_allreduce=True, **kw)


def test_the_plan_sends_uncompressed_gradients_as_bf16_where_it_pays():
    model = bf16_model(plain16=True)
    plan = make_plan([("big", 4000), ("tiny", 8)], model, Overrides(force={"big": False, "tiny": False}))
    assert plan["big"].bf16 and not plan["big"].compress
    assert plan["big"].t_orig == pytest.approx(6 * (1000 + 500) + (5 + 40))
    assert plan["tiny"].bf16 and plan["tiny"].t_orig == pytest.approx(6 * 1001 + 5.08)  # 4 bytes fewer, no pass more
    pinned = make_plan([("big", 4000)], model, Overrides(force={"big": False}, bf16=False))
    assert not pinned["big"].bf16 and pinned["big"].t_orig == pytest.approx(6 * (1000 + 1000) + (5 + 40))
    always = make_plan([("tiny", 8)], model, Overrides(force={"tiny": False}, bf16=True))
    assert always["tiny"].bf16 and always["tiny"].t_orig == pytest.approx(6 * 1001 + 5.08)
    # a compressed entry is never bf16, though its uncompressed branch would be
    squeezed = make_plan([("big", 4000)], model, Overrides(force={"big": True}))
    assert squeezed["big"].compress and not squeezed["big"].bf16
    # a backend that sums only fp32 (plain16 off) never gets it, and asking for it is an error
    assert not make_plan([("big", 4000)], bf16_model(), Overrides(force={"big": False}))["big"].bf16
    with pytest.raises(ValueError, match="bf16=True needs"):
        make_plan([("big", 4000)], bf16_model(), Overrides(bf16=True))


def test_fused_entries_are_planned_for_their_size():
    buckets = fusion_buckets([(f"q{i}", torch.nn.Parameter(torch.zeros(2))) for i in range(3)], NoneCompressor(), 1)
    model = bf16_model(plain16=True)
    plan = make_plan([(b.name, 4 * b.numel) for b in buckets], model, Overrides(force={b.name: False for b in buckets}))
    out = fuse_uncompressed(buckets, plan, 4 * 2000, first_limit=4 * 2)
    assert layout(out) == [["q2"], ["q1", "q0"]]
    fused, alone = plan[out[1].name], plan[out[0].name]
    assert fused.bf16 and fused.k == 1 and fused.t_orig == pytest.approx(model.t_sync(16, False, 1, bf16=True))
    assert alone.t_orig == pytest.approx(model.t_sync(8, False, 1, bf16=True)) and alone.t_orig < fused.t_orig


@pytest.mark.parametrize("shapes", [[(3, 5)], [(3, 5), (7,), (2, 2, 2)]])
def test_a_bucket_sent_as_bf16_casts_in_its_copy_and_keeps_one_buffer(shapes):
    """send_bf16: put() writes torch's bf16 rounding of each gradient (made contiguous) into the
    bucket's bf16 buffer and finds NaN/Inf there; the fp32 buffer is gone meanwhile, and comes back
    when the bucket travels as fp32 again. One gradient alone (synced in place as fp32) too."""
    torch.manual_seed(0)
    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(s))) for i, s in enumerate(shapes)]
    b = _Bucket(params)
    b.send_bf16(True)
    assert b.sent.dtype == torch.bfloat16 and b.sent.numel() == b.numel and b.flat is None
    for (_, p), (off, n, _) in zip(params, b.segments):
        g = torch.randn(*p.shape[::-1]).t() if p.dim() == 2 else torch.randn(p.shape)  # a transposed one
        p.grad = g
        assert b.put(p) is True and p.grad.is_contiguous() and torch.equal(p.grad, g)
        assert torch.equal(b.sent[off:off + n], g.reshape(-1).to(torch.bfloat16))
    assert [t.data_ptr() for _, t in b.into()] == [p.grad.data_ptr() for _, p in params]
    params[-1][1].grad.view(-1)[-1] = float("nan")
    assert b.put(params[-1][1]) is False
    b.send_bf16(False)
    assert b.wire is None and b.sent is b.flat and (b.flat is None) == (len(shapes) == 1)
    if len(shapes) > 1:
        assert b.put(params[0][1]) is True and b.flat.dtype == torch.float32
    with pytest.raises(ValueError, match="only fp32 CPU"):
        _Bucket([("h", torch.nn.Parameter(torch.zeros(4, dtype=torch.float16)))]).send_bf16(True)
