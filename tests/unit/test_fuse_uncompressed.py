"""fuse_uncompressed: after planning, runs of buckets the plan leaves uncompressed become
buckets of up to the plain limit (one allreduce each), and the plan's entries follow."""
import pytest
import torch

from hipress.compression.none import NoneCompressor
from hipress.planner import AffineCurve, CostModel
from hipress.planner.plan import Overrides, make_plan
from hipress.torch.optimizer import fuse_uncompressed, fusion_buckets


def setup(force, sizes=(100, 100, 100, 100, 100, 900)):
    named = [(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate(sizes)]
    buckets = fusion_buckets(named, NoneCompressor(), 1)  # one bucket per parameter (each >= 1 byte)
    model = CostModel(AffineCurve(10, 1), AffineCurve(3, 0.5), AffineCurve(2, 0.25), 4, "ring", "quantization", 0.25)
    plan = make_plan([(b.name, 4 * b.numel) for b in buckets], model, Overrides(force=force))
    return buckets, plan


def layout(buckets):
    return [[n for n, _ in b.params] for b in buckets]


def test_runs_fuse_up_to_the_limit_and_compressed_buckets_stay():
    # backward order is p5..p0; p2 compressed splits the uncompressed runs
    force = {f"p{i}": i == 2 for i in range(6)}
    buckets, plan = setup(force)
    before = plan.predicted_time()
    out = fuse_uncompressed(buckets, plan, 4 * 1000)
    # p5 (900) + p4 (100) = 1000 elements fit; p3 starts a run of one (stays); p2 stays; p1 + p0 fuse
    assert layout(out) == [["p5", "p4"], ["p3"], ["p2"], ["p1", "p0"]]
    assert [plan.entry(b.name, b.numel).compress for b in out] == [False, False, True, False]
    assert [e.name for e in plan] == [b.name for b in out]   # the plan's order is the buckets'
    merged = plan[out[0].name]
    assert merged.nbytes == 4 * 1000 and merged.k == 1 and merged.reason == "fused: 2 uncompressed"
    assert plan.predicted_time()[0] == pytest.approx(before[0])  # the uncompressed times are summed
    assert "p5" not in plan and "p4" not in plan
    assert out[0].flat is not None and out[0].flat.numel() == 1000 and not out[0].in_place
    assert out[1] is buckets[2]  # a run of one is the same bucket


def test_a_bucket_at_the_limit_stays_alone_in_place():
    force = {f"p{i}": False for i in range(6)}
    buckets, plan = setup(force)
    out = fuse_uncompressed(buckets, plan, 4 * 900)
    assert layout(out) == [["p5"], ["p4", "p3", "p2", "p1", "p0"]]
    assert out[0].in_place


def test_merge_refuses_compressed_or_scattered_entries():
    buckets, plan = setup({"p0": True, "p1": False, "p2": False, "p3": False})
    with pytest.raises(ValueError, match="none compressed"):
        plan.merge_uncompressed(["p1", "p0"], "x")
    with pytest.raises(ValueError, match="not consecutive"):
        plan.merge_uncompressed(["p3", "p1"], "x")
