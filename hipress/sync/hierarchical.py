"""Local aggregation (paper 000 §5.1): reduce uncompressed on the host first, sync
compressed across hosts with one rank per host, then share the result on the host.

For one gradient, on every rank:
  1. local all-reduce (sum, no compression) over the ranks of this host: the backend's
     allreduce where it has one, else hipress's ring; intra-host links are much faster than
     the network, so compressing there would only cost time
  2. on the host's first rank only: the chosen cross-host strategy (ring, PS or low-rank,
     with compression, sum) over one rank per host
  3. local broadcast of the host root's result
  4. divide by the world size (op=Average)
Both levels communicate through the exchanges of their groups (hipress.comm.exchange),
which keep one order of communication per rank, or let the global coordinator schedule it.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from hipress.engine import Handle
from hipress.sync.base import Strategy, SyncContext
from hipress.sync.ring import RingStrategy


class HierarchicalStrategy(Strategy):
    name = "hierarchical"

    def __init__(self, cross: Strategy, local_ctx: SyncContext, cross_ctx: Optional[SyncContext], world_size: int,
                 average: bool = True, local_sum: Optional[Strategy] = None):
        """cross: a strategy built with average=False; local_ctx: uncompressed, over this
        host's ranks; cross_ctx: over one rank per host, None on ranks that are not their
        host's first rank; local_sum: the host's uncompressed sum, average=False (default:
        hipress's ring)."""
        self.cross = cross
        self.local_ctx = local_ctx
        self.cross_ctx = cross_ctx
        self.world_size = world_size
        self.average = average
        self.local_sum = local_sum if local_sum is not None else RingStrategy(average=False)

    def spread(self, ranks: int) -> int:
        return self.cross.spread(self.world_size // self.local_ctx.size)  # over one rank per host

    def reserve(self, ctx: SyncContext, tensor_name: str, bounds: Sequence[Tuple[int, int]]) -> None:
        if self.cross_ctx is not None:
            self.cross.reserve(self.cross_ctx, tensor_name, bounds)

    def state_spans(self, ctx: SyncContext, tensor_name: str, bounds: Sequence[Tuple[int, int]]):
        # the host's sum is uncompressed (no residual); the cross-host sync's states on host roots
        return self.cross.state_spans(self.cross_ctx, tensor_name, bounds) if self.cross_ctx is not None else []

    def forget_layout(self) -> None:
        self.cross.forget_layout()

    def layout_state(self) -> dict:
        return self.cross.layout_state()

    def load_layout_state(self, sd: dict) -> None:
        self.cross.load_layout_state(sd)

    def build(self, ctx: SyncContext, tensor_name: str, flat: torch.Tensor,
              bounds: Sequence[Tuple[int, int]], deps: Sequence[Handle] = (), **kw) -> Handle:
        h = list(deps)
        if self.local_ctx.size > 1:
            h = [self.local_sum.build(self.local_ctx, f"{tensor_name}@local", flat, bounds, h)]
        if self.cross_ctx is not None and self.cross_ctx.size > 1:
            h = [self.cross.build(self.cross_ctx, tensor_name, flat, bounds, h, **kw)]
        if self.local_ctx.size > 1:
            h = [self.local_ctx.exchange.broadcast(f"bcast.{tensor_name}@local", flat, 0, h)]
        n = self.world_size

        def finish():
            if self.average:
                flat.div_(n)

        return self.local_ctx.compute(f"average.{tensor_name}", finish, h)
