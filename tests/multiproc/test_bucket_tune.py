"""bucket_bytes="tune" with real ranks (local processes over gloo; bucket_tune_worker.py).

One launch per world size runs every config (process start-up dominates otherwise):
  * every rank applies the same sizes, and the same buckets, at the same steps; the objective
    each trial records is the slowest rank's (the fake clock makes the last rank the slowest);
  * uncompressed, the tuned run's parameters equal a fixed-bucket run's (ring and dear);
  * with error-feedback compressors, no residual is lost across rebuilds: the sum over ranks of
    the gradients sent so far equals N times the sum of the averaged gradients applied, plus the
    residuals still held (compressor states and the carry), element by element;
  * a checkpoint taken mid-tuning resumes bit-identically (sizes, history, parameters).
"""
import re

import pytest
import torch

from hipress.planner import chunk_bounds
from worker_common import launch_worker

STEPS = 8
LR = 0.1
TUNE = {"window": 1, "warmup": 0, "trials": 5, "min_bytes": 16}  # a new size at every step start 1..5
# the rebuild step made to skip (NaN on rank 0): the carry must survive the undo
NAN_AT = 3
EF = [("ring", "onebit"), ("ps", "onebit"), ("allgather", "tbq"), ("dear", "onebit")]
RESUME_TUNE = {"window": 2, "warmup": 1, "trials": 4, "min_bytes": 16}  # decisions at steps 3, 6, 9, 12
RESUME_STEPS, SAVE_AT = 14, 7


def same_sizes_configs():
    return [{"strategy": s, "steps": STEPS, "tune": TUNE} for s in ("ring", "dear")] + \
           [{"strategy": "ring", "steps": STEPS, "tune": TUNE, "clock": "real"}]


def fixed_configs():
    return [{"strategy": s, "steps": STEPS, "fixed": 512} for s in ("ring", "dear")]


def ef_configs(pairs):
    return [{"strategy": s, "compression": c, "steps": STEPS, "tune": TUNE, "momentum": False,
             "kwargs": {"grad_clip": None}, "nan_at": [NAN_AT], "state_at": [NAN_AT]} for s, c in pairs]


def resume_configs():
    return [{"strategy": s, "compression": c, "steps": RESUME_STEPS, "tune": RESUME_TUNE, "save_at": SAVE_AT}
            for s, c in (("ring", "onebit"), ("dear", "none"), ("ps", "tbq"))]


CONFIGS = {2: same_sizes_configs() + fixed_configs() + ef_configs(EF) + resume_configs(),
           3: same_sizes_configs() + fixed_configs() + ef_configs(EF[:1])}


@pytest.fixture(scope="module", params=[2, 3])
def run(request, tmp_path_factory):
    np = request.param
    return np, launch_worker("bucket_tune_worker.py", tmp_path_factory.mktemp(f"tune{np}"), np, CONFIGS[np], 240)


def pick(np, results, **want):
    """(index, config) of the launched configs whose fields have these values."""
    return [(i, c) for i, c in enumerate(CONFIGS[np]) if all(c.get(k) == v for k, v in want.items())]


def synthetic_seconds(size):  # bucket_tune_worker.synthetic_seconds
    import math
    return round((1.0 + 0.1 * (math.log2(size) - 8.0) ** 2) * 2 ** 20) / 2 ** 20


def test_every_rank_applies_the_same_sizes(run):
    np, results = run
    for i, cfg in enumerate(CONFIGS[np]):
        if "tune" not in cfg:
            continue
        what = f"{np} ranks, {cfg['strategy']} {cfg.get('compression', 'none')} {cfg.get('clock', 'fake')} clock"
        first = results[0][i]
        for r in range(1, np):
            rec = results[r][i]
            assert rec["size"] == first["size"], f"{what}: rank {r} applied other sizes"
            assert rec["layout"] == first["layout"], f"{what}: rank {r} built other buckets"
            assert rec["history"] == first["history"], f"{what}: rank {r} recorded another history"
        steps = range(cfg["steps"])
        changes = sum(first["layout"][s] != first["layout"][s - 1] for s in steps if s)
        assert changes >= 2, f"{what}: the buckets were rebuilt {changes} time(s); the test needs several"
        assert first["done"], f"{what}: not settled after {cfg['steps']} steps"
        if cfg.get("clock", "fake") == "fake":
            # the objective is the slowest rank's: the fake clock runs (1 + rank / 4) times the synthetic time
            for size, objective in first["history"]:
                assert objective == pytest.approx(synthetic_seconds(size) * (1 + (np - 1) / 4), rel=1e-9), what
            best = min(first["history"], key=lambda t: t[1])[0]
            assert first["size"][cfg["steps"] - 1] == best, f"{what}: settled on {first['size']}, best {best}"


def assert_close(got, want, what):
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-6, msg=lambda m: f"{what} {name}: {m}")


def test_uncompressed_tuned_equals_fixed_buckets(run):
    np, results = run
    for strategy in ("ring", "dear"):
        (ti, _), = pick(np, results, strategy=strategy, tune=TUNE, clock=None, compression=None)
        (fi, _), = pick(np, results, strategy=strategy, fixed=512)
        for r in range(np):
            tuned, fixed = results[r][ti], results[r][fi]
            for step in range(STEPS):
                assert_close(tuned["params"][step], fixed["params"][step], f"{strategy} rank {r} step {step}")
            assert_close(tuned["final"], fixed["final"], f"{strategy} rank {r} final")
            assert_close(tuned["final"], results[0][ti]["final"], f"{strategy} rank {r} vs rank 0")
        assert any(not torch.equal(results[0][ti]["final"][n], results[0][ti]["initial"][n])
                   for n in results[0][ti]["final"]), "nothing trained"


