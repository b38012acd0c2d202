"""Non-finite gradients with real ranks (2 local processes over gloo; hipress/torch/nonfinite.py).

For every registered algorithm, every strategy it runs under, COVAP and dear: rank 1's gradient
of one parameter gets a NaN (another run: an Inf) at step K. On every rank: step K is
skipped (parameters unchanged), the compressor and momentum state after it equals the state
before it exactly, the warning names the parameter and rank 1, and the final parameters equal,
bit for bit, those of a run that simply never took step K's batch (and are the same on both
ranks), while a run that took every batch ends elsewhere. nonfinite="raise": every rank raises naming them, and training goes on to the same
result. AMP: Horovod's GradScaler pattern halves the scale on both ranks alike at step K.
"""
import json
import os
import sys

import pytest
import torch

from hipress import compression
from hipress.launch import run
from hipress.sync.factory import STRATEGIES

HERE = os.path.dirname(os.path.abspath(__file__))
NP, K, T = 2, 2, 5
POISONED = "0.weight"
ALGORITHMS = compression.available() + ["covap"]
KWARGS = {"dgc": {"warmup_steps": 4}, "covap": {"interval": 2, "mode": "paper", "inner": "tbq"}}
AMP = {("none", "ring"), ("terngrad", "allgather"), ("powersgd", "ring")}


def strategies(algorithm):
    if algorithm != "covap" and compression.get(algorithm).lowrank:
        return ["ring"]  # the low-rank strategy, whatever is asked
    return sorted(STRATEGIES)


CONFIGS = [{"compression": a, "strategy": s, "kwargs": KWARGS.get(a, {}), "amp": (a, s) in AMP}
           for a in ALGORITHMS for s in strategies(a)]
# one fused bucket (all four gradients in one buffer) through a ring; PS through the coordinator
CONFIGS.append({"compression": "tbq", "strategy": "ring", "kwargs": {}, "bucket_bytes": 1 << 20, "amp": False})
# one fused bucket through the backend's allreduce, checked as its gradients are copied in (_Bucket.put)
CONFIGS.append({"compression": "none", "strategy": "ring", "kwargs": {}, "bucket_bytes": 1 << 20, "amp": False})
# COVAP's paper mode (one fused bucket; its residual added after the bucket's check): checked in the copy
CONFIGS.append({"compression": "covap", "strategy": "ring", "kwargs": {"interval": 2, "mode": "paper"},
                "bucket_bytes": 1 << 20, "amp": False})
CONFIGS.append({"compression": "onebit", "strategy": "ps", "kwargs": {"coordinator": True}, "amp": True})
# a plan: the poisoned gradient uncompressed, as bf16 (cast in its copy, checked there: _Bucket.put),
# another compressed (its state must come back)
CONFIGS.append({"compression": "tbq", "strategy": "ring", "amp": False, "kwargs": {
    "plan": {"force": {POISONED: False, "2.weight": True}, "bf16": True, "measure": 0}}})
# strategy "dear" (one fused bucket, checked for NaN/Inf where it is submitted): uncompressed and with
# error feedback; no AMP (dear has no synchronize()-then-step() form)
CONFIGS += [{"compression": a, "strategy": "dear", "kwargs": {}, "bucket_bytes": 1 << 20, "amp": False}
            for a in ("none", "onebit")]


def name(cfg):
    return (f"{cfg['compression']}-{cfg['strategy']}" + ("-fused" if cfg.get("bucket_bytes") else "")
            + ("-coordinated" if cfg["kwargs"].get("coordinator") else "")
            + ("-planned-bf16" if cfg["kwargs"].get("plan") else ""))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("nonfinite")
    cmd = [sys.executable, os.path.join(HERE, "nonfinite_worker.py"), str(out), json.dumps(CONFIGS), str(K), str(T)]
    code, logs = run(cmd, NP, timeout=280, quiet=True)
    assert code == 0, "\n".join(logs)[-4000:]
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(NP)]
    return {name(cfg): [ranks[r][i] for r in range(NP)] for i, cfg in enumerate(CONFIGS)}


