"""Named, recoverable failures of DistributedOptimizer with real ranks (issue #22 items 5, 6;
docs/reliability.md): configuration mismatches rejected at wrap time on every rank, join() for
uneven inputs against a single-process computation, requires_grad changes after wrapping,
reset() after a failed sync (bit-identical to a run that skipped the failed batch), and timeouts
and dead ranks named in the error."""
import os
import sys

import pytest
import torch

from hipress.launch import run

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from robust_worker import batch, make_model  # noqa: E402
from worker_common import run_ranks_by_hand  # noqa: E402

WORKER = os.path.join(HERE, "robust_worker.py")


def launch(tmp_path, scenario, np, arg=None, env=None, timeout=240):
    cmd = [sys.executable, WORKER, scenario, str(tmp_path)] + ([arg] if arg else [])
    code, logs = run(cmd, np, timeout=timeout, quiet=True, env=dict(os.environ, HIPRESS_TIMEOUT_S="30", **(env or {})))
    assert code == 0, "\n".join(logs)[-4000:]
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(np)]


def launch_by_hand(tmp_path, scenario, np, arg=None, timeout_s="6", ranks=None, env=None):
    """For scenarios where a rank fails on purpose (the launcher would stop everyone at once);
    ``ranks``: the ranks started (default: all np)."""
    cmd = [sys.executable, WORKER, scenario, str(tmp_path)] + ([arg] if arg else [])
    return run_ranks_by_hand(cmd, np, dict(os.environ, HIPRESS_TIMEOUT_S=timeout_s, **(env or {})), ranks)


def test_configuration_mismatch_fails_at_wrap_on_every_rank(tmp_path):
    res = launch(tmp_path, "config", 3)
    expected = {"compression": ([1, 2], "compression"), "strategy": ([1], "strategy"),
                "partition_bytes": ([1], "partition_bytes"), "backward_passes_per_step": ([1], "backward_passes_per_step"),
                "op": ([1, 2], "op"), "nonfinite": ([1], "nonfinite"), "bucket_bytes": ([1], "bucket layout"),
                "threshold": ([1], "compression kwargs")}
    for r in range(3):
        errors = res[r]["errors"]
        for field, (ranks, named) in expected.items():
            msg = errors[field]
            assert msg is not None, f"rank {r}: a different {field} on rank(s) {ranks} was not rejected"
            assert f"rank(s) {ranks} differ from rank 0 in {named}" in msg, msg
            assert msg == res[0]["errors"][field]  # the same error on every rank
    for r in range(1, 3):  # the same configuration everywhere still trains
        for k, v in res[0]["trained"].items():
            assert torch.equal(res[r]["trained"][k], v)


def expected_join(steps, np, lr=0.1):
    """What plain SGD with op=Average gives when rank r trains steps[r] batches and then joins
    (zeros in every later sync, its parameters frozen), followed by one step on every rank."""
    models = [make_model() for _ in range(np)]

    def grads(r, x):
        m = models[r]
        m.zero_grad()
        m(x).pow(2).sum().backward()
        return [p.grad.double() for p in m.parameters()]

    def apply(ranks, avg):
        with torch.no_grad():
            for r in ranks:
                for p, g in zip(models[r].parameters(), avg):
                    p -= lr * g.float()

    for t in range(max(steps)):
        active = [r for r in range(np) if t < steps[r]]
        contributions = [grads(r, batch(r, t)) for r in active]
        avg = [sum(gs) / np for gs in zip(*contributions)]
        apply(active, avg)
    contributions = [grads(r, batch(r, 99)) for r in range(np)]
    apply(range(np), [sum(gs) / np for gs in zip(*contributions)])
    return [dict(m.named_parameters()) for m in models]


@pytest.mark.parametrize("np,steps,strategy,nonfinite", [(2, "2,4", "ring", "skip"), (3, "5,2,4", "ring", "off"),
                                                         (3, "3,3,1", "ps", "skip")])
def test_join_uneven_inputs(tmp_path, np, steps, strategy, nonfinite):
    res = launch(tmp_path, "join", np, steps, env={"STRATEGY": strategy, "NONFINITE": nonfinite})
    counts = [int(s) for s in steps.split(",")]
    last_candidates = [r for r in range(np) if counts[r] == max(counts)]  # a tie: whichever joined last
    want = expected_join(counts, np)
    for r in range(np):
        assert res[r]["last"] == res[0]["last"] and res[0]["last"] in last_candidates
        for k, v in res[r]["final"].items():
            torch.testing.assert_close(v, want[r][k].detach(), rtol=1e-6, atol=1e-7,
                                       msg=lambda m: f"rank {r} {k}: {m}")


def test_join_uneven_inputs_covap_local_mode(tmp_path):
    """COVAP's local mode waits for each step's agreement a step late, but a rank in join() waits
    for it at once: its zero steps end only once every rank's step has begun, so every rank
    finds the last joiner's final step in time (no mismatched collective, no hang), even where
    the last joiner calls join() a second after its last step."""
    res = launch(tmp_path, "join", 2, "2,5", env={"STRATEGY": "ring", "NONFINITE": "skip", "COMPRESSION": "covap",
                                                  "JOIN_DELAY_S": "1"})
    assert res[0]["last"] == res[1]["last"] == 1
    for k, v in res[0]["final"].items():
        assert torch.equal(v, res[1]["final"][k]), f"{k}: the ranks differ after synchronize()"
        assert torch.isfinite(v).all(), k


