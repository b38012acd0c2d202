"""plan="auto"'s measured choice (hipress/torch/plan_trial.py) with real ranks: local processes
over gloo, bucket_tune_worker.py's plan mode.

Two ranks train with onebit under a plan whose model side compresses the weights (forced), the
other candidate compressing nothing (fp32, so its sums are exact). The trial measures 2 steps per
candidate after 1 warm-up step: "plain" runs steps 0-2, the model's plan from step 3, and the
choice is made at step 6's start. A scripted clock gives each candidate a known step time,
(1 + rank / 4) times longer on rank 1, so the slowest rank's objective is known in advance.
  * every rank runs the same plan at every step, the trial records the slowest rank's time, and
    the faster candidate is kept (either way);
  * nothing is lost across the switches (SGD without momentum): the sum over ranks and steps of
    the gradients equals N * (p0 - p) / lr plus the residuals still held, element by element;
  * momentum correction's velocities move: a weight taken over starts from the SGD's buffer, and
    a weight let go of gets the average of the ranks' velocities as its buffer;
  * a checkpoint taken mid-trial resumes bit-identically, also where the resumed job's own profile
    (the link timed anew) would plan otherwise: it plans from the checkpoint's;
  * the same with the global coordinator, whose slots then carry compressed payloads of odd
    byte counts beside plain ones (each must start aligned for the plain ones' float view);
  * the third candidate, "all" (the model's plan with its unpinned uncompressed buckets compressed
    too), measured after the model's and kept where fastest, with nothing lost.
"""
import pytest
import torch

from test_bucket_tune import check_conservation, residuals_by_parameter
from worker_common import launch_worker

NP = 2
STEPS = 9
LR = 0.1
WEIGHTS = ("a.weight", "b.weight")
# only the pinned weights compressed (min_compress_bytes keeps the model off the rest)
PLAN = {"force": {w: True for w in WEIGHTS}, "min_compress_bytes": 1 << 20, "bf16": False, "measure": 2}
SWITCH, CHOICE = 3, 6  # the steps whose start switches to the model's plan, then makes the choice
SLOW_MODEL = {"plain": 0.5, "model": 1.0}  # seconds per step on rank 0 (whole binary fractions: exact sums)
FAST_MODEL = {"plain": 1.0, "model": 0.5}
EF = [{"strategy": s, "compression": "onebit", "steps": STEPS, "plan": PLAN, "plan_seconds": SLOW_MODEL,
       "momentum": False, "kwargs": {"grad_clip": None, "bucket_bytes": 0, "coordinator": c}}
      for s, c in (("ring", False), ("ps", False), ("ring", True))]
MOMENTUM = [{"strategy": "ring", "compression": "onebit", "steps": STEPS, "plan": PLAN, "plan_seconds": SLOW_MODEL,
             "kwargs": {"bucket_bytes": 0}}]
# fused buckets (bucket_bytes "auto": the tiny model is one bucket), the model's plan kept, a checkpoint mid-trial
FUSED = {"fused[unused.bias..a.weight]": True}
RESUME = [{"strategy": "ring", "compression": "onebit", "steps": STEPS, "plan": dict(PLAN, force=FUSED),
           "plan_seconds": FAST_MODEL, "save_at": 4}]
# checkpoints loaded by optimizers of other plan= options: one saved while "plain" runs and one
# saved in the model's window, into an optimizer that does not measure (measure=0); one saved by a
# job that did not measure, into one that does
UNMEASURED = dict(PLAN, measure=0)
ACROSS = [{"strategy": "ring", "compression": "onebit", "steps": 5, "plan": PLAN, "plan_seconds": SLOW_MODEL,
           "kwargs": {"bucket_bytes": 0}, "save_at": at, "load_into": [UNMEASURED]} for at in (1, 4)] + \
         [{"strategy": "ring", "compression": "onebit", "steps": 5, "plan": UNMEASURED, "kwargs": {"bucket_bytes": 0},
           "save_at": 4, "load_into": [PLAN]}]
