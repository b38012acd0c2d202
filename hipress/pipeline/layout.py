"""Where each rank sits in a pipeline x data-parallel job, and which layers each stage runs.

Ranks are laid out stage-major: rank = stage * dp + replica. The ranks of one stage (its
data-parallel group) are consecutive; the ranks of one replica (its pipeline) are dp apart.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

import torch.nn as nn


@dataclasses.dataclass(frozen=True)
class Layout:
    pp: int  # pipeline stages
    dp: int  # data-parallel replicas of each stage

    def __post_init__(self):
        for name in ("pp", "dp"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")

    @property
    def size(self) -> int:
        return self.pp * self.dp

    def rank(self, stage: int, replica: int) -> int:
        return stage * self.dp + replica

    def stage_of(self, rank: int) -> int:
        self._check(rank)
        return rank // self.dp

    def replica_of(self, rank: int) -> int:
        self._check(rank)
        return rank % self.dp

    def dp_group(self, stage: int) -> List[int]:
        """The ranks holding stage ``stage``, in replica order."""
        return [self.rank(stage, d) for d in range(self.dp)]

    def tied_group(self) -> List[int]:
        """The 2D ranks holding the first or the last stage: first-stage ranks, then last-stage
        ranks, each in replica order (the fused embedding all-reduce's members)."""
        return self.dp_group(0) + self.dp_group(self.pp - 1)

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside the pp={self.pp} x dp={self.dp} layout of {self.size} ranks")


def stage_bounds(n_layers: int, pp: int, balance: Optional[Sequence[int]] = None) -> List[range]:
    """The layer indices of each stage: ``balance`` (layers per stage) or as even as possible,
    earlier stages taking the remainder."""
    if balance is None:
        if n_layers < pp:
            raise ValueError(f"cannot split {n_layers} layers into {pp} stages: every stage needs a layer")
        base, extra = divmod(n_layers, pp)
        balance = [base + (1 if s < extra else 0) for s in range(pp)]
    balance = list(balance)
    if len(balance) != pp or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in balance):
        raise ValueError(f"balance must be {pp} positive ints (layers per stage), got {balance!r}")
    if sum(balance) != n_layers:
        raise ValueError(f"balance {balance} sums to {sum(balance)}, but the model has {n_layers} layers")
    bounds, start = [], 0
    for b in balance:
        bounds.append(range(start, start + b))
        start += b
    return bounds


def split_stage(model: nn.Sequential, stage: int, pp: int, balance: Optional[Sequence[int]] = None) -> nn.Sequential:
    """Stage ``stage`` of ``model``: a Sequential of its layers under their names in ``model``
    (so ``"embed.weight"`` keeps its name on the stage that holds it)."""
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"the model must be a torch.nn.Sequential (its layers are cut into stages), "
                         f"got {type(model).__name__}")
    bounds = stage_bounds(len(model), pp, balance)
    layers = bounds[stage]
    return model[layers.start:layers.stop]
