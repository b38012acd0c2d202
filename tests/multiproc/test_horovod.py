"""hipress under horovodrun (gloo and MPI): the Horovod transport passes the same checks as the
other transports, examples/train.py gives the same parameters as under the other launchers,
and Horovod's DistributedOptimizer baselines average correctly.

Needs Horovod with its PyTorch extension (``bash scripts/install_horovod.sh``): these tests
skip, saying so, only where ``horovod.torch`` does not import. The tests of what happens
without Horovod (one log line, hipress's own transport) always run.
"""
import json
import os
import subprocess
import sys

import pytest
from example_run import TRAIN, clean_env
from example_run import digests as _digests
from example_run import horovod_missing, horovodrun

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "horovod_worker.py")
# larger batches than test_example.py's run: fewer steps, same comparison, within the time budget
EXAMPLE = [TRAIN, "--epochs", "1", "--batch-size", "64"]


needs_horovod = pytest.mark.skipif(horovod_missing() is not None, reason=str(horovod_missing()))


def _env(**extra):
    return clean_env("60", **extra)


def _results(result_dir):
    res = {}
    for name in sorted(os.listdir(result_dir)):
        with open(os.path.join(result_dir, name)) as f:
            d = json.load(f)
        res[d["rank"]] = d
    return res


# ---------------------------------------------------------------------------- transport
@needs_horovod
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode,n,hosts", [("gloo", 4, 2), ("mpi", 3, 0)])
def test_horovod_transport_all_operations_and_baselines(mode, n, hosts, tmp_path):
    """run_checks on the world, local and cross transports; then hvd.DistributedOptimizer
    (horovod_ext.baseline) with and without fp16 averages the gradients."""
    args = ["--mode", "checks", "--baseline"] + (["--fake-hosts", str(hosts)] if hosts else [])
    rc, out = horovodrun(mode, n, [sys.executable, WORKER, *args], timeout=280, HIPRESS_TEST_RESULT_DIR=tmp_path)
    res = _results(tmp_path)
    assert rc == 0 and sorted(res) == list(range(n)), out[-6000:]
    for r, d in res.items():
        assert d["transport"] == f"horovod/{mode}" and d["size"] == n, d
        assert d["horovod"]["rank"] == r and d["horovod"]["size"] == n, d
        assert "alltoallv" in d["checks"] and "mismatch_errors" in d["checks"] and "groups" in d["checks"], d
        assert d["collective_checks"], d
        if hosts:
            members = [q for q in range(n) if q % hosts == r % hosts]
            assert d["grouping"][:2] == [members.index(r), len(members)], d
        want = -sum(q + 1 for q in range(n)) / n
        assert d["none"] == d["fp16"] == [want] * 4, d


# ---------------------------------------------------------------------------- the example
@pytest.fixture(scope="module")
def local_result():
    from hipress.launch import run

    code, logs = run([sys.executable, *EXAMPLE], 3, timeout=300, quiet=True)
    assert code == 0, "\n".join(logs)[-3000:]
    return _digests("\n".join(logs), 3)


@needs_horovod
@pytest.mark.timeout(330)
@pytest.mark.parametrize("mode", ["gloo", "mpi"])
def test_example_under_horovodrun_gives_identical_result(mode, local_result):
    rc, out = horovodrun(mode, 3, [sys.executable, *EXAMPLE], timeout=300)
    assert rc == 0, out[-4000:]
    digest, accuracy = _digests(out, 3)  # every rank holds the same parameters
    if mode == "gloo":  # gloo's allreduce sums as the local run's does: the same bits
        assert (digest, accuracy) == local_result
    else:
        # uncompressed gradients are summed by the backend's allreduce (hipress.sync.allreduce):
        # MPI adds the ranks' values in another order than gloo, so the last bits differ
        assert accuracy == pytest.approx(local_result[1], abs=0.02)


# ---------------------------------------------------------------------------- without Horovod
_NO_HOROVOD = """
import sys
sys.modules["horovod"] = None          # horovod (and horovod.torch) cannot be imported
import hipress
hipress.init()
print("TRANSPORT", hipress.comm.world.transport().name, flush=True)
hipress.comm.world.shutdown()
hipress.init()                         # a second init says nothing more
hipress.comm.world.shutdown()
"""


@pytest.mark.timeout(60)
def test_without_horovod_hipress_says_why_once():
    env = _env(HOROVOD_RANK=0, HOROVOD_SIZE=1, HOROVOD_LOCAL_RANK=0, HOROVOD_LOCAL_SIZE=1)
    p = subprocess.run([sys.executable, "-c", _NO_HOROVOD], env=env, capture_output=True, text=True, timeout=50)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "TRANSPORT loopback" in p.stdout, p.stdout
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if "Horovod transport is unavailable" in ln]
    assert len(lines) == 1, p.stdout + p.stderr
    assert "horovod.torch does not import" in lines[0] and "install_horovod.sh" in lines[0], lines[0]


@pytest.mark.timeout(60)
def test_without_horovodrun_nothing_is_said():
    p = subprocess.run([sys.executable, "-c", _NO_HOROVOD], env=_env(), capture_output=True, text=True, timeout=50)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Horovod" not in p.stdout + p.stderr, p.stdout + p.stderr


def test_asking_for_horovod_without_it_fails_clearly():
    code = _NO_HOROVOD.replace("hipress.init()\nprint", "hipress.init(transport='horovod')\nprint")
    p = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=50)
    assert p.returncode != 0 and "horovod.torch does not import" in p.stderr, p.stdout + p.stderr


def test_started_by_horovodrun_detection():
    from horovod_ext import started_by_horovodrun

    assert started_by_horovodrun({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "h"})
    mpi = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_MCA_orte_tag_output": "1", "OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "^openib"}
    assert started_by_horovodrun(mpi)                                      # horovodrun --mpi
    assert not started_by_horovodrun(dict(mpi, HIPRESS_HOROVODRUN="0"))
    assert started_by_horovodrun({"OMPI_COMM_WORLD_SIZE": "2", "HIPRESS_HOROVODRUN": "1"})
    assert not started_by_horovodrun({"OMPI_COMM_WORLD_SIZE": "2"})          # plain mpirun
    assert not started_by_horovodrun({"RANK": "0", "WORLD_SIZE": "2"})       # torchrun
    assert not started_by_horovodrun({})
