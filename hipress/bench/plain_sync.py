"""Uncompressed buckets: the transport's allreduce against hipress's own ring, A/B in one job (issue 21).

    python -m hipress.bench.plain_sync --np 4 --bandwidth 10gbit --latency 0.2ms [--buckets 25 --bucket-mb 1]

Every rank of an emulated cluster (``hipress.bench.cluster``, one network namespace per rank) makes
both syncs of compression "none" over the same exchanges: the plain path (``make_sync``'s default,
``hipress.sync.allreduce``) and hipress's ring (``plain_allreduce=False``, what ran before). Each
round submits B buckets at once (as a backward pass would, without the compute) and times until the
last is synchronized; the two kinds alternate round by round, and which goes first alternates too,
so a drift of the machine's load falls on both. A round's time is its slowest rank's. Prints the
medians and their ratio; ``--json`` writes every round. The two results are checked to agree.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def worker(buckets: int, numel: int, rounds: int, out: str) -> None:
    import torch

    import hipress
    from hipress.comm import world
    from hipress.comm.exchange import open_exchanges
    from hipress.compression.none import NoneCompressor
    from hipress.engine import get_engine
    from hipress.sync import StateStore, make_sync

    hipress.init()
    rank, size, tr = world.rank(), world.size(), world.transport()
    engine = get_engine()
    exchanges = open_exchanges(engine)
    syncs = {kind: make_sync(engine, exchanges, NoneCompressor(), "ring", StateStore(rank), True, False, size, True,
                             plain_allreduce=(kind == "allreduce"))
             for kind in ("allreduce", "ring")}
    if syncs["allreduce"].strategy.name != "allreduce":
        raise SystemExit(f"the {tr.name} transport has no allreduce: nothing to compare")
    g = torch.Generator().manual_seed(rank)
    grads = [torch.randn(numel, generator=g) for _ in range(buckets)]
    times = {"allreduce": [], "ring": []}
    results = {}
    for rnd in range(rounds + 1):  # round 0 warms both up and is not counted
        order = ("allreduce", "ring") if rnd % 2 == 0 else ("ring", "allreduce")
        for kind in order:
            bufs = [x.clone() for x in grads]
            tr.barrier()
            t0 = time.perf_counter()
            handles = [syncs[kind].build(f"{kind}.b{i}", b, [(0, numel)]) for i, b in enumerate(bufs)]
            for h in handles:
                h.result(timeout=300)
            dt = time.perf_counter() - t0
            slowest = torch.tensor([dt], dtype=torch.float64)
            gathered = torch.empty(size, dtype=torch.float64)
            tr.allgather(slowest.view(torch.uint8), gathered.view(torch.uint8))
            if rnd:
                times[kind].append(float(gathered.max()))
            results[kind] = bufs
    for a, b in zip(results["allreduce"], results["ring"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"transport": tr.name, "np": size, "times": times}, f)
    hipress.shutdown()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--bandwidth", default="10gbit", help="tc rate per host; 'none' = unshaped")
    p.add_argument("--latency", default="0.2ms")
    p.add_argument("--buckets", type=int, default=25, help="buckets submitted together per round")
    p.add_argument("--bucket-mb", type=float, default=1.0, help="fp32 megabytes per bucket")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds of each kind")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", help="write every round here")
    p.add_argument("--worker", nargs=4, metavar=("BUCKETS", "NUMEL", "ROUNDS", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(int(a.worker[0]), int(a.worker[1]), int(a.worker[2]), a.worker[3])
        return {}
    from hipress.bench.cluster import EmulatedCluster

    numel = int(a.bucket_mb * (1 << 20)) // 4
    out = os.path.join("/tmp", f"hipress-plain-sync-{os.getpid()}.json")
    bw = None if a.bandwidth == "none" else a.bandwidth
    env = {"PYTHONPATH": REPO + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")}
    with EmulatedCluster(a.np, bandwidth=bw, latency=a.latency, quiet=True) as cluster:
        cmd = [sys.executable, "-m", "hipress.bench.plain_sync", "--worker", str(a.buckets), str(numel),
               str(a.rounds), out]
        code, outputs = cluster.run(cmd, timeout=a.timeout, env=env, cwd=REPO)
        emulated = cluster.emulated
    if code != 0:
        raise SystemExit(f"the ranks failed (exit {code}):\n" + "\n".join(o[-3000:] for o in outputs))
    with open(out) as f:
        res = json.load(f)
    os.unlink(out)
    med = {k: statistics.median(v) for k, v in res["times"].items()}
    res.update(median_s=med, ratio_ring_over_allreduce=med["ring"] / med["allreduce"], emulated=emulated,
               config=dict(np=a.np, bandwidth=a.bandwidth, latency=a.latency, buckets=a.buckets,
                           bucket_mb=a.bucket_mb, rounds=a.rounds))
    print(f"{res['transport']}, {a.np} ranks, {a.bandwidth}, {a.latency}"
          f"{'' if emulated else ' (NOT emulated: loopback)'}: {a.buckets} buckets x {a.bucket_mb:g} MB per round, "
          f"medians of {a.rounds} rounds (slowest rank)")
    for k in ("ring", "allreduce"):
        print(f"  {k:9s} {1e3 * med[k]:8.1f} ms   rounds: {', '.join(f'{1e3 * t:.0f}' for t in res['times'][k])}")
    print(f"  ring / allreduce = {res['ratio_ring_over_allreduce']:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
