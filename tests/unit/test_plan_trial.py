"""plan="auto"'s measured choice, the trial alone (hipress/torch/plan_trial.py): a scripted clock,
and identities for the collectives (the multi-rank behaviour: tests/multiproc/test_plan_trial_ranks.py)."""
import pytest

from hipress.planner import Overrides
from hipress.torch.plan_trial import CoordinatorTrial, PlanTrial


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def run(trial, clock, seconds, steps, skipped=()):
    """steps training steps, each taking seconds[plan in use]; returns the plan of each step and
    the steps whose start switched plans."""
    plans, switches = [], []
    for s in range(steps):
        if trial.step_start(s - 1 in skipped, lambda x: x) is not None:
            switches.append(s)
            trial.mark()
        plans.append(trial.in_use)
        clock.t += seconds[trial.in_use]
    return plans, switches


@pytest.mark.parametrize("seconds,kept", [({"plain": 2.0, "model": 1.0}, "model"),
                                          ({"plain": 1.0, "model": 2.0}, "plain"),
                                          ({"plain": 1.0, "model": 1.0}, "plain"),  # a tie: no compression
                                          ({"plain": 1.0, "model": 0.984375}, "plain")])  # 1.6%: within MARGIN
def test_measures_both_and_keeps_the_faster(seconds, kept):
    clock = Clock()
    trial = PlanTrial(3, clock, verbose=False)
    plans, switches = run(trial, clock, seconds, 14)
    # 1 step to start the clock, 1 warm-up, 3 measured: the switch at step 4, the choice at step 8
    assert plans[:4] == ["plain"] * 4 and plans[4:8] == ["model"] * 4 and plans[8:] == [kept] * 6
    assert switches == ([4] if kept == "model" else [4, 8])
    assert trial.done and trial.chosen == kept and trial.seconds == seconds
    assert "kept the" in trial.summary()


@pytest.mark.parametrize("seconds,kept", [({"plain": 2.0, "model": 1.5, "all": 1.0}, "all"),
                                          ({"plain": 2.0, "model": 1.0, "all": 1.5}, "model"),
                                          ({"plain": 1.0, "model": 1.5, "all": 2.0}, "plain"),
                                          ({"plain": 2.0, "model": 1.0, "all": 1.0}, "model"),  # a tie: the first
                                          # within MARGIN (3%) of the one kept before: not taken
                                          ({"plain": 2.0, "model": 1.0, "all": 0.984375}, "model"),
                                          ({"plain": 1.0, "model": 0.984375, "all": 0.9375}, "all"),
                                          ({"plain": 1.0, "model": 0.984375, "all": 0.984375}, "plain")])
def test_three_candidates_measured_in_order_and_the_fastest_kept(seconds, kept):
    clock = Clock()
    trial = PlanTrial(2, clock, verbose=False, candidates=("plain", "model", "all"))
    plans, switches = run(trial, clock, seconds, 14)
    # 1 step to start the clock, then 1 warm-up and 2 measured per candidate: switches at 3 and 6, the choice at 9
    assert plans[:3] == ["plain"] * 3 and plans[3:6] == ["model"] * 3 and plans[6:9] == ["all"] * 3
    assert plans[9:] == [kept] * 5 and switches == [3, 6] + ([] if kept == "all" else [9])
    assert trial.done and trial.chosen == kept and trial.seconds == seconds
    assert f"kept the {PlanTrial.KEPT[kept]} plan" in trial.summary()


def test_candidates_checked_and_resumed_between_those_saved():
    for bad in (("plain",), ("model", "plain"), ("plain", "model", "model"), ("plain", "fast")):
        with pytest.raises(ValueError, match="two or more of"):
            PlanTrial(2, candidates=bad)
    clock = Clock()
    three = PlanTrial(2, clock, verbose=False, candidates=("plain", "model", "all"))
    run(three, clock, {"plain": 1.0, "model": 1.0, "all": 1.0}, 7)  # in "all"'s window
    sd = three.state_dict()
    assert sd["candidates"] == ["plain", "model", "all"] and sd["in_use"] == "all"
    with pytest.raises(ValueError, match="trial state measures"):  # this optimizer has no "all" plan
        PlanTrial(2).load_state_dict(sd)
    # a state saved before "all" existed names no candidates: the trial goes on between plain and model
    clock = Clock()
    two = PlanTrial(2, clock, verbose=False)
    run(two, clock, {"plain": 1.0, "model": 2.0}, 4)
    old = {k: v for k, v in two.state_dict().items() if k != "candidates"}
    resumed = PlanTrial(2, Clock(), verbose=False, candidates=("plain", "model", "all"))
    resumed.load_state_dict(old)
    assert resumed.candidates == ("plain", "model") and resumed.in_use == "model"


