"""examples/train.py runs unchanged under the built-in launcher, torchrun and mpirun,
with identical results for a fixed seed (same final parameters on every rank; the same bits
as the built-in launcher's where the transport is the same, gloo under torchrun)."""
import os
import shutil
import subprocess
import sys

import pytest
from example_run import TRAIN
from example_run import digests as _digests

from hipress.launch import run

EXAMPLE = [TRAIN, "--epochs", "1"]


def digests(text):
    return _digests(text, 3)


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
    # every rank holds the same parameters (digests() checks); uncompressed gradients are summed
    # by the transport's allreduce (MPI_Allreduce here, gloo's in the local run), which add the
    # ranks' values in their own orders, so the bits may differ but not the training
    _, accuracy = digests(p.stdout + p.stderr)
    assert accuracy == pytest.approx(local_result[1], abs=0.02)
