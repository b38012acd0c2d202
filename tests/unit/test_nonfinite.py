"""Non-finite gradients without peers (hipress/torch/nonfinite.py, hipress/sync/undo.py); the
multi-rank behaviour is tested in tests/multiproc/test_nonfinite_ranks.py."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn

import hipress
from hipress import compression
from hipress.sync import StateStore
from hipress.sync.undo import UndoLog
from hipress.torch.nonfinite import NonFiniteGradientError, NonFiniteGradientWarning, all_finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_all_finite(dtype):
    t = torch.randn(1000).to(dtype)
    assert all_finite(t)
    assert all_finite(torch.empty(0, dtype=dtype))
    for bad in (float("nan"), float("inf"), -float("inf")):
        u = t.clone()
        u[517] = bad
        assert not all_finite(u)
    # finite elements whose sum overflows: still finite
    big = torch.full((64,), torch.finfo(dtype).max, dtype=dtype)
    assert all_finite(big)
    big[::2] = -torch.finfo(dtype).max
    big[:2] = torch.finfo(dtype).max
    assert all_finite(big)


def test_undo_log_copies_on_first_touch_only():
    log = UndoLog()
    a = torch.arange(4.0)
    log.touch("a", [a])  # disabled: nothing kept
    log.enabled = True
    log.touch("a", [a])
    a.add_(1)
    log.touch("a", [a])  # second touch in the step: the first copy stays
    a.add_(1)
    log.created("b", "info")
    got = {}
    log.undo(lambda k, copies, info: got.__setitem__(k, (copies, info)))
    assert torch.equal(got["a"][0][0], torch.arange(4.0)) and got["b"] == (None, "info")
    log.undo(lambda *a: pytest.fail("undo after undo restores nothing"))
    log.touch("a", [a])
    spare = log._spare["a"][0]
    log.commit()
    log.touch("a", [a])
    assert log._spare["a"][0] is spare  # the copy's buffer is kept from step to step


def test_undo_log_replace_keeps_the_old_tensors_as_the_copy():
    """replace(): the new values go into spare buffers and the old tensors are the copy, with no
    copy made; after commit the old tensors are the next step's buffers; after an undo (restored by
    copying into the current state) the buffers still alternate, never aliasing the state."""
    log = UndoLog()
    u = torch.arange(4.0)
    assert log.replace("u", [u])[0] is u  # disabled: in place
    log.enabled = True
    state = u
    for step in range(4):
        new = log.replace("u", [state])[0]
        assert new is not state and log.replace("u", [new])[0] is new  # once per step
        torch.add(state, 1.0, out=new)
        before, state = state, new
        assert torch.equal(state, before + 1)  # the old one is left as it was
        if step == 2:
            log.undo(lambda k, copies, _: state.copy_(copies[0]))
            assert torch.equal(state, before)
        else:
            log.commit()
    assert torch.equal(state, torch.arange(4.0) + 3)  # steps 0, 1 and 3 taken, 2 undone

@pytest.mark.parametrize("name", sorted(set(compression.available()) - {"powersgd"}))
def test_state_store_undo_restores_exactly(name):
    comp = compression.get(name)
    store = StateStore(rank=1)
    store.undo_log.enabled = True
    g = torch.randn(300)
    comp.encode(g, store.get("k", comp, 300))
    store.commit()
    before = store.state_dict()
    comp.encode(g * 3, store.get("k", comp, 300))
    comp.encode(g, store.get("new", comp, 300))  # created this step
    store.undo()
    after = store.state_dict()
    assert set(after) == {"k"}
    for k, v in before["k"]["buffers"].items():
        assert torch.equal(after["k"]["buffers"][k], v), k
    assert torch.equal(after["k"]["scalars"], before["k"]["scalars"])
    # a dropped state comes back the same as it would have been made
    fresh = StateStore(rank=1)
    st_a, st_b = store.get("new", comp, 300), fresh.get("new", comp, 300)
    assert torch.equal(st_a.scalars, st_b.scalars)



class _Scaled(compression.Compressor):
    """A user compressor in Python with a state buffer and a counter of its own: fp16 values
    times a scale that it keeps (1.5, then 1 after its first encode)."""
    name, category, rate = "scaled_test", "quantization", 0.5

    def max_encoded_bytes(self, numel, shape=None):
        return 2 * numel

    def new_state(self, numel, shape=None):
        st = super().new_state(numel, shape)
        st.add_buffer("scale", 1).fill_(1.5)
        return st

    def encode(self, grad, state=None, out=None):
        scale = 1.0 if state is None else float(state.buffers["scale"])
        if state is not None:
            state.buffers["scale"].fill_(1.0)
            state.scalars[1] += 1
        return (grad.reshape(-1) * scale).to(torch.float16).view(torch.uint8).clone()

    def decode(self, payload, out):
        out.copy_(payload.view(torch.float16).to(torch.float32).view(out.shape))
        return out


_EF = sorted(n for n in compression.available() if compression.get(n).takes_residual_in)


@pytest.mark.parametrize("name", _EF + ["python"])
def test_state_store_encode_writes_the_residual_out_of_place(name):
    """StateStore.encode with the undo log on: an error-feedback residual is written into the
    log's spare buffer and the old tensor is the log's copy (nothing copied); payloads and states
    are bit for bit those of a store without the log, also after a step undone and taken again."""
    assert {"onebit", "tbq", "graddrop"} <= set(_EF)
    comp = compression.ErrorFeedback(_Scaled()) if name == "python" else compression.get(name)
    logged, plain = StateStore(rank=1), StateStore(rank=1)
    logged.undo_log.enabled = True
    shape = (20, 100)
    for step in range(5):
        g = torch.randn(shape, generator=torch.Generator().manual_seed(step)).view(-1)
        if step == 3:  # taken, then undone: the next encode must see the state of step 2
            logged.encode("k", comp, g * 7, shape)
            logged.undo()
        res = comp.residual_buffer
        old = logged._states["k"].buffers[res] if step else None
        a, b = logged.encode("k", comp, g, shape), plain.encode("k", comp, g, shape)
        assert torch.equal(a, b), step
        _same_state_then_commit(logged, plain, comp, old, step)


def _same_state_then_commit(logged, plain, comp, old, step):
    """logged's state "k" is plain's, bit for bit, and (after the first step) the old residual is
    the undo log's copy, not copied; then logged's step is committed."""
    sa, sb = logged.state_dict()["k"], plain.state_dict()["k"]
    for k in sb["buffers"]:
        assert torch.equal(sa["buffers"][k], sb["buffers"][k]), (step, k)
    assert torch.equal(sa["scalars"], sb["scalars"]), step
    if step:
        st = logged._states["k"]
        assert st.buffers[comp.residual_buffer] is not old
        r = list(st.buffers).index(comp.residual_buffer)
        assert logged.undo_log._saved["k"][r] is old  # the old residual is the copy, not copied
    logged.commit()


@pytest.mark.parametrize("name", ["powersgd", "powersgd_grace", "acpsgd"])
def test_state_store_lowrank_round0_writes_the_matrix_out_of_place(name):
    """StateStore.encode_round0 (the low-rank sync's first round) with the undo log on: PowerSGD's
    matrix (gradient + residual; ACP-SGD's residual) is written into the log's spare buffer, the old
    one stays as the copy. Every round's payload, the decoded gradient and the states are bit for
    bit those of a store without the log, also after a step undone and taken again."""
    comp = compression.get(name, rank=2)
    logged, plain = StateStore(rank=1), StateStore(rank=1)
    logged.undo_log.enabled = True
    shape = (20, 100)

    def step_of(store, g):
        first, st = store.encode_round0("k", comp, g, shape)
        payloads = [first]
        for k in range(1, comp.rounds):
            payloads.append(comp.encode_round(k, payloads[-1], st))
        out = torch.empty(g.numel())
        comp.finish(payloads[-1].clone(), st, out)
        return payloads + [out]

    for step in range(5):
        g = torch.randn(shape, generator=torch.Generator().manual_seed(step)).view(-1)
        if step == 3:  # taken, then undone: the next encode must see the state of step 2
            step_of(logged, g * 7)
            logged.undo()
        old = logged._states["k"].buffers[comp.residual_buffer] if step else None
        for a, b in zip(step_of(logged, g), step_of(plain, g)):
            assert torch.equal(a, b), step
        _same_state_then_commit(logged, plain, comp, old, step)


def test_error_feedback_residual_in_checks_it():
    comp = compression.get("onebit")
    st = comp.new_state(10)
    with pytest.raises(ValueError, match="residual_in must be 10"):
        comp.encode(torch.randn(10), st, residual_in=torch.zeros(9))
    with pytest.raises(ValueError, match="needs a state"):
        comp.encode(torch.randn(10), None, residual_in=torch.zeros(10))

def test_state_store_undo_puts_pending_back():
    comp = compression.get("tbq")
    store = StateStore()
    store.undo_log.enabled = True
    comp.encode(torch.randn(10), store.get("k", comp, 10))
    sd = store.state_dict()
    other = StateStore()
    other.undo_log.enabled = True
    other.load_state_dict(sd)
    comp.encode(torch.randn(10), other.get("k", comp, 10))
    other.undo()
    assert "k" in other.state_dict() and torch.equal(other.state_dict()["k"]["buffers"]["residual"],
                                                     sd["k"]["buffers"]["residual"])


@pytest.fixture
def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))


def poison(p, value, index=0):
    """p's next gradient gets ``value`` at flat ``index``, during backward (before hipress sees it)."""
    def hook(g):
        handle.remove()
        g = g.clone()
        g.view(-1)[index] = value
        return g

    handle = p.register_hook(hook)


def run(model, opt, batches, nan_at=None):
    for i, x in enumerate(batches):
        opt.zero_grad()
        if i == nan_at:
            poison(model[0].weight, float("nan"), 5)
        model(x).sum().backward()
        opt.step()


def test_single_rank_skip_equals_not_taking_the_batch(model):
    ref = copy.deepcopy(model)
    kw = dict(compression="tbq", momentum_correction=True)
    opt = hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(), **kw)
    ref_opt = hipress.DistributedOptimizer(torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9),
                                           named_parameters=ref.named_parameters(), **kw)
    torch.manual_seed(1)
    batches = [torch.randn(5, 4) for _ in range(5)]
    with pytest.warns(NonFiniteGradientWarning, match=r"'0\.weight' \(rank 0\)"):
        run(model, opt, batches, nan_at=2)
    assert opt.last_nonfinite == {}  # the last step was fine
    run(ref, ref_opt, batches[:2] + batches[3:])
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    for k, v in ref_opt.state_dict()["hipress"]["velocity"].items():
        assert torch.equal(opt.state_dict()["hipress"]["velocity"][k], v)


