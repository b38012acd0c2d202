"""Non-finite gradients (NaN, Inf): detected before they enter any state, the step skipped
consistently on every rank with every state as it was (issue #22).

    opt = hipress.DistributedOptimizer(opt, ..., nonfinite="skip")    # the default
    opt = hipress.DistributedOptimizer(opt, ..., nonfinite="raise")   # NonFiniteGradientError
    opt = hipress.DistributedOptimizer(opt, ..., nonfinite="off")     # no check, no undo log

Why it needs more than a check: gradients are compressed during backward, bucket by bucket,
and compression updates state (error-feedback residuals, RNG counters, DGC accumulations,
PowerSGD's Q, PS aggregators' and ring hops' residuals, momentum correction's velocities).
One rank's NaN is known to the others only in ``synchronize()``, after their own state has
already taken this step's gradients in. So, per step:

1. each rank checks every parameter's final gradient *before* clipping, momentum correction
   and compression (:func:`all_finite`: one ``sum`` over the gradient, faster than a copy;
   ``isfinite().all()`` only when the sum is not finite). A non-finite gradient is replaced
   by zeros, so nothing non-finite is ever encoded, sent, or decoded by a peer (a NaN scale
   in a payload header would fail the peer's decode and stall the collectives), and every
   rank runs the same collectives as always;
2. every state is copied the first time it is touched in a step (:class:`hipress.sync.undo.UndoLog`:
   copy-on-write into buffers kept from step to step), on every rank, whichever site touches it
   (a rank's own encode, a PS aggregator's or a ring hop's re-encode of peers' payloads);
3. ``synchronize()``, once every handle completed, allgathers one byte per parameter (was it
   non-finite on this rank). If any rank saw one, every rank restores every copied state
   (states created this step are dropped and made again, the same, when next used), sets the
   gradients of the affected parameters to NaN (so AMP's ``GradScaler`` finds inf on every
   rank, and lowers its scale the same way everywhere) and warns naming the parameters and
   ranks; ``step()`` then does not run the wrapped optimizer ("skip"), or ``synchronize()``
   raises :class:`NonFiniteGradientError` ("raise"). Otherwise the copies are simply kept
   for the next step.
The step is then exactly as if its batch had not been taken, on every rank.

COVAP's local mode with "skip" is the exception (docs/covap.md, "Non-finite gradients"): each
rank's model is its own replica between averages, so only the rank that saw the NaN or Inf skips
its step, nothing is restored (COVAP's schedule and averages are every rank's and go on), and the
step's agreement is waited for a step later, so the ranks do not meet at every step's end.
"""
from __future__ import annotations

import math
from typing import Dict, List

import torch

MODES = ("skip", "raise", "off")


class NonFiniteGradientError(RuntimeError):
    """Raised on every rank by ``synchronize()``/``step()`` with ``nonfinite="raise"``.
    ``where`` maps each parameter name to the ranks whose gradient of it was NaN or Inf.
    Every state is as before the step: zero the gradients and go on."""

    def __init__(self, message: str, where: Dict[str, List[int]]):
        super().__init__(message)
        self.where = where


class NonFiniteGradientWarning(RuntimeWarning):
    """Warned on every rank when a step is skipped (``nonfinite="skip"``); in COVAP's local mode
    on the rank that skips it."""


def resolve(mode) -> str:
    if mode not in MODES:
        raise ValueError(f"nonfinite must be one of {MODES}, got {mode!r}")
    return mode


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite. A NaN or Inf element makes any sum of the
    elements NaN or Inf, so a finite sum proves every element finite (one pass over memory,
    no allocation: faster than a copy; 64 MiB fp32 on this 2-core host: 2.4 ms against 5.0 for a
    copy and 46 ms for ``isfinite(t).all()``, ``python -m hipress.bench.nonfinite``). A non-finite
    sum may also be an overflow of finite elements; then the exact elementwise check decides."""
    if t.numel() == 0 or not t.is_floating_point():
        return True
    s = t.sum(dtype=torch.float32) if t.element_size() < 4 else t.sum()
    if math.isfinite(float(s)):
        return True
    return bool(torch.isfinite(t).all())


def describe(where: Dict[str, List[int]], step_action: str, restored: bool = True) -> str:
    shown = [f"'{n}' (rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))})" for n, r in list(where.items())[:10]]
    more = f" and {len(where) - 10} more" if len(where) > 10 else ""
    return (f"hipress: non-finite (NaN/Inf) gradient of {', '.join(shown)}{more}; {step_action}"
            + ("; compressor and momentum state restored on every rank" if restored else ""))
