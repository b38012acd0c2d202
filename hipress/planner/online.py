"""Profiling inside a running job, so that every rank ends with the same profile.

    prof = profile_online(compressor, transport, strategy="ring")     # collective

Steps (every rank calls it at the same point, e.g. when DistributedOptimizer is built):
  1. rank 0 looks for a cached profile for (N, strategy, device, algorithm) and tells
     everyone whether it found one (one broadcast)
  2. if found, every rank times a 1 MB transfer (as in 3); if rank 0's time is off the cached
     T_send curve by more than 2x either way in two rounds in a row, the link has changed
     (another network, other tc settings: the cache key cannot see them) and the profile
     is re-measured
  3. if not: every rank measures T_send(m) the way the strategy sends (a collective
     ladder, so ranks stay in step; comm-queue tasks, byte count then payload): ring
     steps for CaSync-Ring, bulk all-to-all exchanges per peer for CaSync-PS and allgather
     (and, for PS, the same exchanges with a single aggregator, whose fewer messages cost
     less); the backend's allreduce, which uncompressed buckets go through; T_enc/T_dec
     of the compressor and of the uncompressed path's copy/merge operators, all ranks at
     once (a barrier before each call: they share the host's cores and memory as in a
     sync); and the hand-off of an empty compute task. Every sample is the slowest
     rank's time (an exchange waits for the slowest rank). Rank 0 fits the curves and
     saves them
  4. rank 0 broadcasts the profile JSON; every rank builds its cost model from it, so
     plans are identical on all ranks (local timings differ a little between ranks)
"""
from __future__ import annotations

import functools
import json
import statistics
import time
import warnings
from typing import Optional, Sequence

import torch

from hipress.compression.none import NoneCompressor
from hipress.planner.cost_model import EXECUTED_STRATEGIES
from hipress.planner.profile import (DEFAULT_LADDER, Profile, StaleProfileError, load_profile, profile_compressor,
                                     profile_path, save_profile)

TASK_TIMEOUT_S = 600
PROBE_BYTES, PROBE_REPEATS, PROBE_NOISE_S = 1 << 20, 3, 0.5e-3
CHAIN_BYTES = 1 << 20


def _broadcast_bytes(transport, data: Optional[bytes]) -> bytes:
    n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    transport.broadcast(n.view(torch.uint8), 0)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if transport.rank == 0 and data \
        else torch.empty(int(n[0]), dtype=torch.uint8)
    if buf.numel():
        transport.broadcast(buf, 0)
    return bytes(buf.numpy().tobytes())


def slowest(transport):
    """Collective reduce(seconds) -> the largest of every rank's seconds."""
    def reduce(t: float) -> float:
        every = torch.empty(transport.size, dtype=torch.float64)
        transport.allgather(torch.tensor([float(t)], dtype=torch.float64).view(torch.uint8), every.view(torch.uint8))
        return float(every.max())

    return reduce


def transfer_once(transport, strategy: str, engine=None, aggregators: Optional[int] = None):
    """send_once(nbytes) -> seconds of one transfer of nbytes as the strategy moves data: a
    comm-queue task of the engine sending a byte count and then the payload.

    ring: one ring step (send to the next rank while receiving from the previous).
    ps: CaSync-PS's two bulk exchanges with ``aggregators`` = A aggregator ranks
    (default N): a gather (every rank sends nbytes to every aggregator) and a broadcast
    (every aggregator sends nbytes to every rank), divided by 2(N-1): an aggregator's link
    carries (N-1) nbytes each way per exchange whatever A is, so this is the time of one
    transfer under that traffic (several flows share a host's link, slower than one ring
    flow, and fewer aggregators post fewer messages); equation 1's alpha = 2(N-1)
    transfers then add up to the two exchanges.
    allgather: its exchange is PS's with N aggregators (every rank sends nbytes to every
    rank), so the same transfers, the same per-peer share.

    The task runs as many transfers back to back as one sync makes (2(N-1) ring steps, the
    two PS exchanges) and the time is divided among them: ranks leave the barrier before
    it at different moments, and a sync pays that skew once, not once per step. A ring
    step of CHAIN_BYTES or more is timed alone (the skew is lost in it).
    """
    from hipress.engine import get_engine
    from hipress.comm.exchange import transfer

    engine = engine or get_engine()
    r, n = transport.rank, transport.size
    reduce = slowest(transport)
    if strategy == "ring":
        nxt, prv = (r + 1) % n, (r - 1) % n
        plan = [([nxt], {prv}, False)] * (2 * (n - 1))
        per_transfer, chained = 1, lambda nbytes: nbytes < CHAIN_BYTES
    else:  # ps; allgather: PS's exchange with N aggregators
        aggs = range(aggregators or n)
        others = [j for j in range(n) if j != r]
        gather = ([a for a in aggs if a != r], set(others) if r in aggs else set(), True)
        bcast = (others if r in aggs else [], {a for a in aggs if a != r}, True)
        plan = [gather, bcast]
        per_transfer, chained = max(1, n - 1), lambda nbytes: True
    payload = functools.lru_cache(maxsize=1)(lambda nbytes: torch.zeros(nbytes, dtype=torch.uint8))

    def send_once(nbytes: int) -> float:
        out = payload(nbytes)
        steps = plan if chained(nbytes) else plan[:1]

        def transfers():
            for dsts, srcs, bulk in steps:
                transfer(transport, {j: out for j in dsts}, srcs, pairwise=not bulk)

        return _timed_task(transport, engine, reduce, "profile.send", transfers, "comm") / (len(steps) * per_transfer)

    return send_once


