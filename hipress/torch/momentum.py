"""Momentum correction: each rank applies SGD's momentum to its own gradient before
compression, and the wrapped optimizer steps with the averaged result and no momentum.

DGC (Lin et al. 2018, §3.2) prescribes it for sparsification; hipress applies it to every
single-round algorithm, because the same reasoning holds for any compressor with error
feedback: what compression delays is sent later as part of the velocity, instead of being
injected into a momentum buffer that then keeps replaying the compression error. On digits
(4 ranks, lr 0.05, momentum 0.9; docs/convergence.md) it took onebit (ring) from 60.9% to
87.9% and TBQ from 24.9% to 67.0% (uncompressed: 95.6%).

For a parameter p of a ``torch.optim.SGD`` group (momentum m, dampening d, weight decay w,
nesterov) with local gradient g, each step, on every rank, exactly as SGD computes it:

    g <- g + w * p
    u <- g                       on the first step, else   u <- m * u + (1 - d) * g
    g <- g + m * u  (nesterov)   or   g <- u

and the wrapped SGD then runs with momentum 0 and weight decay 0 on the average of the
ranks' g. Without compression the result equals plain SGD's (momentum and the average are
linear); with compression the velocity u stays local, as DGC's does.

"auto" turns it on for a ``torch.optim.SGD`` with momentum and a single-round compressor.
PowerSGD keeps its paper's form (momentum after aggregation): char LM, 4 ranks, validation
perplexity 17.7 that way against 22.9 with momentum correction (uncompressed 14.5); on digits
the two were within seed noise (seeds 42/1/2: -1.35/-0.67/-0.34 points against
+0.67/-1.0/+1.3). Other optimizers (Adam, ...) keep their own state and are left alone.

A compressor whose algorithm is itself a momentum method (SIGNUM: the sign of its own
momentum, ``momentum_in_compressor = True``) keeps the momentum: with momentum correction on,
hipress applies weight decay to the local gradient and steps the SGD without momentum, as
above, but applies no velocity of its own (``in_compressor``). The momentum is then the
compressor's (signum's ``momentum``, 0.9 by default as in its paper), not the SGD's, so it is
not applied twice (a velocity of a velocity, or momentum again after the average).
"""
from __future__ import annotations

import contextlib
from typing import Dict, Optional, Set

import torch

from hipress import _C
from hipress.compression.base import is_f32_flat
from hipress.sync.undo import UndoLog

#: the group settings momentum correction takes over from the wrapped SGD during step()
_TAKEN = {"momentum": 0.0, "weight_decay": 0.0, "nesterov": False, "dampening": 0.0}


def applies(optimizer: torch.optim.Optimizer) -> Optional[str]:
    """None if momentum correction can run with this optimizer, else why not."""
    if not isinstance(optimizer, torch.optim.SGD):
        return f"it needs torch.optim.SGD, got {type(optimizer).__name__}"
    if not any(g.get("momentum", 0) for g in optimizer.param_groups):
        return "the SGD has no momentum"
    if any(g.get("maximize", False) for g in optimizer.param_groups):
        return "maximize=True is not supported"
    return None


def resolve(mode, optimizer: torch.optim.Optimizer, compressor) -> bool:
    """Whether to apply momentum correction: "auto" (see the module docstring), True or False."""
    if mode not in ("auto", True, False):
        raise ValueError(f"momentum_correction must be 'auto', True or False, got {mode!r}")
    why_not = applies(optimizer)
    if mode is True and why_not:
        raise ValueError(f"momentum_correction=True: {why_not}")
    if mode == "auto":
        return why_not is None and compressor.name != "none" and not compressor.lowrank
    return bool(mode)


def in_compressor(compressor) -> bool:
    """Whether the compressor applies the momentum itself (SIGNUM): momentum correction then
    applies no velocity (see the module docstring)."""
    inner = getattr(compressor, "inner", compressor)  # ErrorFeedback(inner)
    return bool(getattr(inner, "momentum_in_compressor", False))


