"""strategy="dear"'s schedule (hipress/torch/dear.py) and its optimizer integration in a
single-rank job: when updates run, with which settings, and the errors."""
import pytest
import torch
import torch.nn as nn

import hipress
from hipress.torch import dear


class Bucket:
    def __init__(self, name, params):
        self.name, self.params = name, params


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def make_model():
    torch.manual_seed(0)
    return Net()


def names(model):
    return {id(p): n for n, p in model.named_parameters()}


def schedule(model, trace=None):
    """Buckets as the optimizer makes them (reverse parameter order): b's, then a's."""
    updates = []
    buckets = [Bucket("b", list(model.b.named_parameters())), Bucket("a", list(model.a.named_parameters()))]
    s = dear.Schedule(buckets, model, names(model), lambda bucket, hyper: updates.append((bucket.name, hyper)),
                      lambda: "nobody", trace)
    return s, buckets, updates


def test_forward_releases_each_bucket_before_its_first_module_runs():
    model = make_model()
    s, buckets, updates = schedule(model)
    assert [b.name for b in s.forward_order] == ["a", "b"]
    seen = []
    model.a.register_forward_pre_hook(lambda m, args: seen.append(("a runs", [u for u, _ in updates])))
    model.b.register_forward_pre_hook(lambda m, args: seen.append(("b runs", [u for u, _ in updates])))
    for b in s.forward_order:
        s.defer(b, None, [{"lr": 1.0}])
    model(torch.randn(3, 4))
    # hooks registered later run after the schedule's: each module saw its own bucket updated,
    # and b's update waited until b was about to run
    assert seen == [("a runs", ["a"]), ("b runs", ["a", "b"])]
    assert s.pending == []
    model(torch.randn(3, 4))  # nothing pending: nothing runs again
    assert len(updates) == 2


def test_flush_runs_pending_in_order_and_state_dict_flushes():
    model = make_model()
    s, buckets, updates = schedule(model)
    s.defer(buckets[1], None, [])
    s.defer(buckets[0], None, [])
    with pytest.raises(RuntimeError, match="deferred twice"):
        s.defer(buckets[0], None, [])
    model.state_dict()
    assert [u for u, _ in updates] == ["a", "b"] and s.pending == []
    s.defer(buckets[0], None, [])
    model.load_state_dict(model.state_dict())
    s.defer(buckets[1], None, [])
    s.flush()
    assert [u for u, _ in updates] == ["a", "b", "b", "a"]


def test_trace_records_each_wait_and_update_in_order():
    """With a trace (the timeline on), each released bucket leaves a wait slice, then an update
    slice, ordered in time."""
    model = make_model()
    slices = []
    s, _, _ = schedule(model, trace=lambda name, t0, t1: slices.append((name, t0, t1)))
    for b in s.forward_order:
        s.defer(b, None, [])
    model(torch.randn(3, 4))
    assert [n for n, _, _ in slices] == ["wait.allgather.a", "update.a", "wait.allgather.b", "update.b"]
    assert all(t0 <= t1 for _, t0, t1 in slices)
    assert all(a[2] <= b[1] for a, b in zip(slices, slices[1:])), slices


def test_parameter_used_without_its_module_hook_is_refused():
    model = make_model()
    s, buckets, _ = schedule(model)
    s.defer(buckets[0], None, [])
    s.begin_backward()  # b was not released by a forward
    w = model.b.weight
    w.grad = torch.zeros_like(w)
    with pytest.raises(RuntimeError, match="'b.weight' got a gradient"):
        s.check_fresh(w)
    w.grad = None
    s.check_fresh(w)  # unused this step: nothing stale was read
    s.check_fresh(model.a.weight)


def test_owning_modules_lists_tied_parameters_under_each_and_rejects_strangers():
    model = make_model()
    model.c = nn.Linear(4, 6)
    model.c.weight = model.a.weight  # tied
    owners = dear.owning_modules(model, [model.a.weight], names(model))
    assert set(owners) == {model.a, model.c}
    stranger = nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="belong to no module"):
        dear.owning_modules(model, [stranger], {id(stranger): "stranger"})


