"""compression="covap" (hipress/torch/covap.py) with real ranks: the optimizer's result
equals COVAP's rule applied in one process, in both modes, and the profiler gives every rank
the same interval. Two ranks over gloo, one launch with a timeout."""
import os
import sys

import pytest
import torch

from hipress.compression.none import NoneCompressor
from hipress.launch import run
from hipress.torch import covap
from hipress.torch.optimizer import fusion_buckets

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import covap_worker as W  # noqa: E402
from covap_replica import local_replicas  # noqa: E402

NP = 2


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    d = tmp_path_factory.mktemp("covap")
    code, logs = run([sys.executable, os.path.join(HERE, "covap_worker.py"), str(d)], NP, timeout=180, quiet=True)
    assert code == 0, "\n".join(logs)[-4000:]
    return d


def replica(interval, steps):
    """COVAP by hand: the average of the ranks' gradients, filtered unit by unit (every rank
    selects the same units, and the filter is linear), then momentum SGD."""
    model = W.make_model()
    named = list(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    buckets = fusion_buckets(named, NoneCompressor(), 0)  # the optimizer's buckets, in its order
    filt = covap.Filter({b.name: b.numel for b in buckets}, interval)
    for step in range(steps):
        grads = []
        for r in range(NP):
            x, y = W.batch(r, step)
            model.zero_grad(set_to_none=True)
            ((model(x) - y) ** 2).mean().backward()
            grads.append({n: p.grad.clone() for n, p in named})
        for b in buckets:
            flat = torch.cat([(grads[0][n] + grads[1][n]).reshape(-1) / NP for n, _ in b.params])
            filt.apply(b.name, flat)
            for (n, p), off in zip(b.params, b.offsets):
                p.grad = flat[off:off + p.numel()].view_as(p).clone()
        filt.advance()
        opt.step()
    return {n: p.detach() for n, p in named}, filt


def test_fixed_interval_equals_the_rule(out):
    want, filt = replica(2, W.STEPS)
    assert sum(len(u) for u in filt.units.values()) > len(filt.units), "the large weight was not sharded"
    for r in range(NP):
        got = torch.load(out / f"fixed-paper-rank{r}.pt")
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=f"rank {r} {n}")
    # the filter mattered: the uncompressed run ends elsewhere
    plain, _ = replica(1, W.STEPS)
    assert any(not torch.allclose(plain[n], want[n], atol=1e-4) for n in want)


def test_profiler_agrees_across_ranks(out):
    res = [torch.load(out / f"auto-rank{r}.pt", weights_only=False) for r in range(NP)]
    for r in res:
        assert r["before"] is None, "profiled before its 1 warm-up + 2 timed steps were over"
        p = r["after"]
        assert p is not None and p.t_comp > 0 and p.t_comm > 0  # the profiler timed the syncs
        assert p.interval == min(covap.interval_from_ccr(p.ccr), covap.MAX_INTERVAL["paper"])
    assert res[0]["after"] == res[1]["after"], "ranks computed different profiles"
    assert res[0]["state"]["filter"]["interval"] == res[0]["after"].interval
    for n in res[0]["params"]:
        assert torch.equal(res[0]["params"][n], res[1]["params"][n])


def test_local_mode_equals_local_replicas(out):
    """mode="local": each rank steps on its own gradient, the selected units' parameters averaged
    before the step. The ranks differ between averages, each equal to its replica."""
    buckets = [(b.name, [n for n, _ in b.params]) for b in fusion_buckets(list(W.make_model().named_parameters()),
                                                                         NoneCompressor(), 0)]
    want, filt = local_replicas(W.make_model, W.batch, buckets, 2, 0, W.STEPS, wire="bf16")
    assert sum(len(u) for u in filt.units.values()) > len(filt.units), "the large weight was not sharded"
    got = [torch.load(out / f"fixed-local-rank{r}.pt") for r in range(NP)]
    for r in range(NP):
        for n in want[r]:
            torch.testing.assert_close(got[r][n], want[r][n], rtol=1e-5, atol=1e-6, msg=f"rank {r} {n}")
    # the ranks are replicas of their own (their last steps were local), and not the paper's run
    assert any(not torch.allclose(got[0][n], got[1][n], atol=1e-4) for n in got[0])
    paper = torch.load(out / "fixed-paper-rank0.pt")
    assert any(not torch.allclose(got[0][n], paper[n], atol=1e-4) for n in paper)
    for r in range(NP):  # hipress.allreduce between steps waited for the step's averages first
        q = torch.load(out / f"quiesce-rank{r}.pt")
        assert q["in_flight"] > 0 and q["done"] and q["allreduce"] == 1.0, q
    # the averages travelled as bf16 differences (wire="bf16"): fp32 ones end elsewhere
    fp32, _ = local_replicas(W.make_model, W.batch, buckets, 2, 0, W.STEPS, wire="fp32")
    assert any(not torch.allclose(got[0][n], fp32[0][n], rtol=1e-5, atol=1e-6) for n in got[0])
    # synchronize() between steps: every rank holds the replicas' average, the last step's
    # averages applied first
    settled, _ = local_replicas(W.make_model, W.batch, buckets, 2, 0, W.STEPS, wire="bf16", settle=True)
    synced = [torch.load(out / f"synced-rank{r}.pt") for r in range(NP)]
    for n in want[0]:
        assert torch.equal(synced[0][n], synced[1][n]), n
        torch.testing.assert_close(synced[0][n], (settled[0][n] + settled[1][n]) / NP, rtol=1e-5, atol=1e-6, msg=n)


