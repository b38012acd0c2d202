"""Online Bayesian optimisation of the tensor-fusion buffer size (paper 001 §IV-B, DeAR).

``DistributedOptimizer(..., bucket_bytes="tune")`` hands the bucket size to a
:class:`BucketTuner`. The tuner runs trials: each sets a size, lets ``warmup`` steps pass
(the first step of a layout pays for new buffers and compressor states), then measures
``window`` steps. The objective of a trial is the **slowest rank's** mean step time over its
window (the ranks wait for each other, so the slowest one sets the throughput). Trial 0 is
``start_bytes`` (DeAR: 25 MB, clamped to the range); every later size is proposed by optuna's
``GPSampler``, a Gaussian-process sampler whose acquisition function is log expected
improvement, over log2(bytes) in [min_bytes, max_bytes] (max_bytes is capped at the model's
gradient bytes: every larger size gives the same buckets). After ``trials`` trials the tuner
settles for good on the size with the best measured objective.

Why optuna: it is a maintained library (releases every few months, wide use), its GPSampler
is a GP with EI (DeAR's acquisition) over a 1-D space in a few lines, and its ask/tell form
fits a search driven from the training loop. The tuner rebuilds a study from the full history
for every proposal, with a sampler seeded by ``seed`` and the trial number, so a proposal is
a function of (seed, measurements so far) alone: a job resumed from a checkpoint proposes
exactly what the uninterrupted job would have, given the same measurements. optuna is
imported only when a tuner is made (``import hipress`` does not need it).

The tuner is transport-agnostic: :meth:`BucketTuner.step_start` is given two functions,
``slowest`` (this rank's window seconds -> the maximum over ranks) and ``share`` (rank 0's
decision -> every rank's copy). The optimizer passes collectives over its transport; the unit
tests pass identities and a scripted clock.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from typing import Callable, List, Optional, Tuple

from hipress.torch.step_window import StepWindow

MIB = 1 << 20
# Defaults: DeAR measures "over multiple steps (e.g., 10 steps)" from a first trial at 25 MB and
# finds a good size in "tens of trials"; the issue asks for at most 20.
DEFAULTS = {
    "trials": 20,            # trials in all (the first is start_bytes), then the best is kept
    "window": 10,            # measured steps per trial
    "warmup": 1,             # steps after each change that are not measured
    "min_bytes": 1 * MIB,
    "max_bytes": 256 * MIB,  # capped at the model's gradient bytes
    "start_bytes": 25 * MIB,  # trial 0, clamped to the range
    "startup_trials": 3,     # trials (trial 0 included) before the GP proposes: random ones
    "seed": 0,
    "clock": None,           # seconds as a float (default time.perf_counter); tests script it
    "verbose": True,         # rank 0 prints the settled size once
}
SEARCH_PARAM = "log2_bytes"


def check_knobs(knobs: Optional[dict]) -> dict:
    """``bucket_tune``'s knobs merged onto :data:`DEFAULTS`, checked: a ValueError names each
    unknown or bad one."""
    if knobs is None:
        knobs = {}
    if not isinstance(knobs, dict):
        raise ValueError(f"bucket_tune must be a dict of knobs ({', '.join(DEFAULTS)}), got {type(knobs).__name__}")
    unknown = sorted(set(knobs) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"bucket_tune: unknown knob(s) {unknown}; the knobs are {list(DEFAULTS)}")
    k = {**DEFAULTS, **knobs}
    bad = []

    def whole(name, low):
        v = k[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            bad.append(f"{name} must be an int >= {low}, got {v!r}")

    whole("trials", 1)
    whole("window", 1)
    whole("warmup", 0)
    whole("startup_trials", 1)
    whole("seed", 0)
    for name in ("min_bytes", "max_bytes", "start_bytes"):
        whole(name, 4)  # one fp32 gradient element
    if not bad and k["max_bytes"] < k["min_bytes"]:
        bad.append(f"max_bytes ({k['max_bytes']}) must be >= min_bytes ({k['min_bytes']})")
    if k["clock"] is not None and not callable(k["clock"]):
        bad.append(f"clock must be a callable returning seconds, got {k['clock']!r}")
    if not isinstance(k["verbose"], bool):
        bad.append(f"verbose must be True or False, got {k['verbose']!r}")
    if bad:
        raise ValueError("bucket_tune: " + "; ".join(bad))
    return k


def search_range(knobs: dict, model_bytes: int) -> Tuple[int, int]:
    """(lowest, highest) size searched: [min_bytes, min(max_bytes, model_bytes)]; a model smaller
    than min_bytes leaves one size (every size then makes the same single bucket)."""
    lo = knobs["min_bytes"]
    return lo, max(lo, min(knobs["max_bytes"], int(model_bytes)))


@contextlib.contextmanager
def _quiet_optuna(optuna):
    """optuna logs each study and warns that GPSampler is experimental; inside, neither (its
    verbosity is restored after, in case the program uses optuna itself)."""
    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            yield
    finally:
        optuna.logging.set_verbosity(level)


def import_optuna():
    try:
        import optuna
    except ImportError as e:
        raise ImportError("bucket_bytes='tune' needs optuna (pip install optuna==4.6.0; scripts/setup.sh installs it): "
                          f"{e}") from e
    return optuna


class BucketTuner:
    """The search's state and its rules; see the module docstring. ``model_bytes``: the bytes of
    every gradient that is synced (the search's upper cap)."""

    def __init__(self, model_bytes: int, knobs: Optional[dict] = None):
        self.knobs = check_knobs(knobs)
        self.lo, self.hi = search_range(self.knobs, model_bytes)
        self._optuna = None
        if self.lo < self.hi:  # something to search: fail now, on every rank, if optuna is missing
            self._optuna = import_optuna()
        # measured trials: (bytes, objective: the slowest rank's seconds per step over the window)
        self.history: List[Tuple[int, float]] = []
        self.size = min(max(self.knobs["start_bytes"], self.lo), self.hi)
        self.done = self.lo == self.hi
        self._window = StepWindow(self.knobs["window"], self.knobs["warmup"], self.knobs["clock"])

    # ------------------------------------------------------------------ sizes
    def to_bytes(self, x: float) -> int:
        """2**x bytes, rounded to whole fp32 elements, inside the range."""
        return min(self.hi, max(self.lo, 4 * max(1, round(2.0 ** x / 4))))

    @property
    def best(self) -> Optional[Tuple[int, float]]:
        """(bytes, objective) of the trial with the lowest measured objective (None before the first);
        the first of equals."""
        return min(self.history, key=lambda t: t[1]) if self.history else None

    # ------------------------------------------------------------------ measuring
    def restart_window(self) -> None:
        """A measurement to throw away (a failed step, reset()): the trial's window starts over."""
        self._window.restart()

    def step_start(self, previous_skipped: bool, slowest: Callable[[float], float],
                   share: Callable[[Tuple[int, bool]], Tuple[int, bool]], rank: int = 0) -> Optional[int]:
        """Called on every rank at the start of every step (the optimizer: its first final
        gradient). The time since the last call is the period of the previous step; it counts
        unless that step was skipped (non-finite gradients: the caller says so, every rank
        alike), was a warm-up step, or there was no previous call. When the window is full,
        ``slowest`` and ``share`` are called (collectives: every rank calls them at the same
        step, since what decides it is the same on every rank) and the next size is returned
        if it differs from the current one; else None."""
        if self.done or not self._window.tick(previous_skipped):
            return None
        objective = slowest(self._window.seconds) / self._window.measured
        old = self.size
        self.history.append((self.size, objective))
        proposal = self._decide() if rank == 0 else (0, False)
        size, done = share(proposal)
        self._apply(size, done)
        self._window.start_now()  # the decision and the rebuild that follows are not a step's time
        if done and self.knobs["verbose"] and rank == 0:
            print(self.summary(), flush=True)
        return self.size if self.size != old else None

    def mark(self) -> None:
        """The clock restarts now (after work that is not a training step, such as the rebuild)."""
        if not self.done:
            self._window.mark()

    # ------------------------------------------------------------------ deciding (rank 0)
    def _decide(self) -> Tuple[int, bool]:
        if len(self.history) >= self.knobs["trials"]:
            return self.best[0], True
        return self.to_bytes(self.propose()), False

    def _apply(self, size: int, done: bool) -> None:
        self.size = int(size)
        self.done = bool(done)

    def propose(self) -> float:
        """log2(bytes) of the next trial: GPSampler's ask on a study made of every measured trial."""
        optuna = self._optuna
        dist = optuna.distributions.FloatDistribution(math.log2(self.lo), math.log2(self.hi))
        n = len(self.history)
        import torch  # GPSampler fits and optimises with torch autograd, which is off inside the
        # gradient hook that calls this (torch runs hooks under no_grad)
        with _quiet_optuna(optuna), torch.enable_grad():
            startup = optuna.samplers.RandomSampler(seed=self.knobs["seed"] * 1000 + n)
            sampler = optuna.samplers.GPSampler(seed=self.knobs["seed"] * 1000 + n,
                                                n_startup_trials=self.knobs["startup_trials"],
                                                independent_sampler=startup, warn_independent_sampling=False)
            study = optuna.create_study(direction="minimize", sampler=sampler)
            # the sizes applied (whole fp32 elements), so every rank's history says the same
            for size, value in self.history:
                study.add_trial(optuna.trial.create_trial(params={SEARCH_PARAM: math.log2(size)},
                                                          distributions={SEARCH_PARAM: dist}, value=value))
            return float(study.ask({SEARCH_PARAM: dist}).params[SEARCH_PARAM])

    # ------------------------------------------------------------------ reporting, checkpoints
    def summary(self) -> str:
        b = self.best
        trials = ", ".join(f"{s / MIB:.2f}:{1e3 * v:.1f}" for s, v in self.history)
        head = (f"hipress: bucket_bytes tuned to {self.size} bytes ({self.size / MIB:.2f} MiB) after "
                f"{len(self.history)} trials")
        if b is None:
            return head + f" (range [{self.lo}, {self.hi}] bytes: nothing to search)"
        return head + (f"; best measured {1e3 * b[1]:.1f} ms/step (slowest rank); trials (MiB:ms) {trials}")

    def state_dict(self) -> dict:
        """Everything a resumed job needs to go on as this one would: the trials measured, the
        size in force, and the window in progress (its time so far, including the step now
        running up to this call, so the step that spans the checkpoint is measured as the time
        before the save plus the time after the load)."""
        window = self._window.state_dict()
        if self.done:
            window["open_s"] = None
        return {"version": 1, "range": [self.lo, self.hi], "history": [list(t) for t in self.history],
                "size": self.size, "done": self.done, **window}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("version") != 1:
            raise ValueError(f"bucket tuner state of version {sd.get('version')!r}; this hipress reads version 1")
        if list(sd["range"]) != [self.lo, self.hi]:
            raise ValueError(f"bucket tuner state searched sizes {sd['range']} bytes, this optimizer searches "
                             f"[{self.lo}, {self.hi}] (another model or other min_bytes/max_bytes)")
        self.history = [(int(s), float(v)) for s, v in sd["history"]]
        self.size, self.done = int(sd["size"]), bool(sd["done"])
        self._window.load_state_dict(sd)