def same(a, b, path=""):
    """Paths where two nested dicts/lists of tensors and plain values differ (exactly)."""
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(set(a) ^ set(b))}"]
        return [d for k in a for d in same(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in same(x, y, f"{path}[{i}]")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return [] if a.shape == b.shape and torch.equal(a, b) else [path]
    return [] if a == b else [path]


def moves(state):
    """Whether some compressor state left its initial zeros (a buffer or the RNG counter/step, or
    COVAP's residuals)."""
    residuals = ((state.get("covap") or {}).get("filter") or {}).get("residual", {})
    return any(bool(v.any()) for s in state["compressor_state"].values()
               for v in [*s["buffers"].values(), s["scalars"]]) or any(bool(v.any()) for v in residuals.values())


IDS = [name(c) for c in CONFIGS]


@pytest.mark.parametrize("cfg", IDS)
@pytest.mark.parametrize("kind", ["nan", "inf", "raise"])
def test_step_undone_on_every_rank(results, cfg, kind):
    for r, res in enumerate(results[cfg]):
        got = res[kind]
        where = f"{cfg} {kind} rank {r}"
        assert not same(got["params_before"], got["params_after"]), f"{where}: step {K} changed parameters"
        if cfg.split("-")[0] != "none":
            assert moves(got["state_before"]), f"{where}: no compressor state to check"
        diff = same(got["state_before"], got["state_after"])
        assert not diff, f"{where}: hipress state changed by the skipped step: {diff[:5]}"
        assert got["last_nonfinite"] == {POISONED: [1]}, where
        if kind == "raise":
            assert [e["step"] for e in got["errors"]] == [K] and got["errors"][0]["where"] == {POISONED: [1]}, where
            assert f"'{POISONED}' (rank 1)" in got["errors"][0]["message"], where
            assert got["warnings"] == [], where
        else:
            assert got["errors"] == [], where
            warned = [(w["step"], w["category"]) for w in got["warnings"]]
            assert warned == [(K, "NonFiniteGradientWarning")], f"{where}: {got['warnings']}"
            assert f"'{POISONED}' (rank 1)" in got["warnings"][0]["message"], where


@pytest.mark.parametrize("cfg", IDS)
@pytest.mark.parametrize("kind", ["nan", "inf", "raise"])
def test_equals_run_without_the_batch(results, cfg, kind):
    for r, res in enumerate(results[cfg]):
        diff = same(res[kind]["final"], res["reference"]["final"])
        assert not diff, f"{cfg} {kind} rank {r}: final parameters differ from the run without batch {K}: {diff}"
        diff = same(res[kind]["final"], results[cfg][0][kind]["final"])
        assert not diff, f"{cfg} {kind}: rank {r}'s parameters differ from rank 0's: {diff}"
    # the teeth: the batch left out matters (a run that took every batch ends elsewhere)
    assert same(results[cfg][0]["reference"]["final"], results[cfg][0]["plain"]["final"])


@pytest.mark.parametrize("cfg", [name(c) for c in CONFIGS if c["amp"]])
def test_grad_scaler_lowers_scale_alike(results, cfg):
    scales = [res["amp"]["scales"] for res in results[cfg]]
    assert scales[0] == scales[1], f"{cfg}: scales differ across ranks: {scales}"
    assert scales[0][K] == scales[0][K - 1] / 2 and scales[0][K - 1] == scales[0][0], scales
    for r, res in enumerate(results[cfg]):
        amp = res["amp"]
        assert not same(amp["params_before"], amp["params_after"]), f"{cfg} rank {r}: step {K} changed parameters"
        assert not same(amp["state_before"], amp["state_after"]), f"{cfg} rank {r}: state changed"
        assert not same(amp["final"], results[cfg][0]["amp"]["final"]), f"{cfg}: ranks differ"
        assert all(torch.isfinite(v).all() for v in amp["final"].values())
