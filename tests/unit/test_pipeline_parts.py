"""hipress.pipeline's single-process parts: the rank layout, the split into stages, the 1F1B
schedule and its epilogue, the tied-parameter checks, the selective-stage argument, and the
compressed backward sends' lazy error propagation (error conservation)."""
import collections

import pytest
import torch
import torch.nn as nn

from hipress.pipeline import schedule
from hipress.pipeline.compressed_backward import BackwardCompressor, matrix_shape
from hipress.pipeline.layout import Layout, compressed_stage_set, split_stage, stage_bounds, tied_names_of_stage
from hipress.pipeline.tied import tree_sum


def test_layout_is_stage_major():
    lay = Layout(pp=3, dp=2)
    assert lay.size == 6
    assert [(lay.stage_of(r), lay.replica_of(r)) for r in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert lay.dp_group(1) == [2, 3]
    assert lay.tied_group() == [0, 1, 4, 5]
    with pytest.raises(ValueError, match="outside"):
        lay.stage_of(6)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="pp must be"):
            Layout(pp=bad, dp=1)


def test_stage_bounds_and_split():
    assert stage_bounds(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_bounds(4, 2, [1, 3]) == [range(0, 1), range(1, 4)]
    with pytest.raises(ValueError, match="sums to 5"):
        stage_bounds(4, 2, [2, 3])
    with pytest.raises(ValueError, match="every stage needs a layer"):
        stage_bounds(1, 2)
    model = nn.Sequential(collections.OrderedDict(a=nn.Linear(2, 2), b=nn.Tanh(), c=nn.Linear(2, 2)))
    last = split_stage(model, 1, 2)
    assert [n for n, _ in last.named_parameters()] == ["c.weight", "c.bias"]
    with pytest.raises(ValueError, match="nn.Sequential"):
        split_stage(nn.Linear(2, 2), 0, 1)


@pytest.mark.parametrize("stages,micro", [(1, 3), (2, 4), (4, 2), (4, 8)])
def test_one_f_one_b(stages, micro):
    for s in range(stages):
        ops = schedule.one_f_one_b(s, stages, micro)
        assert sorted(ops) == sorted([("F", i) for i in range(micro)] + [("B", i) for i in range(micro)])
        assert [i for op, i in ops if op == "F"] == list(range(micro))
        assert [i for op, i in ops if op == "B"] == list(range(micro))
        in_flight, most = 0, 0
        for op, _ in ops:
            in_flight += 1 if op == "F" else -1
            most = max(most, in_flight)
        assert most == min(stages - s, micro)  # 1F1B's memory bound
        if s == stages - 1:  # the last stage runs each backward right after its forward
            assert ops == [(op, i) for i in range(micro) for op in ("F", "B")]


@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 8), (3, 3)])
def test_epilogue_is_the_receivers_cool_down(stages, micro):
    """A backward send is in the epilogue exactly when its receiver runs that backward right
    after another backward (its cool-down), not right after a forward (steady state)."""
    for sender in range(1, stages):
        ops = schedule.one_f_one_b(sender - 1, stages, micro)
        cool_down = {i for k, (op, i) in enumerate(ops) if op == "B" and ops[k - 1][0] == "B"}
        assert cool_down  # more micro-batches than stages: every receiver has one
        assert {i for i in range(micro) if schedule.in_epilogue(sender, stages, micro, i)} == cool_down
    with pytest.raises(ValueError, match="sends no activation gradient"):
        schedule.in_epilogue(0, stages, micro, 0)


def test_epilogue_without_steady_state():
    """Fewer micro-batches than stages: stage 0 runs every forward, then every backward."""
    assert [schedule.in_epilogue(1, 4, 2, i) for i in range(2)] == [True, True]
    assert [schedule.in_epilogue(3, 4, 2, i) for i in range(2)] == [False, True]


def tied_model():
    model = nn.Sequential(collections.OrderedDict(embed=nn.Embedding(10, 4), mid=nn.Linear(4, 4),
                                                  head=nn.Linear(4, 10, bias=False)))
    model.head.weight = model.embed.weight
    return model


def test_tied_names():
    model, pair = tied_model(), [("embed.weight", "head.weight")]
    assert tied_names_of_stage(model, pair, 0, 3) == ["embed.weight"]
    assert tied_names_of_stage(model, pair, 1, 3) == []
    assert tied_names_of_stage(model, pair, 2, 3) == ["head.weight"]
    assert tied_names_of_stage(model, pair, 0, 1) == []  # one stage: one parameter, synced as any other
    with pytest.raises(ValueError, match="'mid.weight' is not a parameter of the last stage"):
        tied_names_of_stage(model, [("embed.weight", "mid.weight")], 0, 3)
    with pytest.raises(ValueError, match="not a parameter of the first stage"):
        tied_names_of_stage(model, [("nope", "head.weight")], 0, 3)
    with pytest.raises(ValueError, match="differ in shape"):
        tied_names_of_stage(model, [("mid.weight", "head.weight")], 0, 2, balance=[2, 1])
    with pytest.raises(ValueError, match="pairs"):
        tied_names_of_stage(model, ["embed.weight"], 0, 3)
    untied = nn.Sequential(collections.OrderedDict(embed=nn.Embedding(10, 4), head=nn.Linear(4, 10, bias=False)))
    with pytest.raises(ValueError, match="must be one parameter"):
        tied_names_of_stage(untied, pair, 0, 1)