# resumed where the planner's profile, taken anew, says another link: the job that saves sees a slow one
# (compression pays), the resumed one a fast one (it does not); measured or not
LINKS = {"saved": 1e-4, "resumed": 1e-12}
PROFILED = [{"strategy": "ring", "compression": "onebit", "steps": STEPS, "plan": {"bf16": False, "measure": m},
             "plan_seconds": dict(FAST_MODEL, all=0.75), "kwargs": {"bucket_bytes": 0}, "save_at": 4, "links": LINKS}
            for m in (0, 2)]
# the third candidate: over a link the profile says is fast the model compresses only the pinned
# weight, so "all" (every unpinned bucket compressed too) is measured after it, and kept, fastest
ALL_STEPS = 12
ALL = [{"strategy": "ring", "compression": "onebit", "steps": ALL_STEPS,
        "plan": {"force": {"a.weight": True}, "bf16": False, "measure": 2},
        "plan_seconds": {"plain": 1.0, "model": 1.0, "all": 0.5}, "momentum": False,
        "kwargs": {"grad_clip": None, "bucket_bytes": 0}, "links": {"saved": 1e-12}}]
CONFIGS = EF + MOMENTUM + RESUME + PROFILED + ACROSS + ALL


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch_worker("bucket_tune_worker.py", tmp_path_factory.mktemp("trial"), NP, CONFIGS, 240)


def expected_plans(seconds):
    kept = min(("plain", "model"), key=lambda c: seconds[c])
    return ["plain"] * SWITCH + ["model"] * (CHOICE - SWITCH) + [kept] * (STEPS - CHOICE)


def test_every_rank_runs_the_faster_plan_after_measuring_both(results):
    for i, cfg in enumerate(EF + MOMENTUM + RESUME):
        what = f"{cfg['strategy']} coordinator={cfg.get('kwargs', {}).get('coordinator')} {cfg['plan_seconds']}"
        want = expected_plans(cfg["plan_seconds"])
        for r in range(NP):
            rec = results[r][i]
            assert [rec["plan"][s] for s in range(STEPS)] == want, f"{what}: rank {r}"
            assert rec["layout"] == results[0][i]["layout"], f"{what}: rank {r} built other buckets"
            # the slowest rank's (rank 1: 1.25 times rank 0's) mean over the window
            assert rec["trial"]["seconds"] == {c: t * (1 + (NP - 1) / 4) for c, t in cfg["plan_seconds"].items()}
            assert rec["trial"]["chosen"] == want[-1]
        # the model's plan compresses what its pins say, the plain one nothing
        compressed = {b["name"] for b in results[0][i]["buckets"]
                      for k, st in results[0][i]["state"]["compressor_state"].items()
                      if k.startswith(b["name"] + "/") and "residual" in st["buffers"]}
        assert bool(compressed) == (want[-1] == "model"), f"{what}: compressed buckets at the end: {compressed}"


def test_no_residual_is_lost_across_plan_switches(results):
    for i, cfg in enumerate(EF):
        rec0 = results[0][i]
        # the switch back to "plain" at CHOICE handed every residual to the carry, sent in that step
        carried = sum(float(results[r][i]["carry"][CHOICE][w].abs().sum()) for r in range(NP) for w in WEIGHTS
                      if w in results[r][i]["carry"][CHOICE])
        assert carried > 1e-3, f"{cfg['strategy']}: no residual handed back at the switch: no teeth"
        assert all(not results[r][i]["carry"][s] for r in range(NP) for s in range(STEPS) if s != CHOICE)
        # plain at the end: no residual is held, so every gradient was applied
        held = {n: torch.zeros_like(t) for n, t in rec0["final"].items()}
        for r in range(NP):
            for name, t in residuals_by_parameter(results[r][i], results[r][i]["state"], NP).items():
                held[name] += t
        assert max(float(t.abs().max()) for t in held.values()) == 0.0
        check_conservation(results, NP, i, rec0["final"], STEPS, held, "after both switches:")
        # and while the model's plan ran (the parameters after its last step), residuals were held
        before = {n: rec0["params"][CHOICE - 1][n] for n in rec0["final"]}
        with pytest.raises(AssertionError):
            check_conservation(results, NP, i, before, CHOICE, {n: torch.zeros_like(t) for n, t in before.items()},
                               "without the residuals:")


