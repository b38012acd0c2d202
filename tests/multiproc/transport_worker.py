"""One rank of a multi-process transport test (started by test_transport.py, directly or
under mpirun). Discovers its launch with hipress.comm.world.init(), then:

  --mode checks   runs every check of hipress.comm.transport.testing on the world transport,
                  verifies local/cross grouping (``--fake-hosts K`` puts ranks on K pretend
                  hosts through HIPRESS_HOSTNAME) and runs checks on the local/cross groups
  --mode kill     loops large alltoallv; rank --victim SIGKILLs itself in the middle of one
  --mode hang     rank --victim never joins the collective; the others must time out

Prints one line ``RESULT <json>`` per rank; exit 0 = checks passed, 3 = failed with the
expected TransportError (kill/hang modes).
"""
import argparse
import os
import signal
import sys
import threading
import time

from worker_common import emit, gloo_event_loops


def launch_rank():
    for k in ("OMPI_COMM_WORLD_RANK", "HOROVOD_RANK", "RANK"):
        if os.environ.get(k) is not None:
            return int(os.environ[k])
    return None




def check_control_transport(world, wt, rank, size, pattern):
    """world.control_transport(): where the backend runs two collectives at once, small allgathers
    on it complete while another thread's allreduce is in flight on the world transport, both
    exact; elsewhere None. Returns 'concurrent' or 'none'."""
    import torch

    ctl = world.control_transport()
    if not wt.concurrent_splits:
        assert ctl is None, ctl
        return "none"
    assert ctl is not None and ctl is not wt and (ctl.rank, ctl.size) == (rank, size), ctl
    assert world.control_transport() is ctl  # made once
    big = torch.full((1 << 22,), float(rank + 1))
    busy = threading.Thread(target=wt.allreduce, args=(big,))
    busy.start()
    for i in range(20):
        table = torch.empty(4 * size, dtype=torch.uint8)
        ctl.allgather(pattern(rank * 100 + i, 4), table, sizes_agreed=True)
        for q in range(size):
            assert torch.equal(table[4 * q:4 * q + 4], pattern(q * 100 + i, 4)), (i, q)
    busy.join(60)
    assert not busy.is_alive() and torch.equal(big, torch.full_like(big, size * (size + 1) / 2))
    return "concurrent"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="checks", choices=["checks", "kill", "hang"])
    ap.add_argument("--fake-hosts", type=int, default=0)
    ap.add_argument("--explicit", nargs=4, metavar=("RANK", "SIZE", "ADDR", "PORT"))
    ap.add_argument("--victim", type=int, default=1)
    ap.add_argument("--expect-transport", default=None)
    args = ap.parse_args()

    r0 = launch_rank() if not args.explicit else int(args.explicit[0])
    if args.fake_hosts:
        os.environ["HIPRESS_HOSTNAME"] = f"fakehost{r0 % args.fake_hosts}"

    import torch

    from hipress.comm import world
    from hipress.comm.transport.base import TransportError
    from hipress.comm.transport.testing import pattern, run_checks

    t0 = time.time()
    if args.explicit:
        r, n, addr, port = args.explicit
        world.init(rank=int(r), size=int(n), master_addr=addr, master_port=int(port))
    else:
        world.init()
    world.init()  # idempotent
    wt = world.transport()
    rank, size = world.rank(), world.size()
    out = {"rank": rank, "size": size, "transport": wt.name, "launcher": world.launch_info().launcher,
           "init_s": round(time.time() - t0, 3)}
    if args.expect_transport and not wt.name.startswith(args.expect_transport):
        raise SystemExit(f"rank {rank}: expected the {args.expect_transport} transport, got {wt.name}")

    if args.mode == "checks":
        K = args.fake_hosts or 1
        # expected grouping: rank q lives on host q % K; hosts are ordered by lowest rank
        host_members = lambda q: [p for p in range(size) if p % K == q % K]  # noqa: E731
        lr = host_members(rank).index(rank)
        cross = [q for q in range(size) if host_members(q).index(q) == lr]  # my local_rank, one per host
        exp = {"local_rank": lr, "local_size": len(host_members(rank)),
               "cross_rank": cross.index(rank), "cross_size": len(cross)}
        got = {"local_rank": world.local_rank(), "local_size": world.local_size(),
               "cross_rank": world.cross_rank(), "cross_size": world.cross_size()}
        if got != exp:
            raise SystemExit(f"rank {rank}: host grouping {got} != expected {exp}")
        out["grouping"] = got
        out["checks"] = run_checks(wt)
        loc, cross = world.local_transport(), world.cross_transport()
        assert (loc.rank, loc.size) == (got["local_rank"], got["local_size"]), (loc, got)
        assert (cross.rank, cross.size) == (got["cross_rank"], got["cross_size"]), (cross, got)
        # every host runs the local checks together, then every cross group its own
        out["local_checks"] = run_checks(loc, ["alltoallv", "allgatherv", "broadcast", "allreduce"])
        wt.barrier()
        out["cross_checks"] = run_checks(cross, ["alltoallv", "sendrecv_ring"])
        wt.barrier()
        out["control"] = check_control_transport(world, wt, rank, size, pattern)
        out["gloo_event_loops"] = gloo_event_loops()
        world.shutdown()
        emit(out)
        return 0

    # failure modes: a few good rounds first, so the failure really is mid-job
    counts = [1 << 20] * size
    send = torch.cat([pattern(rank * 10 + j, c) for j, c in enumerate(counts)])
    recv = torch.empty(sum(counts), dtype=torch.uint8)
    for _ in range(2):
        wt.alltoallv(send, counts, recv, counts)
    wt.barrier()
    if rank == args.victim:
        if args.mode == "kill":
            # die while the collective is in flight
            threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
            while True:
                wt.alltoallv(send, counts, recv, counts)
        else:
            emit(dict(out, hanging=True))
            time.sleep(3600)
    t1 = time.time()
    try:
        while True:
            wt.alltoallv(send, counts, recv, counts)
            if time.time() - t1 > 120:
                raise SystemExit(f"rank {rank}: no error after 120 s")
    except TransportError as e:
        out.update(error=str(e), error_peers=e.peers, error_op=e.op, detect_s=round(time.time() - t1, 3))
        emit(out)
        sys.stdout.flush()
        os._exit(3)  # the transport is unusable; do not run teardown collectives


if __name__ == "__main__":
    sys.exit(main())
