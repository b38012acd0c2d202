"""Local aggregation (paper 000 §5.1): reduce uncompressed on the host first, sync
compressed across hosts with one rank per host, then share the result on the host.

For one gradient, on every rank:
  1. local ring all-reduce (sum, no compression) over the ranks of this host; intra-host
     links are much faster than the network, so compressing there would only cost time
  2. on the host's first rank only: the chosen cross-host strategy (ring, PS or low-rank,
     with compression, sum) over one rank per host
  3. local broadcast of the host root's result
  4. divide by the world size (op=Average)
All comm tasks of both levels share one CommChain, so each rank still issues its
communication in submission order (see hipress.sync.base).
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch

from hipress.compression.none import NoneCompressor
from hipress.engine import Handle
from hipress.sync.base import Strategy, SyncContext
from hipress.sync.ring import RingStrategy


class HierarchicalStrategy(Strategy):
    name = "hierarchical"

    def __init__(self, cross: Strategy, local_ctx: SyncContext, cross_ctx, world_size: int, average: bool = True):
        """cross: a strategy built with average=False; cross_ctx: None on ranks that are
        not their host's first rank."""
        self.cross = cross
        self.local_ctx = local_ctx
        self.cross_ctx = cross_ctx
        self.world_size = world_size
        self.average = average
        self.local_ring = RingStrategy(average=False)

    @staticmethod
    def contexts(engine, local_transport, cross_transport, compressor, states, chain, is_host_root: bool):
        local = SyncContext(engine, local_transport, NoneCompressor(), states, chain)
        cross = SyncContext(engine, cross_transport, compressor, states, chain) if is_host_root else None
        return local, cross

    def build(self, ctx: SyncContext, tensor_name: str, flat: torch.Tensor,
              bounds: Sequence[Tuple[int, int]], deps: Sequence[Handle] = (), **kw) -> Handle:
        h = list(deps)
        if self.local_ctx.size > 1:
            h = [self.local_ring.build(self.local_ctx, f"{tensor_name}@local", flat, bounds, h)]
        if self.cross_ctx is not None and self.cross_ctx.size > 1:
            h = [self.cross.build(self.cross_ctx, tensor_name, flat, bounds, h, **kw)]
        if self.local_ctx.size > 1:
            lt = self.local_ctx.transport

            def share():
                if flat.numel():
                    lt.broadcast(flat.view(torch.uint8), 0)

            h = [self.local_ctx.comm(f"bcast.{tensor_name}@local", share, h)]
        n = self.world_size

        def finish():
            if self.average:
                flat.div_(n)

        return self.local_ctx.compute(f"average.{tensor_name}", finish, h)
