"""Sequential, single-process oracle for the CaSync strategies.

Given every rank's gradient, it applies the same compressor calls with the same
per-chunk / per-partition state keys as the real strategies, in plain loops with no
engine and no transport, and returns what every rank must end with. Tests compare a
real multi-process run against it ("decode-of-aggregate semantics").
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from hipress.planner.plan import chunk_bounds
from hipress.sync.base import StateStore, partition_shape


def _partitions(grads: Sequence[torch.Tensor], name: str, bounds: Sequence[Tuple[int, int]]):
    """(fp32 flat copies of the gradients, [(state key, start, end)] of the non-empty
    partitions): what every strategy starts from, with the strategies' key names."""
    out = [g.detach().float().clone().view(-1) for g in grads]
    return out, [(f"{name}/p{i}", s, e) for i, (s, e) in enumerate(bounds) if e > s]


def ring(grads: Sequence[torch.Tensor], comp, stores: Sequence[StateStore], name: str,
         bounds: Sequence[Tuple[int, int]], average: bool = True) -> List[torch.Tensor]:
    n = len(grads)
    out, parts = _partitions(grads, name, bounds)
    for key, s, e in parts:
        xs = [o[s:e] for o in out]
        ch = chunk_bounds(e - s, n)

        def encode(r, c, contributions):
            a, b = ch[c]
            enc = comp if contributions == 1 else comp.merged_for(contributions)
            return enc.encode(xs[r][a:b], stores[r].get(f"{key}/c{c}", enc, b - a))

        for step in range(n - 1):
            # Rank r sends chunk (r - step), a sum of step + 1 ranks; rank r + 1 merges it into the same chunk.
            payloads = [encode(r, (r - step) % n, step + 1) for r in range(n)]
            for r in range(n):
                a, b = ch[(r - step) % n]
                comp.decode_add(payloads[r], xs[(r + 1) % n][a:b])
        for r in range(n):
            c = (r + 1) % n
            a, b = ch[c]
            p = encode(r, c, n)
            for q in range(n):
                comp.decode(p, xs[q][a:b])
        if average:
            for x in xs:
                x.div_(n)
    return out


def ps(grads: Sequence[torch.Tensor], comp, stores: Sequence[StateStore], name: str,
       bounds: Sequence[Tuple[int, int]], owners: Sequence[int], average: bool = True,
       segments=None) -> List[torch.Tensor]:
    """owners[i]: aggregator rank of partition i (as the real strategy chose it). segments: the
    buffer's tensors as (offset, numel, shape), as the optimizer gives the strategy (a partition
    of whole rows of one tensor gets that shape: onebit's per-row scales)."""
    n = len(grads)
    out, parts = _partitions(grads, name, bounds)
    for (key, s, e), a in zip(parts, owners):
        acc = torch.zeros(e - s, dtype=torch.float32)
        shape = partition_shape(segments, s, e)
        for r in range(n):
            comp.decode_add(comp.encode(out[r][s:e], stores[r].get(f"{key}/worker", comp, e - s, shape)), acc)
        m = comp.merged_for(n)
        p = m.encode(acc, stores[a].get(f"{key}/aggregator", m, e - s, shape))
        for r in range(n):
            comp.decode(p, out[r][s:e])
            if average:
                out[r][s:e].div_(n)
    return out


def allgather(grads: Sequence[torch.Tensor], comp, stores: Sequence[StateStore], name: str,
              bounds: Sequence[Tuple[int, int]], average: bool = True, segments=None) -> List[torch.Tensor]:
    """Every rank encodes each partition with its own state; every rank sums the decoded
    payloads of all ranks in rank order; nothing is re-encoded. segments: as ps's."""
    n = len(grads)
    out, parts = _partitions(grads, name, bounds)
    for key, s, e in parts:
        shape = partition_shape(segments, s, e)
        payloads = [comp.encode(out[r][s:e], stores[r].get(f"{key}/worker", comp, e - s, shape)) for r in range(n)]
        acc = torch.zeros(e - s, dtype=torch.float32)
        for p in payloads:
            comp.decode_add(p, acc)
        for r in range(n):
            out[r][s:e].copy_(acc)
            if average:
                out[r][s:e].div_(n)
    return out


def lowrank(grads: Sequence[torch.Tensor], comp, stores: Sequence[StateStore], name: str, shape,
            average: bool = True, segments=None) -> List[torch.Tensor]:
    """Multi-round aggregatable compressors: per round every rank encodes, payloads are
    summed in rank order, and the last sum is decoded on every rank. segments: the
    (offset, numel, shape) of each matrix of a fused buffer, each synced on its own
    (default: the whole buffer is one matrix of ``shape``); those sent raw (``sent_raw``) are
    summed as they are."""
    from hipress.sync.lowrank import finish_average, matrix_shape, sent_raw

    n = len(grads)
    out = [g.detach().float().clone().view(-1) for g in grads]
    segments = [(0, out[0].numel(), shape)] if segments is None else segments
    segments = [sg for sg in segments if sg[1] > 0]
    for i, (off, numel, sh) in enumerate(segments):
        parts = [o[off:off + numel] for o in out]
        if sent_raw(comp, numel, sh):
            total = parts[0].clone()
            for p in parts[1:]:
                total += p
            for r in range(n):
                parts[r].copy_(total)
                if average:
                    parts[r].div_(n)
            continue
        key = f"{name}/lowrank" if len(segments) == 1 else f"{name}/lowrank/{i}"
        states = [st.get(key, comp, numel, matrix_shape(sh, numel)) for st in stores]
        total = None
        for k in range(comp.rounds):
            payloads = [comp.encode_round(k, parts[r] if k == 0 else total.clone(), states[r]) for r in range(n)]
            total = payloads[0].clone()
            for p in payloads[1:]:
                comp.combine(total, p, out=total)
        for r in range(n):
            finish_average(comp, total.clone(), states[r], parts[r], n if average else 1)
    return out
