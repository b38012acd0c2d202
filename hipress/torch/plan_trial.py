"""Measured choices made while training: candidates run a window of steps each and the fastest
is kept (a later one only where it is clearly faster). ``PlanTrial``: plan="auto" (and
compression="auto"), the cost model's plan against the plan that compresses nothing (and the one
that compresses everything); ``CoordinatorTrial``: coordinator="auto", the global coordinator
off against on (below).

The cost model prices a bucket's compression by its encode and decode time alone, measured on
an idle core. In training, compression runs beside backward on the same cores and slows it:
on the emulated 4-host cluster at 10 Gbit/s, VGG19-like's model plan (TernGrad on the large
buckets) ran at 1.14x DDP where the same job with nothing compressed (every bucket as bf16
through the backend's allreduce) ran at 1.27x (docs/benchmarks.md). No per-bucket model sees
that cost, a whole step does. So where the model's plan compresses something, the optimizer
runs ``Overrides.measure`` steps of each candidate, in this order, and keeps one:

* ``"plain"`` first: nothing compressed, every bucket as the model's uncompressed choice
  (fp32 or bf16 as ``Overrides.bf16`` says; a plan's ``force`` pins only the model's plan);
* then ``"model"``: the cost model's plan;
* then, where the model's plan leaves buckets uncompressed that the user's pins allow to be
  compressed, ``"all"``: those compressed too. The model prices a bucket alone; in a step, an
  uncompressed bucket's allreduce runs in the same queue as the compressed buckets' exchanges,
  and on VGG19-like at 1 Gbit/s (PS) the model's plan (21 small gradients as bf16) ran 2-6%
  slower than compressing everything (docs/benchmarks.md);
* then, for the rest of the job, the first one unless a later one's **slowest rank's** mean step
  time over its window was lower than the kept one's by more than ``MARGIN`` (3%), going down the
  list: each later candidate compresses more, and compression error (or, below, the coordinator's
  work) is not worth a gain within the windows' noise. Two 10-step windows of one configuration in
  a job differed by 1.7% and 2.7%; on ResNet50-like at 10 Gbit/s "all" and "plain" measured 469.5
  and 469.7 ms per step.

Each candidate's window starts after ``WARMUP`` step(s) (new buffers, compressor states);
steps skipped for non-finite gradients are not counted (hipress/torch/step_window.py). Every
rank measures its own steps; one allgather of one float per candidate gives every rank the
same maxima, so every rank decides the same without a broadcast. The optimizer switches plans
at a step's start, with nothing in flight; what one plan leaves in compressor state
(error-feedback residuals) and momentum correction's velocities is handed to the other
(hipress/torch/optimizer.py, ``_hp_use_plan``), so nothing is lost in the switch.

coordinator="auto" measures the same way: ``"off"`` (the direct exchanges) first, then ``"on"``
(every exchange through the global coordinator, started at that switch), and keeps "on" only
where it is faster by more than ``MARGIN``: "on" is more work per step (on VGG19-like at 1 Gbit/s,
PS, the two windows of one job put either mode ahead by up to 5%, while paired blocks had "on"
slower, 0.93-0.985x). Whether the coordinator pays depends on the job: without tensor fusion it ran 2.5-4x
faster than off on the emulated 4-host cluster, with fusion from 0.98x to 1.16x
(docs/benchmarks.md), which no rule of thumb sorts out. Its window starts after
``CoordinatorTrial.WARMUP`` steps: a step is declared ahead only once two steps in a row ran the
same exchanges (hipress/comm/coordinator/ahead.py), so the third step under it is the first of
its steady state. Both candidates run the same syncs over other exchanges, so the switch hands
nothing over: compressor states stay where they are. Beside plan="auto" (coordinator="auto" is
compression="auto"'s default) it starts once the plan is kept and measures both modes with it,
"off" too: the plan's own window ran earlier, right after the plan's switch, and in one job it
was 11% slower than the same plan and mode in paired blocks later (docs/coordinator.md).
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence

from hipress.torch.step_window import StepWindow


class PlanTrial:
    """The measured choice's state; see the module docstring. ``steps``: measured steps per
    candidate (Overrides.measure); ``candidates``: those measured, in order (a subsequence of
    CANDIDATES, at least two); ``clock``: seconds as a float (tests script it)."""

    CANDIDATES = ("plain", "model", "all")  # in the order they are measured
    WARMUP = 1  # steps after each switch that are not measured
    MARGIN = 0.03  # by how much a later candidate must be faster than the one kept before it
    WHAT = "plan"  # in messages
    KEPT = {"plain": "uncompressed", "model": "model", "all": "all-compressed"}  # in the summary

    def __init__(self, steps: int, clock: Optional[Callable[[], float]] = None, verbose: bool = True,
                 candidates: Optional[Sequence[str]] = None):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"a {self.WHAT} trial measures at least 1 step per candidate, got {steps!r}")
        self.candidates = self._check_candidates(self.CANDIDATES[:2] if candidates is None else candidates)
        self.steps = steps
        self.verbose = verbose
        self.in_use = self.candidates[0]
        self.seconds: Dict[str, float] = {}  # candidate -> the slowest rank's mean seconds per step
        self.done = False
        self._window = StepWindow(steps, self.WARMUP, clock)

    @property
    def clock(self) -> Callable[[], float]:
        return self._window.clock

    @clock.setter
    def clock(self, fn: Callable[[], float]) -> None:
        self._window.clock = fn

    @property
    def chosen(self) -> Optional[str]:
        """The candidate kept for good (None while measuring)."""
        return self.in_use if self.done else None

    def restart_window(self) -> None:
        """A measurement to throw away (a failed step, reset()): this candidate's window starts over."""
        if not self.done:
            self._window.restart()

    def step_start(self, previous_skipped: bool, slowest: Callable[[float], float],
                   rank: int = 0) -> Optional[str]:
        """Called on every rank at the start of every step. When the window of the candidate in
        use is full, ``slowest`` (this rank's seconds -> the maximum over ranks; a collective every
        rank calls at the same step) gives its objective, and the candidate to switch to is
        returned (the next one to measure, or the one kept once all are measured, if it is not the
        one in use); else None."""
        if self.done or not self._window.tick(previous_skipped):
            return None
        self.seconds[self.in_use] = slowest(self._window.seconds) / self._window.measured
        old = self.in_use
        left = [c for c in self.candidates if c not in self.seconds]
        if left:
            self.in_use = left[0]
        else:
            self.in_use = self._kept_candidate()
            self.done = True
            if self.verbose and rank == 0:
                print(self.summary(), flush=True)
        self._window.start_now()  # the decision and the switch that follows are not a step's time
        return self.in_use if self.in_use != old else None

    def _kept_candidate(self) -> str:
        """The candidate to keep, all measured: the first, unless a later one is faster than the
        one kept so far by more than MARGIN (the module docstring)."""
        kept = self.candidates[0]
        for c in self.candidates[1:]:
            if self.seconds[c] < (1 - self.MARGIN) * self.seconds[kept]:
                kept = c
        return kept

    def _check_candidates(self, names: Sequence[str]) -> tuple:
        names = tuple(names)
        if len(names) < 2 or len(set(names)) != len(names) or \
                [c for c in self.CANDIDATES if c in names] != list(names):
            raise ValueError(f"a {self.WHAT} trial measures two or more of {self.CANDIDATES}, in that order; "
                             f"got {names}")
        return names

    def mark(self) -> None:
        """The clock restarts now (after the switch, which is not a training step)."""
        if not self.done:
            self._window.mark()

    def settle(self, name: str) -> None:
        """``name`` for good, unmeasured (a checkpoint of a job that ran it alone)."""
        if name not in self.candidates:
            raise ValueError(f"no candidate {self.WHAT} {name!r}; the candidates are {self.candidates}")
        self.in_use, self.done = name, True

    def summary(self) -> str:
        measured = ", ".join(f"{c} {1e3 * s:.1f}" for c, s in self.seconds.items())
        head = self._kept() if self.done else f"hipress: the {self.WHAT} trial is measuring {self.in_use!r}"
        return head + (f" (ms per step, slowest rank, {self.steps} steps each: {measured})" if measured else "")

    def _kept(self) -> str:
        return f"hipress: plan='auto' kept the {self.KEPT[self.in_use]} plan"

    def state_dict(self) -> dict:
        window = self._window.state_dict()
        if self.done:
            window["open_s"] = None
        return {"version": 1, "steps": self.steps, "in_use": self.in_use, "seconds": dict(self.seconds),
                "done": self.done, "window": window, "candidates": list(self.candidates)}

    def load_state_dict(self, sd: dict) -> None:
        """A saved trial goes on between the candidates it measured, where this optimizer has them
        all (the plans it made); a state naming another is refused."""
        if sd.get("version") != 1:
            raise ValueError(f"{self.WHAT} trial state of version {sd.get('version')!r}; this hipress reads version 1")
        saved = tuple(sd.get("candidates", self.CANDIDATES[:2]))  # (states saved before "all" have none)
        if set(saved) - set(self.candidates) or sd["in_use"] not in saved or set(sd["seconds"]) - set(saved):
            raise ValueError(f"the {self.WHAT} trial state measures {saved} ({sd['in_use']!r} in use, measured "
                             f"{sorted(sd['seconds'])}); this optimizer's trial measures {self.candidates}: "
                             f"resume with the plan= and the pins it was saved with")
        self.candidates = self._check_candidates(saved)
        self.in_use, self.done = sd["in_use"], bool(sd["done"])
        self.seconds = {c: float(s) for c, s in sd["seconds"].items()}
        self._window.load_state_dict(sd["window"])


class CoordinatorTrial(PlanTrial):
    """coordinator="auto"'s measured choice (the module docstring): "off", then "on"; "on" is kept
    only where it is faster by more than MARGIN."""

    CANDIDATES = ("off", "on")
    WARMUP = 2
    WHAT = "coordinator"

    def _kept(self) -> str:
        return f"hipress: coordinator='auto' kept the coordinator {self.in_use}"
