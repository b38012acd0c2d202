"""Compressor states across layouts: what each state's residual stands for, and how a checkpoint
of another layout (another number of ranks: ring chunks and PS's aggregators follow it; other
buckets) hands its residuals to the parameters they belong to.

Both front ends use it: the optimizer (hipress/torch/optimizer.py) and the DDP hook
(hipress/torch/ddp.py). A checkpoint holds ``state_owners`` (key -> [[parameter name, offset in
the parameter, offset in the state's buffer, elements], ...]) and ``state_ranks``; a loader of
another layout turns every error-feedback residual into a per-parameter carry, added to that
parameter's next gradient on the loading rank. Each residual is a part of the sum over ranks at
whatever site of the sync it waited (a ring hop's partial sum, a PS aggregator's sum), so the next
step's sum carries exactly what the old states held.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

Owners = Dict[str, List[List]]


def owners_of(spans: Sequence[Tuple[str, int, int]], params: Sequence[Tuple[str, torch.Tensor]],
              offsets: Sequence[int]) -> Owners:
    """One bucket's owners: ``spans`` are its sync's ``state_spans`` (key, start, end in the
    bucket), ``params`` and ``offsets`` its (name, parameter) pairs and where each starts."""
    return {key: [[n, lo - off, lo - s, hi - lo] for (n, p), off in zip(params, offsets)
                  if (lo := max(s, off)) < (hi := min(e, off + p.numel()))]
            for key, s, e in spans}


def take_residuals(states, spans: Sequence[Tuple[str, int, int]], params: Sequence[Tuple[str, torch.Tensor]],
                   offsets: Sequence[int]) -> Dict[str, torch.Tensor]:
    """Removes the states of one bucket's ``spans`` from ``states`` (a StateStore) and returns
    their residuals summed per parameter (flat fp32 tensors of each parameter's size): what a
    rebuilt layout hands back to the gradients. Other per-element state goes with its state."""
    sizes = {n: p.numel() for n, p in params}
    out: Dict[str, torch.Tensor] = {}
    for key, pieces in owners_of(spans, params, offsets).items():
        bufs = states.take(key)
        if bufs and "residual" in bufs:
            _add_pieces(out, bufs["residual"], pieces, sizes)
    return out


def _add_pieces(out: Dict[str, torch.Tensor], residual: torch.Tensor, pieces: List[List],
                sizes: Dict[str, int]) -> None:
    """Adds a residual's pieces ([name, offset in the parameter, offset in the residual, elements])
    to ``out``'s per-parameter sums (flat fp32, of ``sizes``)."""
    res = residual.reshape(-1)
    for name, at, start, count in pieces:
        acc = out.setdefault(name, torch.zeros(sizes[name], dtype=torch.float32))
        acc[at:at + count] += res[start:start + count].to(torch.float32)


def unmovable_buffers(compressor) -> List[str]:
    """The compressor's per-element state other than error-feedback residuals (DGC's and Signum's
    momentum): no other layout has a home for it."""
    return sorted({b for c in (compressor, compressor.merged_for(2)) for b in c.new_state(8).buffers} - {"residual"})


def same_layout(saved: dict, owners: Owners, ranks, my_owners: Owners, my_ranks: int) -> bool:
    """Whether the saved states belong to this layout (every saved key stands for what it stands
    for here, among as many ranks)."""
    return ranks == my_ranks and all(my_owners.get(k) == owners.get(k) for k in saved)


def residuals_by_parameter(saved: dict, owners: Owners, numels: Optional[Dict[str, int]], unmovable: List[str]
                           ) -> Dict[str, torch.Tensor]:
    """The saved states' residuals, summed per parameter (flat fp32 tensors of each parameter's
    size; where ``numels`` is None, of the extent the owners cover, which the caller checks against
    the parameter once it knows it). Raises ValueError where the states hold what cannot move
    (``unmovable``), or name a key or a parameter the owners or this job lack."""
    if unmovable and saved:
        raise ValueError(f"the checkpoint's compressor states belong to another layout (another number of "
                         f"ranks, or other buckets) and hold {unmovable}, which only their own layout can use: "
                         f"resume with the number of ranks and bucket options it was saved with")
    if numels is None:
        numels = {}
        for pieces in owners.values():
            for name, at, _, count in pieces:
                numels[name] = max(numels.get(name, 0), at + count)
    carry: Dict[str, torch.Tensor] = {}
    for key, st in saved.items():
        res = st["buffers"].get("residual")
        if res is None:
            continue
        if key not in owners:
            raise ValueError(f"the checkpoint's compressor state {key!r} has no owner in its state_owners")
        unknown = [name for name, *_ in owners[key] if name not in numels]
        if unknown:
            raise ValueError(f"the checkpoint's compressor states name a parameter this job lacks: {unknown[0]!r}")
        _add_pieces(carry, res, owners[key], numels)
    return carry


def moved_warning(count: int) -> str:
    return (f"hipress: the checkpoint's compressor states belong to another layout (another number of ranks, "
            f"or other buckets): their error-feedback residuals ({count} parameter(s)) go into this rank's next "
            f"gradients, and the states start afresh")
