"""compression="covap" through hipress's DDP comm hook (hipress.ddp), two ranks over gloo: the
hook equals COVAP's rule applied in one process to DDP's buckets, a checkpointed hook state
resumes bit for bit (COVAP around TBQ), and the profiler gives every rank the same interval."""
import os
import sys

import pytest
import torch

from hipress.launch import run
from hipress.torch import covap

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import covap_ddp_worker as W  # noqa: E402
from covap_replica import local_replicas  # noqa: E402
from ddp_hook_worker import batch, make_model  # noqa: E402

NP = 2


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("covap_ddp")
    code, logs = run([sys.executable, os.path.join(HERE, "covap_ddp_worker.py"), str(d)], NP, timeout=240,
                     quiet=True)
    assert code == 0, "\n".join(logs)[-4000:]
    return [torch.load(d / f"rank{r}.pt", weights_only=False) for r in range(NP)]


def replica(buckets, interval, whole_steps, steps):
    """COVAP by hand over the hook's buckets: the average of the ranks' gradients (every rank
    selects the same units and the filter is linear), synced whole for the first
    ``whole_steps`` steps (DDP's buckets settling), then filtered; then momentum SGD."""
    model = make_model()
    named = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    filt = covap.Filter({name: sum(named[n].numel() for n in members) for name, members in buckets}, interval)
    for step in range(steps):
        grads = []
        for r in range(NP):
            x, y = batch(r, step)
            model.zero_grad(set_to_none=True)
            ((model(x) - y) ** 2).mean().backward()
            grads.append({n: p.grad.clone() for n, p in named.items()})
        avg = {n: sum(g[n] for g in grads) / NP for n in named}
        if step >= whole_steps:
            for name, members in buckets:
                flat = torch.cat([avg[n].reshape(-1) for n in members])
                filt.apply(name, flat)
                off = 0
                for n in members:
                    k = named[n].numel()
                    avg[n] = flat[off:off + k].view_as(named[n])
                    off += k
            filt.advance()
        for n, p in named.items():
            p.grad = avg[n].clone()
        opt.step()
    return {n: p.detach() for n, p in named.items()}, filt


def test_hook_equals_the_rule(results):
    got = results[0]["fixed"]
    buckets = [(name, [n.removeprefix("module.") for n in members]) for name, members in got["buckets"]]
    # DDP's first step has one bucket of all, then one per parameter: the filter starts once
    # two steps show the same buckets
    assert len(got["buckets"]) == 4
    assert got["filtered_steps"] == W.STEPS - 3
    want, filt = replica(buckets, 2, W.STEPS - got["filtered_steps"], W.STEPS)
    assert filt.units == got["units"]
    assert sum(len(u) for u in filt.units.values()) > len(filt.units), "no bucket was sharded"
    for r in range(NP):
        for n in want:
            torch.testing.assert_close(results[r]["fixed"]["params"][n], want[n], rtol=1e-5, atol=1e-6,
                                       msg=f"rank {r} {n}")
    plain, _ = replica(buckets, 1, 0, W.STEPS)
    assert any(not torch.allclose(plain[n], want[n], atol=1e-4) for n in want), "the filter changed nothing"


