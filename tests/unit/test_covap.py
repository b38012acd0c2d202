"""COVAP's rules (hipress/torch/covap.py) against paper 004's statements and examples."""
import pytest
import torch

from hipress.torch import covap


def test_interval_is_ceil_of_ccr():
    assert [covap.interval_from_ccr(c) for c in (0.0, 0.4, 1.0, 1.01, 2.1, 3.5, 4.0)] == [1, 1, 1, 2, 3, 4, 4]
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError):
            covap.interval_from_ccr(bad)


def test_selection_sends_each_unit_once_per_interval():
    """Fig. 2(a): with I = 4 the first tensor goes at steps 0, 4, ... (the paper counts from 1),
    the second at 3, 7, ...; every step sends one unit of every four."""
    interval, units = 4, 8
    sent = [[t for t in range(units) if covap.selected(t, step, interval)] for step in range(12)]
    assert sent[0] == [0, 4] and sent[1] == [3, 7] and sent[2] == [2, 6] and sent[3] == [1, 5]
    for t in range(units):
        steps = [s for s in range(12) if t in sent[s]]
        assert len(steps) == 3 and all(b - a == interval for a, b in zip(steps, steps[1:]))


def test_sharding_vgg19_example():
    """§III-C: VGG-19's median tensor has 5,590,260 elements; its tensors of 3 and 19 medians
    are split into 3 and 19 parts, or into I parts when I is smaller."""
    m = 5_590_260
    sizes = [m // 3, m, 3 * m + 17, m, 19 * m + 5, m // 2, 2 * m - 1]
    assert sorted(sizes)[len(sizes) // 2] == m
    assert covap.shard_counts(sizes, 32) == [1, 1, 3, 1, 19, 1, 1]
    assert covap.shard_counts(sizes, 4) == [1, 1, 3, 1, 4, 1, 1]
    assert covap.shard_counts(sizes, 1) == [1] * len(sizes)
    assert covap.shard_counts([], 4) == []


def test_ef_coefficient_schedule():
    assert covap.ef_coefficient(0) == 0.5
    assert covap.ef_coefficient(49) == 0.5
    assert covap.ef_coefficient(50) == pytest.approx(0.6)
    assert covap.ef_coefficient(249) == pytest.approx(0.9)
    assert covap.ef_coefficient(250) == 1.0 and covap.ef_coefficient(10_000) == 1.0
    assert covap.ef_coefficient(7, init=0.2, ascend_steps=3, ascend_range=0.25) == pytest.approx(0.7)


def test_aligned_comm_time_removes_waiting():
    """Fig. 3: rank 1 started its first collective 4 ms early and waited inside it; rank 2
    was late for the second. Aligned at each collective's end, each lasts as long as its
    last arriver measured."""
    durations = [[0.010, 0.007, 0.003],   # rank 0
                 [0.014, 0.005, 0.003],   # rank 1: waited 4 ms in the first
                 [0.010, 0.009, 0.004]]   # rank 2
    assert covap.aligned_comm_time(durations) == pytest.approx(0.010 + 0.005 + 0.003)
    with pytest.raises(ValueError, match="different numbers"):
        covap.aligned_comm_time([[0.1], [0.1, 0.2]])
    p = covap.make_profile(0.01, 0.02, 0.05)
    assert p.ccr == pytest.approx(2.5) and p.interval == 3


def test_filter_error_feedback_and_selection():
    """Two buckets, I = 2: a unit not selected keeps coeff * residual + gradient and sends
    zeros; when selected it sends all it holds and its residual empties."""
    f = covap.Filter({"a": 4, "b": 4}, interval=2, shard=False, ef_init=0.5, ascend_steps=2, ascend_range=0.25)
    g = torch.ones(4)
    sent = {}
    for step in range(4):
        for name in ("a", "b"):
            flat = g.clone()
            rngs = f.apply(name, flat)
            sent[(step, name)] = (rngs, flat[0].item())
        f.advance()
    # step 0: unit 0 ("a") selected; step 1: unit 1 ("b"); ...
    assert sent[(0, "a")] == ([(0, 4)], 1.0) and sent[(0, "b")] == ([], 0.0)
    # step 1: b sends coeff(1)=0.5 * 1 + 1; a keeps 1
    assert sent[(1, "b")] == ([(0, 4)], 1.5) and sent[(1, "a")] == ([], 0.0)
    # step 2: coeff(2) = 0.75: a sends 0.75 * 1 + 1
    assert sent[(2, "a")] == ([(0, 4)], 1.75)
    # step 3: b's residual was 1 (kept at step 2): 0.75 * 1 + 1
    assert sent[(3, "b")] == ([(0, 4)], 1.75)
    # checkpoint round trip: the same next step from a restored filter
    g2 = covap.Filter({"a": 4, "b": 4}, interval=2, shard=False, ef_init=0.5, ascend_steps=2, ascend_range=0.25)
    g2.load_state_dict(f.state_dict())
    x1, x2 = torch.full((4,), 2.0), torch.full((4,), 2.0)
    assert f.apply("b", x1) == g2.apply("b", x2) and torch.equal(x1, x2) and x1[0].item() == 0.0
    with pytest.raises(ValueError, match="interval"):
        covap.Filter({"a": 4}, interval=3).load_state_dict(f.state_dict())


def test_filter_shards_large_buckets_into_units():
    f = covap.Filter({"small": 10, "big": 35, "mid": 10}, interval=4)
    assert [u for u, _ in f.units["small"]] == [0]
    assert [r for _, r in f.units["big"]] == [(0, 12), (12, 24), (24, 35)]  # floor(35/10) = 3 parts
    assert [u for u, _ in f.units["mid"]] == [4]
    flat = torch.ones(35)
    assert f.apply("big", flat) == [] and torch.count_nonzero(flat) == 0  # step 0 sends units 0 and 4
    f.advance()
    flat = torch.ones(35)
    assert f.apply("big", flat) == [(24, 35)]  # step 1 sends unit 3, with what it kept at step 0
    assert torch.count_nonzero(flat) == 11 and flat[30].item() == 1.5


def test_filter_interval_one_sends_everything_untouched():
    f = covap.Filter({"a": 10, "b": 35}, interval=1)
    for _ in range(3):
        flat = torch.arange(35, dtype=torch.float32)
        assert f.apply("b", flat) == [(0, 35)]
        assert torch.equal(flat, torch.arange(35, dtype=torch.float32))
        f.advance()
    assert f.residual == {}


@pytest.mark.parametrize("bad", [0, -1, 2.5, "3", True])
def test_interval_argument_checked(bad):
    with pytest.raises(ValueError):
        covap.check_interval(bad)
    assert covap.check_interval("auto") is None and covap.check_interval(3) == 3


def test_options_mode_and_its_cap():
    mine, inner, rest = covap.split_options({"interval": 2, "threshold": 0.1})
    assert mine["mode"] == "local" and mine["max_interval"] == covap.MAX_INTERVAL["local"] and inner == "none"
    assert rest == {"threshold": 0.1}
    mine, inner, _ = covap.split_options({"mode": "paper", "inner": "tbq"})
    assert mine["max_interval"] == covap.MAX_INTERVAL["paper"] and inner == "tbq"
    assert covap.split_options({"max_interval": 3})[0]["max_interval"] == 3
    with pytest.raises(ValueError, match="mode must be"):
        covap.split_options({"mode": "residual"})
    with pytest.raises(ValueError, match="mode='paper'"):  # local mode averages uncompressed parameters
        covap.split_options({"inner": "tbq"})
    with pytest.raises(ValueError, match="max_interval"):
        covap.split_options({"max_interval": 0})
    assert covap.Run({"b": 4}).refs is None  # wire "fp32" by default
    assert covap.Run({"b": 4}, wire="bf16").refs is not None and covap.Run({"b": 4}, mode="paper").refs is None
    with pytest.raises(ValueError, match="wire must be"):
        covap.split_options({"wire": "fp16"})
    with pytest.raises(ValueError, match="wire= is what mode='local'"):  # the paper's mode sends gradients
        covap.split_options({"mode": "paper", "wire": "bf16"})


def test_local_mode_selects_units_without_touching_the_gradient():
    run = covap.Run({"a": 10, "b": 35}, interval=2)  # mode "local"
    assert run.local
    flat = torch.arange(35, dtype=torch.float32)
    sent = [run.select("b", flat)]
    run.finish_step(None)
    sent.append(run.select("b", flat))
    assert torch.equal(flat, torch.arange(35, dtype=torch.float32)) and run.filter.residual == {}
    # b's units (1 and 2: "a" is unit 0; b has 3.5 medians, split into I = 2) alternate
    assert sent == [[(2, (18, 35))], [(1, (0, 18))]]
    assert not covap.Run({"a": 10}, interval=1).local  # interval 1: plain gradient averaging
    assert not covap.Run({"a": 10}, interval=2, mode="paper").local
    assert not covap.Run({"a": 10}).local  # profiling first


def test_average_turns_into_its_difference_once():
    a = covap.Average("b", 3, torch.tensor([1.0, 2.0]))
    a.values.copy_(torch.tensor([2.0, 2.0]))  # what the sync does: the average, in place
    assert torch.equal(a.delta(), torch.tensor([1.0, 0.0])) and a.sent is None and a.handle is None
    assert torch.equal(a.delta(), torch.tensor([1.0, 0.0]))  # a checkpoint's delta() then the step's: one subtraction
    b = covap.Average.of_delta("b", 3, torch.tensor([1.0, 0.0]))
    assert torch.equal(b.delta(), torch.tensor([1.0, 0.0])) and (b.name, b.start) == ("b", 3)


class _Bucket:
    name = "b"

    def __init__(self, values):
        self.values = values

    def param_values(self, s, e):
        return self.values[s:e].clone()


def test_bf16_average_sends_the_difference_from_the_reference():
    """wire "bf16": a unit's first average is of its fp32 parameters and becomes its reference
    (in bf16); later ones sum bf16 differences from it, and each rank moves by sum / n - what
    it sent, so what its own difference lost to rounding stays in its parameters."""
    refs, n = covap.References(), 2
    sent = {}

    def build(key, values, bounds):
        sent["fp32"] = values.clone()
        values.copy_(torch.tensor([1.0, 3.0]))  # the sync's average, in place
        return None

    def build16(key, values, bounds):
        sent["bf16"] = values.clone()
        values.add_(torch.tensor([0.25, -0.5]).to(torch.bfloat16))  # the other rank's difference: the sum
        return None

    (first,) = covap.start_averages(_Bucket(torch.tensor([0.5, 2.0, 9.0])), [(0, (0, 2))], build, build16, refs, n)
    assert "bf16" not in sent and torch.equal(sent["fp32"], torch.tensor([0.5, 2.0]))  # no reference yet
    assert refs.values == {}  # set when applied
    assert torch.equal(first.delta(), torch.tensor([0.5, 1.0]))
    ref = refs.values["b@0:2"]
    assert ref.dtype == torch.bfloat16 and torch.equal(ref.float(), torch.tensor([1.0, 3.0]))
    params = torch.tensor([1.0 + 2 ** -12, 3.125, 9.0])  # this rank's local steps since
    (second,) = covap.start_averages(_Bucket(params), [(0, (0, 2))], build, build16, refs, n)
    assert sent["bf16"].dtype == torch.bfloat16
    assert torch.equal(sent["bf16"].float(), (params[:2] - ref.float()).to(torch.bfloat16).float())
    mine = sent["bf16"].float()
    mean = (sent["bf16"] + torch.tensor([0.25, -0.5]).to(torch.bfloat16)).float() / n  # the sum is bf16
    assert torch.equal(second.delta(), mean - mine)
    assert torch.equal(refs.values["b@0:2"].float(), (torch.tensor([1.0, 3.0]) + mean).to(torch.bfloat16).float())
    # the references are what a checkpoint holds of them
    restored = covap.References()
    restored.load_state_dict(refs.state_dict())
    assert restored.values.keys() == refs.values.keys() and torch.equal(restored.values["b@0:2"], refs.values["b@0:2"])
    # without a bf16 sync (the backend does not sum bf16): every average in fp32, no references
    assert covap.start_averages(_Bucket(params), [(0, (0, 2))], build, None, refs, n)[0].refs is None


class _Sync:
    def __init__(self, done, error=None):
        self.done, self.error = done, error

    def wait(self, timeout):
        return self.done

    def exception(self, timeout):
        return self.error


def test_wait_averages_names_the_late_or_failed_bucket():
    late, failed = covap.Average("late", 0, torch.zeros(1)), covap.Average("failed", 0, torch.zeros(1))
    late.handle, failed.handle = _Sync(False), _Sync(True, RuntimeError("peer 1 died"))
    covap.wait_averages([covap.Average.of_delta("x", 0, torch.zeros(1))], 1.0, lambda: "")  # nothing to wait for
    with pytest.raises(TimeoutError, match="'late'.*rank 1"):
        covap.wait_averages([late], 0.0, lambda: "waiting for rank 1")
    with pytest.raises(RuntimeError, match="'failed' failed: peer 1 died"):
        covap.wait_averages([failed], 1.0, lambda: "")


# ---------------------------------------------------------------- the profiler across a checkpoint
SIZES = {"a": 8, "b": 8}
# per step: (backward, each bucket's communication) in 1/128 s (binary fractions: exact sums);
# CCR = 3 / 1 every step
TIMES = (1, {"a": 1, "b": 2})


def scripted_step(run, start_s):
    """One step on a scripted clock starting at ``start_s`` (1/256 s before the backward begins);
    the buckets are sent one after the other as the backward ends. Returns the profile when
    the step made it (one rank: the gather is this rank's row)."""
    comp, comm = TIMES
    t = start_s + 1 / 256
    run.grad_ready(t)
    t += comp / 128
    run.grad_ready(t)
    for name, ticks in comm.items():
        run.submitted(name, t)
        t += ticks / 128
        run.completed(name, t)
    profile = run.finish_step(lambda v: v.unsqueeze(0))
    run.step_end(t)
    return profile


def run_steps(run, steps, clock0):
    """The step at which each profile was made (steps numbered from ``steps.start``)."""
    return {s: p for s in steps if (p := scripted_step(run, clock0 + s)) is not None}


@pytest.mark.parametrize("saved_after", [1, 2, 3])  # warm-up only; one, two profiled steps of three
def test_profiler_resumes_mid_profile_on_schedule(saved_after):
    """A checkpoint taken while the profiler measures holds the steps measured so far: the
    resumed run (a new process: its clock elsewhere, no previous step's end) finishes the
    profile at the same step with the same interval, so its filter's steps match."""
    args = dict(interval="auto", mode="paper", profile_steps=3)
    whole = covap.Run(SIZES, **args)
    made = run_steps(whole, range(0, 8), 0.0)
    assert list(made) == [3] and made[3].interval == 3 and whole.filter.step == 4

    first = covap.Run(SIZES, **args)
    assert run_steps(first, range(0, saved_after), 0.0) == {}
    sd = first.state_dict()
    resumed = covap.Run(SIZES, **args)
    resumed.load_state_dict(sd)
    again = run_steps(resumed, range(saved_after, 8), 5000.0)
    assert list(again) == [3]
    assert (again[3].interval, again[3].t_comp, again[3].t_comm) == (made[3].interval, made[3].t_comp, made[3].t_comm)
    assert resumed.filter.step == whole.filter.step
    # the teeth: without the steps measured so far it profiles afresh, and filters later
    fresh = covap.Run(SIZES, **args)
    fresh.load_state_dict({k: v for k, v in sd.items() if k != "profiling"})
    assert list(run_steps(fresh, range(saved_after, 8), 5000.0)) == [saved_after + 3]


def test_reprofile_checkpoint_keeps_the_filters_residuals():
    """Saved while re-profiling: the filter set aside (its residuals, its step) comes back in the
    resumed run once the new profile gives the same interval; a fixed interval refuses it."""
    args = dict(interval="auto", mode="paper", profile_steps=2)
    run = covap.Run(SIZES, **args)
    run_steps(run, range(0, 3), 0.0)
    flat = torch.ones(8)
    run.filter.apply("b", flat)  # b is not selected at the filter's step 0: its gradient waits as a residual
    assert float(run.filter.residual["b"].sum()) > 0
    run.reprofile()
    sd = run.state_dict()
    resumed = covap.Run(SIZES, **args)
    resumed.load_state_dict(sd)
    run_steps(resumed, range(3, 6), 5000.0)
    assert resumed.filter.interval == 3 and torch.equal(resumed.filter.residual["b"], run._keep.residual["b"])
    with pytest.raises(ValueError, match="fixed interval"):
        covap.Run(SIZES, interval=3, mode="paper").load_state_dict(sd)


def hook_step(stream, start_s):
    """One step of the DDP hook's side on the scripted clock (DDP hands out the buckets as the
    backward ends). Returns the profile when the step's first bucket closed the one before."""
    comp, comm = TIMES
    t = start_s + 1 / 256 + comp / 128
    made = None
    for name, ticks in comm.items():
        made = stream.begin(t, lambda v: v.unsqueeze(0)) or made
        stream.select(name, torch.zeros(SIZES[name]), t)
        timed = stream.profiling  # (as the hook: only a profiled step's syncs are timed)
        if timed:
            stream.submitted(name, t)
        t += ticks / 128
        if timed:
            stream.completed(name, t)
    stream.end_step()
    return made


@pytest.mark.parametrize("saved_after", [3, 5])
def test_hook_profiler_resumes_with_the_step_it_had_not_closed(saved_after):
    """The DDP hook closes a profiled step at the next step's first bucket, so a checkpoint
    between steps holds one step timed but not closed: the resumed hook closes it, and its
    profile comes at the uninterrupted one's step."""
    args = dict(interval="auto", mode="paper", profile_steps=3)
    whole = covap.StreamRun(args)
    made = [s for s in range(10) if hook_step(whole, float(s)) is not None]
    first = covap.StreamRun(args)
    for s in range(saved_after):
        assert hook_step(first, float(s)) is None
    sd = first.state_dict()
    resumed = covap.StreamRun(args)
    resumed.load_state_dict(sd)
    again = [s for s in range(saved_after, 10) if hook_step(resumed, 5000.0 + s) is not None]
    assert again == made and resumed.run.profile.interval == whole.run.profile.interval == 3
    assert resumed.run.filter.step == whole.run.filter.step
    # the teeth: without the pending step, the profile comes a step later
    sd.pop("profile_due")
    sd["run"]["profiling"].pop("current")
    late = covap.StreamRun(args)
    late.load_state_dict(sd)
    assert [s for s in range(saved_after, 10) if hook_step(late, 5000.0 + s) is not None] == [made[0] + 1]


def test_reprofile_to_another_interval_keeps_the_residuals_and_names_the_changed_units():
    """The filter's residuals are per bucket, whatever its units: a new profile with another
    interval keeps them (and the coefficient schedule's step); the units it shards otherwise are
    the ones whose inner compressor states no longer fit (changed_units)."""
    sizes = {"a": 8, "b": 64, "c": 8}  # median 8: b is sharded into min(8, I) units
    run = covap.Run(sizes, interval="auto", mode="paper", profile_steps=2)

    def step(start_s):  # CCR 3: backward 1/128 s, the buckets' syncs 1/128 s each
        t = start_s + 1 / 256
        run.grad_ready(t)
        t += 1 / 128
        run.grad_ready(t)
        for name in sizes:
            run.submitted(name, t)
            t += 1 / 128
            run.completed(name, t)
        made = run.finish_step(lambda v: v.unsqueeze(0))
        run.step_end(t)
        return made

    assert [s for s in range(4) if step(float(s))] == [2] and run.filter.interval == 3
    old = run.filter
    old.apply("b", torch.ones(64))  # units of b not selected at step 0 keep their gradient
    old.advance()
    kept, old_step = old.residual["b"].clone(), old.step
    assert float(kept.sum()) > 0
    run.max_interval = 2
    run.reprofile()
    assert [s for s in range(4, 7) if step(float(s))] == [6] and run.filter.interval == 2
    assert torch.equal(run.filter.residual["b"], kept) and run.filter.step == old_step > 0
    assert [u[:2] for u in old.units["b"]] == [(1, (0, 22)), (2, (22, 43)), (3, (43, 64))]
    changed = covap.changed_units(old, run.filter)
    assert {(n, t) for n, t, _ in changed} == {("b", 1), ("b", 2), ("b", 3), ("c", 4)}
    assert ("b", 1, (0, 22)) in changed  # the range its states were made for
    assert covap.changed_units(None, run.filter) == []
