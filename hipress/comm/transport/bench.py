"""Transport microbenchmark: alltoallv and send/recv throughput versus message size,
each hipress transport against the raw library underneath it, in the same run.

    python -m hipress.comm.transport.bench                      # 2 local ranks, 4 KB .. 16 MB
    python -m hipress.comm.transport.bench --ranks 4 --out results/transport.json

It launches its own ranks: torch/gloo ranks as local processes (TCPStore on a free port),
MPI ranks with ``mpirun`` (skipped with a note where mpirun or the MPI build is missing),
loopback ranks as threads. Pairs measured in one process, alternating per repetition:

  torch/gloo   hipress TorchDistTransport.alltoallv      vs  torch.distributed.all_to_all_single
               hipress send/recv                        vs  torch.distributed.send/recv
  mpi          hipress MpiTransport.alltoallv (C++)     vs  mpi4py Comm.Alltoallv
               hipress send/recv                        vs  mpi4py Comm.Send/Recv
  loopback     hipress LoopbackTransport (threads)      (no raw library; reference only)

``size`` is the bytes each rank sends to each peer (alltoallv) or the bytes of one message
(send/recv). alltoallv time: median over iterations of rank 0's time from a common barrier
to completion; GB/s = size * (ranks-1) / time (bytes leaving one rank). send/recv: ping-pong
between ranks 0 and 1, time = round trip / 2, GB/s = size / time. hipress runs with its
default shape checks (one small metadata allgather per collective, an 8-byte header per
message) and, as ``hipress-nocheck``, without them.

It lives with the transports, not in hipress/bench, because it builds each backend
directly (and twice: with and without checks), which nothing outside hipress/comm does.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List

from hipress.supervise import free_port

DEFAULT_SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


def _iters_for(size: int, budget_bytes: int) -> int:
    return max(5, min(200, budget_bytes // max(size, 1)))


def _median_times(fn: Callable[[], None], sync: Callable[[], None], iters: int) -> List[float]:
    out = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _measure(pairs: Dict[str, Dict[str, Callable]], sizes, ranks, rank, reps, budget, sync_fns) -> list:
    """pairs[op][impl] = make(size) -> fn; alternate impls per repetition, pool the samples."""
    import torch  # noqa: F401

    rows = []
    for op, impls in pairs.items():
        for size in sizes:
            iters = _iters_for(size, budget)
            fns = {impl: make(size) for impl, make in impls.items()}
            for fn in fns.values():  # warm up (connections, allocations)
                for _ in range(2):
                    sync_fns[op]()
                    fn()
            samples = {impl: [] for impl in fns}
            for _ in range(reps):
                for impl, fn in fns.items():
                    samples[impl] += _median_times(fn, sync_fns[op], max(1, iters // reps))
            if rank == 0:
                for impl, s in samples.items():
                    med = statistics.median(s)
                    if op == "sendrecv":
                        med /= 2.0  # ping-pong round trip -> one way
                    moved = size * (ranks - 1) if op == "alltoallv" else size
                    rows.append({"op": op, "impl": impl, "size": size, "iters": len(s), "median_s": med,
                                 "gbps": moved / med / 1e9 if med > 0 else float("inf")})
    return rows


def _pattern(n):
    import torch

    return (torch.arange(n, dtype=torch.int64) % 251).to(torch.uint8)


# ---------------------------------------------------------------------------- workers
def _ping_pong(rank: int, send: Callable[[int], None], recv: Callable[[int], None]) -> Callable[[], None]:
    """One round trip between ranks 0 and 1 (send(peer) / recv(peer)); other ranks do nothing."""
    def fn():
        if rank == 0:
            send(1)
            recv(1)
        elif rank == 1:
            recv(0)
            send(0)
    return fn


def _hipress_cases(t, n: int) -> Dict[str, Callable]:
    """op -> make(size) -> fn, for a hipress Transport t of n ranks."""
    import torch

    def a2a(size):
        send, recv = _pattern(size * n), torch.empty(size * n, dtype=torch.uint8)
        return lambda: t.alltoallv(send, [size] * n, recv, [size] * n)

    def pp(size):
        buf = _pattern(size)
        return _ping_pong(t.rank, lambda peer: t.send(buf, peer), lambda peer: t.recv(buf, peer))

    return {"alltoallv": a2a, "sendrecv": pp}


def _pairs(hp, hp_nc, n: int, raw: Dict[str, Callable]) -> Dict[str, Dict[str, Callable]]:
    """The measured pairs: hipress with and without shape checks against the raw library, per op."""
    checked, nocheck = _hipress_cases(hp, n), _hipress_cases(hp_nc, n)
    return {op: {"hipress": checked[op], "hipress-nocheck": nocheck[op], "raw": raw[op]} for op in raw}


def _worker_torch(args) -> None:
    import torch
    import torch.distributed as dist

    from hipress.comm.transport.torch_dist import TorchDistTransport

    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    from hipress.comm.rendezvous import tcp_store

    store = tcp_store("127.0.0.1", int(os.environ["MASTER_PORT"]), n, rank, 120.0)  # loopback only
    dist.init_process_group("gloo", store=dist.PrefixStore("raw", store), rank=rank, world_size=n)
    hp = TorchDistTransport.create(rank, n, store=store, timeout_s=120)
    hp_nc = TorchDistTransport.create(rank, n, store=dist.PrefixStore("nocheck", store), timeout_s=120, check=False)

    def a2a_raw(size):
        send, recv = _pattern(size * n), torch.empty(size * n, dtype=torch.uint8)
        return lambda: dist.all_to_all_single(recv, send, [size] * n, [size] * n)

    def pp_raw(size):
        buf = _pattern(size)
        return _ping_pong(rank, lambda peer: dist.send(buf, peer), lambda peer: dist.recv(buf, peer))

    pairs = _pairs(hp, hp_nc, n, {"alltoallv": a2a_raw, "sendrecv": pp_raw})
    rows = _measure(pairs, args.sizes, n, rank, args.reps, args.budget, {"alltoallv": dist.barrier, "sendrecv": dist.barrier})
    dist.barrier()
    if rank == 0:
        print("BENCH " + json.dumps({"transport": "torch/gloo", "raw": "torch.distributed (gloo)", "rows": rows}), flush=True)
    hp.close()
    hp_nc.close()
    dist.destroy_process_group()


def _worker_mpi(args) -> None:
    import numpy as np
    from mpi4py import MPI

    from hipress.comm.transport.mpi import MpiTransport

    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    hp = MpiTransport.world(timeout_s=120)
    hp_nc = MpiTransport.world(timeout_s=120, check=False)

    def a2a_raw(size):
        send, recv = _pattern(size * n).numpy(), np.empty(size * n, dtype=np.uint8)
        counts = np.full(n, size, dtype=np.int32)
        displs = np.arange(n, dtype=np.int32) * size
        return lambda: comm.Alltoallv([send, counts, displs, MPI.BYTE], [recv, counts, displs, MPI.BYTE])

    def pp_raw(size):
        buf = _pattern(size).numpy()
        return _ping_pong(rank, lambda peer: comm.Send([buf, MPI.BYTE], peer, 0),
                          lambda peer: comm.Recv([buf, MPI.BYTE], peer, 0))

    pairs = _pairs(hp, hp_nc, n, {"alltoallv": a2a_raw, "sendrecv": pp_raw})
    rows = _measure(pairs, args.sizes, n, rank, args.reps, args.budget, {"alltoallv": comm.Barrier, "sendrecv": comm.Barrier})
    comm.Barrier()
    if rank == 0:
        print("BENCH " + json.dumps({"transport": "mpi", "raw": f"mpi4py {MPI.Get_library_version().splitlines()[0]}",
                                     "rows": rows}), flush=True)
    hp.close()
    hp_nc.close()


def _run_loopback(args) -> dict:
    from hipress.comm.transport import loopback

    n = args.ranks
    out = {}

    def body(t):
        cases = _hipress_cases(t, n)
        rows = _measure({op: {"hipress": make} for op, make in cases.items()}, args.sizes, n, t.rank,
                        args.reps, args.budget, {"alltoallv": t.barrier, "sendrecv": t.barrier})
        if t.rank == 0:
            out["rows"] = rows

    loopback.spawn(n, body, timeout_s=120)
    return {"transport": "loopback", "raw": None, "rows": out["rows"]}


# ---------------------------------------------------------------------------- driver
def _child_env() -> dict:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _worker_args(args) -> List[str]:
    return ["--sizes", ",".join(map(str, args.sizes)), "--reps", str(args.reps), "--budget", str(args.budget)]


def _collect(outputs: List[str], what: str) -> dict:
    for out in outputs:
        for line in out.splitlines():
            if line.startswith("BENCH "):
                return json.loads(line[len("BENCH "):])
    raise RuntimeError(f"{what}: no result; output:\n" + "\n".join(o[-3000:] for o in outputs))


def _run_torch(args) -> dict:
    port = free_port()
    procs = []
    for r in range(args.ranks):
        env = _child_env()
        env.update(RANK=str(r), WORLD_SIZE=str(args.ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-m", "hipress.comm.transport.bench", "--worker", "torch",
                                       *_worker_args(args)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=args.timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    return _collect(outs, "torch/gloo")


def _run_mpi(args) -> dict:
    if shutil.which("mpirun") is None:
        return {"transport": "mpi", "skipped": "mpirun not found"}
    from hipress.comm.transport import mpi as hmpi

    if not hmpi.available():
        return {"transport": "mpi", "skipped": "hipress built without MPI"}
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return {"transport": "mpi", "skipped": "mpi4py not installed (the raw baseline)"}
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(args.ranks), sys.executable, "-m",
           "hipress.comm.transport.bench", "--worker", "mpi", *_worker_args(args)]
    out = subprocess.run(cmd, env=_child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=args.timeout).stdout
    return _collect([out], "mpi")


def _human(n: int) -> str:
    for unit, div in (("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def _table(results: List[dict]) -> str:
    lines = ["| transport | op | size | hipress GB/s | hipress-nocheck GB/s | raw GB/s | hipress/raw time | raw library |",
             "|---|---|---|---|---|---|---|---|"]
    for res in results:
        if "skipped" in res:
            lines.append(f"| {res['transport']} | - | - | - | - | - | - | skipped: {res['skipped']} |")
            continue
        by = {}
        for row in res["rows"]:
            by.setdefault((row["op"], row["size"]), {})[row["impl"]] = row
        for (op, size), impls in by.items():
            h, nc, raw = impls.get("hipress"), impls.get("hipress-nocheck"), impls.get("raw")
            ratio = f"{h['median_s'] / raw['median_s']:.2f}" if h and raw else "-"
            lines.append(f"| {res['transport']} | {op} | {_human(size)} | {h['gbps']:.3f} | "
                         f"{nc['gbps']:.3f} | " if nc else f"| {res['transport']} | {op} | {_human(size)} | {h['gbps']:.3f} | - | ")
            lines[-1] += f"{raw['gbps']:.3f} | {ratio} | {res['raw'] or '-'} |" if raw else f"- | - | - |"
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)),
                    help="comma-separated bytes per peer (alltoallv) / per message (send/recv)")
    ap.add_argument("--transports", default="torch,mpi,loopback")
    ap.add_argument("--reps", type=int, default=3, help="alternations between hipress and the raw library")
    ap.add_argument("--budget", type=int, default=256 << 20, help="bytes per size and impl (sets the iterations)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", default=None, help="JSON output path (e.g. results/transport.json)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.sizes = [int(s) for s in str(args.sizes).split(",") if s]
    if args.worker == "torch":
        _worker_torch(args)
        return 0
    if args.worker == "mpi":
        _worker_mpi(args)
        return 0
    if args.ranks < 2:
        ap.error("--ranks must be at least 2")
    results = []
    t0 = time.time()
    for name in [s.strip() for s in args.transports.split(",") if s.strip()]:
        print(f"# running {name} with {args.ranks} ranks ...", file=sys.stderr, flush=True)
        if name == "torch":
            results.append(_run_torch(args))
        elif name == "mpi":
            results.append(_run_mpi(args))
        elif name == "loopback":
            results.append(_run_loopback(args))
        else:
            ap.error(f"unknown transport {name!r}")
    print(_table(results))
    goal = []
    top = max(args.sizes)
    for res in results:
        if "skipped" in res or not res.get("raw"):
            continue
        for op in ("alltoallv", "sendrecv"):
            rows = {r["impl"]: r for r in res["rows"] if r["op"] == op and r["size"] == top}
            if "hipress" in rows and "raw" in rows:
                ratio = rows["hipress"]["median_s"] / rows["raw"]["median_s"]
                goal.append({"transport": res["transport"], "op": op, "size": top, "time_ratio": ratio,
                             "within_10pct": ratio <= 1.10})
    for g in goal:
        print(f"\n{g['transport']} {g['op']} at {_human(g['size'])}: hipress/raw time = {g['time_ratio']:.3f} "
              f"({'within' if g['within_10pct'] else 'NOT within'} 10%)", end="")
    print()
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
        import torch

        doc = {"benchmark": "transport", "config": {"ranks": args.ranks, "sizes": args.sizes, "reps": args.reps,
                                                    "budget": args.budget},
               "machine": {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
                           "torch": torch.__version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S")},
               "wall_s": round(time.time() - t0, 1), "results": results, "goal_16mb": goal}
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