def test_local_mode_equals_local_replicas(results):
    """mode="local" in the hook: each rank steps on its own gradient, the selected units'
    parameters averaged during the backward (written before the step)."""
    got = [results[r]["local"] for r in range(NP)]
    buckets = [(name, [n.removeprefix("module.") for n in members]) for name, members in got[0]["buckets"]]
    assert got[0]["filtered_steps"] == W.STEPS - 3
    whole = W.STEPS - got[0]["filtered_steps"]
    want, filt = local_replicas(make_model, batch, buckets, 2, whole, W.STEPS, wire="bf16")
    assert filt.units == got[0]["units"]
    for r in range(NP):
        for n in want[r]:
            torch.testing.assert_close(got[r]["params"][n], want[r][n], rtol=1e-5, atol=1e-6, msg=f"rank {r} {n}")
    assert any(not torch.allclose(got[0]["params"][n], got[1]["params"][n], atol=1e-4) for n in want[0])
    # the averages travelled as bf16 differences (wire="bf16"): fp32 ones end elsewhere
    fp32, _ = local_replicas(make_model, batch, buckets, 2, whole, W.STEPS, wire="fp32")
    assert any(not torch.allclose(got[0]["params"][n], fp32[0][n], rtol=1e-5, atol=1e-6) for n in want[0])
    # state.synchronize() between steps: every rank holds the replicas' average, the last step's
    # averages applied first
    settled, _ = local_replicas(make_model, batch, buckets, 2, whole, W.STEPS, wire="bf16", settle=True)
    for n in want[0]:
        assert torch.equal(got[0]["synced"][n], got[1]["synced"][n]), n
        torch.testing.assert_close(got[0]["synced"][n], (settled[0][n] + settled[1][n]) / NP, rtol=1e-5, atol=1e-6,
                                   msg=n)
    # in mode "paper" the ranks are the same already, and synchronize() leaves them
    paper = results[0]["fixed"]
    assert all(torch.equal(paper["params"][n], paper["synced"][n]) for n in paper["params"])


def test_resume_is_bit_identical(results):
    for r in range(NP):
        res = results[r]["resume"]
        ck = res["checkpoint"]["covap"]
        assert ck["run"]["filter"]["step"] > 0 and ck["run"]["filter"]["residual"], "checkpoint before the filter ran"
        assert any("/u" in k for k in res["checkpoint"]["compressor_state"]), "no per-unit TBQ state"
        for n, v in res["whole"].items():
            assert torch.equal(v, res["resumed"][n]), f"rank {r} {n}: resume not bit-identical"


def test_profiler_agrees_across_ranks(results):
    res = [results[r]["auto"] for r in range(NP)]
    for a in res:
        # steps 0-1: DDP's buckets settle; the profiler then warms up one step and times two
        assert a["before"] is None
        p = a["after"]
        assert p is not None and p.t_comp > 0 and p.t_comm > 0
        assert p.interval == min(covap.interval_from_ccr(p.ccr), covap.MAX_INTERVAL["paper"])
        assert a["state"]["run"]["filter"]["interval"] == p.interval
    assert res[0]["after"] == res[1]["after"], "ranks computed different profiles"
    for n in res[0]["params"]:
        assert torch.equal(res[0]["params"][n], res[1]["params"][n])


def test_profiled_steps_send_once_the_last_bucket_is_ready(results):
    """As the optimizer: while COVAP profiles, the hook starts no bucket's sync before the step's
    last bucket is handed over, then all of them; otherwise each as it comes."""
    for r in range(NP):
        steps, cur, ended = [], [], False  # a step ends with the sends after its last bucket
        for e in results[r]["auto"]["events"]:
            if e[0] == "ready" and ended:
                steps.append(cur)
                cur, ended = [], False
            cur.append(e)
            ended = ended or (e[0] == "ready" and e[2])
        steps.append(cur)
        assert len(steps) == 8
        profiled = [i for i, s in enumerate(steps) if s[0][1]]
        assert len(profiled) == 3, steps  # after DDP's buckets settle: 1 warm-up + 2 timed steps
        for i in profiled:
            n = sum(e[0] == "ready" for e in steps[i])
            assert n > 1 and [e[0] for e in steps[i]] == ["ready"] * n + ["sent"] * n, steps[i]
        later = steps[profiled[-1] + 1:]
        assert later and all(s[1] == ("sent",) for s in later), later


def test_bad_options():
    import hipress.ddp

    with pytest.raises(ValueError, match="interval"):
        hipress.ddp.HookState("covap", interval=0)
    with pytest.raises(ValueError, match="single-round"):
        hipress.ddp.HookState("covap", inner="powersgd", mode="paper")
    with pytest.raises(ValueError, match="mode='paper'"):  # local mode averages uncompressed parameters
        hipress.ddp.HookState("covap", inner="tbq")
    with pytest.raises(ValueError, match="mode must be"):
        hipress.ddp.HookState("covap", mode="residual")
    with pytest.raises(ValueError, match="no COVAP state"):
        hipress.ddp.HookState("covap", interval=2).load_state_dict({"compressor_state": {}})
