"""The bucket-size tuner (hipress/torch/bucket_tuner.py) on scripted objectives, and
bucket_bytes="tune" on one rank: checks, rebuilds, state_dict.

A scripted run drives BucketTuner.step_start as the optimizer does, with a clock that each
step moves by the step time of the size in force (a synthetic curve over log2(bytes) with a
known best, optionally with seeded noise) and identities for the collectives (one rank)."""
import math
import random

import pytest
import torch
import torch.nn as nn

import hipress
from hipress.torch.bucket_tuner import DEFAULTS, MIB, BucketTuner, check_knobs, search_range

pytest.importorskip("optuna")


def curve(best_log2, a, skew):
    """Seconds per step over bucket bytes: a parabola in log2(bytes), steeper on one side; in whole
    2**-20 s, so that sums and differences of clock readings are exact wherever the clock starts."""
    def seconds(size):
        d = math.log2(size) - best_log2
        return round(0.1 * (1 + a * d * d * (skew if d > 0 else 1.0)) * 2 ** 20) / 2 ** 20
    return seconds


def drive(tuner, seconds, noise=0.0, seed=0, max_steps=10_000):
    """Steps until the tuner settles; returns the steps taken. Each step lasts seconds(size) times
    (1 + noise * N(0, 1))."""
    rng = random.Random(seed)
    clock = tuner.knobs["clock"].__self__
    step = 0
    while not tuner.done and step < max_steps:
        tuner.step_start(False, lambda s: s, lambda d: d)
        clock.t += seconds(tuner.size) * (1 + noise * rng.gauss(0, 1))
        step += 1
    return step


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def tuner_for(model_bytes=1 << 30, **knobs):
    c = Clock()
    return BucketTuner(model_bytes, {"clock": c.__call__, "window": 1, "warmup": 0, "verbose": False, **knobs})


def sweep_best(seconds, lo=20, hi=28):
    """The best fixed buffer of a sweep over the powers of two of the default range, 1..256 MiB."""
    return min(seconds(1 << k) for k in range(lo, hi + 1))


CURVES = [(23.3, 0.08, 1.0), (20.6, 0.15, 0.4), (26.8, 0.05, 2.5)]


@pytest.mark.parametrize("best_log2,a,skew", CURVES)
def test_reaches_the_best_fixed_buffer_noise_free(best_log2, a, skew):
    seconds = curve(best_log2, a, skew)
    t = tuner_for()
    drive(t, seconds)
    assert t.done and len(t.history) == DEFAULTS["trials"] <= 20
    assert t.history[0][0] == 25 * MIB, "DeAR's first trial: 25 MB"
    assert sweep_best(seconds) / seconds(t.size) >= 0.95, t.summary()
    assert t.size == t.best[0]


@pytest.mark.parametrize("best_log2,a,skew,seed", [(22.4, 0.1, 1.5, 1), (25.5, 0.12, 0.7, 2)])
def test_reaches_the_best_fixed_buffer_with_noise(best_log2, a, skew, seed):
    """2% seeded noise on every step (a window of 3 steps per trial), and the sweep noise-free."""
    seconds = curve(best_log2, a, skew)
    t = tuner_for(window=3, seed=seed)
    drive(t, seconds, noise=0.02, seed=seed)
    assert len(t.history) <= 20
    assert sweep_best(seconds) / seconds(t.size) >= 0.95, t.summary()


def test_same_measurements_same_choices_and_the_seed_matters():
    seconds = curve(22.0, 0.1, 1.0)
    runs = []
    for seed in (0, 0, 1):
        t = tuner_for(trials=5, seed=seed)
        drive(t, seconds)
        runs.append(t.history)
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_warmup_and_skipped_steps_are_not_measured():
    """Warm-up steps and skipped steps last 100 s here; the objectives must not see them."""
    seconds = curve(23.0, 0.1, 1.0)
    t = tuner_for(trials=4, window=2, warmup=1)
    c = t.knobs["clock"].__self__
    step, warm = 0, set()
    sizes = []
    while not t.done:
        before = len(t.history)
        t.step_start(step - 1 in (5, 6), lambda s: s, lambda d: d)  # the steps 5 and 6 are skipped
        if step == 0 or len(t.history) != before:
            warm.add(step)  # the first step of each trial
        sizes.append(t.size)
        c.t += 100.0 if step in warm or step in (5, 6) else seconds(t.size)
        step += 1
    for size, objective in t.history:
        assert objective == pytest.approx(seconds(size)), t.history
    # 4 trials x (1 warm-up + 2 measured) steps, the 2 skipped ones on top; it settles at the start
    # of the step after them (that step runs, settled)
    assert step == 4 * 3 + 2 + 1


