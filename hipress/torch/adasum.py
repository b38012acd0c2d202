"""``hipress.DistributedOptimizer(opt, op=hipress.Adasum)``: Horovod's Adasum optimizer.

Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation") combines the
ranks' *updates*, not their gradients: each rank steps the wrapped optimizer on its own
gradient, and the ranks' parameter changes are added adaptively, pair by pair,

    adasum(a, b) = (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b

(orthogonal updates add, identical ones average), per tensor, over a binary tree of the
ranks (hipress.torch.collectives' Adasum allreduce). So, per ``step()``:

1. every rank checks its gradients are finite and the ranks agree (one byte each): if any
   rank has a NaN or Inf, no rank steps (``nonfinite="skip"`` warns, ``"raise"`` raises
   :class:`~hipress.torch.nonfinite.NonFiniteGradientError`), and nothing has changed;
2. each rank keeps its parameters, runs the wrapped optimizer's step on its local gradients
   (its state, Adam's moments say, stays local, as in Horovod) and takes the difference;
3. one grouped Adasum allreduce of the differences, and every rank sets its parameters to
   the kept ones plus the combined difference: the same parameters on every rank.

Nothing is sent during backward, so there is nothing to fuse or overlap, and the updates travel
uncompressed or as float16 (``compression="fp16"``), as Horovod's Adasum optimizer allows. Learning rates
are not scaled by the number of ranks (Horovod's examples: ``lr_scaler = 1`` with Adasum).
The number of ranks must be a power of 2, as Horovod's Adasum requires.
"""
from __future__ import annotations

import contextlib
import warnings

import torch

from hipress.comm import world
from hipress.torch import collectives, nonfinite


class AdasumOptimizer:
    """Methods mixed into the dynamic subclass of the wrapped optimizer (see :func:`wrap`)."""

    def _adasum_setup(self, named, nonfinite_mode: str, fp16: bool) -> None:
        world.init()
        n = world.size()
        if n & (n - 1):
            raise NotImplementedError(f"op=Adasum needs a power of 2 ranks (Horovod's Adasum), got {n}")
        self._adasum_named = named
        self._adasum_wire = collectives.Compression.fp16 if fp16 else collectives.Compression.none
        self._adasum_nonfinite = nonfinite.resolve(nonfinite_mode)
        self.last_nonfinite = {}

    def synchronize(self):
        """Nothing to wait for: with Adasum the ranks combine updates in ``step()``, and the
        gradients stay each rank's own (so ``synchronize(); clip; step()`` clips local gradients)."""

    @contextlib.contextmanager
    def skip_synchronize(self):
        """For scripts written for op=Average (``synchronize()`` then ``step()`` inside this):
        step() combines the updates either way."""
        yield

    def join(self) -> int:
        raise NotImplementedError("join() is not supported with op=Adasum: every rank's update takes part in "
                                  "the pairwise combination")

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._adasum_skip_nonfinite():
            return loss
        params = [p for _, p in self._adasum_named]
        kept = [p.detach().clone() for p in params]
        super(self.__class__, self).step()
        with torch.no_grad():
            deltas = [p.detach() - k for p, k in zip(params, kept)]
            combined = collectives.grouped_allreduce(deltas, op=collectives.Adasum, name="hipress.adasum.step",
                                                     compression=self._adasum_wire)
            for p, k, d in zip(params, kept, combined):
                p.copy_(k.add_(d))
        return loss

    def _adasum_skip_nonfinite(self) -> bool:
        """Agrees with every rank on whether some local gradient is NaN/Inf; True: skip the step."""
        if self._adasum_nonfinite == "off":
            return False
        mine = torch.tensor([p.grad is not None and not nonfinite.all_finite(p.grad) for _, p in self._adasum_named],
                            dtype=torch.uint8)
        table = collectives.allgather(mine.view(1, -1)) if world.size() > 1 else mine.view(1, -1)
        hit = table.any(0).nonzero().view(-1).tolist()
        where = {self._adasum_named[i][0]: table[:, i].nonzero().view(-1).tolist() for i in hit}
        self.last_nonfinite = where
        if not where:
            return False
        if self._adasum_nonfinite == "raise":
            raise nonfinite.NonFiniteGradientError(nonfinite.describe(where, "step not taken"), where)
        warnings.warn(nonfinite.describe(where, "step skipped on every rank"), nonfinite.NonFiniteGradientWarning,
                      stacklevel=3)
        return True


def wrap(optimizer: torch.optim.Optimizer, named, nonfinite_mode: str, fp16: bool = False) -> torch.optim.Optimizer:
    """Makes ``optimizer`` an Adasum optimizer in place (its class becomes a subclass of its own)."""
    base = optimizer.__class__
    optimizer.__class__ = type(base.__name__, (base,),
                               {k: v for k, v in AdasumOptimizer.__dict__.items() if not k.startswith("__")}
                               | {"__module__": base.__module__})
    try:
        optimizer._adasum_setup(named, nonfinite_mode, fp16)
    except Exception:
        optimizer.__class__ = base
        raise
    return optimizer
