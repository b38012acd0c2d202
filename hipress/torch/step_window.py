"""Seconds per training step over a window of steps, as the optimizer's online searches measure
them (bucket_bytes="tune": hipress/torch/bucket_tuner.py; plan="auto"'s measured choice:
hipress/torch/plan_trial.py).

A step's time is the period between two calls of :meth:`StepWindow.tick` (the optimizer calls it
at each step's first final gradient). After a change (a new bucket layout, another plan), the
first ``warmup`` steps are not counted: they pay for new buffers and compressor states. A step
skipped for non-finite gradients is not counted either (it is not a step of the configuration's
throughput), so the window grows by one.
"""
from __future__ import annotations

import time
from typing import Callable, Optional


class StepWindow:
    """``window`` measured steps after ``warmup`` ones; ``clock``: seconds as a float
    (time.perf_counter by default; tests script it)."""

    def __init__(self, window: int, warmup: int, clock: Optional[Callable[[], float]] = None):
        self.window, self.warmup = int(window), int(warmup)
        self.clock: Callable[[], float] = clock or time.perf_counter
        self.restart()

    def restart(self) -> None:
        """Nothing measured, ``warmup`` steps to let pass first (a new configuration, or a
        measurement to throw away: a failed step, reset())."""
        self.seconds = 0.0
        self.measured = 0
        self.to_skip = self.warmup
        self._last: Optional[float] = None  # clock at the start of the step in progress

    def tick(self, previous_skipped: bool) -> bool:
        """A step starts now: the time since the last tick is the previous step's, counted unless
        that step was skipped, was a warm-up step, or there was no previous tick. True once the
        window is full."""
        now = self.clock()
        if self._last is not None:
            if previous_skipped:
                pass
            elif self.to_skip:
                self.to_skip -= 1
            else:
                self.seconds += now - self._last
                self.measured += 1
        self._last = now
        return self.measured >= self.window

    def mark(self) -> None:
        """The clock restarts now (after work that is not a training step, such as a rebuild)."""
        if self._last is not None:
            self._last = self.clock()

    def start_now(self) -> None:
        """A fresh window whose first step starts now (after a decision taken at a tick)."""
        self.restart()
        self._last = self.clock()

    def state_dict(self) -> dict:
        """The window in progress, including the step now running up to this call, so that the
        step spanning a checkpoint is measured as the time before the save plus the time after the
        load."""
        return {"seconds": self.seconds, "measured": self.measured, "to_skip": self.to_skip,
                "open_s": None if self._last is None else self.clock() - self._last}

    def load_state_dict(self, sd: dict) -> None:
        self.seconds, self.measured, self.to_skip = float(sd["seconds"]), int(sd["measured"]), int(sd["to_skip"])
        self._last = None if sd["open_s"] is None else self.clock() - float(sd["open_s"])