class MomentumCorrection:
    """The per-parameter velocities of one rank (see the module docstring). ``velocity=False``
    (a compressor with its own momentum, :func:`in_compressor`): weight decay only."""

    def __init__(self, optimizer: torch.optim.Optimizer, names: Dict[int, str], velocity: bool = True):
        self._opt = optimizer
        self._names = names
        self._velocity = bool(velocity)
        self._group_of: Dict[int, dict] = {}
        self.velocity: Dict[str, torch.Tensor] = {}
        # ids of the parameters it corrects (limit_to); None: every parameter
        self._only: Optional[Set[int]] = None
        # copy-on-write log of this step's velocity changes (see hipress.sync.undo; enabled by
        # the optimizer unless nonfinite="off")
        self.undo_log = UndoLog()

    def _group(self, p) -> dict:
        g = self._group_of.get(id(p))
        if g is None:  # first use, or add_param_group() since
            self._group_of = {id(q): g for g in self._opt.param_groups for q in g["params"]}
            g = self._group_of[id(p)]
        return g

    def limit_to(self, params: Set[int]) -> None:
        """Correct only the parameters with these ids (those a plan compresses); the others keep
        the wrapped SGD's own momentum and weight decay (see plain_step)."""
        self._only = set(params)

    def corrects(self, p: torch.nn.Parameter) -> bool:
        return self._only is None or id(p) in self._only

    def apply(self, p: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Turns p's final local gradient into its local update direction, in place (nothing for
        a parameter it does not correct)."""
        native = self._native(p, grad)
        if native is not None:
            self._native_update(p, grad, *native, _C.ops_momentum_update)
            return
        if not self.corrects(p):
            return
        group = self._group(p)
        m = group.get("momentum", 0.0)
        if group.get("weight_decay", 0.0):
            grad.add_(p.detach(), alpha=group["weight_decay"])
        if not m or not self._velocity:
            return
        name = self._names[id(p)]
        nesterov, d = group.get("nesterov", False), group.get("dampening", 0.0)
        u = self.velocity.get(name)
        if u is None:
            self.undo_log.created(name)
            self.velocity[name] = u = grad.detach().clone()
            if not nesterov:
                return  # grad is u already
        else:  # into a spare buffer when the step's old velocity must be kept (no copy of it)
            new = self.undo_log.replace(name, [u])[0]
            self.velocity[name] = u = torch.mul(u, m, out=new).add_(grad, alpha=1.0 - d)
        if nesterov:
            grad.add_(u, alpha=m)
        else:
            grad.copy_(u)

    def apply_checked(self, p: torch.nn.Parameter, grad: torch.Tensor) -> Optional[bool]:
        """:meth:`apply` with the optimizer's NaN/Inf check of ``grad`` in the same native pass,
        where SGD's default update runs into the undo log's spare buffer (so the old velocity is
        kept, and the step's undo restores it): whether ``grad`` was finite. If it was not,
        ``grad`` and the new velocity hold garbage: the caller sends zeros and every rank undoes
        the step. None, changing nothing, where that pass does not apply: the caller checks
        ``grad`` first, then calls :meth:`apply`."""
        native = self._native(p, grad) if self.undo_log.enabled else None
        return None if native is None else self._native_update(p, grad, *native, _C.ops_momentum_update_finite)

    def _native(self, p: torch.nn.Parameter, grad: torch.Tensor):
        """(group, name, velocity) where p's update is SGD's default (momentum, no dampening, no
        nesterov) of a velocity it already has, all fp32 CPU and contiguous: one native pass
        (:meth:`_native_update`); else None."""
        if not self._velocity or not self.corrects(p):
            return None
        group = self._group(p)
        name = self._names[id(p)]
        u = self.velocity.get(name)
        if (u is None or not group.get("momentum", 0.0) or group.get("nesterov", False)
                or group.get("dampening", 0.0) or not (is_f32_flat(u) and is_f32_flat(grad))):
            return None
        return group, name, u

    def _native_update(self, p, grad, group: dict, name: str, u: torch.Tensor, op):
        """Weight decay, then ``op`` (``ops_momentum_update[_finite]``): the update and its copy into
        grad in one pass with SGD's roundings, into a spare buffer where the undo log keeps the step's
        old velocity (no copy of it). Returns what ``op`` returns."""
        if group.get("weight_decay", 0.0):  # (a NaN or Inf in grad stays one)
            grad.add_(p.detach(), alpha=group["weight_decay"])
        new = self.undo_log.replace(name, [u])[0]
        out = op(new.data_ptr(), u.data_ptr(), float(group["momentum"]), grad.data_ptr(), grad.numel())
        self.velocity[name] = new
        return out

    @contextlib.contextmanager
    def plain_step(self):
        """Inside: the wrapped SGD steps without momentum and weight decay (applied already) on the
        parameters this corrects, and as configured on the others: each param group is split in
        two for the step (copies of the group's settings; the optimizer's state is per parameter,
        so it is unaffected), and the groups are back as they were after it."""
        groups = self._opt.param_groups
        split = []
        for g in groups:
            mine = [p for p in g["params"] if self.corrects(p)]
            rest = [p for p in g["params"] if not self.corrects(p)]
            if mine:
                split.append({**g, **{k: v for k, v in _TAKEN.items() if k in g}, "params": mine})
            if rest:
                split.append({**g, "params": rest})
        self._opt.param_groups = split
        try:
            yield
        finally:
            self._opt.param_groups = groups

    def commit(self) -> None:
        self.undo_log.commit()

    def undo(self) -> None:
        """Every velocity as before this step (a new one dropped)."""
        def restore(name, copies, _):
            if copies is None:
                self.velocity.pop(name, None)
            else:  # into the current buffer: the copy is the next step's spare (UndoLog.replace)
                self.velocity[name].copy_(copies[0])

        self.undo_log.undo(restore)

    def state_dict(self) -> dict:
        return {k: v.clone() for k, v in self.velocity.items()}

    def load_state_dict(self, sd: dict) -> None:
        self.undo_log.commit()
        self.velocity = {k: v.detach().clone() for k, v in sd.items()}
