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

from typing import Optional, Sequence, Tuple

import torch

from hipress.engine import Handle
from hipress.sync.base import Strategy, SyncContext, fp32_view, payload_bound


def matrix_shape(shape: Optional[Sequence[int]], numel: int) -> Tuple[int, int]:
    """The 2-D view a low-rank compressor sees: (first dim, rest); 1-D tensors are n×1."""
    if shape is None or len(shape) < 2:
        return (numel, 1)
    return (int(shape[0]), numel // max(1, int(shape[0])))


def sent_raw(comp, numel: int, shape) -> bool:
    """Whether a matrix is summed as it is, in the first round, instead of through its factors: where
    a multi-round compressor's factors would take no fewer bytes than the matrix (PowerSGD's rank-r P
    and Q of a 1-D tensor, n x 1, or of a matrix with few rows or columns). What the PowerSGD paper
    and DDP's PowerSGD hook do with such tensors: the sum is exact, needs no state, and a bucket of
    only such tensors (a bias before a large layer that has a bucket of its own) takes one round
    trip instead of two. Single-round compressors (ACP-SGD) send every matrix through its factor."""
    if comp.rounds < 2:
        return False
    try:
        return comp.max_encoded_bytes(numel, matrix_shape(shape, numel)) >= 4 * numel
    except NotImplementedError:
        return False


def finish_average(comp, payload: torch.Tensor, state, out: torch.Tensor, n: int) -> None:
    """``out`` = the decoded sum ``payload`` divided by ``n``: where the compressor can, the sum's
    factors are divided before the decode (a few floats) instead of the decoded matrix after it (a
    pass over the whole tensor)."""
    scaled = n == 1 or comp.scale_sum(payload, 1.0 / n)
    comp.finish(payload, state, out)
    if not scaled:
        out.div_(n)


class LowRankStrategy(Strategy):
    """``segments`` (keyword of build): the matrices a fused buffer holds, as
    (offset, numel, shape) each. Their payloads of one round travel as one exchange (their
    concatenation) and are summed matrix by matrix: the same sums, bit for bit, as one sync
    per matrix, at one exchange per round per bucket instead of per matrix (as DDP's
    PowerSGD hook batches a bucket's P and Q factors). Without it the buffer is one matrix
    of ``shape``. Matrices sent raw (:func:`sent_raw`) travel together as one block of floats
    at the end of the first round's payload."""

    name = "lowrank"

    def __init__(self, average: bool = True):
        self.average = average

    def build(self, ctx: SyncContext, tensor_name: str, flat: torch.Tensor,
              bounds: Sequence[Tuple[int, int]], deps: Sequence[Handle] = (), shape=None,
              segments: Optional[Sequence[Tuple[int, int, Optional[Sequence[int]]]]] = None, **kw) -> Handle:
        comp, n = ctx.compressor, ctx.size
        if flat.numel() == 0:
            return ctx.compute(f"done.{tensor_name}", lambda: None, deps)
        # Each matrix is whole: low-rank factors of partitions would be a different algorithm.
        segments = [(0, flat.numel(), shape)] if segments is None else [sg for sg in segments if sg[1] > 0]
        if any(off < 0 or off + numel > flat.numel() for off, numel, _ in segments):
            raise ValueError(f"{tensor_name}: segments {segments} do not fit a buffer of {flat.numel()} elements")
        keys = [f"{tensor_name}/lowrank"] if len(segments) == 1 else \
            [f"{tensor_name}/lowrank/{i}" for i in range(len(segments))]
        views = [flat[off:off + numel] for off, numel, _ in segments]
        as_is = [sent_raw(comp, numel, sh) for _, numel, sh in segments]
        raw = [i for i, r in enumerate(as_is) if r]
        low = [i for i, r in enumerate(as_is) if not r]
        states = []  # of the compressed matrices, got by the first round's encode (StateStore.encode_round0)
        # What each rank's round payload may take, from this rank's own knowledge of the matrices:
        # a round carries P or Q, at most the single-process payload (P and Q) of each matrix,
        # and the first round the raw block too.
        seg_bounds = [payload_bound(comp, segments[i][1], segments[i][2]) for i in low]
        round_max = None if any(b is None for b in seg_bounds) else \
            sum(seg_bounds) + 4 * sum(segments[i][1] for i in raw)
        slot = {}
        prev = list(deps)
        for k in range(comp.rounds if low else 1):
            def encode(k=k):
                if k == 0:
                    parts = []
                    for i in low:
                        part, st = ctx.states.encode_round0(keys[i], comp, views[i],
                                                            matrix_shape(segments[i][2], segments[i][1]))
                        parts.append(part)
                        states.append(st)
                else:
                    parts = [comp.encode_round(k, inp, st) for inp, st in zip(slot.pop("sums"), states)]
                if k == 0 and raw:  # a copy: the block must not change while it is sent and summed
                    parts.append(torch.cat([views[i] for i in raw]).view(torch.uint8))
                slot["sizes"] = [p.numel() for p in parts]  # the same on every rank (same shapes)
                slot["mine"] = parts[0] if len(parts) == 1 else torch.cat(parts)

            got = {}  # src -> concatenated payloads of this round

            def combine(k=k, got=got):
                sizes = slot.pop("sizes")
                per_rank = [got.pop(r).split(sizes) for r in range(n)]
                sums = []
                for i in range(len(sizes)):  # rank order: every rank holds bit-identical sums
                    if k == 0 and raw and i == len(sizes) - 1:  # the raw block, summed as floats
                        acc = per_rank[0][i].clone().view(torch.float32)
                        for r in range(1, n):
                            acc += fp32_view(per_rank[r][i])
                        slot["raw"] = acc
                        continue
                    acc = per_rank[0][i].clone()
                    for r in range(1, n):
                        comp.combine(acc, per_rank[r][i], out=acc)
                    sums.append(acc)
                slot["sums"] = sums

            enc = ctx.compute(f"encode.{tensor_name}.r{k}", encode, prev)
            g = ctx.exchange.allgather(f"allgather.{tensor_name}.r{k}", lambda: slot["mine"],
                                       {src: (lambda buf, src=src, got=got: got.__setitem__(src, buf))
                                        for src in range(n)}, [enc], max_bytes=round_max)
            prev = [ctx.compute(f"combine.{tensor_name}.r{k}", combine, [g])]

        def finish():
            for payload, st, i in zip(slot.pop("sums"), states, low):
                finish_average(comp, payload, st, views[i], n if self.average else 1)
            if raw:
                total, at = slot.pop("raw"), 0
                if self.average:
                    total.div_(n)
                for i in raw:
                    views[i].copy_(total[at:at + views[i].numel()])
                    at += views[i].numel()

        return ctx.compute(f"decode.{tensor_name}", finish, prev)