@pytest.mark.parametrize("strategy", ["ring", "ps"])
def test_requires_grad_changes_after_wrapping(tmp_path, strategy):
    res = launch(tmp_path, "freeze", 2, env={"STRATEGY": strategy})
    for r in range(2):
        for k in ("0.weight", "0.bias"):  # frozen over steps 2-3: not touched (no momentum, no residual)
            assert torch.equal(res[r]["before_unfreeze"][k], res[r]["at_freeze"][k]), k
            assert not torch.equal(res[r]["final"][k], res[r]["before_unfreeze"][k]), f"{k} did not train again"
        for k in ("2.weight", "2.bias"):
            assert not torch.equal(res[r]["before_unfreeze"][k], res[r]["at_freeze"][k])
        for k, v in res[r]["final"].items():  # unfrozen and synced: the ranks agree exactly
            assert torch.equal(v, res[0]["final"][k]), f"rank {r} {k} differs from rank 0"


def test_ranks_that_freeze_different_parameters_fail_the_step_on_every_rank(tmp_path):
    """Rank 1's buckets differ from rank 0's for one step. The step's first allreduce compares the
    bucket layouts (its later ones then skip their own check): every rank fails that step with the
    same named error, before a mismatched collective could abort a process; after reset() and with
    the same parameters trained again, the ranks agree again."""
    res = launch(tmp_path, "freeze_one_rank", 2)
    for r in range(2):
        assert [t for t, _ in res[r]["errors"]] == [2], res[r]["errors"]
        assert "ranks disagree on what the sizes follow from (agree_on)" in res[r]["errors"][0][1]
        for k, v in res[r]["final"].items():
            assert torch.equal(v, res[0]["final"][k]), f"rank {r} {k} differs from rank 0"


@pytest.mark.parametrize("strategy,coordinator", [("ring", "0"), ("allgather", "0"), ("ps", "1"), ("ring", "1")])
def test_reset_after_failed_sync(tmp_path, strategy, coordinator):
    """With the global coordinator, reset() replaces its executor (the old one failed) and its
    step predictions start over."""
    res = launch(tmp_path, "reset", 2, env={"STRATEGY": strategy, "COORDINATOR": coordinator})
    for r in range(2):
        assert len(res[r]["errors"]) == 1 and "injected transport failure" in res[r]["errors"][0]
        for k, v in res[r]["failed"].items():
            # training went on, compressor and momentum state as before the failed step: the same
            # parameters, bit for bit, as a run that never took that batch
            assert torch.equal(v, res[r]["reference"][k]), f"rank {r} {k}"
            assert torch.equal(v, res[0]["failed"][k])


@pytest.mark.slow
@pytest.mark.parametrize("coordinator", ["0", "1"])
def test_stalled_rank_is_named_and_reset_recovers(tmp_path, coordinator):
    """Rank 1 sleeps 1.5 timeouts before a step: the others' step fails naming rank 1; every rank
    (rank 1 too, on the connections the others closed) fails that step, resets and trains on;
    with the global coordinator too (its executors fail and reset() replaces them)."""
    codes, outs = launch_by_hand(tmp_path, "stall", 3, arg="9", timeout_s="6", env={"COORDINATOR": coordinator})
    assert codes == [0, 0, 0], "\n".join(o[-2000:] for o in outs)
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    for r in (0, 2):
        assert len(res[r]["errors"]) == 1, res[r]["errors"]
        err = res[r]["errors"][0]
        assert "rank(s) [1] report no failure" in err, err
    assert len(res[1]["errors"]) == 1, res[1]["errors"]
    for r in range(3):
        for k, v in res[r]["final"].items():
            assert torch.equal(v, res[0]["final"][k])


def test_killed_rank_is_named(tmp_path):
    codes, outs = launch_by_hand(tmp_path, "kill", 3, timeout_s="10")
    assert codes == [3, 17, 3], "\n".join(o[-2000:] for o in outs)
    for r in (0, 2):
        err = torch.load(tmp_path / f"rank{r}.pt")["errors"][0]
        assert "rank(s) [1] report no failure" in err, err


@pytest.mark.parametrize("started,missing", [((0, 1), [2]), ((1, 2), [0])])
def test_rank_that_never_starts_is_named(tmp_path, started, missing):
    codes, outs = launch_by_hand(tmp_path, "rendezvous", 3, timeout_s="5", ranks=started)
    assert codes == [3] * len(started), "\n".join(o[-2000:] for o in outs)
    for r in started:
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert got["type"] == "TransportError", got  # a RuntimeError
        if missing == [0]:
            assert "rank 0 never arrived at the rendezvous" in got["error"], got["error"]
        else:
            assert f"rank(s) {missing} never arrived at the rendezvous" in got["error"], got["error"]
