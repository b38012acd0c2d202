"""examples/horovod/: Horovod-style scripts whose only hipress line is ``import hipress as hvd``,
on 2 ranks under every launcher (python -m hipress.launch, torchrun, mpirun, horovodrun), and
the same files run on Horovod itself with that line changed to ``import horovod.torch as hvd``.

The MNIST example (scikit-learn's digits) reaches a stated accuracy, and for a fixed seed every
launcher gives the same parameters bit for bit: hipress's averages do not depend on the transport.
"""
import ast
import os
import re
import shutil
import subprocess
import sys

import pytest
from example_run import ROOT, clean_env, digests, horovodrun

from hipress.launch import run

N = 2
EXAMPLES = os.path.join(ROOT, "examples", "horovod")
MNIST = os.path.join(EXAMPLES, "pytorch_mnist.py")
SYNTHETIC = os.path.join(EXAMPLES, "pytorch_synthetic_benchmark.py")
# 2 epochs of 24 steps per rank: about 80% on digits (chance 10%)
MNIST_ARGS = ["--no-cuda", "--lr", "0.1", "--batch-size", "32", "--epochs", "2"]
MNIST_ACCURACY = 0.6
SYNTHETIC_ARGS = ["--no-cuda", "--model", "resnet_tiny", "--image-size", "32", "--num-classes", "10",
                  "--batch-size", "8", "--num-warmup-batches", "1", "--num-batches-per-iter", "2", "--num-iters", "2"]
IMPORT_LINE_OF_HIPRESS = "import hipress as hvd\n"
IMPORT_LINE_OF_HOROVOD = "import horovod.torch as hvd\n"
needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed")


def launch_local(cmd):
    code, logs = run([sys.executable, *cmd], N, timeout=240, quiet=True, env=clean_env("60"))
    out = "\n".join(logs)
    assert code == 0, out[-4000:]
    return out


def launch_torchrun(cmd):
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(N), *cmd],
                       capture_output=True, text=True, timeout=240, env=clean_env("60"))
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return p.stdout + p.stderr


def launch_mpirun(cmd):
    env = clean_env("60", OMPI_ALLOW_RUN_AS_ROOT=1, OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1, OMPI_MCA_mpi_yield_when_idle=1)
    p = subprocess.run(["mpirun", "--oversubscribe", "-np", str(N), sys.executable, *cmd],
                       capture_output=True, text=True, timeout=240, env=env)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return p.stdout + p.stderr


def launch_horovodrun(mode):
    def launch(cmd):
        rc, out = horovodrun(mode, N, [sys.executable, *cmd], timeout=240)
        assert rc == 0, out[-4000:]
        return out
    return launch


def on_horovod(script, tmp_path):
    """A copy of script whose import line is Horovod's: the only line that differs."""
    text = open(script).read()
    tree = ast.parse(text)
    imports = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
               and "hipress" in ast.unparse(n)]
    names = [n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "hipress"]
    assert imports == [IMPORT_LINE_OF_HIPRESS.strip()] and not names and text.count(IMPORT_LINE_OF_HIPRESS) == 1, \
        f"{script} must use hipress only through its one import line: {imports} {names}"
    copy = tmp_path / os.path.basename(script)
    copy.write_text(text.replace(IMPORT_LINE_OF_HIPRESS, IMPORT_LINE_OF_HOROVOD))
    return str(copy)


def check_benchmark(out):
    """Every timed iteration and the totals were printed, with positive rates."""
    iters = re.findall(r"Iter #(\d+): ([0-9.]+) img/sec per CPU", out)
    assert [int(i) for i, _ in iters] == [0, 1] and all(float(r) > 0 for _, r in iters), out[-3000:]
    total = re.search(rf"Total img/sec on {N} CPU\(s\): ([0-9.]+) \+-([0-9.]+)", out)
    assert total and float(total.group(1)) > 0, out[-3000:]


# ------------------------------------------------------------------ MNIST-shaped example
@pytest.fixture(scope="module")
def mnist_local():
    return digests(launch_local([MNIST, *MNIST_ARGS]), N)


