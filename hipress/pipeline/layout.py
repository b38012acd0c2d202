"""Where each rank sits in a pipeline x data-parallel job, and which layers each stage runs.

Ranks are laid out stage-major: rank = stage * dp + replica. The ranks of one stage (its
data-parallel group) are consecutive; the ranks of one replica (its pipeline) are dp apart.
"""
from __future__ import annotations

import dataclasses
from typing import FrozenSet, List, Optional, Sequence, Tuple

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


def tied_names_of_stage(model: nn.Sequential, tied: List[Tuple[str, str]], stage: int, pp: int,
                        balance: Optional[Sequence[int]] = None) -> List[str]:
    """The names among ``tied`` that stage ``stage`` holds a copy of, after checking that every
    pair is (a first-stage parameter, a last-stage parameter of the same shape)."""
    first = dict(split_stage(model, 0, pp, balance).named_parameters())
    last = dict(split_stage(model, pp - 1, pp, balance).named_parameters(remove_duplicate=False))
    mine = []
    for pair in tied:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(n, str) for n in pair)):
            raise ValueError(f"tied must hold (first-stage name, last-stage name) pairs, got {pair!r}")
        a, b = pair
        if a not in first:
            raise ValueError(f"tied parameter {a!r} is not a parameter of the first stage (it has {sorted(first)[:8]})")
        if b not in last:
            raise ValueError(f"tied parameter {b!r} is not a parameter of the last stage (it has {sorted(last)[:8]})")
        if first[a].shape != last[b].shape:
            raise ValueError(f"tied parameters {a!r} {tuple(first[a].shape)} and {b!r} {tuple(last[b].shape)} "
                             f"differ in shape")
        if pp == 1:
            if first[a] is not last[b]:
                raise ValueError(f"with pp=1 the tied parameters {a!r} and {b!r} must be one parameter "
                                 f"(there is no second stage to hold a copy)")
            continue  # one parameter, synchronized like any other
        mine += [a] if stage == 0 else [b] if stage == pp - 1 else []
    return mine


def compressed_stage_set(compress_stages, pp: int) -> FrozenSet[int]:
    """compress_stages: None or 0 (none), k (the first k stages: their data-parallel traffic starts
    last, after the longest backward, so it is the one on the critical path) or a list of stages."""
    if compress_stages is None:
        return frozenset()
    if isinstance(compress_stages, bool):
        raise ValueError(f"compress_stages must be an int or a list of stage indices, got {compress_stages!r}")
    if isinstance(compress_stages, int):
        if not 0 <= compress_stages <= pp:
            raise ValueError(f"compress_stages={compress_stages} is not in [0, pp={pp}]")
        return frozenset(range(compress_stages))
    try:
        stages = list(compress_stages)
    except TypeError:
        raise ValueError(f"compress_stages must be an int or a list of stage indices, got {compress_stages!r}") from None
    bad = [s for s in stages if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < pp]
    if bad:
        raise ValueError(f"compress_stages holds {bad}, which are not stage indices in [0, {pp})")
    return frozenset(stages)
