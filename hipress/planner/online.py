"""Profiling inside a running job, so that every rank ends with the same profile.

    prof = profile_online(compressor, transport, strategy="ring")     # collective

Steps (every rank calls it at the same point, e.g. when DistributedOptimizer is built):
  1. rank 0 looks for a cached profile for (N, strategy, device, algorithm) and tells
     everyone whether it found one (one broadcast)
  2. if not: every rank measures T_send(m) with ring sendrecv steps of m bytes (a
     collective ladder, so ranks stay in step) and T_enc/T_dec of the compressor;
     rank 0 fits the curves and saves the profile to the cache
  3. rank 0 broadcasts the profile JSON; every rank builds its cost model from it, so
     plans are identical on all ranks (local timings differ a little between ranks)
"""
from __future__ import annotations

import json
import time
from typing import Optional, Sequence

import torch

from hipress.planner.profile import (DEFAULT_LADDER, Profile, load_profile, profile_compressor, profile_path,
                                     save_profile)

PLANNER_STRATEGY = {"ring": "ring", "ps": "ps_colocated"}


def _broadcast_bytes(transport, data: Optional[bytes]) -> bytes:
    n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    transport.broadcast(n.view(torch.uint8), 0)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if transport.rank == 0 and data \
        else torch.empty(int(n[0]), dtype=torch.uint8)
    if buf.numel():
        transport.broadcast(buf, 0)
    return bytes(buf.numpy().tobytes())


def ring_send_once(transport):
    """send_once(nbytes) -> seconds of one ring step (send to next, receive from previous)."""
    cache = {}

    def send_once(nbytes: int) -> float:
        if nbytes not in cache:
            cache.clear()
            cache[nbytes] = (torch.zeros(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8))
        out, inp = cache[nbytes]
        r, n = transport.rank, transport.size
        transport.barrier()
        t0 = time.perf_counter()
        transport.sendrecv(out, (r + 1) % n, inp, (r - 1) % n)
        return time.perf_counter() - t0

    return send_once


def profile_online(compressor, transport, strategy: str, *, device: str = "cpu", cache_dir=None,
                   refresh: bool = False, sizes: Sequence[int] = DEFAULT_LADDER, repeats: int = 3) -> Profile:
    """Collective: returns the same Profile on every rank (see module docstring)."""
    pstrat = PLANNER_STRATEGY.get(strategy, strategy)
    n = transport.size
    path = profile_path(n, pstrat, device, compressor.name, cache_dir)
    cached = None
    if transport.rank == 0 and path.exists() and not refresh:
        cached = load_profile(path, n=n, strategy=pstrat, device=device, algorithm=compressor.name)
    have = _broadcast_bytes(transport, b"1" if cached is not None else b"")
    if not have:
        prof = profile_compressor(compressor, ring_send_once(transport), n=n, strategy=pstrat, device=device,
                                  sizes=sizes, repeats=repeats)
        if transport.rank == 0:
            save_profile(prof, path)
            cached = prof
    text = _broadcast_bytes(transport, json.dumps(cached.to_dict()).encode() if transport.rank == 0 else None)
    return Profile.from_dict(json.loads(text.decode()), f"rank 0's profile {path}")