def test_range_clamps_to_the_model():
    assert search_range(check_knobs({}), 5 * MIB) == (MIB, 5 * MIB)
    assert search_range(check_knobs({}), 1 << 40) == (MIB, 256 * MIB)
    t = tuner_for(model_bytes=5 * MIB, trials=6)
    assert (t.lo, t.hi, t.size) == (MIB, 5 * MIB, 5 * MIB)  # start 25 MiB clamped
    drive(t, curve(21.0, 0.1, 1.0))
    assert MIB <= min(s for s, _ in t.history) and max(s for s, _ in t.history) <= 5 * MIB
    small = tuner_for(model_bytes=4000)  # the whole model is one bucket at any size: nothing to search
    assert small.done and small.size == MIB and not small.history
    assert small.step_start(False, None, None) is None
    lo = tuner_for(model_bytes=4000, min_bytes=64, start_bytes=8)
    assert (lo.lo, lo.hi, lo.size) == (64, 4000, 64)


@pytest.mark.parametrize("knobs,words", [
    ({"trails": 5}, "unknown knob(s) ['trails']"),
    ({"trials": 0}, "trials must be an int >= 1"),
    ({"window": 1.5}, "window must be an int >= 1"),
    ({"warmup": -1}, "warmup must be an int >= 0"),
    ({"min_bytes": 2}, "min_bytes must be an int >= 4"),
    ({"min_bytes": 1 << 20, "max_bytes": 1 << 10}, "max_bytes (1024) must be >= min_bytes (1048576)"),
    ({"clock": 3}, "clock must be a callable"),
    ({"seed": True}, "seed must be an int >= 0"),
    ({"verbose": "yes"}, "verbose must be True or False"),
])
def test_bad_knobs_are_named(knobs, words):
    with pytest.raises(ValueError) as e:
        check_knobs(knobs)
    assert words in str(e.value)


def test_state_dict_resumes_mid_window_identically():
    seconds = curve(24.0, 0.1, 1.0)

    def run(split):
        t = tuner_for(trials=6, window=3, warmup=1)
        c = t.knobs["clock"].__self__
        for step in range(40):
            if step == split:  # a new process: another clock, the state through a dict
                sd = t.state_dict()
                t = tuner_for(trials=6, window=3, warmup=1)
                t.knobs["clock"].__self__.t = 5.0
                t.load_state_dict(sd)
                c = t.knobs["clock"].__self__
            t.step_start(False, lambda s: s, lambda d: d)
            c.t += seconds(t.size)
        return t.history, t.size

    assert run(split=None) == run(split=9) == run(split=14)
    t = tuner_for(model_bytes=5 * MIB)
    with pytest.raises(ValueError, match="searched sizes"):
        t.load_state_dict(tuner_for().state_dict())


# ------------------------------------------------------------------ the optimizer, one rank


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 40), nn.Linear(40, 5), nn.Linear(5, 1)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def wrap(strategy="ring", compression="none", **kw):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    where = {"model": model} if strategy == "dear" else {"named_parameters": model.named_parameters()}
    return model, hipress.DistributedOptimizer(opt, strategy=strategy, compression=compression, **where, **kw)