def test_mnist_under_hipress_launch_learns(mnist_local):
    _, accuracy = mnist_local
    assert accuracy > MNIST_ACCURACY


def test_mnist_under_torchrun_gives_identical_result(mnist_local):
    assert digests(launch_torchrun([MNIST, *MNIST_ARGS]), N) == mnist_local


@pytest.mark.mpi
@needs_mpirun
def test_mnist_under_mpirun_gives_identical_result(mnist_local):
    assert digests(launch_mpirun([MNIST, *MNIST_ARGS]), N) == mnist_local


@pytest.mark.timeout(300)
def test_mnist_under_horovodrun_gives_identical_result(mnist_local):
    assert digests(launch_horovodrun("gloo")([MNIST, *MNIST_ARGS]), N) == mnist_local


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_mnist_under_horovodrun_mpi_gives_identical_result(mnist_local):
    assert digests(launch_horovodrun("mpi")([MNIST, *MNIST_ARGS]), N) == mnist_local


@pytest.mark.slow
def test_mnist_gradient_predivide_factor_changes_nothing(mnist_local):
    """With 2 ranks and a factor of 2, g/2 + g'/2, halved, doubled, is exactly (g + g')/2."""
    assert digests(launch_local([MNIST, *MNIST_ARGS, "--gradient-predivide-factor", "2"]), N) == mnist_local


@pytest.mark.slow
def test_mnist_fp16_allreduce_learns():
    _, accuracy = digests(launch_local([MNIST, *MNIST_ARGS, "--fp16-allreduce"]), N)
    assert accuracy > MNIST_ACCURACY


def test_mnist_adasum_learns():
    """--use-adasum: each rank's SGD update, combined by Adasum in step() (lr not scaled)."""
    _, accuracy = digests(launch_local([MNIST, *MNIST_ARGS, "--use-adasum"]), N)
    assert accuracy > MNIST_ACCURACY


@pytest.mark.slow
def test_mnist_adasum_fp16_learns():
    _, accuracy = digests(launch_local([MNIST, *MNIST_ARGS, "--use-adasum", "--fp16-allreduce"]), N)
    assert accuracy > MNIST_ACCURACY


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mnist_on_horovod_itself(mnist_local, tmp_path):
    """The same file on Horovod (import line changed) learns as well; with 2 ranks its average
    (one addition, halved) is exact too, so it gives hipress's parameters bit for bit."""
    got = digests(launch_horovodrun("gloo")([on_horovod(MNIST, tmp_path), *MNIST_ARGS]), N)
    assert got[1] > MNIST_ACCURACY
    assert got == mnist_local


# ------------------------------------------------------------------ synthetic benchmark
def test_synthetic_benchmark_under_hipress_launch():
    check_benchmark(launch_local([SYNTHETIC, *SYNTHETIC_ARGS]))


@pytest.mark.slow
def test_synthetic_benchmark_fp16_allreduce_under_hipress_launch():
    check_benchmark(launch_local([SYNTHETIC, *SYNTHETIC_ARGS, "--fp16-allreduce", "--model", "cnn_small"]))


@pytest.mark.slow
def test_synthetic_benchmark_under_torchrun():
    check_benchmark(launch_torchrun([SYNTHETIC, *SYNTHETIC_ARGS]))


@pytest.mark.slow
@pytest.mark.mpi
@needs_mpirun
def test_synthetic_benchmark_under_mpirun():
    check_benchmark(launch_mpirun([SYNTHETIC, *SYNTHETIC_ARGS]))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["gloo", pytest.param("mpi", marks=pytest.mark.mpi)])
def test_synthetic_benchmark_under_horovodrun(mode):
    check_benchmark(launch_horovodrun(mode)([SYNTHETIC, *SYNTHETIC_ARGS]))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_synthetic_benchmark_on_horovod_itself(tmp_path):
    check_benchmark(launch_horovodrun("gloo")([on_horovod(SYNTHETIC, tmp_path), *SYNTHETIC_ARGS]))