def test_compressed_stage_set():
    assert compressed_stage_set(None, 4) == frozenset()
    assert compressed_stage_set(0, 4) == frozenset()
    assert compressed_stage_set(3, 4) == {0, 1, 2}
    assert compressed_stage_set([3, 1], 4) == {1, 3}
    for bad in (5, -1, [4], True, ["0"], 1.5):
        with pytest.raises(ValueError, match="compress_stages"):
            compressed_stage_set(bad, 4)


def test_tree_sum_splits_at_the_midpoint():
    """The fused sync's tree over 2D values is the unfused sum of the two D-value trees."""
    g = torch.Generator().manual_seed(0)
    vals = [torch.randn(1000, generator=g) * 10 ** k for k in range(-3, 5)]
    assert torch.equal(tree_sum(vals), tree_sum(vals[:4]) + tree_sum(vals[4:]))
    flat_order = vals[0].clone()
    for v in vals[1:]:
        flat_order += v
    assert not torch.equal(tree_sum(vals), flat_order)  # the order matters in fp32: the tree is the point


@pytest.mark.parametrize("name,kwargs", [("powersgd", {"rank": 2}), ("topk", {}), ("terngrad", {})])
def test_lazy_error_conserves_the_sum(name, kwargs):
    """Sum over micro-batches of what the receiver decodes + the error kept = the uncompressed sum."""
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(4, 6, 16, generator=g) for _ in range(5)]
    comp = BackwardCompressor(name, lazy_error=True, **kwargs)
    received = torch.zeros(4, 6, 16)
    for grad in grads:
        wire, decoded = comp.encode(grad)
        assert wire.numel() == comp.max_wire_bytes(grad.shape)
        got = comp.decode(wire, grad.shape)  # what the receiving stage gets
        assert torch.equal(got, decoded)
        received += got
    kept = comp.end_step()
    assert kept is not None and kept.abs().max() > 1e-3  # compression did lose something each time
    torch.testing.assert_close(received + kept, sum(grads), rtol=0, atol=1e-5)
    assert comp.end_step() is None  # the error does not outlive the step


def test_warm_started_powersgd_does_not_depend_on_the_gradients_scale():
    """Activation gradients are small (a mean loss over every token: |G| ~ 6e-3 in the example).
    The warm-started Q carries the last gradient's scale, so P = G Q ~ |G|^2, which an absolute
    eps in the orthogonalization used to swamp: rank 16 then lost 0.56-0.91 of the gradient
    against 0.42-0.53 now (the best rank 16: 0.37-0.47; docs/pipeline.md). Small and unit-scale
    gradients must be approximated alike."""
    g = torch.Generator().manual_seed(4)
    basis = torch.randn(96, 6, generator=g) @ torch.randn(6, 32, generator=g)
    grads = [basis + 0.1 * torch.randn(96, 32, generator=g) for _ in range(6)]
    errors = {}
    for scale in (1.0, 1e-6):
        comp = BackwardCompressor("powersgd", lazy_error=False, rank=4)
        errors[scale] = [float((comp.encode(x * scale)[1] / scale - x).norm() / x.norm()) for x in grads]
    assert errors[1.0][-1] < 0.5  # the warm start found the dominant subspace
    for unit, small in zip(errors[1.0], errors[1e-6]):
        assert small == pytest.approx(unit, abs=1e-3)


def test_full_rank_powersgd_is_exact_after_a_warm_start():
    """Rank = columns: the approximation must be the gradient itself. With one Gram-Schmidt pass
    the warm-started (ill-conditioned) P lost 7-30% of the example's activation gradients."""
    g = torch.Generator().manual_seed(6)
    scales = torch.logspace(0, -4, 32)
    comp = BackwardCompressor("powersgd", lazy_error=False, rank=32)
    for _ in range(4):
        x = 1e-3 * (torch.randn(128, 32, generator=g) * scales) @ torch.linalg.qr(torch.randn(32, 32, generator=g))[0]
        decoded = comp.encode(x)[1]
        assert float((decoded - x).norm() / x.norm()) < 1e-4


def test_without_lazy_error_the_sum_is_lost():
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(8, 16, generator=g) for _ in range(4)]
    comp = BackwardCompressor("powersgd", lazy_error=False, rank=1)
    received = sum(comp.encode(x)[1] for x in grads)
    assert comp.end_step() is None
    assert (received - sum(grads)).abs().max() > 0.1


def test_backward_compressor_errors():
    comp = BackwardCompressor("powersgd", rank=2)
    comp.encode(torch.randn(4, 8))
    with pytest.raises(ValueError, match="one shape"):
        comp.encode(torch.randn(2, 8))
    with pytest.raises(ValueError, match="floating point"):
        comp.encode(torch.ones(4, 8, dtype=torch.int64))
    wire = torch.zeros(comp.max_wire_bytes((4, 8)), dtype=torch.uint8)
    with pytest.raises(ValueError, match="payload length"):
        comp.decode(wire, (4, 8))
    with pytest.raises(ValueError, match="unknown compressor"):
        BackwardCompressor("nope")
    assert matrix_shape((2, 3, 5)) == (6, 5)
