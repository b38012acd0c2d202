"""One rank of the Horovod tests (started by test_horovod.py under ``horovodrun``).

  --mode checks    hipress.init() must pick the Horovod transport by itself; rank, size and
                   local rank agree with Horovod's; every check of hipress.comm.transport.testing
                   runs on the world transport, on the local/cross groups (``--fake-hosts K``
                   makes hipress see K hosts, so new process sets are registered), and on a
                   second world transport without pair process sets (sendrecv as alltoall)
  --mode baseline  (also after the checks with --baseline) horovod_ext.baseline: hvd.DistributedOptimizer with and without fp16
                   compression averages the gradients of all ranks

Writes ``rank<r>.json`` into HIPRESS_TEST_RESULT_DIR (horovodrun prefixes output lines; the
test sets it).
"""
import argparse
import os
import sys
import time

from worker_common import emit


def launch_rank():
    for k in ("OMPI_COMM_WORLD_RANK", "HOROVOD_RANK", "PMI_RANK"):
        if os.environ.get(k) is not None:
            return int(os.environ[k])
    return 0




def mode_checks(args):
    from hipress.comm import world
    from hipress.comm.transport.testing import run_checks
    from horovod_ext.transport import HorovodTransport, horovod_info

    t0 = time.time()
    world.init()
    wt = world.transport()
    info = horovod_info()
    rank, size = world.rank(), world.size()
    out = {"rank": rank, "size": size, "transport": wt.name, "launcher": world.launch_info().launcher,
           "horovod": info, "init_s": round(time.time() - t0, 3)}
    if not isinstance(wt, HorovodTransport):
        raise SystemExit(f"rank {rank}: expected the Horovod transport, got {wt!r}")
    if (rank, size) != (info["rank"], info["size"]):
        raise SystemExit(f"rank {rank}/{size}: Horovod says {info['rank']}/{info['size']}")
    if not args.fake_hosts and (world.local_rank(), world.local_size()) != (info["local_rank"], info["local_size"]):
        raise SystemExit(f"rank {rank}: local rank {world.local_rank()}/{world.local_size()} but Horovod says "
                         f"{info['local_rank']}/{info['local_size']}")
    out["checks"] = run_checks(wt)
    loc, cross = world.local_transport(), world.cross_transport()
    out["grouping"] = [world.local_rank(), world.local_size(), world.cross_rank(), world.cross_size()]
    out["local_checks"] = run_checks(loc, ["alltoallv", "allgatherv", "broadcast", "sendrecv_ring"])
    wt.barrier()
    out["cross_checks"] = run_checks(cross, ["alltoallv", "allgather", "sendrecv_ring"])
    wt.barrier()
    # no pair process sets: sendrecv is an alltoall over the transport (ring steps only)
    coll = HorovodTransport.world(p2p="collective")
    out["collective_checks"] = run_checks(coll, ["sendrecv_ring", "alltoallv", "broadcast", "barrier"], errors=False)
    coll.close()
    out["total_s"] = round(time.time() - t0, 3)
    world.shutdown()
    if args.baseline:
        out.update(baseline())
    emit(out)


def baseline():
    import torch

    from horovod_ext.baseline import broadcast_initial_state, horovod_optimizer, init_horovod

    hvd = init_horovod()
    rank, size = hvd.rank(), hvd.size()
    out = {}
    for comp in ("none", "fp16"):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(float(rank))  # differs per rank until the broadcast
        opt = horovod_optimizer(torch.optim.SGD(model.parameters(), lr=1.0), model, compression=comp)
        broadcast_initial_state(model, opt)
        x = torch.full((1, 4), float(rank + 1))
        model(x).sum().backward()  # gradient of rank r: r + 1 in every entry
        opt.step()
        want = -sum(r + 1 for r in range(size)) / size  # start 0 (rank 0's), minus the averaged gradient
        out[comp] = model.weight.detach().flatten().tolist()
        if any(abs(v - want) > 1e-3 for v in out[comp]):
            raise SystemExit(f"rank {rank}: {comp} baseline gave {out[comp]}, expected {want}")
    return out


def mode_baseline(args):
    import horovod.torch as hvd

    out = baseline()
    emit(dict(out, rank=hvd.rank(), size=hvd.size()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="checks", choices=["checks", "baseline"])
    ap.add_argument("--fake-hosts", type=int, default=0)
    ap.add_argument("--baseline", action="store_true", help="--mode checks: then check the baselines too")
    args = ap.parse_args()
    if args.fake_hosts:
        os.environ["HIPRESS_HOSTNAME"] = f"fakehost{launch_rank() % args.fake_hosts}"
    {"checks": mode_checks, "baseline": mode_baseline}[args.mode](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
