"""coordinator="auto" (hipress/torch/plan_trial.py, CoordinatorTrial) with real ranks: two local
processes over gloo, coord_trial_worker.py.

The trial measures 2 steps per candidate after 2 warm-up steps: "off" runs steps 0-3, "on" steps
4-7, and the choice is made at step 8's start. A scripted clock gives each mode a known step time,
(1 + rank / 4) times longer on rank 1, so the slowest rank's objective is known in advance.
  * every rank runs the same mode at every step, the trial records the slowest rank's means, the
    faster mode is kept (either way), and where "off" is kept the coordinator's executor stops;
  * the switches lose nothing and change nothing: TBQ's error feedback (its residuals carried
    through both switches) and PS's aggregators give the parameters of the same job with the
    coordinator off throughout, bit for bit, after every step;
  * a checkpoint taken in the "on" window resumes there, with the same modes and bits after it;
  * beside plan="auto" the coordinator is measured once the plan is kept, off and then on, each
    in a window of its own, and not at all where the plan kept compresses nothing.
"""
import pytest
import torch

from worker_common import launch_worker

NP = 2
STEPS = 11
SWITCH, CHOICE = 4, 8
ON_FASTER = {"off": 1.0, "on": 0.5}
OFF_FASTER = {"off": 0.5, "on": 1.0}
CONFIGS = [{"strategy": s, "compression": "tbq", "coordinator": "auto", "steps": STEPS, "seconds": sec,
            "join": s == "ps"} for s in ("ps", "ring") for sec in (ON_FASTER, OFF_FASTER)]
CONFIGS += [{"strategy": "ps", "compression": "tbq", "coordinator": "auto", "steps": STEPS, "seconds": OFF_FASTER,
             "save_at": 5}]
CONFIGS += [{"strategy": s, "compression": "tbq", "coordinator": False, "steps": STEPS} for s in ("ps", "ring")]
REFERENCE = {"ps": len(CONFIGS) - 2, "ring": len(CONFIGS) - 1}
# Beside plan="auto" (its candidates measured 1 + 2 steps each: "plain" steps 0-2, "model" 3-5, the
# choice at step 6's start): the coordinator waits for the plan kept, then measures "off" from step 6
# and "on" from step 10 (2 + 2 steps each), its choice at step 14's start.
PLAN_STEPS, PLAN_COORD_SWITCH, PLAN_COORD_CHOICE = 16, 10, 14
MODEL_FASTER, PLAIN_FASTER = {"plain": 1.0, "model": 0.5}, {"plain": 0.5, "model": 1.0}
PLANNED = len(CONFIGS)
CONFIGS += [{"strategy": "ps", "compression": "tbq", "coordinator": c, "steps": PLAN_STEPS, "seconds": sec,
             "plan_seconds": plan}
            for c, sec, plan in (("auto", ON_FASTER, MODEL_FASTER), ("auto", OFF_FASTER, MODEL_FASTER),
                                 ("auto", ON_FASTER, PLAIN_FASTER), (False, ON_FASTER, MODEL_FASTER))]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch_worker("coord_trial_worker.py", tmp_path_factory.mktemp("coord_trial"), NP, CONFIGS, 240)


def expected_modes(seconds):
    kept = min(("off", "on"), key=lambda m: seconds[m])
    return ["off"] * SWITCH + ["on"] * (CHOICE - SWITCH) + [kept] * (STEPS - CHOICE)


def test_every_rank_measures_both_and_keeps_the_faster(results):
    for i, cfg in enumerate(CONFIGS[:4]):
        want = expected_modes(cfg["seconds"])
        for r in range(NP):
            rec = results[r][i]
            assert rec["modes"] == want, f"{cfg['strategy']} {cfg['seconds']}: rank {r}"
            assert rec["trial"]["seconds"] == {m: t * (1 + (NP - 1) / 4) for m, t in cfg["seconds"].items()}
            assert rec["trial"]["chosen"] == want[-1]
            # kept on: its executor runs on; kept off: it stopped, and the optimizer holds no coordinated exchanges
            assert rec["coordinated"] == (want[-1] == "on") and rec["executors"] == int(want[-1] == "on")