def test_local_mode_skips_a_nonfinite_step_on_its_rank_only(out):
    """A rank's NaN at a step where units are averaged, in the local mode (each rank's model its
    own replica between averages): that rank alone skips its step (warns, names itself; its
    parameters stay as they were: the step before averaged ranks that were still equal, so its
    averages add nothing), the other steps on, and the filter and the averages go on alike on
    both (the replicas with rank 1's step 1 left out)."""
    snaps = [torch.load(out / f"nonfinite-local-rank{r}.pt") for r in range(NP)]
    for r in range(NP):
        assert [s["filter_step"] for s in snaps[r]] == [1, 2, 3, 4], f"rank {r}"
    before, bad = snaps[1][0]["params"], snaps[1][1]["params"]
    assert [s["last_nonfinite"] for s in snaps[1]] == [{}, {n: [1] for n in before}, {}, {}]  # every gradient NaN
    assert [s["last_nonfinite"] for s in snaps[0]] == [{}, {}, {}, {}]
    assert [len(s["warnings"]) for s in snaps[1]] == [0, 1, 0, 0] and "skipped on this rank" in snaps[1][1]["warnings"][0]
    assert "restored" not in snaps[1][1]["warnings"][0]  # nothing is: the schedule and averages are every rank's
    assert all(not s["warnings"] for s in snaps[0])
    for n in before:
        assert torch.equal(bad[n], before[n]), f"rank 1 {n}: the skipped step moved it"
    assert any(not torch.equal(snaps[0][1]["params"][n], snaps[0][0]["params"][n]) for n in before), \
        "rank 0 did not step"
    buckets = [(b.name, [n for n, _ in b.params]) for b in fusion_buckets(list(W.make_model().named_parameters()),
                                                                         NoneCompressor(), 0)]
    want, _ = local_replicas(W.make_model, W.batch, buckets, 2, 0, 3, skipped_on={(1, 1)})
    for r in range(NP):
        for n in want[r]:
            torch.testing.assert_close(snaps[r][2]["params"][n], want[r][n], rtol=1e-5, atol=1e-6, msg=f"rank {r} {n}")
    # the teeth: without the skip the replicas end elsewhere
    plain, _ = local_replicas(W.make_model, W.batch, buckets, 2, 0, 3)
    assert any(not torch.allclose(plain[1][n], want[1][n]) for n in want[1])


def test_local_mode_ranks_do_not_meet_at_each_step_end(out):
    """Rank 1 began its step 3's backward only once rank 0 had finished its step 3 (within 30 s):
    where each step's end waited for every rank's (the agreement on non-finite gradients), rank 0
    could not have finished it first."""
    snaps = [torch.load(out / f"nonfinite-local-rank{r}.pt") for r in range(NP)]
    assert snaps[1][3]["waited_for_rank0"] is True


def test_profiled_steps_send_once_the_last_gradient_is_ready(out):
    """While COVAP profiles, no bucket is sent before the backward's last gradient (so T_comp is
    measured without communication beside it, docs/covap.md "Profiler"), then every one at once;
    once the filter is on, buckets go out as they fill."""
    for r in range(NP):
        rec = torch.load(out / f"reprofile-rank{r}.pt", weights_only=False)
        n, started = rec["gradients"], rec["started"]
        assert rec["buckets"] == n > 1 and len(started) == 5 * n
        steps = [started[i:i + n] for i in range(0, len(started), n)]
        profiled = [s for s in steps if s[0][0]]
        filtered = [s for s in steps if not s[0][0]]
        assert len(profiled) == 3 and len(filtered) == 2  # 1 warm-up + 2 timed steps, then the filter
        for s in profiled:
            assert [c for _, c in s] == [0] * (n - 1) + [n], s
        assert any(c > 0 for s in filtered for _, c in s[:-1]), filtered


def test_reprofile_to_another_interval_hands_the_changed_units_states_back(out):
    """Re-profiled to another interval, the large weight is sharded otherwise: the inner onebit
    states of the units whose ranges changed go, element by element, into the next gradients
    (the carry), and training goes on (before, the old states met the new units: 'state was
    made for 8192 elements, the gradient has 4096')."""
    res = [torch.load(out / f"reprofile-rank{r}.pt", weights_only=False) for r in range(NP)]
    for rec in res:
        assert rec["first"].interval >= 2, f"CCR {rec['first'].ccr}: one interval only, nothing to change"
        assert rec["second"].interval == (1 if rec["first"].interval == 2 else 2)
        assert rec["changed"], "no unit changed ranges: no teeth"
        want = {}
        hp = rec["saved"]
        for name, t, _ in rec["changed"]:
            for key, st in hp["compressor_state"].items():
                if not key.startswith(f"{name}/u{t}/") or "residual" not in st["buffers"]:
                    continue
                res_ = st["buffers"]["residual"].reshape(-1)
                for pname, at, start, count in hp["state_owners"][key]:
                    acc = want.setdefault(pname, torch.zeros(rec["params"][pname].numel()))
                    acc[at:at + count] += res_[start:start + count]
        assert want and sum(float(t.abs().sum()) for t in want.values()) > 1e-3
        assert rec["carry"].keys() == want.keys()
        for pname, t in want.items():
            torch.testing.assert_close(rec["carry"][pname].reshape(-1), t, rtol=1e-6, atol=1e-7)
    for n in res[0]["params"]:
        assert torch.equal(res[0]["params"][n], res[1]["params"][n])