@pytest.mark.parametrize("kw,words", [
    (dict(bucket_tune={"trials": 3}), "bucket_tune= configures bucket_bytes='tune'"),
    (dict(bucket_bytes="tune", bucket_tune={"windw": 2}), "unknown knob(s) ['windw']"),
    (dict(bucket_bytes="tune", plan="auto", compression="terngrad"), "plan="),
    (dict(bucket_bytes="tune", groups=2), "groups="),
    (dict(bucket_bytes="tune", compression="covap"), "compression='covap'"),
    (dict(bucket_bytes="tune", compression="powersgd"), "'powersgd' is low-rank"),
    (dict(bucket_bytes="tune", compression="dgc"), "momentum"),
    (dict(bucket_bytes="tune", op=hipress.Adasum), "bucket_bytes='tune'"),
])
def test_tune_refuses_what_cannot_rebuild(kw, words):
    with pytest.raises(ValueError) as e:
        wrap(**kw)
    assert words in str(e.value)


@pytest.mark.parametrize("strategy,compression", [("ring", "none"), ("dear", "none"), ("allgather", "onebit")])
def test_one_rank_tunes_rebuilds_and_checkpoints(strategy, compression):
    clock = [0.0]
    knobs = {"window": 1, "warmup": 0, "trials": 4, "min_bytes": 16, "clock": lambda: clock[0], "verbose": False}
    model, opt = wrap(strategy, compression, bucket_bytes="tune", bucket_tune=knobs)
    assert opt.bucket_tuner.hi == 4 * sum(p.numel() for p in model.parameters())
    layouts = set()
    for step in range(6):
        opt.zero_grad()
        model(torch.randn(8, 6)).sum().backward()
        opt.step()
        clock[0] += 1.0 + (math.log2(opt.bucket_tuner.size) - 8) ** 2
        layouts.add(tuple((b.name, b.numel) for b in opt._hp_buckets))
        assert opt._hp_bucket_of == {id(p): b for b in opt._hp_buckets for _, p in b.params}
    assert opt.bucket_tuner.done and len(layouts) >= 2
    assert opt._hp_buckets and max(4 * b.numel for b in opt._hp_buckets if len(b.params) > 1) <= opt.bucket_tuner.size
    sd = opt.state_dict()
    assert sd["hipress"]["bucket_tune"]["tuner"]["size"] == opt.bucket_tuner.size
    _, opt2 = wrap(strategy, compression, bucket_bytes="tune", bucket_tune=knobs)
    opt2.load_state_dict(sd)
    assert [(b.name, b.numel) for b in opt2._hp_buckets] == [(b.name, b.numel) for b in opt._hp_buckets]
    assert opt2.bucket_tuner.done and opt2.bucket_tuner.history == opt.bucket_tuner.history


def test_checkpoint_and_bucket_bytes_must_match():
    """Compressor states belong to the buckets they were saved with: a checkpoint of a tuned run
    loads into a fixed-size optimizer only at the tuned size, and a fixed run's into a tuner not at
    all. (One rank compresses nothing, so the saved residual is put in by hand.)"""
    knobs = {"window": 1, "warmup": 0, "trials": 2, "min_bytes": 16, "verbose": False}
    residual = {"x/p0/worker": {"algorithm": "ef(onebit)", "numel": 3, "shape": (3,), "matrix": (0, 0),
                                "buffers": {"residual": torch.ones(3)}, "scalars": torch.zeros(4, dtype=torch.int64)}}
    model, opt = wrap("allgather", "onebit", bucket_bytes="tune", bucket_tune=knobs)
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(8, 6)).sum().backward()
        opt.step()
    sd = opt.state_dict()
    sd["hipress"]["compressor_state"] = residual
    size = opt.bucket_tuner.size
    with pytest.raises(ValueError, match="saved with bucket_bytes='tune'"):
        wrap("allgather", "onebit", bucket_bytes=size + 4)[1].load_state_dict(sd)
    wrap("allgather", "onebit", bucket_bytes=size)[1].load_state_dict(sd)
    _, fixed = wrap("allgather", "onebit", bucket_bytes=512)
    sd = fixed.state_dict()
    sd["hipress"]["compressor_state"] = residual
    with pytest.raises(ValueError, match="saved without bucket_bytes='tune'"):
        wrap("allgather", "onebit", bucket_bytes="tune", bucket_tune=knobs)[1].load_state_dict(sd)