def test_momentum_moves_between_velocity_and_buffer(results):
    i = len(EF)
    m = 0.9
    for w in WEIGHTS:
        # into the model's plan at SWITCH: each rank's velocity starts from the SGD's buffer
        # (the same on both ranks), and the SGD's buffer goes
        buf = results[0][i]["momentum_buffer"][SWITCH - 1][w]
        assert all(torch.equal(results[r][i]["momentum_buffer"][SWITCH - 1][w], buf) for r in range(NP))
        assert all(w not in results[r][i]["momentum_buffer"][s] for r in range(NP) for s in range(SWITCH, CHOICE))
        # back to plain at CHOICE: buffer = m * (average of the velocities) + the averaged gradient and carry;
        # the velocities after step CHOICE - 1 follow from the buffer at SWITCH - 1 and each rank's gradients
        vel = []
        for r in range(NP):
            u = buf.clone()
            for s in range(SWITCH, CHOICE):
                u = m * u + results[r][i]["grads"][s][w]
            vel.append(u)
        grad = sum(results[r][i]["grads"][CHOICE][w] + results[r][i]["carry"][CHOICE].get(w, 0) for r in range(NP))
        want = m * sum(vel) / NP + grad / NP
        for r in range(NP):
            torch.testing.assert_close(results[r][i]["momentum_buffer"][CHOICE][w], want, rtol=1e-5, atol=1e-6)
    # the biases kept the SGD's momentum throughout
    assert all("a.bias" in results[0][i]["momentum_buffer"][s] for s in range(STEPS))
    for r in range(1, NP):
        for name, t in results[0][i]["final"].items():
            assert torch.equal(results[r][i]["final"][name], t), f"rank {r} {name}"


def test_resume_mid_trial_is_bit_identical(results):
    i = len(EF) + len(MOMENTUM)
    cfg = CONFIGS[i]
    assert SWITCH <= cfg["save_at"] < CHOICE - 1  # saved in the model's window, measured steps on both sides
    for r in range(NP):
        rec, res = results[r][i], results[r][i]["resumed"]
        assert [res["plan"][s] for s in range(cfg["save_at"] + 1, STEPS)] == \
            [rec["plan"][s] for s in range(cfg["save_at"] + 1, STEPS)]
        for name in rec["final"]:
            assert torch.equal(res["final"][name], rec["final"][name]), f"rank {r} {name}"


def test_resume_plans_from_the_checkpoints_profile(results):
    """The resumed job's own profile would compress nothing; it plans from the checkpoint's profile
    instead (the plans the saved compressor states belong to) and goes on bit-identically."""
    base = len(EF) + len(MOMENTUM) + len(RESUME)
    for i, cfg in enumerate(PROFILED, start=base):
        for r in range(NP):
            rec, res = results[r][i], results[r][i]["resumed"]
            assert not any(res["compressed"]["before_load"]), f"measure={cfg['plan']['measure']}: no teeth"
            assert any(res["compressed"]["after"]), f"measure={cfg['plan']['measure']}: rank {r}"
            assert [res["plan"][s] for s in range(cfg["save_at"] + 1, STEPS)] == \
                [rec["plan"][s] for s in range(cfg["save_at"] + 1, STEPS)]
            for name in rec["final"]:
                assert torch.equal(res["final"][name], rec["final"][name]), f"rank {r} {name}"