def test_switching_gives_the_bits_of_the_coordinator_off(results):
    for i, cfg in enumerate(CONFIGS[:5]):
        ref = REFERENCE[cfg["strategy"]]
        for r in range(NP):
            for step in range(STEPS):
                got, want = results[r][i]["params"][step], results[r][ref]["params"][step]
                for name, t in want.items():
                    assert torch.equal(got[name], t), f"{cfg['strategy']} {cfg['seconds']}: rank {r} step {step} {name}"
        if cfg["strategy"] == "ps":  # the aggregators went over with the switches (none chosen anew)
            assert results[0][i]["aggregators"] and results[0][i]["aggregators"] == results[0][ref]["aggregators"]
    # the parameters moved: a trivially equal pair would pass the loop above
    assert not torch.equal(results[0][REFERENCE["ps"]]["params"][0]["a.weight"],
                           results[0][REFERENCE["ps"]]["params"][STEPS - 1]["a.weight"])


def test_resume_in_the_on_window(results):
    i = 4
    cfg = CONFIGS[i]
    assert SWITCH <= cfg["save_at"] < CHOICE - 1
    for r in range(NP):
        rec = results[r][i]
        assert rec["modes"] == expected_modes(cfg["seconds"]), f"rank {r}"
        assert rec["trial"]["chosen"] == "off" and not rec["coordinated"]


def test_beside_plan_auto_both_modes_are_measured_with_the_kept_plan(results):
    factor = 1 + (NP - 1) / 4  # the slowest rank's
    for i, cfg in enumerate(CONFIGS[PLANNED:PLANNED + 2]):
        sec = cfg["seconds"]
        kept = min(("off", "on"), key=lambda m: sec[m])
        want = (["off"] * PLAN_COORD_SWITCH + ["on"] * (PLAN_COORD_CHOICE - PLAN_COORD_SWITCH)
                + [kept] * (PLAN_STEPS - PLAN_COORD_CHOICE))
        for r in range(NP):
            rec = results[r][PLANNED + i]
            assert rec["plan"] == "model"
            assert rec["modes"] == want, f"{sec}: rank {r}"
            # both windows run the model plan
            assert rec["trial"]["seconds"] == {m: (t + MODEL_FASTER["model"]) * factor for m, t in sec.items()}
            assert rec["trial"]["chosen"] == kept
            assert rec["coordinated"] == (kept == "on") and rec["executors"] == int(kept == "on")
            # compressed buckets through the coordinator, uncompressed ones beside it: the bits of the
            # same job with the coordinator off, after every step
            ref = results[r][PLANNED + 3]
            assert rec["model_plan"] == ref["model_plan"]
            for step in range(PLAN_STEPS):
                for name, t in ref["params"][step].items():
                    assert torch.equal(rec["params"][step][name], t), f"{sec}: rank {r} step {step} {name}"


def test_beside_plan_auto_no_coordinator_for_the_uncompressed_plan(results):
    for r in range(NP):
        rec = results[r][PLANNED + 2]
        assert rec["plan"] == "plain"
        assert rec["modes"] == ["off"] * PLAN_STEPS
        assert rec["trial"] == {"seconds": {}, "chosen": "off"}
        assert not rec["coordinated"] and rec["executors"] == 0


def test_join_refused_while_measuring_then_usable(results):
    for i, cfg in enumerate(CONFIGS[:4]):
        if not cfg["join"]:
            continue
        for r in range(NP):
            rec = results[r][i]
            assert "still measures the coordinator on and off" in rec["join_refused"], rec["join_refused"]
            assert rec["joined"] in range(NP)  # every rank joined after the choice, in either mode