def test_skipped_and_thrown_away_steps_are_not_measured():
    clock = Clock()
    trial = PlanTrial(2, clock, verbose=False)
    seconds = {"plain": 1.0, "model": 3.0}
    # step 2 was skipped (non-finite gradients): it took 100 s, which must not count
    plans = []
    for s in range(12):
        if trial.step_start(s == 3, lambda x: x) is not None:
            trial.mark()
        plans.append(trial.in_use)
        clock.t += 100.0 if s == 2 else seconds[trial.in_use]
    assert trial.seconds == {"plain": 1.0, "model": 3.0}
    assert plans.index("model") == 4  # the window grew by the skipped step (3 without it)
    trial2 = PlanTrial(2, clock, verbose=False)
    trial2.step_start(False, lambda x: x)
    clock.t += 1.0
    trial2.step_start(False, lambda x: x)  # warm-up
    clock.t += 1.0
    trial2.restart_window()  # reset(): what was measured goes, the warm-up starts over
    assert trial2.step_start(False, lambda x: x) is None and trial2._window.measured == 0


def test_objective_is_what_slowest_returns():
    clock = Clock()
    trial = PlanTrial(1, clock, verbose=False)
    for _ in range(3):
        trial.step_start(False, lambda x: 4 * x)
        clock.t += 1.0
    assert trial.seconds == {"plain": 4.0}


def test_state_dict_round_trip_mid_window():
    clock = Clock()
    trial = PlanTrial(3, clock, verbose=False)
    seconds = {"plain": 1.0, "model": 2.0}
    run(trial, clock, seconds, 6)  # in the model's window, step 5 done, step 6 not started
    sd = trial.state_dict()
    other = Clock()
    other.t = 1000.0
    resumed = PlanTrial(3, other, verbose=False)
    resumed.load_state_dict(sd)
    assert resumed.in_use == "model" and resumed.seconds == {"plain": 1.0} and not resumed.done
    a, b = run(trial, clock, seconds, 6), run(resumed, other, seconds, 6)
    assert a == b and resumed.seconds == trial.seconds == seconds
    with pytest.raises(ValueError, match="version"):
        resumed.load_state_dict(dict(sd, version=2))
    with pytest.raises(ValueError, match="trial state measures"):
        resumed.load_state_dict(dict(sd, in_use="fast"))


def test_settle_and_bad_arguments():
    trial = PlanTrial(2, verbose=False)
    trial.settle("model")
    assert trial.done and trial.chosen == "model" and trial.step_start(False, lambda x: x) is None
    with pytest.raises(ValueError, match="no candidate"):
        trial.settle("fast")
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="at least 1 step"):
            PlanTrial(bad)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="measure"):
            Overrides(measure=bad)
    assert Overrides().measure == 10 and Overrides(measure=0).measure == 0


@pytest.mark.parametrize("seconds,kept", [({"off": 2.0, "on": 1.0}, "on"),
                                          ({"off": 1.0, "on": 2.0}, "off"),
                                          ({"off": 1.0, "on": 1.0}, "off"),  # a tie: less work per step
                                          # "on" faster by 1.6%, within MARGIN (3%); by 6.25%, beyond it
                                          ({"off": 1.0, "on": 0.984375}, "off"),
                                          ({"off": 1.0, "on": 0.9375}, "on")])
def test_coordinator_trial_measures_off_then_on_after_two_warmup_steps(seconds, kept):
    clock = Clock()
    trial = CoordinatorTrial(2, clock, verbose=False)
    plans, switches = run(trial, clock, seconds, 6)
    assert trial.summary().startswith("hipress: the coordinator trial is measuring 'on'")  # not done yet
    later, later_switches = run(trial, clock, seconds, 6)
    plans, switches = plans + later, switches + [s + 6 for s in later_switches]
    # 1 step to start the clock, 2 warm-up (the coordinator declares a step ahead from its third), 2 measured
    assert plans[:4] == ["off"] * 4 and plans[4:8] == ["on"] * 4 and plans[8:] == [kept] * 4
    assert switches == ([4] if kept == "on" else [4, 8])
    assert trial.done and trial.chosen == kept and trial.seconds == seconds
    assert f"kept the coordinator {kept}" in trial.summary()
    with pytest.raises(ValueError, match="trial state measures"):  # a plan trial's state is not its own
        CoordinatorTrial(2).load_state_dict(PlanTrial(2).state_dict())
    with pytest.raises(ValueError, match="coordinator trial measures at least 1 step"):
        CoordinatorTrial(0)