def test_single_rank_first_step_nonfinite_drops_new_velocity(model):
    opt = hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(), compression="tbq")
    before = copy.deepcopy(model.state_dict())
    opt.zero_grad()
    poison(model[2].bias, float("inf"))
    model(torch.randn(5, 4)).sum().backward()
    with pytest.warns(NonFiniteGradientWarning):
        opt.synchronize()
    assert opt.last_nonfinite == {"2.bias": [0]}
    assert torch.isnan(model[2].bias.grad).all() and torch.isfinite(model[0].weight.grad).all()
    with opt.skip_synchronize():
        assert opt.step() is None
    assert opt.state_dict()["hipress"]["velocity"] == {}
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_single_rank_raise(model):
    opt = hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), nonfinite="raise")
    opt.zero_grad()
    poison(model[0].bias, float("nan"))
    model(torch.randn(5, 4)).sum().backward()
    with pytest.raises(NonFiniteGradientError, match=r"'0\.bias' \(rank 0\)") as e:
        opt.step()
    assert e.value.where == {"0.bias": [0]}
    opt.zero_grad()  # training goes on
    model(torch.randn(5, 4)).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()


def test_exported():
    assert hipress.NonFiniteGradientError is NonFiniteGradientError
    assert hipress.NonFiniteGradientWarning is NonFiniteGradientWarning


def test_off_and_bad_mode(model):
    with pytest.raises(ValueError, match="nonfinite"):
        hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters(), nonfinite="ignore")
    opt = hipress.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(), nonfinite="off")
    opt.zero_grad()
    poison(model[0].bias, float("nan"))
    model(torch.randn(5, 4)).sum().backward()
    opt.step()  # taken as it is
    assert torch.isnan(model[0].bias).any()