KEY = re.compile(r"^(?P<bucket>.+)/p(?P<part>\d+)/(?:c(?P<chunk>\d+)|worker|aggregator)$")


def residuals_by_parameter(rec, state, np):
    """Each compressor state's residual mapped back onto the parameters, from the key scheme the
    strategies document ({bucket}/p{i}/c{chunk} for the ring's chunks, {bucket}/p{i}/worker and
    /aggregator for allgather and PS), plus the carry not yet sent: per parameter, this rank's."""
    out = {n: torch.zeros_like(t) for n, t in rec["final"].items()}
    buckets = {b["name"]: b for b in rec["buckets"]}
    for key, st in state["compressor_state"].items():
        res = st["buffers"].get("residual")
        if res is None:
            continue
        m = KEY.match(key)
        assert m and m["bucket"] in buckets, f"state {key} belongs to no bucket of the final layout"
        b = buckets[m["bucket"]]
        s, e = b["bounds"][int(m["part"])]
        if m["chunk"] is not None:
            cs, ce = chunk_bounds(e - s, np)[int(m["chunk"])]
            s, e = s + cs, s + ce
        flat = torch.zeros(sum(n for _, n in b["params"]))
        flat[s:e] += res.reshape(-1)
        for (name, numel), off in zip(b["params"], b["offsets"]):
            out[name] += flat[off:off + numel].view_as(out[name])
    for name, carry in state.get("carry", {}).items():  # the carry of a rebuild or of a plan switch
        out[name] += carry
    return out


def check_conservation(results, np, i, params_after, upto, held, what):
    """sum over ranks and steps < upto (not skipped) of the gradients = N * (p0 - p) / lr + held."""
    cfg = results[0][i]["config"]
    for name in params_after:
        sent = sum(results[r][i]["grads"][t][name] for r in range(np) for t in range(upto)
                   if not results[r][i]["skipped"][t])
        applied = np * (results[0][i]["initial"][name] - params_after[name]) / LR
        torch.testing.assert_close(applied + held[name], sent, rtol=0, atol=2e-5,
                                   msg=lambda m: f"{what} {cfg['strategy']} {cfg['compression']} {name}: {m}")


def test_error_feedback_residuals_survive_rebuilds(run):
    np, results = run
    for i, cfg in pick(np, results, nan_at=[NAN_AT]):
        what = f"{np} ranks"
        rec0 = results[0][i]
        assert rec0["layout"][NAN_AT] != rec0["layout"][NAN_AT - 1], "the skipped step must be a rebuild step"
        assert all(results[r][i]["skipped"][NAN_AT] for r in range(np)) and not rec0["skipped"][NAN_AT - 1]
        # Right after the skipped rebuild step: the old states were handed to the carry, the new
        # ones the skipped step made were undone: every residual is in the carry, by parameter.
        held = {n: torch.zeros_like(t) for n, t in rec0["final"].items()}
        for r in range(np):
            st = results[r][i]["state_at"][NAN_AT]
            assert not any(s["buffers"]["residual"].any() for s in st["compressor_state"].values()
                           if "residual" in s["buffers"]), "a state of the skipped step survived its undo"
            for name, carry in st.get("carry", {}).items():
                held[name] += carry
        assert max(float(t.abs().max()) for t in held.values()) > 1e-3, "no residual to conserve: no teeth"
        # the parameters after step NAN_AT (skipped): the updates of steps < NAN_AT (dear's too:
        # the forward of step NAN_AT applied step NAN_AT - 1's)
        check_conservation(results, np, i, rec0["params"][NAN_AT], NAN_AT, held, f"{what} after the skipped rebuild:")
        # At the end: the states of the final layout, mapped back to parameters. The carry was
        # sent in the step after each rebuild (and dropped once that step was kept): none is left.
        assert all(not results[r][i]["state"].get("carry") for r in range(np)), "a carry was never sent"
        held = {n: torch.zeros_like(t) for n, t in rec0["final"].items()}
        for r in range(np):
            for name, t in residuals_by_parameter(results[r][i], results[r][i]["state"], np).items():
                held[name] += t
        assert max(float(t.abs().max()) for t in held.values()) > 1e-3
        check_conservation(results, np, i, rec0["final"], cfg["steps"], held, f"{what} at the end:")


def test_resume_mid_tuning_is_bit_identical(run):
    np, results = run
    for i, cfg in pick(np, results, save_at=SAVE_AT):
        for r in range(np):
            rec = results[r][i]
            res = rec["resumed"]
            what = f"rank {r} {cfg['strategy']} {cfg['compression']}"
            # the checkpoint was taken mid-tuning, and the tuning went on after it
            sizes_after = [rec["size"][s] for s in range(SAVE_AT + 1, RESUME_STEPS)]
            assert len(set(sizes_after)) > 1, f"{what}: no size change after the checkpoint"
            assert rec["done"] and len(rec["history"]) == RESUME_TUNE["trials"]
            assert [res["size"][s] for s in range(SAVE_AT + 1, RESUME_STEPS)] == sizes_after, what
            assert res["history"] == rec["history"], what
            for name in rec["final"]:
                assert torch.equal(res["final"][name], rec["final"][name]), f"{what} {name}"
