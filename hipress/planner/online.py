"""Profiling inside a running job, so that every rank ends with the same profile.

    prof = profile_online(compressor, transport, strategy="ring")     # collective

Steps (every rank calls it at the same point, e.g. when DistributedOptimizer is built):
  1. rank 0 looks for a cached profile for (N, strategy, device, algorithm) and tells
     everyone whether it found one (one broadcast)
  2. if found, every rank times a 1 MB transfer (as in 3); if rank 0's time is off the cached
     T_send curve by more than 2x either way, the link has changed (another network,
     other tc settings: the cache key cannot see them) and the profile is re-measured
  3. if not: every rank measures T_send(m) the way the strategy sends (a collective
     ladder, so ranks stay in step; comm-queue tasks, byte count then payload): ring
     steps for CaSync-Ring, bulk all-to-all exchanges per peer for CaSync-PS; and T_enc/T_dec of the compressor and of the
     uncompressed path's copy/merge operators as compute-queue tasks (so the per-task
     hand-off CaSync pays is in the curves), all ranks at once (a barrier before each
     call: they share the host's cores and memory as in a sync); rank 0 fits the curves and saves them
  4. rank 0 broadcasts the profile JSON; every rank builds its cost model from it, so
     plans are identical on all ranks (local timings differ a little between ranks)
"""
from __future__ import annotations

import json
import statistics
import time
import warnings
from typing import Optional, Sequence

import torch

from hipress.compression.none import NoneCompressor
from hipress.planner.cost_model import RING_STRATEGIES
from hipress.planner.profile import (DEFAULT_LADDER, Profile, load_profile, profile_compressor, profile_path,
                                     save_profile)

PLANNER_STRATEGY = {"ring": "casync_ring", "ps": "casync_ps"}
TASK_TIMEOUT_S = 600
PROBE_BYTES, PROBE_REPEATS, PROBE_NOISE_S = 1 << 20, 3, 0.5e-3


def _broadcast_bytes(transport, data: Optional[bytes]) -> bytes:
    n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    transport.broadcast(n.view(torch.uint8), 0)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if transport.rank == 0 and data \
        else torch.empty(int(n[0]), dtype=torch.uint8)
    if buf.numel():
        transport.broadcast(buf, 0)
    return bytes(buf.numpy().tobytes())


def transfer_once(transport, strategy: str, engine=None):
    """send_once(nbytes) -> seconds of one transfer of nbytes as the strategy moves data: a
    comm-queue task of the engine sending a byte count and then the payload.

    casync_ring: one ring step (send to the next rank while receiving from the previous).
    casync_ps: one bulk exchange in which every rank sends nbytes to every other rank,
    divided by the N-1 peers: the time of one transfer under CaSync-PS's all-to-all
    traffic (several flows share a host's link, which is slower than one ring flow);
    equation 1's alpha = 2(N-1) transfers then add up to CaSync-PS's two bulk exchanges.
    """
    from hipress.engine import get_engine
    from hipress.sync.base import direct_exchange

    engine = engine or get_engine()
    r, n = transport.rank, transport.size
    ring = strategy in RING_STRATEGIES
    peers = [(r + 1) % n] if ring else [j for j in range(n) if j != r]
    sources = {(r - 1) % n} if ring else set(peers)
    cache = {}

    def send_once(nbytes: int) -> float:
        if nbytes not in cache:
            cache.clear()
            cache[nbytes] = torch.zeros(nbytes, dtype=torch.uint8)
        out = cache[nbytes]
        transport.barrier()
        t0 = time.perf_counter()
        engine.submit("profile.send", lambda: direct_exchange(transport, {j: out for j in peers}, sources, not ring),
                      queue="comm").result(TASK_TIMEOUT_S)
        return (time.perf_counter() - t0) / max(1, len(peers))

    return send_once


def run_as_task(engine=None):
    """run(fn) for measure_codec: fn as a compute-queue task, waited for."""
    from hipress.engine import get_engine

    engine = engine or get_engine()
    return lambda fn: engine.submit("profile.codec", fn, queue="compute").result(TASK_TIMEOUT_S)


def _link_changed(transport, cached: Optional[Profile], send_once) -> bool:
    """Collective. True on every rank when rank 0's 1 MB transfer is off the cached curve by > 2x."""
    times = [send_once(PROBE_BYTES) for _ in range(PROBE_REPEATS + 1)][1:]
    verdict = b""
    if transport.rank == 0:
        t, want = statistics.median(times), cached.send(PROBE_BYTES)
        # off by more than 2x either way, and by more than timer and scheduling noise
        if abs(t - want) > max(max(t, want) / 2, PROBE_NOISE_S):
            warnings.warn(f"hipress planner: cached profile predicts {want * 1e3:.2f} ms for a 1 MB transfer, "
                          f"measured {t * 1e3:.2f} ms: the link changed, re-profiling")
            verdict = b"1"
    return bool(_broadcast_bytes(transport, verdict))


def profile_online(compressor, transport, strategy: str, *, device: str = "cpu", cache_dir=None,
                   refresh: bool = False, sizes: Sequence[int] = DEFAULT_LADDER, repeats: int = 3,
                   engine=None) -> Profile:
    """Collective: returns the same Profile on every rank (see module docstring).
    engine: whose queues run the timed operators (default: the process-wide engine)."""
    pstrat = PLANNER_STRATEGY.get(strategy, strategy)
    n = transport.size
    path = profile_path(n, pstrat, device, compressor.name, cache_dir)
    cached = None
    if transport.rank == 0 and path.exists() and not refresh:
        cached = load_profile(path, n=n, strategy=pstrat, device=device, algorithm=compressor.name)
    send_once = transfer_once(transport, pstrat, engine)
    have = _broadcast_bytes(transport, b"1" if cached is not None else b"")
    if have and _link_changed(transport, cached, send_once):
        have, cached = b"", None
    if not have:
        prof = profile_compressor(compressor, send_once, n=n, strategy=pstrat, device=device,
                                  sizes=sizes, repeats=repeats, plain=NoneCompressor(), run=run_as_task(engine),
                                  before=transport.barrier)
        if transport.rank == 0:
            save_profile(prof, path)
            cached = prof
    text = _broadcast_bytes(transport, json.dumps(cached.to_dict()).encode() if transport.rank == 0 else None)
    return Profile.from_dict(json.loads(text.decode()), f"rank 0's profile {path}")
