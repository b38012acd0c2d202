"""Synchronization of aggregatable multi-round compressors (low-rank: PowerSGD).

Paper 000 Table 3 / §5.3: for low-rank algorithms both CaSync strategies do one
encode per round, sum in compressed form, and one decode. Per round on every rank:
  1. encode_round(k)   (compute) round 0 from the gradient, round k>0 from the sum of
                       round k-1
  2. allgather         (comm)    every rank's payload of this round, as one bulk exchange
  3. combine           (compute) sum of the N payloads in rank order, so every rank
                       holds bit-identical sums
then finish(sum of last round) decodes into the gradient and divides by N. Payloads
are small (rank × (rows + cols) floats), so gathering them all costs little next to
the dense gradient it replaces.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch

from hipress.engine import Handle
from hipress.sync.base import Strategy, SyncContext


def matrix_shape(shape: Optional[Sequence[int]], numel: int) -> Tuple[int, int]:
    """The 2-D view a low-rank compressor sees: (first dim, rest); 1-D tensors are n×1."""
    if shape is None or len(shape) < 2:
        return (numel, 1)
    return (int(shape[0]), numel // max(1, int(shape[0])))


class LowRankStrategy(Strategy):
    name = "lowrank"

    def __init__(self, average: bool = True):
        self.average = average

    def build(self, ctx: SyncContext, tensor_name: str, flat: torch.Tensor,
              bounds: Sequence[Tuple[int, int]], deps: Sequence[Handle] = (), shape=None, **kw) -> Handle:
        comp, n = ctx.compressor, ctx.size
        numel = flat.numel()
        if numel == 0:
            return ctx.compute(f"done.{tensor_name}", lambda: None, deps)
        # The whole tensor is one matrix: low-rank factors of partitions would be a different algorithm.
        rows_cols = matrix_shape(shape, numel)
        state = ctx.states.get(f"{tensor_name}/lowrank", comp, numel, rows_cols)
        slot = {}
        prev = list(deps)
        for k in range(comp.rounds):
            def encode(k=k):
                inp = flat if k == 0 else slot.pop("sum")
                slot["mine"] = comp.encode_round(k, inp, state)

            got = {}  # src -> payload of this round

            def combine(got=got):
                parts = [got.pop(r) for r in range(n)]
                acc = parts[0].clone()
                for p in parts[1:]:
                    comp.combine(acc, p, out=acc)
                slot["sum"] = acc

            enc = ctx.compute(f"encode.{tensor_name}.r{k}", encode, prev)
            g = ctx.exchange(f"allgather.{tensor_name}.r{k}", {dst: (lambda: slot["mine"]) for dst in range(n)},
                             {src: (lambda buf, src=src, got=got: got.__setitem__(src, buf)) for src in range(n)},
                             [enc])
            prev = [ctx.compute(f"combine.{tensor_name}.r{k}", combine, [g])]

        def finish():
            comp.finish(slot.pop("sum"), state, flat)
            if self.average:
                flat.div_(n)

        return ctx.compute(f"decode.{tensor_name}", finish, prev)
