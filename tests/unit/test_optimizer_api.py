"""DistributedOptimizer behaviour that needs no peers (a single-rank job)."""
import copy
import os
import re
from unittest import mock

import pytest
import torch
import torch.nn as nn

import hipress


@pytest.fixture
def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))


def wrap(model, opt=None, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if opt is None else opt
    return hipress.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **kw)


def backward(model):
    model(torch.randn(5, 4)).sum().backward()


def test_single_rank_step_is_plain_sgd(model):
    ref = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
    ref.load_state_dict(model.state_dict())
    opt = wrap(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(5, 4)
    for m, o in ((model, opt), (ref, ref_opt)):
        o.zero_grad()
        m(x).sum().backward()
        o.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    assert isinstance(opt, torch.optim.SGD)


def test_duplicate_names(model):
    params = list(model.named_parameters())
    with pytest.raises(ValueError, match="duplicate"):
        hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=[("w", p) for _, p in params])


def test_missing_names(model):
    params = list(model.named_parameters())
    with pytest.raises(ValueError, match="does not name 1 parameter"):
        hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=params[:-1])


def test_not_tuples(model):
    with pytest.raises(ValueError, match="tuples"):
        hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=list(model.parameters()))


def test_unknown_algorithm_and_strategy(model):
    with pytest.raises(ValueError, match="nosuch"):
        wrap(model, compression="nosuch")
    with pytest.raises(ValueError, match="unknown strategy 'star'"):
        wrap(model, strategy="star")


def test_step_without_backward(model):
    opt = wrap(model)
    with pytest.raises(RuntimeError, match="without a backward"):
        opt.step()


def test_step_before_all_accumulation_passes(model):
    opt = wrap(model, backward_passes_per_step=2)
    backward(model)
    with pytest.raises(RuntimeError, match="1 of backward_passes_per_step=2"):
        opt.step()


def test_wrap_twice(model):
    opt = wrap(model)
    with pytest.raises(ValueError, match="already wrapped"):
        hipress.DistributedOptimizer(opt)


def test_bad_arguments(model):
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        wrap(model, backward_passes_per_step=0)
    with pytest.raises(ValueError, match="op must be"):
        wrap(model, op="max")
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        hipress.DistributedOptimizer(model)
    with pytest.raises(ValueError, match=r"plan: unknown field\(s\) \['bogus'\]"):
        wrap(model, compression="tbq", plan={"bf16": True, "bogus": 1})