def test_strategy_auto_resumes_with_the_checkpoints_choice(tmp_path):
    """Strategy "auto" under a plan keeps PS or allgather, whichever plan the model predicts faster.
    3 ranks: over the saving job's slow link PS (2(N-1)/N payloads per rank against allgather's
    N-1); the resumed job's own profile says a fast link, where allgather's one exchange wins. It
    plans and picks the strategy again from the checkpoint's profile, before the compressor states
    load, and goes on bit-identically. The compressed weights are wide (hidden 2048: onebit payloads
    of 1.5 KB): with the worker's 40, a payload was mostly its 48-byte header, PS's advantage in bytes
    was gone, and which strategy won over the slow link turned on the machine's measured codec times
    (allgather on an AVX2 machine, by 2%)."""
    plan = {"force": {w: True for w in WEIGHTS}, "min_compress_bytes": 1 << 20, "bf16": False, "measure": 0}
    cfg = {"strategy": "auto", "compression": "onebit", "steps": 6, "plan": plan, "kwargs": {"bucket_bytes": 0},
           "save_at": 3, "links": LINKS, "hidden": 2048}
    got = launch_worker("bucket_tune_worker.py", tmp_path, 3, [cfg], 240)
    for r in range(3):
        rec, res = got[r][0], got[r][0]["resumed"]
        assert rec["strategy"] == "ps" and res["strategy"] == {"before_load": "allgather", "after": "ps"}, \
            (rec["strategy"], res["strategy"])
        for name in rec["final"]:
            assert torch.equal(res["final"][name], rec["final"][name]), f"rank {r} {name}"


def test_checkpoints_across_plan_options(results):
    base = len(EF) + len(MOMENTUM) + len(RESUME) + len(PROFILED)
    for r in range(NP):
        while_plain, in_model, unmeasured = (results[r][base + k]["loaded"][0] for k in range(3))
        # saved while the plan with nothing compressed ran: an optimizer without the choice cannot go on from it
        assert while_plain["error"] and "resume with the plan= it was saved with" in while_plain["error"]
        # saved while the model's plan ran, nothing carried: the model's plan goes on
        assert in_model["error"] is None and in_model["trial"] is None and any(in_model["compressed"])
        # saved by a job that never measured: the measuring optimizer keeps the model's plan, settled
        assert unmeasured["error"] is None and unmeasured["trial"] == ("model", True)
        assert any(unmeasured["compressed"])


def test_all_compressed_candidate_measured_third_and_kept_without_loss(results):
    i = len(CONFIGS) - 1
    cfg = CONFIGS[i]
    want = ["plain"] * SWITCH + ["model"] * (CHOICE - SWITCH) + ["all"] * (ALL_STEPS - CHOICE)
    for r in range(NP):
        rec = results[r][i]
        assert [rec["plan"][s] for s in range(ALL_STEPS)] == want, f"rank {r}"
        assert rec["trial"]["chosen"] == "all"
        assert rec["trial"]["seconds"] == {c: t * (1 + (NP - 1) / 4) for c, t in cfg["plan_seconds"].items()}
    rec0 = results[0][i]
    compressed = {b["name"] for b in rec0["buckets"] for k, st in rec0["state"]["compressor_state"].items()
                  if k.startswith(b["name"] + "/") and "residual" in st["buffers"]}
    assert len(compressed) > 1 and any("b.weight" in n for n in compressed), compressed  # not only the pinned one
    held = {n: torch.zeros_like(t) for n, t in rec0["final"].items()}
    for r in range(NP):
        for name, t in residuals_by_parameter(results[r][i], results[r][i]["state"], NP).items():
            held[name] += t
    assert max(float(t.abs().max()) for t in held.values()) > 0.0  # residuals held: the check has teeth
    check_conservation(results, NP, i, rec0["final"], ALL_STEPS, held, "all-compressed kept:")