def allreduce_once(transport, engine=None):
    """allreduce_once(nbytes) -> seconds of the backend's allreduce of nbytes of fp32, as the plain
    sync runs it (hipress.sync.allreduce): one comm-queue task, the layout already agreed (a
    step's later buckets skip the checking round); all ranks at once, the slowest rank's time."""
    from hipress.engine import get_engine

    engine = engine or get_engine()
    reduce = slowest(transport)
    buffer = functools.lru_cache(maxsize=1)(lambda nbytes: torch.zeros(max(1, nbytes // 4), dtype=torch.float32))

    def once(nbytes: int) -> float:
        values = buffer(nbytes)
        return _timed_task(transport, engine, reduce, "profile.allreduce",
                           lambda: transport.allreduce(values, sizes_agreed=True), "comm")

    return once


def task_once(transport, engine=None):
    """task_once() -> seconds of one empty compute task, submitted and waited for (all ranks
    at once, the slowest rank's time): the hand-off CaSync pays per compute task."""
    from hipress.engine import get_engine

    engine = engine or get_engine()
    reduce = slowest(transport)

    def once() -> float:
        return _timed_task(transport, engine, reduce, "profile.task", lambda: None, "compute")

    return once


def _timed_task(transport, engine, reduce, name: str, work, queue: str) -> float:
    """Seconds of ``work`` run as one engine task on ``queue``, every rank starting after a barrier;
    ``reduce`` makes it the slowest rank's time."""
    transport.barrier()
    t0 = time.perf_counter()
    engine.submit(name, work, queue=queue).result(TASK_TIMEOUT_S)
    return reduce(time.perf_counter() - t0)


def _link_changed(transport, cached: Optional[Profile], send_once) -> bool:
    """Collective. True on every rank when rank 0's 1 MB transfer is off the cached curve by > 2x
    in two probe rounds in a row: one busy moment (a 2.7x slower round was seen on a loaded
    2-core machine) must not cost a re-profile."""
    for _ in range(2):
        times = [send_once(PROBE_BYTES) for _ in range(PROBE_REPEATS + 1)][1:]
        verdict = b""
        if transport.rank == 0:
            t, want = statistics.median(times), cached.send(PROBE_BYTES)
            # off by more than 2x either way, and by more than timer and scheduling noise
            if abs(t - want) > max(max(t, want) / 2, PROBE_NOISE_S):
                verdict = f"cached profile predicts {want * 1e3:.2f} ms for a 1 MB transfer, measured {t * 1e3:.2f} ms"
                verdict = verdict.encode()
        verdict = _broadcast_bytes(transport, verdict)
        if not verdict:
            return False
    if transport.rank == 0:
        warnings.warn(f"hipress planner: {verdict.decode()} (twice): the link changed, re-profiling")
    return True


def profile_online(compressor, transport, strategy: str, *, device: str = "cpu", cache_dir=None,
                   refresh: bool = False, sizes: Sequence[int] = DEFAULT_LADDER, repeats: int = 5,
                   engine=None) -> Profile:
    """Collective: returns the same Profile on every rank (see module docstring).
    strategy: "ring", "ps" or "allgather" (hipress's executed strategies).
    engine: whose queues run the timed operators (default: the process-wide engine).
    A cached file written by an older hipress (another profile version) is re-profiled and replaced."""
    if strategy not in EXECUTED_STRATEGIES:
        raise ValueError(f"the planner has a cost model of each executed strategy {EXECUTED_STRATEGIES} only; "
                         f"{strategy!r} has no cost model yet")
    n = transport.size
    path = profile_path(n, strategy, device, compressor.name, cache_dir)
    cached = None
    if transport.rank == 0 and path.exists() and not refresh:
        try:
            cached = load_profile(path, n=n, strategy=strategy, device=device, algorithm=compressor.name)
        except StaleProfileError as e:
            warnings.warn(f"hipress planner: {e}; re-profiling")
    send_once = transfer_once(transport, strategy, engine)
    have = _broadcast_bytes(transport, b"1" if cached is not None else b"")
    if have and _link_changed(transport, cached, send_once):
        have, cached = b"", None
    if not have:
        one = transfer_once(transport, strategy, engine, aggregators=1) if strategy == "ps" else None
        prof = profile_compressor(compressor, send_once, n=n, strategy=strategy, device=device,
                                  sizes=sizes, repeats=repeats, plain=NoneCompressor(), before=transport.barrier,
                                  reduce=slowest(transport), task_once=task_once(transport, engine),
                                  send_one_once=one,
                                  allreduce_once=allreduce_once(transport, engine) if transport.has_allreduce else None)
        if transport.rank == 0:
            save_profile(prof, path)
            cached = prof
    text = _broadcast_bytes(transport, json.dumps(cached.to_dict()).encode() if transport.rank == 0 else None)
    return Profile.from_dict(json.loads(text.decode()), f"rank 0's profile {path}")