def test_hyperparameters_are_a_snapshot_used_and_then_restored():
    lr = torch.tensor(0.5)
    groups = [{"params": [1], "lr": lr, "momentum": 0.9}, {"params": [2], "lr": 0.1}]
    snap = dear.hyperparameters(groups)
    lr.fill_(0.25)  # what a scheduler does to a tensor lr
    groups[1]["lr"] = 0.05
    with dear.using_hyperparameters(groups, snap):
        assert float(groups[0]["lr"]) == 0.5 and groups[1]["lr"] == 0.1 and groups[0]["params"] == [1]
    assert float(groups[0]["lr"]) == 0.25 and groups[1]["lr"] == 0.05
    with pytest.raises(RuntimeError, match="param groups"):
        with dear.using_hyperparameters(groups + [{"params": [3]}], snap):
            pass


# ---------------------------------------------------------------- with the optimizer, one rank
def test_single_rank_dear_is_adamw_with_scheduler_and_defers_updates():
    model, ref = make_model(), make_model()
    opt = hipress.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1),
                                       strategy="dear", model=model, bucket_bytes=64)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, 0.5) for o in (opt, ref_opt)]
    for step in range(4):
        x = torch.randn(5, 4)
        for m, o, sch in ((model, opt, scheds[0]), (ref, ref_opt, scheds[1])):
            o.zero_grad()
            m(x).square().sum().backward()
            before = m.a.weight.detach().clone()
            o.step()
            sch.step()
            if o is opt:  # deferred: nothing changed yet, every bucket waits for its forward
                assert torch.equal(m.a.weight, before) and len(opt._hp_dear.pending) == len(opt._hp_buckets)
    opt.synchronize()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert opt.state_dict()["state"][0]["step"] == 4


def test_dear_argument_errors():
    model = make_model()
    with pytest.raises(ValueError, match="needs model="):
        hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy="dear")
    with pytest.raises(ValueError, match="model= is used by strategy='dear' only"):
        hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    with pytest.raises(ValueError, match="plan="):
        hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy="dear", model=model,
                                     compression="terngrad", plan="auto")
    with pytest.raises(ValueError, match="low-rank"):
        hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy="dear", model=model,
                                     compression="powersgd")
    other = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="belong to no module"):
        hipress.DistributedOptimizer(torch.optim.SGD(list(model.parameters()) + list(other.parameters()), lr=0.1),
                                     strategy="dear", model=model,
                                     named_parameters=list(model.named_parameters()) + [("other.w", other.weight),
                                                                                         ("other.b", other.bias)])


def test_dear_call_order_errors():
    model = make_model()
    opt = hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy="dear", model=model,
                                       bucket_bytes=64)  # b's parameters share a bucket, a's are apart
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="between backward and step"):
        opt.synchronize()
    with pytest.raises(ValueError, match="no closure"):
        opt.step(lambda: 0.0)
    opt.step()
    opt.zero_grad()
    # b's weight read outside b's forward (so before its update): refused in backward
    x = torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="'b.weight' got a gradient"):
        (torch.relu(model.a(x)) @ model.b.weight.t()).sum().backward()


def test_dear_nonfinite_step_is_skipped_and_nothing_is_deferred():
    model = make_model()
    opt = hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), strategy="dear", model=model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randn(2, 4)
    x[0, 0] = float("nan")
    model(x).sum().backward()
    with pytest.warns(hipress.NonFiniteGradientWarning):
        opt.step()
    assert opt._hp_dear.pending == []
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()  # the next step goes on as usual
    opt.step()
    assert len(opt._hp_dear.pending) == len(opt._hp_buckets)
    opt.synchronize()
    for n, p in model.named_parameters():
        assert p.isfinite().all() and not torch.equal(p, before[n]), n


def test_speedup_bound_is_paper_eq6():
    # communication fully hidden: linear speed-up
    assert dear.speedup_bound(4, t_ff=1.0, t_bp=2.0, t_rs=0.5, t_ag=0.5) == 4.0
    # reduce-scatter longer than backward by 1, all-gather longer than forward by 2: 3 of 6 exposed
    assert dear.speedup_bound(4, t_ff=1.0, t_bp=2.0, t_rs=3.0, t_ag=3.0) == pytest.approx(4 * 3 / 6)
    with pytest.raises(ValueError):
        dear.speedup_bound(4, 0.0, 0.0, 1.0, 1.0)