def same(a, b):
    """Deep equality of nested dicts/lists/tuples holding tensors (bit for bit)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_state_dict_carries_compressor_state(model):
    """optimizer.state_dict()["hipress"] holds real compressor state and a fresh optimizer
    continues from it bit for bit. One rank never compresses in step() (its gradient is
    already the average), so the optimizer's own sync is driven directly: the strategies
    run over the loopback transport at one rank too and keep their state in the store the
    optimizer saves. TBQ has error feedback: its residuals are the state."""

    def sync(opt, grads):
        for name, g in grads.items():
            flat = g.clone()
            assert opt._hp_compressed.build(name, flat, [(0, flat.numel())]).wait(30)
            grads[name] = flat
        return grads

    def tbq(m):  # momentum SGD, so the velocities are state too
        return hipress.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                                            named_parameters=m.named_parameters(), compression="tbq",
                                            strategy="ring")

    torch.manual_seed(1)
    grads = [{n: torch.randn(p.numel()) for n, p in model.named_parameters()} for _ in range(2)]
    opt = tbq(model)
    backward(model)
    opt.step()  # velocities (momentum correction keeps SGD's momentum in hipress's state)
    assert all(v.any() for v in opt.state_dict()["hipress"]["velocity"].values()), "no velocities"
    sync(opt, dict(grads[0]))
    sd = opt.state_dict()
    states = sd["hipress"]["compressor_state"]
    assert sorted(states) == sorted(f"{n}/p0/c0" for n, _ in model.named_parameters())
    assert all(s["buffers"]["residual"].any() for s in states.values()), "no residual kept"

    def fresh():
        torch.manual_seed(0)
        return tbq(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1)))

    opt2 = fresh()
    opt2.load_state_dict(sd)
    assert same(opt2.state_dict(), sd)  # restored, not used yet: kept as it was
    want = sync(opt, dict(grads[1]))
    assert same(sync(opt2, dict(grads[1])), want)
    assert same(opt2.state_dict(), opt.state_dict())
    # Without the "hipress" entry the next sync differs: the check above is not vacuous.
    opt3 = fresh()
    opt3.load_state_dict({k: v for k, v in sd.items() if k != "hipress"})
    assert not same(sync(opt3, dict(grads[1])), want)


def test_buckets_fill_by_bytes_sent():
    """A bucket fills until one exchange of it sends bucket_bytes: the gradients themselves
    uncompressed, only the factors with PowerSGD; a gradient of bucket_bytes or more is
    always alone (synced in place)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(512, 512, bias=False), *[nn.Linear(64, 64, bias=False) for _ in range(8)])

    def layout(**kw):
        return sorted([n for n, _ in b.params] for b in wrap(m, bucket_bytes=64 << 10, **kw)._hp_buckets)

    # 64x64 fp32 = 16 KiB: four fill a 64 KiB bucket; the 1 MiB matrix is alone
    assert layout(compression="none") == [["0.weight"], ["4.weight", "3.weight", "2.weight", "1.weight"],
                                          ["8.weight", "7.weight", "6.weight", "5.weight"]]
    # PowerSGD rank 8 sends 48 + 8*4*(64+64) bytes per 64x64 matrix: all eight fit one bucket
    assert layout(compression="powersgd") == [["0.weight"], [f"{i}.weight" for i in range(8, 0, -1)]]


