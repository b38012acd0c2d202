"""Do link conflicts cost on this cluster? Three send patterns of the same bytes, timed (issue 21).

    python -m hipress.bench.links --np 4 --bandwidth 1gbit --latency 0.2ms [--mib 2] [--repeats 10]
    python -m hipress.bench.links --np 4                 # local processes over loopback

The coordinator (docs/coordinator.md) runs a step's messages in slots of non-conflicting links: in a
slot every rank sends to at most one peer and hears from at most one, so no receiver's link is shared
(no incast at a PS aggregator). That pays where sharing a link costs more than its bytes: switch
buffers that drop under incast, TCP collapse. Without the coordinator a PS gather posts all of its
messages at once. This bench times, over gloo point-to-point messages of ``--mib`` MiB each:

  incast                   every other rank sends one message to rank 0, all at once
  all-to-all at once       every rank sends one message to every other, all posted together, as
                           hipress's transport posts a PS gather or broadcast without the coordinator
                           (receives first, then the sends, staggered by rank: to r + 1, r + 2, ...)
  all-to-all in matchings  the same messages in n - 1 slots: in slot s rank r sends to r + s and
                           hears from r - s, a slot after the one before has finished on this rank
                           (the coordinator's conflict-free slots)

Each repetition starts at a barrier and ends when every rank is done (a second barrier): the time is
the median over ``--repeats`` after two warm-up ones. Every received message is checked against what
its sender wrote. With a bandwidth, each row also gives the line-rate time of its busiest link (bytes
into the busiest rank / rate) and the ratio to it. Where matchings are no faster than all at once,
the coordinator's slots have nothing to win on this cluster but its batching.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from hipress.bench.cluster import parse_rate
from hipress.bench.common import describe_link, run_ranks

PATTERNS = ("incast", "all-to-all at once", "all-to-all in matchings")


def _payload(src: int, dst: int, numel: int):
    import torch

    return torch.full((numel,), float(src * 1000 + dst), dtype=torch.float32)


def worker(mib: float, repeats: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    numel = max(1, int(mib * 2 ** 20) // 4)
    send = {p: _payload(rank, p, numel) for p in range(n) if p != rank}
    recv = {p: torch.empty(numel) for p in range(n) if p != rank}

    def incast():
        works = [dist.irecv(recv[p], p) for p in recv] if rank == 0 else [dist.isend(send[0], 0)]
        for w in works:
            w.wait()
        return list(recv) if rank == 0 else []

    def at_once():  # as hipress's transport posts an all-to-all: receives first, sends staggered by rank
        works = [dist.irecv(recv[(rank - k) % n], (rank - k) % n) for k in range(1, n)]
        works += [dist.isend(send[(rank + k) % n], (rank + k) % n) for k in range(1, n)]
        for w in works:
            w.wait()
        return list(recv)

    def matchings():
        for s in range(1, n):
            dst, src = (rank + s) % n, (rank - s) % n
            for w in (dist.isend(send[dst], dst), dist.irecv(recv[src], src)):
                w.wait()
        return list(recv)

    times = {}
    for name, run in zip(PATTERNS, (incast, at_once, matchings)):
        spent = []
        for _ in range(repeats + 2):
            for t in recv.values():
                t.fill_(-1.0)
            dist.barrier()
            t0 = time.perf_counter()
            heard = run()
            dist.barrier()
            spent.append(time.perf_counter() - t0)
            for p in heard:
                if not torch.equal(recv[p], _payload(p, rank, numel)):
                    raise RuntimeError(f"{name}: rank {rank} received wrong bytes from rank {p}")
        times[name] = statistics.median(spent[2:])
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"np": n, "bytes": 4 * numel, "repeats": repeats, "seconds": times}, f)
    dist.destroy_process_group()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--bandwidth", default="none", help="tc rate per host (emulated cluster); 'none' = local processes")
    p.add_argument("--latency", default="0.2ms")
    p.add_argument("--switch-buffer", default=None,
                   help="bytes a switch port queues before dropping (hipress.bench.cluster), e.g. 256k; default: deep")
    p.add_argument("--mib", type=float, default=2.0, help="MiB per message")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--worker", nargs=3, metavar=("MIB", "REPEATS", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(float(a.worker[0]), int(a.worker[1]), a.worker[2])
        return {}
    if a.np < 3:
        raise SystemExit("--np must be at least 3: with two ranks no two messages share a link")
    if a.mib <= 0 or a.repeats < 1:
        raise SystemExit("--mib must be > 0 and --repeats >= 1")
    line = None if a.bandwidth == "none" else parse_rate(a.bandwidth)
    res, emulated = run_ranks("hipress.bench.links", [a.mib, a.repeats], a.np, a.bandwidth, a.latency, a.timeout,
                              a.switch_buffer)
    # the bytes into the busiest rank (rank 0 in incast, every rank in the all-to-alls), which its one
    # link carries whatever the order, at the line rate
    ideal = (a.np - 1) * res["bytes"] * 8 / line if line is not None and emulated else None
    rows = []
    for name in PATTERNS:
        s = res["seconds"][name]
        row = {"pattern": name, "ms": s * 1e3}
        if ideal is not None:
            row.update({"line_rate_ms": ideal * 1e3, "x_line_rate": s / ideal})
        rows.append(row)
    link = describe_link(a.bandwidth, a.latency, a.switch_buffer, emulated)
    print(f"### links: {a.np} ranks, {link}; {a.mib:g} MiB per message, medians of {a.repeats}\n")
    print("| pattern | ms | line rate of the busiest link, ms | x line rate |\n|---|---|---|---|")
    for r in rows:
        extra = f"{r['line_rate_ms']:.1f} | {r['x_line_rate']:.2f}" if "line_rate_ms" in r else " | "
        print(f"| {r['pattern']} | {r['ms']:.1f} | {extra} |")
    doc = {"config": vars(a), "emulated": emulated, "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return doc


if __name__ == "__main__":
    main()
