"""Uncompressed gradients through the backend's own allreduce (issue 21: compression never a loss).

Where a gradient is not compressed (``compression="none"``, or the planner's choice for it),
there is nothing for hipress to encode, merge or decode, so its ring would only move fp32
chunks in 2(N-1) Python-driven sendrecv steps. The backend's allreduce (gloo or NCCL through
torch.distributed, MPI_Allreduce, Horovod's) does the same sum in one native collective.
For one gradient (or fused bucket) on every rank:
  1. allreduce  (comm)    the bucket in place, one collective on the exchange, so it keeps its
                place in the rank's one order of communication (the chain shared with
                compressed gradients) and overlaps backward like any comm task
  2. average    (compute) divide by N (op=Average); with op=Sum the allreduce is the last task
Partitions do not matter here: the bucket's contiguous partitions are one collective (K only
pipelines compute against communication, and there is no compute to pipeline). The sum's
order is the backend's, so it may differ from a rank-order sum in the last bit, but every
rank ends with the same bits.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from hipress.engine import Handle
from hipress.sync.base import Strategy, SyncContext


def contiguous_spans(bounds: Sequence[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """The non-empty partitions, with those that touch merged into one (start, end) each."""
    spans: List[Tuple[int, int]] = []
    for s, e in bounds:
        if e <= s:
            continue
        if spans and spans[-1][1] == s:
            spans[-1] = (spans[-1][0], e)
        else:
            spans.append((s, e))
    return spans


class AllreduceStrategy(Strategy):
    name = "allreduce"

    def __init__(self, average: bool = True):
        self.average = average

    def build(self, ctx: SyncContext, tensor_name: str, flat: torch.Tensor,
              bounds: Sequence[Tuple[int, int]], deps: Sequence[Handle] = (), **kw) -> Handle:
        spans = contiguous_spans(bounds)
        if not spans:
            return ctx.compute(f"done.{tensor_name}", lambda: None, list(deps))
        sums = [ctx.exchange.allreduce(f"allreduce.{tensor_name}" + (f"/s{i}" if len(spans) > 1 else ""),
                                       flat[s:e], deps)
                for i, (s, e) in enumerate(spans)]
        if not self.average and len(sums) == 1:
            return sums[0]
        n = ctx.size

        def finish():
            if self.average:
                for s, e in spans:
                    flat[s:e].div_(n)

        return ctx.compute(f"average.{tensor_name}", finish, sums, nbytes=4 * sum(e - s for s, e in spans))
