"""Synchronization of parameters tied between the first and the last stage (a language model's
input embedding and output head), unfused or fused (Optimus-CC §6).

Unfused (Megatron-LM's way): each copy's gradient is all-reduced over its stage's D
data-parallel ranks, then the two sums are added over each replica's first/last pair:
V(3D-2)/D bytes per rank (eq. 15). Fused: one all-reduce over the 2D ranks holding either copy:
V(2D-1)/D (eq. 16). Both divide by D afterwards (the average over replicas).

Both use :func:`ordered_allreduce`, whose sum of n values is the same binary tree for any
chunking: values split at their midpoint, each half summed the same way, the two halves added.
The fused group lists the first stage's ranks and then the last stage's, so its tree is
(tree of the first-stage copies) + (tree of the last-stage copies), exactly what the unfused
path adds: the two are bit-identical, not only equal in exact arithmetic.
"""
from __future__ import annotations

from typing import List, Sequence

import torch
import torch.distributed as dist

#: p2p tag of the tied-parameter sync (the schedule's own messages use others)
TAG = 7


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def tree_sum(values: Sequence[torch.Tensor]) -> torch.Tensor:
    """The midpoint tree's sum of ``values`` (see the module docstring)."""
    if len(values) == 1:
        return values[0].clone()
    mid = (len(values) + 1) // 2
    return tree_sum(values[:mid]) + tree_sum(values[mid:])


def ordered_allreduce(flat: torch.Tensor, ranks: List[int]) -> torch.Tensor:
    """Sums the 1-D fp32 ``flat`` in place over ``ranks`` (global ranks of torch.distributed's
    default group, this rank among them), by the midpoint tree.

    A power-of-two group runs recursive halving (reduce-scatter, partner distance 1, 2, 4, ...:
    the lowest level of the tree first) and then recursive doubling (all-gather): each rank
    sends 2V(n-1)/n bytes, a ring's cost. Other sizes gather every copy (V(n-1) bytes) and sum
    locally: the same tree, at more traffic."""
    me = dist.get_rank()
    n = len(ranks)
    if me not in ranks:
        raise ValueError(f"rank {me} is not in the all-reduce group {ranks}")
    if n == 1:
        return flat
    pos = ranks.index(me)
    if not _is_power_of_two(n):
        got = [flat if r == me else torch.empty_like(flat) for r in ranks]
        works = [dist.isend(flat, r, tag=TAG) for r in ranks if r != me]
        for r, t in zip(ranks, got):
            if r != me:
                dist.recv(t, r, tag=TAG)
        for w in works:
            w.wait()
        flat.copy_(tree_sum(got))
        return flat
    bounds = [len(c) for c in torch.arange(flat.numel()).tensor_split(n)]
    starts = [sum(bounds[:i]) for i in range(n + 1)]

    def span(lo: int, hi: int) -> torch.Tensor:  # chunks [lo, hi) of flat
        return flat[starts[lo]:starts[hi]]

    lo, hi, ranges = 0, n, []
    dist_ = 1
    while dist_ < n:  # reduce-scatter: keep the half my bit of dist_ names
        partner = ranks[pos ^ dist_]
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if pos & dist_ == 0 else ((mid, hi), (lo, mid))
        incoming = torch.empty_like(span(*keep))
        w = dist.isend(span(*give).clone(), partner, tag=TAG)
        dist.recv(incoming, partner, tag=TAG)
        w.wait()
        span(*keep).add_(incoming)
        ranges.append((lo, hi))
        lo, hi = keep
        dist_ *= 2
    while dist_ > 1:  # all-gather: the reverse, each step doubling what I hold
        dist_ //= 2
        partner = ranks[pos ^ dist_]
        plo, phi = ranges.pop()
        mid = (plo + phi) // 2
        other = (mid, phi) if (lo, hi) == (plo, mid) else (plo, mid)
        w = dist.isend(span(lo, hi).clone(), partner, tag=TAG)
        dist.recv(span(*other), partner, tag=TAG)
        w.wait()
        lo, hi = plo, phi
    return flat


def sync_tied_gradients(grads: List[torch.Tensor], layout, stage: int, replica: int, fused: bool) -> List[List[int]]:
    """Replaces each tied gradient (this rank's copy; first or last stage) by the average over the
    replicas of the sum of both copies' gradients. Returns the groups it all-reduced over, in order."""
    if not grads:
        return []
    flat = torch.cat([g.reshape(-1).to(torch.float32) for g in grads])
    groups = ([layout.tied_group()] if fused
              else [layout.dp_group(stage), [layout.rank(0, replica), layout.rank(layout.pp - 1, replica)]])
    for group in groups:
        ordered_allreduce(flat, group)
    flat.div_(layout.dp)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    return groups
