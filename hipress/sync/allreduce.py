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
With ``into`` (the optimizer's fused gradients, each with its offset in ``flat``), step 2 writes
sum / N straight into them, one pass, where an average in ``flat`` and a copy back would be two;
``flat`` then holds the sum where it was sent itself, or is left as it was (cast to bf16 first).
With ``wire=torch.bfloat16`` (a plan's choice where it pays: half the bytes) a ``flat`` already
in bf16 (the optimizer's buckets of fp32 gradients, cast as they are copied in: _Bucket.send_bf16)
is sent as it is, and any other is cast to bf16 by a task before step 1; step 2 copies the bf16
sum back (then divides, in fp32). bf16 rather than fp16 because it has fp32's exponent range: a gradient
neither overflows to inf nor underflows to zero on the way, whatever its scale (DDP's fp16 hook
can do both), at 8 bits of mantissa (relative rounding 2^-9 per add).
``agree_on`` / ``sizes_agreed`` (the optimizer's): the step's first allreduce compares a digest
of the bucket layout in its checking round, and the step's later ones skip that round (a round
trip at the tail of the step, where the last bucket waits for it).
Partitions do not matter here: the bucket's contiguous partitions are one collective (K only
pipelines compute against communication, and there is no compute to pipeline). The sum's
order is the backend's, so it may differ from a rank-order sum in the last bit, but every
rank ends with the same bits.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from hipress import _C
from hipress.compression.base import is_f32_flat
from hipress.engine import Handle
from hipress.planner.plan import chunk_bounds
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
    writes_into = True

    def __init__(self, average: bool = True, wire: torch.dtype = torch.float32):
        self.average = average
        self.wire = wire
        # Scratch kept from step to step (a bucket's bf16 copy; dear's receive buffer where it is
        # large, below). A step's tasks on a gradient finish before its next sync.
        self._scratch: Dict[str, torch.Tensor] = {}

    # glibc's malloc maps a block this large (M_MMAP_THRESHOLD's ceiling on 64-bit) afresh on every
    # call, so its pages fault in again each step: on VGG19-like (a 32 MB gradient) that cost dear
    # 5-9% of its step. Smaller blocks come back from the heap, still in cache; keeping those
    # measured no faster (ResNet50-like), so they stay temporary.
    MMAP_BYTES = 32 << 20

    def _buffer(self, name: str, numel: int, dtype: torch.dtype, always: bool = True) -> torch.Tensor:
        if not always and numel * dtype.itemsize < self.MMAP_BYTES:
            return torch.empty(numel, dtype=dtype)
        buf = self._scratch.get(name)
        if buf is None or buf.numel() != numel or buf.dtype != dtype:
            buf = self._scratch[name] = torch.empty(numel, dtype=dtype)
        return buf

    def state_spans(self, ctx: SyncContext, tensor_name: str, bounds: Sequence[Tuple[int, int]]):
        return []  # nothing is encoded: no compressor state

    def build(self, ctx: SyncContext, tensor_name: str, flat: torch.Tensor,
              bounds: Sequence[Tuple[int, int]], deps: Sequence[Handle] = (),
              into: Optional[Sequence[Tuple[int, torch.Tensor]]] = None, sizes_agreed: bool = False,
              agree_on: Optional[int] = None, **kw) -> Handle:
        """``into``: (offset in ``flat``, tensor) pairs that tile all of ``flat``; the result goes
        there instead of into ``flat``. ``agree_on``, ``sizes_agreed``: for the transport's check
        (see the module docstring); a later partition of this gradient skips it either way."""
        spans = contiguous_spans(bounds)
        if not spans:
            return ctx.compute(f"done.{tensor_name}", lambda: None, list(deps))
        if into is not None and (spans != [(0, flat.numel())] or sum(t.numel() for _, t in into) != flat.numel()
                                 or any(off < 0 or off + t.numel() > flat.numel() for off, t in into)):
            raise ValueError(f"{tensor_name}: 'into' must tile the whole gradient, which must be sent whole "
                             f"(partitions {spans[:4]} of {flat.numel()} elements)")
        if into is not None and not all(is_f32_flat(t) for _, t in into):
            raise ValueError(f"{tensor_name}: 'into' takes contiguous fp32 CPU tensors")
        nbytes = 4 * sum(e - s for s, e in spans)
        cast = flat.dtype != self.wire
        if cast:
            buf = self._buffer(f"wire.{tensor_name}", sum(e - s for s, e in spans), self.wire)
            views, at = [], 0
            for s, e in spans:
                views.append((flat[s:e], buf[at:at + e - s]))
                at += e - s

            def to_wire():
                for src, dst in views:
                    dst.copy_(src)

            deps = [ctx.compute(f"cast.{tensor_name}", to_wire, list(deps), nbytes=nbytes)]
            sent = [w for _, w in views]
        else:
            sent = [flat[s:e] for s, e in spans]
        sums = [ctx.exchange.allreduce(f"allreduce.{tensor_name}" + (f"/s{i}" if len(spans) > 1 else ""), t, deps,
                                       sizes_agreed=sizes_agreed or (i > 0 and agree_on is not None),
                                       agree_on=agree_on if i == 0 else None)
                for i, t in enumerate(sent)]
        if not self.average and not cast and len(sums) == 1 and into is None:
            return sums[0]
        n = ctx.size
        if into is not None:  # one span, all of flat: sent[0] holds the sum; one native pass, no GIL
            work = _C.native_scatter_divided(sent[0].data_ptr(), sent[0].dtype == torch.bfloat16,
                                             float(n) if self.average else 1.0,
                                             [(off, dst.data_ptr(), dst.numel()) for off, dst in into])
            return ctx.compute(f"average.{tensor_name}", work, sums, nbytes=nbytes, keep=(sent, into))

        def finish():
            for (s, e), t in zip(spans, sent):
                if cast:
                    flat[s:e].copy_(t)
                if self.average:
                    flat[s:e].div_(n)

        return ctx.compute(f"average.{tensor_name}", finish, sums, nbytes=nbytes)

    # The two phases apart (strategy "dear": the reduce-scatter in backward, the all-gather before
    # the next forward), each one native collective per contiguous span: chunk j of the span
    # belongs to rank j (chunk_bounds), as the pair below agrees; not the ring's 2(N-1) steps.
    # ``agree_on`` / ``sizes_agreed``: the checking rounds, as build's (the optimizer compares the
    # layout at the step's first reduce-scatter; the rest of the step's phases skip their rounds).
    def reduce_scatter(self, ctx: SyncContext, tensor_name: str, flat: torch.Tensor,
                       bounds: Sequence[Tuple[int, int]], deps: Sequence[Handle] = (), sizes_agreed: bool = False,
                       agree_on: Optional[int] = None) -> Handle:
        """One alltoallv sends chunk j of each span to rank j; this rank sums the n chunks it got
        (in rank order) into its own chunk and averages it there (op=Average): the owner's
        chunk is final, and the all-gather only moves it."""
        return self._each_span(ctx, tensor_name, flat, bounds, deps, self._reduce_scatter, sizes_agreed, agree_on)

    def all_gather(self, ctx: SyncContext, tensor_name: str, flat: torch.Tensor,
                   bounds: Sequence[Tuple[int, int]], deps: Sequence[Handle] = (),
                   sizes_agreed: bool = False) -> Handle:
        """One allgatherv of the owners' chunks of each span: afterwards every rank's ``flat``
        holds the owners' bits, the same on every rank."""
        return self._each_span(ctx, tensor_name, flat, bounds, deps, self._all_gather, sizes_agreed, None)

    def _each_span(self, ctx, tensor_name, flat, bounds, deps, phase, sizes_agreed, agree_on) -> Handle:
        if ctx.size == 1:
            return ctx.compute(f"done.{tensor_name}", lambda: None, list(deps))

        def check(i):  # the first span's round compares agree_on; the later spans' sizes follow from it
            if agree_on is None:
                return {"sizes_agreed": sizes_agreed}
            return {"sizes_agreed": sizes_agreed, "agree_on": agree_on} if i == 0 else {"sizes_agreed": True}

        return self._each_range(ctx, tensor_name, flat, contiguous_spans(bounds), deps, phase, "s", check)

    @staticmethod
    def _chunks(ctx, x: torch.Tensor):
        cb = chunk_bounds(x.numel(), ctx.size)
        return cb, [4 * (e - s) for s, e in cb]

    def _reduce_scatter(self, ctx, key, x, deps, sizes_agreed: bool = False, agree_on: Optional[int] = None) -> Handle:
        n, r = ctx.size, ctx.rank
        cb, counts = self._chunks(ctx, x)
        mine = x[cb[r][0]:cb[r][1]]
        got = self._buffer(f"recv.{key}", n * mine.numel(), torch.float32, always=False)
        moved = ctx.exchange.alltoallv(f"alltoallv.{key}", x.view(torch.uint8), counts, got.view(torch.uint8),
                                       [counts[r]] * n, deps, sizes_agreed, agree_on)

        def reduce():
            torch.sum(got.view(n, -1), 0, out=mine)
            if self.average:
                mine.div_(n)

        return ctx.compute(f"reduce.{key}", reduce, [moved], nbytes=4 * got.numel())

    def _all_gather(self, ctx, key, x, deps, sizes_agreed: bool = False) -> Handle:
        r = ctx.rank
        cb, counts = self._chunks(ctx, x)
        mine = x[cb[r][0]:cb[r][1]]  # sent from where it lies: the transport skips copying it onto itself
        return ctx.exchange.allgatherv(f"allgatherv.{key}", mine.view(torch.uint8), x.view(torch.uint8), counts,
                                       list(deps), sizes_agreed=sizes_agreed)
