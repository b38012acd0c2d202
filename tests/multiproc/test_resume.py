"""Checkpoint/resume through the optimizer, with real ranks (2 local processes over gloo).

For every registered algorithm and every strategy it runs under: job A trains K+M steps
uninterrupted; job B trains K steps, every rank saves model.state_dict() and
optimizer.state_dict() to its own file, and the processes exit; a fresh job C loads them
and trains M more. C's parameters must equal A's bit for bit on every rank. So that this
cannot pass trivially, the compressor state B saved must be non-empty (and have moved
away from its initial zeros), and a job D that resumes without it (everything else
loaded) must end somewhere else.

Algorithms come from the registry, so a newly registered one is covered too; "none" is a
control (stateless: only the momentum buffers carry over).
"""
import json
import os
import sys

import pytest
import torch

from hipress import compression
from hipress.launch import run
from hipress.sync.factory import STRATEGIES

# every algorithm x strategy in two launches: more than pytest's default 300 s per test
pytestmark = pytest.mark.timeout(900)

HERE = os.path.dirname(os.path.abspath(__file__))
NP, K, M = 2, 3, 3
# every registered algorithm, and COVAP's filter in both modes (its residuals and step are state too)
ALGORITHMS = compression.available() + ["covap", "covap-local", "covap-bf16", "covap-auto"]
# the compression= of a name that is not an algorithm's
COMPRESSION = {"covap-local": "covap", "covap-bf16": "covap", "covap-auto": "covap"}
# Defaults everywhere except where they leave part of a state unused: DGC's and GradDrop's
# step counters only matter during warm-up, so let the warm-up cross the checkpoint (step K
# of 4: a step lost at the checkpoint would restart at the 25% density of step 0).
# COVAP: a fixed interval (the profiled one depends on timing). Mode "paper" around TBQ, whose
# residuals make the compressor state non-empty; mode "local", where the ranks' models and
# momenta differ between averages and the filter's step is the state (the teeth: without it
# the resumed run averages on the other steps); and that mode with wire="bf16", whose units'
# references are state too (without them the resumed run sends fp32 averages where it sent bf16).
# And interval="auto", profiled before the checkpoint: its profiling steps synced whole buckets
# before the units, so PS chose aggregators in an order the resumed job does not replay (the
# teeth: without the checkpoint's sync_layout, the resumed run's units went to other aggregators).
# Capped at 1: the uninterrupted job A and the checkpointed job B profile apart, and a measured
# interval may come out otherwise in each.
KWARGS = {"dgc": {"warmup_steps": 4}, "graddrop": {"warmup_steps": 4},
          "covap": {"interval": 2, "mode": "paper", "inner": "tbq"}, "covap-local": {"interval": 2},
          "covap-bf16": {"interval": 2, "wire": "bf16"},
          "covap-auto": {"mode": "paper", "inner": "onebit", "profile_steps": 1, "max_interval": 1}}


def strategies(algorithm):
    # Multi-round compressors (PowerSGD) always run the low-rank strategy whatever is
    # asked (hipress.sync.factory.make_sync): one run covers them.
    if COMPRESSION.get(algorithm, algorithm) != "covap" and compression.get(algorithm).lowrank:
        return ["ring"]
    return sorted(STRATEGIES)


CONFIGS = [{"algorithm": a, "compression": COMPRESSION.get(a, a), "strategy": s, "kwargs": KWARGS.get(a, {})}
           for a in ALGORITHMS for s in strategies(a)]


def launch(out, phase):
    cmd = [sys.executable, os.path.join(HERE, "resume_worker.py"), str(out), phase, json.dumps(CONFIGS),
           str(K), str(M)]
    code, logs = run(cmd, NP, timeout=400, quiet=True)  # both launches within the module's 900 s
    assert code == 0, "\n".join(logs)[-4000:]
    return [torch.load(out / f"{phase}-rank{r}.pt", weights_only=False) for r in range(NP)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two launches for all configs (process start-up dominates otherwise): A and B, then C and D."""
    out = tmp_path_factory.mktemp("resume")
    first = launch(out, "first")
    resumed = launch(out, "resume")
    ckpts = [[torch.load(out / f"ckpt-{i}-rank{r}.pt", weights_only=False) for r in range(NP)]
             for i in range(len(CONFIGS))]
    return first, resumed, ckpts


def indices(algorithm):
    return [i for i, c in enumerate(CONFIGS) if c["algorithm"] == algorithm]


def differing(a, b):
    return [n for n in a if not torch.equal(a[n], b[n])]


def departures(runs, algorithm, key):
    """'strategy rank r: [parameters]' wherever the resumed run ``key`` differs from job A."""
    first, resumed, _ = runs
    return [f"{CONFIGS[i]['strategy']} rank {r}: {names}" for i in indices(algorithm) for r in range(NP)
            if (names := differing(first[r][i]["uninterrupted"], resumed[r][i][key]))]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_resume_is_bit_identical(runs, algorithm):
    bad = departures(runs, algorithm, "resumed")
    assert not bad, f"{algorithm}: resumed parameters differ from the uninterrupted run:\n  " + "\n  ".join(bad)


# not COVAP's local mode: there each rank's momentum is its own by design, and broadcasting rank
# 0's replaces it (docs/covap.md)
@pytest.mark.parametrize("algorithm", [a for a in ALGORITHMS if a not in ("covap-local", "covap-bf16")])
def test_broadcast_optimizer_state_after_resume_keeps_each_ranks_state(runs, algorithm):
    """Each rank loads its own checkpoint, then hipress.broadcast_optimizer_state(opt, 0), the
    Horovod way: still bit-identical. Broadcasting rank 0's compressor state to every rank
    used to replace the others' (different by design) and end 0.009-0.049 away."""
    bad = departures(runs, algorithm, "resumed_then_broadcast")
    assert not bad, f"{algorithm}: resume + broadcast_optimizer_state differs:\n  " + "\n  ".join(bad)


def moved(state):
    """Whether a saved CompressorState differs from a fresh one (zeros): some buffer
    (residual, accumulator, Q) or scalar (RNG counter, step) changed."""
    return any(bool(v.any()) for v in state["buffers"].values()) or bool(state["scalars"].any())


@pytest.mark.parametrize("algorithm", [a for a in ALGORITHMS if a not in ("none", "covap-local", "covap-bf16")])
def test_saved_compressor_state_is_not_empty(runs, algorithm):
    _, _, ckpts = runs
    for i in indices(algorithm):
        for r in range(NP):
            states = ckpts[i][r]["optimizer"]["hipress"]["compressor_state"]
            assert states, f"{algorithm} {CONFIGS[i]['strategy']} rank {r}: no compressor state saved"
            assert any(moved(s) for s in states.values()), \
                f"{algorithm} {CONFIGS[i]['strategy']} rank {r}: saved compressor state is all initial zeros"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_resume_without_compressor_state_differs(runs, algorithm):
    """The teeth of the bit-identical check: the same resume minus the "hipress" entry of
    the optimizer state (model and momentum still loaded) does not reproduce job A. The
    control "none" has no compressor state to lose, so there it must still be identical:
    what differs for the others is the compressor state and nothing else."""
    first, resumed, _ = runs
    for i in indices(algorithm):
        for r in range(NP):
            names = differing(first[r][i]["uninterrupted"], resumed[r][i]["without_compressor_state"])
            where = f"{algorithm} {CONFIGS[i]['strategy']} rank {r}"
            if algorithm == "none":
                assert not names, f"{where}: dropping the (empty) compressor state changed {names}"
            else:
                assert names, f"{where}: resuming without compressor state changed nothing"
