"""Allgather synchronization (GRACE's form, paper 002 §III): nothing is re-encoded.

For a gradient split into K partitions, on every rank:
  1. encode     (compute) every partition with this rank's state (error feedback,
                momentum, RNG counter); the K payloads are framed into one segment
  2. allgather  (comm)    every rank's segment to every rank, as one bulk exchange
  3. aggregate  (compute) per partition: sum over ranks, in rank order, of the decoded
                payloads (fused decode_add), then divide by N; every rank adds the same
                numbers in the same order, so all end bit-identical
                (``Compressor.aggregate_payloads``; a ported GRACE compressor runs its
                communicator's reduction there, hipress/compression/grace_api.py)
Compressed bytes are decoded exactly once and never averaged or re-encoded, so an
algorithm whose quantizer or selector is not safe on merged partial sums (TBQ's fixed
threshold caps a sum's step per hop; TernGrad's stochastic rounding compounds per hop;
DGC's top-k of a sum) trains as it does alone. The price is traffic: each rank sends its
payload to N-1 peers (a ring sends about 2 payloads' worth per rank), and it receives N-1.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch

from hipress.engine import Handle
from hipress.sync.base import (Strategy, SyncContext, frame, frame_bound, partition_shape, payload_bound,
                               unframe)


class AllgatherStrategy(Strategy):
    name = "allgather"
    frames_partitions = True

    def __init__(self, average: bool = True):
        self.average = average

    def state_spans(self, ctx: SyncContext, tensor_name: str, bounds: Sequence[Tuple[int, int]]):
        return [(f"{tensor_name}/p{i}/worker", s, e) for i, (s, e) in enumerate(bounds) if e > s]

    def build(self, ctx: SyncContext, tensor_name: str, flat: torch.Tensor,
              bounds: Sequence[Tuple[int, int]], deps: Sequence[Handle] = (), segments=None, **kw) -> Handle:
        """``segments``: the tensors of the buffer as (offset, numel, shape); a partition that is whole rows
        of one tensor gives its state that shape (onebit's per-row scales)."""
        n, comp = ctx.size, ctx.compressor
        parts = [(f"{tensor_name}/p{i}", s, e) for i, (s, e) in enumerate(bounds) if e > s]
        if not parts:
            return ctx.compute(f"done.{tensor_name}", lambda: None, deps)
        slot = {"in": {}}

        def encode():
            slot["out"] = frame([ctx.states.encode(f"{key}/worker", comp, flat[s:e], partition_shape(segments, s, e))
                                 for key, s, e in parts])

        def aggregate():
            received = [unframe(slot["in"].pop(src), len(parts)) for src in range(n)]
            for j, (_, s, e) in enumerate(parts):  # the ranks' payloads in rank order
                comp.aggregate_payloads([received[src][j] for src in range(n)], flat[s:e], self.average)

        nbytes = 4 * flat.numel()
        enc = ctx.compute(f"encode.{tensor_name}", encode, deps, nbytes=nbytes)
        g = ctx.exchange.allgather(f"allgather.{tensor_name}", lambda: slot.pop("out"),
                                   {src: (lambda buf, src=src: slot["in"].__setitem__(src, buf)) for src in range(n)},
                                   [enc], max_bytes=frame_bound([payload_bound(comp, e - s) for _, s, e in parts]),
                                   size=frame_bound([comp.encoded_bytes(e - s, partition_shape(segments, s, e))
                                                     for _, s, e in parts]))
        return ctx.compute(f"aggregate.{tensor_name}", aggregate, [g], nbytes=nbytes)
