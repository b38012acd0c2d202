"""Which task graph synchronizes a gradient: the one place that turns the user's choices
(strategy name, compressor, local aggregation) into a strategy bound to its context.

* ``strategy``: "ring" (CaSync-Ring), "ps" (CaSync-PS), "allgather" (GRACE's form: every
  rank decodes every rank's payload, nothing is re-encoded) or "auto": the fastest strategy
  that keeps the algorithm's accuracy. Ring (bandwidth-optimal) where re-encoding merged sums
  is safe (``compressor.reencode_safe``: no compression), allgather where it is not (every
  built-in lossy algorithm: it never re-encodes; its traffic, N-1 payloads received per
  rank, stays below an uncompressed ring's 2(N-1)/N while N < 2 / rate, e.g. 32 ranks for
  TernGrad's 2 bits); with a planner, "ps" here, the strategy profiled, and then the optimizer
  keeps PS or allgather, whichever plan the planner's model predicts faster (a tie: allgather).
  PS re-encodes once, at the aggregator, and its traffic, 2(N-1)/N payloads per rank, is below
  allgather's N-1 from 3 ranks on; allgather has one exchange, not two (docs/planner.md).
* multi-round aggregatable compressors (PowerSGD) always use the low-rank strategy.
* uncompressed gradients (compressor "none": ``compression="none"`` or the planner's choice)
  go through the backend's own allreduce (``allreduce.py``) whatever the strategy name, which
  chooses how *compressed* gradients travel, where the exchange has one. Under the global
  coordinator, which plans point-to-point messages only, that is on the direct exchanges beside
  it (``Exchanges.plain``) where the backend has them; not for strategy "dear", which needs the
  ring's two phases (``plain_allreduce=False``). Elsewhere the named strategy runs them.
* local aggregation wraps the chosen strategy (hierarchical: uncompressed on the host,
  compressed across hosts); its host phase is an allreduce too where the exchange has one.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence, Tuple

import torch

from hipress.comm.exchange import Exchanges
from hipress.compression.base import Compressor
from hipress.compression.none import NoneCompressor
from hipress.engine import Engine, Handle
from hipress.sync.allgather import AllgatherStrategy
from hipress.sync.allreduce import AllreduceStrategy
from hipress.sync.base import StateStore, Strategy, SyncContext
from hipress.sync.hierarchical import HierarchicalStrategy
from hipress.sync.lowrank import LowRankStrategy
from hipress.sync.ps import PSStrategy
from hipress.sync.ring import RingStrategy

STRATEGIES = {"ring": RingStrategy, "ps": PSStrategy, "allgather": AllgatherStrategy}


def resolve_strategy(name: str, compressor: Compressor, planned: bool = False) -> str:
    """The strategy name "auto" stands for with this compressor (and a planner or not);
    checks the name."""
    fixed = compressor.fixed_strategy
    if fixed is not None:  # a ported GRACE compressor: allgather only
        if name not in ("auto", fixed):
            raise ValueError(f"{compressor.name} syncs with the {fixed!r} strategy only, got strategy={name!r}")
        return fixed
    if name == "auto":
        if compressor.reencode_safe:
            return "ring"
        return "ps" if planned else "allgather"
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; expected one of {sorted(STRATEGIES)} or 'auto'")
    return name


def use_local_aggregation(mode, hostnames: Sequence[str]) -> bool:
    """auto: when some ranks share a host AND there are several hosts (on a single host the
    whole sync would be uncompressed). True: whenever some ranks share a host. Decided from
    the hostnames of all ranks, so every rank decides the same."""
    if mode not in ("auto", True, False):
        raise ValueError(f"local_aggregation must be 'auto', True or False, got {mode!r}")
    hosts = len(set(hostnames))
    if mode is False or hosts == len(hostnames):
        return False
    return mode is True or hosts > 1


@dataclasses.dataclass(frozen=True)
class Sync:
    """A strategy bound to the context it emits tasks into."""

    strategy: Strategy
    ctx: SyncContext

    def build(self, name: str, flat: torch.Tensor, bounds: Sequence[Tuple[int, int]], **kw) -> Handle:
        return self.strategy.build(self.ctx, name, flat, bounds, **kw)

    @property
    def spread(self) -> int:
        """Over how many ranks a gradient's partitions share the work (Strategy.spread)."""
        return self.strategy.spread(self.ctx.size)

    def reserve(self, name: str, bounds: Sequence[Tuple[int, int]]) -> None:
        self.strategy.reserve(self.ctx, name, bounds)

    def state_spans(self, name: str, bounds: Sequence[Tuple[int, int]]):
        return self.strategy.state_spans(self.ctx, name, bounds)

    def forget_layout(self) -> None:
        self.strategy.forget_layout()

    def layout_state(self) -> dict:
        return self.strategy.layout_state()

    def load_layout_state(self, sd: dict) -> None:
        self.strategy.load_layout_state(sd)

    # The two phases, apart (RingStrategy's, and AllreduceStrategy's over the backend's collectives;
    # strategy "dear" uses them).
    def reduce_scatter(self, name: str, flat: torch.Tensor, bounds: Sequence[Tuple[int, int]], **check) -> Handle:
        return self.strategy.reduce_scatter(self.ctx, name, flat, bounds, **check)

    def all_gather(self, name: str, flat: torch.Tensor, bounds: Sequence[Tuple[int, int]], **check) -> Handle:
        return self.strategy.all_gather(self.ctx, name, flat, bounds, **check)


def make_sync(engine: Engine, exchanges: Exchanges, compressor: Compressor, strategy: str, states: StateStore,
              average: bool, hierarchical: bool, world_size: int, is_host_root: bool,
              plain_allreduce: bool = True, wire: torch.dtype = torch.float32) -> Sync:
    """The sync of gradients compressed with ``compressor`` (see the module docstring).
    Syncs made from the same ``exchanges`` keep one order of communication per rank.
    ``plain_allreduce``: uncompressed sums by the backend's allreduce where it has one;
    ``wire``: the dtype they travel in (torch.bfloat16 where the backend sums it: a plan's choice)."""
    if plain_allreduce and isinstance(compressor, NoneCompressor) and exchanges.plain is not None:
        exchanges = exchanges.plain  # beside the coordinator
    # The world's backend decides for every group: its splits are transports of the same kind,
    # and every rank decides the same.
    native_sum = plain_allreduce and exchanges.world.has_allreduce
    inner_average = average and not hierarchical
    if compressor.lowrank:
        inner = LowRankStrategy(average=inner_average)
    elif native_sum and isinstance(compressor, NoneCompressor):
        if wire not in exchanges.world.transport.allreduce_dtypes:
            raise ValueError(f"the {exchanges.world.transport.name} transport's allreduce does not sum {wire}")
        inner = AllreduceStrategy(average=inner_average, wire=wire)
    else:
        inner = STRATEGIES[resolve_strategy(strategy, compressor)](average=inner_average)
    if not hierarchical:
        return Sync(inner, SyncContext(engine, exchanges.world, compressor, states))
    local_ctx = SyncContext(engine, exchanges.local, NoneCompressor(), states)
    cross_ctx = SyncContext(engine, exchanges.cross, compressor, states) if is_host_root else None
    local_sum = AllreduceStrategy(average=False) if native_sum else RingStrategy(average=False)
    return Sync(HierarchicalStrategy(inner, local_ctx, cross_ctx, world_size, average, local_sum), local_ctx)
