"""examples/train.py runs unchanged under the built-in launcher, torchrun and mpirun,
with identical results for a fixed seed (same final parameters on every rank)."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from hipress.launch import run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = [os.path.join(ROOT, "examples", "train.py"), "--epochs", "1"]
DONE = re.compile(r"rank (\d)/(\d) done: test accuracy ([0-9.]+) .*? params sha256 ([0-9a-f]{16})")


def digests(text):
    found = DONE.findall(text)
    assert len(found) == 3, text[-3000:]
    assert len({f[3] for f in found}) == 1, f"ranks disagree: {found}"
    return found[0][3], float(found[0][2])


@pytest.fixture(scope="module")
def local_result():
    code, logs = run([sys.executable, *EXAMPLE], 3, timeout=300, quiet=True)
    assert code == 0, "\n".join(logs)[-3000:]
    return digests("\n".join(logs))


def test_local_launcher_trains(local_result):
    _, acc = local_result
    assert acc > 0.3  # one epoch (31 steps) of 3 ranks on digits; chance is 0.1


def test_torchrun_gives_identical_result(local_result):
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3", *EXAMPLE],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert digests(p.stdout + p.stderr) == local_result


@pytest.mark.mpi
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed")
def test_mpirun_gives_identical_result(local_result):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    p = subprocess.run(["mpirun", "--oversubscribe", "-np", "3", sys.executable, *EXAMPLE],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert digests(p.stdout + p.stderr) == local_result
