"""Local launcher: runs a command as N ranks on this machine (torchrun-style env).

    python -m hipress.launch -np 4 python examples/train.py --epochs 3

Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1
and a free MASTER_PORT, so hipress.init() finds it; rank 0's rendezvous store listens on
127.0.0.1 only, and gloo on the loopback interface (GLOO_SOCKET_IFNAME=lo, unless set);
HIPRESS_JOB_SECRET, unless set, is a fresh random secret of this job, with which the ranks
check that the store they reach is their job's (docs/security.md); OMP_NUM_THREADS, unless set, is the
cores divided among the ranks (as torchrun does: several ranks each running a full-width
OpenMP pool oversubscribe the cores, and idle OpenMP threads spin for milliseconds after
every parallel op, stalling the communication threads; a 64 KB exchange between two ranks
on two cores took 5-8 ms instead of 0.3 ms). Output lines are prefixed with the rank. If
any rank fails, the others are stopped and the launcher exits with that rank's code (128 + N
for a rank killed by signal N); Ctrl-C, SIGTERM, SIGHUP or --timeout (exit 124) stop every
rank. Nothing is left running. The supervision is hipress.supervise's, shared with
hipress.bench.cluster.
"""
from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
from typing import Dict, Optional, Sequence

from hipress import config
from hipress.supervise import Terminated, free_port, restore_signals, supervise, terminate_on_signals


def job_secret(base: Optional[Dict[str, str]] = None) -> str:
    """The job's HIPRESS_JOB_SECRET: the one in ``base`` (default os.environ) if set, else a fresh one."""
    return config.get("HIPRESS_JOB_SECRET", os.environ if base is None else base) or secrets.token_hex(32)


def rank_env(rank: int, size: int, port: int, base: Optional[Dict[str, str]] = None,
             hosts: int = 1, secret: Optional[str] = None) -> Dict[str, str]:
    """Environment of one rank. hosts > 1 pretends the ranks live on that many hosts
    (consecutive ranks per host, via HIPRESS_HOSTNAME), to exercise per-host logic here.
    ``secret``: the job's HIPRESS_JOB_SECRET (:func:`job_secret`; the same for every rank)."""
    env = dict(os.environ if base is None else base)
    per_host = -(-size // hosts)
    local_size = min(per_host, size - (rank // per_host) * per_host)
    env.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank % per_host),
               LOCAL_WORLD_SIZE=str(local_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               PYTHONUNBUFFERED="1")
    if secret:
        env["HIPRESS_JOB_SECRET"] = secret
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank runs here: gloo listens on loopback only
    if hosts > 1:
        env["HIPRESS_HOSTNAME"] = f"host{rank // per_host}"
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // size)))  # every rank runs here
    return env


def run(cmd: Sequence[str], np: int, timeout: Optional[float] = None, env: Optional[Dict[str, str]] = None,
        quiet: bool = False, cwd: Optional[str] = None, hosts: int = 1):
    """Runs cmd as np ranks; returns (exit code, [output lines per rank]).

    Exit code: 0 if all ranks succeeded, else the first failing rank's code (128 + N for
    a rank killed by signal N; 124 on timeout). Every rank is stopped before this returns
    (hipress.supervise).
    """
    if np < 1:
        raise ValueError(f"-np must be >= 1, got {np}")
    if not 1 <= hosts <= np:
        raise ValueError(f"--hosts must be in [1, np={np}], got {hosts}")
    port, secret = free_port(), job_secret(env)
    return supervise(lambda r, **io: subprocess.Popen(list(cmd), env=rank_env(r, np, port, env, hosts, secret),
                                                      cwd=cwd, **io),
                     np, timeout, quiet=quiet, tag="launch")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hipress.launch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-np", "--np", type=int, default=config.get("HIPRESS_NP"), help="number of ranks")
    ap.add_argument("--timeout", type=float, default=None, help="seconds before every rank is stopped")
    ap.add_argument("--hosts", type=int, default=1, help="pretend the ranks are spread over this many hosts")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command each rank runs")
    a = ap.parse_args(argv)
    if a.command[:1] == ["--"]:  # `-np 4 -- python train.py`, as hipress.bench.cluster takes it
        a.command = a.command[1:]
    if not a.command:
        ap.error("no command given (e.g. python -m hipress.launch -np 4 python train.py)")
    old = terminate_on_signals()
    try:
        code, _ = run(a.command, a.np, a.timeout, hosts=a.hosts)
    except KeyboardInterrupt:
        return 130
    except Terminated as t:
        return t.code
    finally:
        restore_signals(old)
    return code


if __name__ == "__main__":
    sys.exit(main())
