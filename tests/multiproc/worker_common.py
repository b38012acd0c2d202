"""Shared by the multi-process test workers (run as scripts from this directory)."""
import json
import os

from hipress import config


def emit(d):
    """One RESULT line on stdout, and a file when HIPRESS_TEST_RESULT_DIR is set (mpirun and
    horovodrun may interleave or prefix the output lines of different ranks)."""
    line = json.dumps(d)
    print("RESULT " + line, flush=True)
    where = config.get("HIPRESS_TEST_RESULT_DIR")
    if where:
        with open(os.path.join(where, f"rank{d['rank']}.json"), "w") as f:
            f.write(line)


def gloo_event_loops() -> int:
    """This process's gloo network event-loop threads (one per gloo device; each wakes 100 times
    a second even when idle, so hipress's groups share one: hipress.comm.transport.torch_dist)."""
    tasks = "/proc/self/task"
    names = []
    for t in os.listdir(tasks):
        try:
            with open(os.path.join(tasks, t, "comm")) as f:
                names.append(f.read().strip())
        except OSError:  # a thread that ended meanwhile
            pass
    return names.count("gloo_tcp_loop")


def start_together(directory, rank, size, timeout_s=120.0):
    """File barrier before hipress.init(): each rank marks itself ready in directory and waits
    until all size ranks are. Under load, importing torch can take some ranks many seconds
    longer than others; without this, that skew eats into a short HIPRESS_TIMEOUT_S meant for
    the failure under test (init's own collectives then time out instead)."""
    import time
    open(os.path.join(directory, f"ready.{rank}"), "w").close()
    deadline = time.monotonic() + timeout_s
    while sum(os.path.exists(os.path.join(directory, f"ready.{r}")) for r in range(size)) < size:
        if time.monotonic() > deadline:
            raise SystemExit(f"rank {rank}: the other ranks did not start within {timeout_s:g} s")
        time.sleep(0.02)


def device():
    """The device the workers' models run on (HIPRESS_TEST_DEVICE: cpu, or cuda on a GPU machine)."""
    import torch
    return torch.device(config.get("HIPRESS_TEST_DEVICE"))


def launch_worker(worker, tmp_path, np, configs, timeout):
    """Runs WORKER OUT_DIR CONFIGS_JSON on np ranks with hipress.launch (its timeout stops a hang);
    returns each rank's torch.save'd results (OUT_DIR/rank{r}.pt)."""
    import json
    import sys

    import torch
    from hipress.launch import run

    out = tmp_path / f"out{np}"
    out.mkdir()
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), worker), str(out),
           json.dumps(configs)]
    code, logs = run(cmd, np, timeout=timeout, quiet=True)
    assert code == 0, "\n".join(logs)[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(np)]


def run_ranks_by_hand(cmd, np, env, ranks=None, within_s=180):
    """Starts cmd as ranks of an np-rank job (``ranks``: which; default all) without the launcher,
    which would stop every rank as soon as one fails: the survivors' own reaction is what a test
    looks at. Returns (exit codes, outputs); a rank still running after within_s fails the test."""
    import subprocess

    import pytest
    from hipress.launch import free_port, rank_env

    port = free_port()
    procs = [subprocess.Popen(cmd, env=rank_env(r, np, port, env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for r in (range(np) if ranks is None else ranks)]
    try:
        outs = [p.communicate(timeout=within_s)[0] for p in procs]
    except subprocess.TimeoutExpired:
        pytest.fail(f"a rank still runs {within_s} s after the start (a hang)")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs], outs