def test_ps_spreads_a_large_gradient_over_one_aggregator_per_rank():
    """Without a plan, PS gives a bucket one partition per rank (each of at least
    SPREAD_PARTITION_BYTES), so every rank aggregates a share of it; partition_bytes still caps
    a partition's size, None still means one partition; the ring and allgather keep one."""
    from hipress.sync import STRATEGIES
    from hipress.sync.base import partition_shape
    from hipress.sync.hierarchical import HierarchicalStrategy
    from hipress.torch.optimizer import SPREAD_PARTITION_BYTES, _Bucket, bucket_bounds

    def bucket(numel):
        return _Bucket([("w", torch.nn.Parameter(torch.zeros(numel)))])

    big = 8 * SPREAD_PARTITION_BYTES // 4  # 8 spread units of fp32
    assert STRATEGIES["ps"]().spread(4) == 4
    assert STRATEGIES["ring"]().spread(4) == STRATEGIES["allgather"]().spread(4) == 1
    assert len(bucket_bounds(bucket(big), 64 << 20, False, spread=4)) == 4
    assert bucket_bounds(bucket(big), 64 << 20, False, spread=4)[0] == (0, big // 4)
    assert len(bucket_bounds(bucket(big), 64 << 20, False, spread=16)) == 8  # each keeps its minimum
    assert len(bucket_bounds(bucket(big // 8 - 1), 64 << 20, False, spread=4)) == 1
    assert len(bucket_bounds(bucket(big), 64 << 20, False, spread=1)) == 1
    assert len(bucket_bounds(bucket(big), 2 * SPREAD_PARTITION_BYTES, False, spread=2)) == 4  # the cap
    assert len(bucket_bounds(bucket(big), None, False, spread=4)) == 1
    # a matrix is cut at whole rows, so that onebit keeps one scale per row (partition_shape)
    matrix = _Bucket([("m", torch.nn.Parameter(torch.zeros(6, 700_001)))])
    parts = bucket_bounds(matrix, 64 << 20, False, spread=4)
    assert len(parts) == 4 and parts[-1][1] == matrix.numel
    assert all(partition_shape(matrix.segments, s, e) is not None for s, e in parts)
    # local aggregation: PS runs over one rank per host, so it spreads over the hosts
    local = mock.Mock(size=4)
    assert HierarchicalStrategy(STRATEGIES["ps"](average=False), local, None, 16).spread(4) == 4
    assert HierarchicalStrategy(STRATEGIES["ring"](average=False), local, None, 16).spread(4) == 1


def test_transport_that_cannot_carry_cpu_payloads_is_refused(model):
    """A world transport on a CUDA device (NCCL) cannot move hipress's CPU payloads: the
    optimizer says so up front instead of failing inside the first step."""
    from hipress.comm import world
    from hipress.comm.transport import loopback

    class CudaOnly(loopback.LoopbackTransport):
        name = "cuda-only"
        device = "cuda:0"

    world.shutdown()
    world.init(transport=CudaOnly(loopback.LoopbackWorld(1), 0))
    try:
        with pytest.raises(ValueError, match="cuda-only transport moves cuda buffers only"):
            wrap(model)
        assert not hasattr(torch.optim.SGD, "_hipress_setup")
    finally:
        world.shutdown()


def test_gradient_clipping_before_compression(model):
    """grad_clip runs on every final gradient (by name) before the step uses it; "paper" is the
    paper's for TernGrad (2.5 sigma per layer) and nothing for an algorithm without one; "auto"
    (the default) is nothing."""
    from hipress.torch import clipping

    seen = []

    def halve(name, g):
        seen.append(name)
        g.mul_(0.5)

    ref = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
    ref.load_state_dict(model.state_dict())
    opt = wrap(model, grad_clip=halve)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)  # half of wrap's lr 0.1: the same step
    x = torch.randn(5, 4)
    for m, o in ((model, opt), (ref, ref_opt)):
        o.zero_grad()
        m(x).sum().backward()
        o.step()
    assert sorted(seen) == sorted(n for n, _ in model.named_parameters())
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)

    g = torch.randn(10000)
    g[0] = 100.0
    bound = 2.5 * float(g.std())
    inside = g.abs() <= bound
    before = g.clone()
    clipping.sigma(2.5)("w", g)
    assert float(g[0]) == pytest.approx(bound) and float(g.abs().max()) <= bound * (1 + 1e-6)
    assert torch.equal(g[inside], before[inside])  # elements within the bound are untouched
    assert clipping.resolve("paper", "terngrad") is clipping.PAPER["terngrad"]
    assert clipping.resolve("paper", "tbq") is None and clipping.resolve(None, "terngrad") is None
    assert clipping.resolve("auto", "terngrad") is None
    with pytest.raises(ValueError, match="grad_clip must be"):
        wrap(nn.Linear(2, 2), grad_clip="sometimes")
    with pytest.raises(ValueError, match="c > 0"):
        clipping.sigma(0)


@pytest.mark.parametrize("limited", [False, True])
@pytest.mark.parametrize("kw", [dict(momentum=0.9), dict(momentum=0.9, weight_decay=0.01, nesterov=True),
                                dict(momentum=0.5, dampening=0.3, weight_decay=0.1)])
def test_momentum_correction_is_sgd_without_compression(kw, limited):
    """Momentum correction moves SGD's momentum and weight decay in front of the sync; with a
    lossless sync that is SGD itself (up to float rounding), and the user's settings are back
    after each step. limited: it corrects only the first layer (as under a plan, the parameters
    of compressed buckets); the others step with the SGD's own momentum, and the sum is the same."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 2))
    b = copy.deepcopy(a)
    opt = hipress.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1, **kw), named_parameters=a.named_parameters(),
                                       momentum_correction=True)
    if limited:
        opt._hp_momentum.limit_to({id(p) for p in a[0].parameters()})
    ref = torch.optim.SGD(b.parameters(), lr=0.1, **kw)
    for _ in range(6):
        x = torch.randn(8, 5)
        for m, o in ((a, opt), (b, ref)):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert len(opt.param_groups) == 1 and all(opt.param_groups[0][k] == v for k, v in kw.items())
    sd = opt.state_dict()
    assert sorted(sd["hipress"]["velocity"]) == (["0.bias", "0.weight"] if limited else
                                                 ["0.bias", "0.weight", "2.bias", "2.weight"])
    # the SGD's own momentum buffers: only for the parameters momentum correction leaves alone
    assert sorted(i for i, st in sd["state"].items() if st.get("momentum_buffer") is not None) == \
        ([2, 3] if limited else [])


@pytest.mark.parametrize("undo", [False, True])
def test_momentum_correction_velocity_is_sgds_bit_for_bit(undo):
    """Each step's velocity and corrected gradient are exactly u.mul_(m).add_(g) (SGD's roundings;
    the fused native pass), with the undo log on (new values into its spare buffer) or off."""
    from hipress.torch.momentum import MomentumCorrection
    p = nn.Parameter(torch.zeros(3, 1000))
    mc = MomentumCorrection(torch.optim.SGD([p], lr=0.1, momentum=0.9), {id(p): "w"})
    mc.undo_log.enabled = undo
    u = None
    for step in range(4):
        g = torch.randn(3, 1000)
        grad = g.clone()
        mc.apply(p, grad)
        u = g.clone() if u is None else u.mul_(0.9).add_(g)
        assert torch.equal(grad.view(torch.int32), u.view(torch.int32)), step
        assert torch.equal(mc.velocity["w"].view(torch.int32), u.view(torch.int32)), step
        mc.commit()


def test_momentum_correction_choices(model):
    sgd = lambda **kw: torch.optim.SGD(model.parameters(), lr=0.1, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="needs torch.optim.SGD"):
        wrap(model, opt=torch.optim.Adam(model.parameters()), momentum_correction=True)
    with pytest.raises(ValueError, match="has no momentum"):
        wrap(model, opt=sgd(), momentum_correction=True)
    with pytest.raises(ValueError, match="'auto', True or False"):
        wrap(model, opt=sgd(momentum=0.9), momentum_correction="yes")
    # auto: on for a single-round compressor with momentum SGD; off for none, PowerSGD and Adam
    assert wrap(model, opt=sgd(momentum=0.9), compression="onebit")._hp_momentum is not None
    assert wrap(model, opt=sgd(momentum=0.9))._hp_momentum is None
    assert wrap(model, opt=sgd(momentum=0.9), compression="powersgd")._hp_momentum is None
    assert wrap(model, opt=torch.optim.Adam(model.parameters()), compression="onebit")._hp_momentum is None


def test_auto_strategy_is_the_fastest_safe_one(model):
    """Ring where re-encoding merged sums is safe (no compression), allgather where it is not
    (every built-in lossy algorithm); under a planner PS is profiled, and the optimizer then keeps
    PS or allgather, whichever plan the model predicts faster."""
    from hipress.sync import resolve_strategy

    assert wrap(model, strategy="auto")._hp_strategy_name == "ring"
    for algo in ("onebit", "tbq", "terngrad", "dgc", "graddrop"):
        assert wrap(model, compression=algo, strategy="auto")._hp_strategy_name == "allgather", algo
    assert resolve_strategy("auto", hipress.compression.get("dgc"), planned=True) == "ps"
    with pytest.raises(ValueError, match="unknown strategy"):
        wrap(model, compression="dgc", strategy="tree")


def test_a_plan_corrects_momentum_only_where_it_compresses(model):
    """Under a plan, momentum correction (an aid to compression) covers the parameters of the
    buckets it compresses; the others keep the SGD's own momentum, and their NaN/Inf check runs
    per bucket (nothing changes their gradients before it)."""
    from hipress.planner import AffineCurve, CostModel
    from hipress.planner.plan import Overrides, make_plan

    names = [n for n, _ in model.named_parameters()]
    cost = CostModel(AffineCurve(10, 1), AffineCurve(3, 0.5), AffineCurve(2, 0.25), 2, "ring", "quantization", 0.25)
    plan = make_plan([(n, 4 * p.numel()) for n, p in reversed(list(model.named_parameters()))], cost,
                     Overrides(force={n: n.startswith("0.") for n in names}))
    clip = hipress.clipping.sigma(2.5)
    opt = wrap(model, opt=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), compression="tbq",
               plan=plan, bucket_bytes=1, grad_clip=clip)
    assert {n for n, p in model.named_parameters() if opt._hp_momentum.corrects(p)} == {"0.weight", "0.bias"}
    assert opt._hp_clip_for(opt._hp_bucket_of[id(model[0].weight)]) is clip
    assert opt._hp_clip_for(opt._hp_bucket_of[id(model[2].weight)]) is None


@pytest.mark.parametrize("kw,want", [
    (dict(), (25 << 20, 1 << 20)),                                   # the backend's allreduce: DDP's rule
    (dict(strategy="dear"), (25 << 20, 1 << 20)),                    # dear's native phases too
    (dict(compression="covap"), (25 << 20, 1 << 20)),                # COVAP with "none" inside
    (dict(compression="terngrad"), (4 << 20, None)),                 # compressed: smaller, early encodes
    (dict(compression="onebit", strategy="ps"), (4 << 20, None)),    # a scale per tensor of a bucket
    (dict(compression="onebit", strategy="ring"), (1 << 20, None)),  # a scale per partition: keep it small
    (dict(compression="dgc", strategy="ring"), (4 << 20, None)),
    (dict(compression="powersgd"), (1 << 20, None)),                 # low-rank: counts its factors' bytes
    (dict(strategy="dear", compression="onebit"), (1 << 20, None)),  # dear's phases, COVAP: measured at 1 MiB
    (dict(compression="covap", compression_kwargs=dict(inner="onebit", mode="paper")), (1 << 20, None)),
    (dict(plan="auto", compression="terngrad"), (4 << 20, None)),    # a plan regroups its plain runs itself
    (dict(plan="auto", compression="onebit", strategy="ring"), (1 << 20, None)),
    (dict(coordinator=True), (25 << 20, 1 << 20)),                   # beside the coordinator, the allreduce
])
def test_auto_bucket_bytes_follow_the_path_a_bucket_takes(kw, want):
    from hipress.torch.optimizer import Options

    o = Options(**kw)
    assert (o.bucket_bytes, o.first_bucket_bytes) == want



def test_coordinator_option_is_checked():
    from hipress.torch.ddp import HookState
    from hipress.torch.optimizer import Options

    assert Options(coordinator="auto", compression="tbq").coordinator == "auto"
    assert Options(coordinator="auto", compression="auto").plan == "auto"  # measured after the plan's choice
    # the default: measured where the planner chooses (not beside dear), off elsewhere; HIPRESS_COORDINATOR first
    assert Options(compression="auto").coordinator == "auto" and Options(compression="tbq").coordinator is False
    with pytest.raises(ValueError, match="strategy='dear' runs the ring's phases"):  # that error, not the coordinator's
        Options(compression="auto", strategy="dear")
    with mock.patch.dict(os.environ, {"HIPRESS_COORDINATOR": "0"}):
        assert Options(compression="auto").coordinator is False
    for bad in ("yes", 1, "on"):
        with pytest.raises(ValueError, match="coordinator must be True, False or 'auto'"):
            Options(coordinator=bad)
    # one measured choice at a time
    for kw, named in ((dict(compression="covap"), "covap"), (dict(bucket_bytes="tune"), "tune"),
                      (dict(strategy="dear"), "dear")):
        with pytest.raises(ValueError, match=f"coordinator='auto' measures.*{re.escape(named)}"):
            Options(coordinator="auto", **kw)
    with pytest.raises(ValueError, match="'auto' .* is hipress.DistributedOptimizer's"):
        HookState("tbq", coordinator="auto")
