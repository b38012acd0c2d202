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
