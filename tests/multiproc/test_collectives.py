"""Horovod's collective API in the hipress namespace (hipress/torch/collectives.py): every op
against exact expected values on 2 and 3 real processes, over torch.distributed/gloo and under
mpirun (hipress's MPI transport). One worker run per configuration runs all the checks
(collectives_worker.py): reductions (Average/Sum/Min/Max/Product, integer and float dtypes,
prescale/postscale, Adasum), allgather with variable first dimensions, broadcast from every root,
alltoall with uneven splits, reducescatter with uneven rows, zero-size tensors, grouped, in-place
and async forms, process sets of a subset of ranks, autograd gradients, SyncBatchNorm against one
BatchNorm over all the batches, join with one rank stopping early, and mismatch errors raised on
every rank.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest
from example_run import clean_env

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "collectives_worker.py")
TIMEOUT_S = 280  # per configuration; every spawned process is killed after it


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(p):
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait()


def _run(cmds_envs):
    """Start the processes; wait for all (killing all after TIMEOUT_S: a hang fails the test)."""
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for cmd, env in cmds_envs]
    outs = []
    try:
        for p in procs:
            try:
                outs.append(p.communicate(timeout=TIMEOUT_S)[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    _kill(q)
                pytest.fail(f"still running after {TIMEOUT_S} s (a hang):\n" + "\n".join(outs)[-6000:])
    finally:
        for p in procs:
            _kill(p)
    return [p.returncode for p in procs], "\n".join(outs)


def _results(result_dir):
    res = {}
    for name in sorted(n for n in os.listdir(result_dir) if n.endswith(".json")):
        with open(os.path.join(result_dir, name)) as f:
            d = json.load(f)
        res[d["rank"]] = d
    return res


def _check(n, rcs, res, out, transport):
    assert sorted(res) == list(range(n)), out[-6000:]
    failed = {r: d["failed"] for r, d in res.items() if d["failed"]}
    assert not failed, "\n".join(f"--- rank {r}: {name}\n{why}" for r, f in failed.items() for name, why in f.items())
    assert rcs == [0] * len(rcs), out[-6000:]
    names = set(res[0]["passed"])
    for r, d in res.items():
        assert d["size"] == n and d["transport"] == transport, d
        assert set(d["passed"]) == names, (r, d["passed"])
    assert len(names) == 19, sorted(names)  # every check of collectives_worker.run_all


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 3])
def test_collectives_gloo(n, tmp_path):
    port = _free_port()
    runs = [([sys.executable, WORKER], clean_env("30", RANK=r, WORLD_SIZE=n, LOCAL_RANK=r, MASTER_ADDR="127.0.0.1",
                                                 MASTER_PORT=port, EXPECT_TRANSPORT="torch/gloo",
                                                 HIPRESS_TEST_RESULT_DIR=tmp_path))
            for r in range(n)]
    rcs, out = _run(runs)
    _check(n, rcs, _results(tmp_path), out, "torch/gloo")


def _mpi_missing():
    if shutil.which("mpirun") is None:
        return "mpirun not found"
    try:
        from hipress import _C
    except ImportError as e:
        return f"hipress._C not built: {e}"
    return None if getattr(_C, "with_mpi", False) else "hipress was built without MPI"


@pytest.mark.skipif(_mpi_missing() is not None, reason=str(_mpi_missing()))
@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 3])
def test_collectives_mpi(n, tmp_path):
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(n), sys.executable, WORKER]
    env = clean_env("30", EXPECT_TRANSPORT="mpi", HIPRESS_TEST_RESULT_DIR=tmp_path, OMPI_MCA_mpi_yield_when_idle=1)
    rcs, out = _run([(cmd, env)])
    _check(n, rcs, _results(tmp_path), out, "mpi")


def _horovod_missing():
    try:
        import horovod.torch as hvd_  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"horovod.torch does not import ({type(e).__name__}: {e})"
    if shutil.which("horovodrun") is None:
        return "horovodrun is not on PATH"
    if shutil.which("mpirun") is None or not hvd_.mpi_built():
        return "Horovod without MPI"
    return None


@pytest.mark.skipif(_horovod_missing() is not None, reason=str(_horovod_missing()))
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,n", [("gloo", 2), ("mpi", 3)])
def test_collectives_under_horovodrun(mode, n, tmp_path):
    """The same checks with Horovod's own collectives underneath (the Horovod transport)."""
    cmd = ["horovodrun", f"--{mode}", "-np", str(n), "-H", f"localhost:{n}", sys.executable, WORKER]
    env = clean_env("30", EXPECT_TRANSPORT=f"horovod/{mode}", HIPRESS_TEST_RESULT_DIR=tmp_path,
                    OMPI_MCA_mpi_yield_when_idle=1)
    rcs, out = _run([(cmd, env)])
    _check(n, rcs, _results(tmp_path), out, f"horovod/{mode}")


PARITY_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "horovod_parity_worker.py")


def _last_calls(result_dir):
    """Each rank's last three calls started (horovod_parity_worker.started)."""
    lines = []
    for name in sorted(n for n in os.listdir(result_dir) if n.startswith("progress.")):
        with open(os.path.join(result_dir, name)) as f:
            lines.append(f"rank {name.split('.', 1)[1]} last calls: " + " | ".join(f.read().splitlines()[-3:]))
    return "\n".join(lines) + "\n"


@pytest.mark.skipif(_horovod_missing() is not None, reason=str(_horovod_missing()))
@pytest.mark.timeout(300)
def test_same_results_as_horovod(tmp_path):
    """Each call made through horovod.torch and through hipress on 3 ranks: same values (integers
    exactly), shapes, dtypes, gradients and exception types."""
    n = 3
    cmd = ["horovodrun", "--gloo", "-np", str(n), "-H", f"localhost:{n}", sys.executable, PARITY_WORKER]
    rcs, out = _run([(cmd, clean_env("30", HIPRESS_TEST_RESULT_DIR=tmp_path))])
    res = _results(tmp_path)
    assert sorted(res) == list(range(n)), _last_calls(tmp_path) + out[-6000:]
    for r, d in res.items():
        assert d["diffs"] == [], "\n".join(d["diffs"])[:6000]
        assert d["compared"] >= 150, d["compared"]
    assert rcs == [0], out[-4000:]
