"""Transport checks on the in-process loopback transport (N ranks as threads), the failure
semantics of the interface, and runtime launch discovery. The byte-exact checks are the
same functions the multi-process gloo and MPI tests run (hipress.comm.transport.testing)."""
import time

import pytest
import torch

from hipress.comm import world
from hipress.comm.transport import loopback
from hipress.comm.transport.base import TransportError
from hipress.comm.transport.testing import CHECKS, run_checks


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_all_checks(n):
    res = loopback.spawn(n, run_checks, timeout_s=20)
    assert all("alltoallv" in r for r in res)
    if n > 1:
        assert all("mismatch_errors" in r for r in res)


@pytest.mark.timeout(60)
def test_checks_without_metadata_checks():
    res = loopback.spawn(3, lambda t: run_checks(t, list(CHECKS)), timeout_s=20, check=False)
    assert len(res) == 3


@pytest.mark.timeout(30)
def test_failed_rank_ends_the_others_waits_at_once():
    seen = {}

    def body(t):
        if t.rank == 1:
            raise ValueError("boom on purpose")
        t0 = time.monotonic()
        try:
            t.alltoallv(torch.zeros(3, dtype=torch.uint8), [1, 1, 1], torch.zeros(3, dtype=torch.uint8), [1, 1, 1])
        except TransportError as e:
            seen[t.rank] = (e, time.monotonic() - t0)
            raise

    with pytest.raises(ValueError, match="boom on purpose") as info:
        loopback.spawn(3, body, timeout_s=30)
    assert info.value.loopback_rank == 1  # the root cause, not the consequences
    for r in (0, 2):
        e, dt = seen[r]
        assert e.peers == [1] and e.op == "alltoallv" and "rank 1 failed with ValueError" in str(e)
        assert dt < 5, "a dead peer must be noticed at once, not after the timeout"


@pytest.mark.timeout(30)
def test_late_rank_times_out_with_its_name():
    seen = {}

    def body(t):
        if t.rank == 2:
            time.sleep(2.0)
            return
        t0 = time.monotonic()
        try:
            t.barrier()
        except TransportError as e:
            seen[t.rank] = (e, time.monotonic() - t0)
            raise

    with pytest.raises(TransportError):
        loopback.spawn(3, body, timeout_s=0.5)
    for r in (0, 1):
        e, dt = seen[r]
        assert e.peers == [2] and "timed out after 0.5 s" in str(e), e
        assert 0.4 < dt < 1.9


@pytest.mark.timeout(30)
def test_recv_from_silent_peer_names_it():
    def body(t):
        if t.rank == 0:
            with pytest.raises(TransportError, match=r"recv\(src=2, tag=5\)") as info:
                t.recv(torch.zeros(4, dtype=torch.uint8), 2, tag=5)
            assert info.value.peers == [2]
        else:
            time.sleep(0.8)

    loopback.spawn(3, body, timeout_s=0.3)


@pytest.mark.timeout(30)
def test_collective_mismatch_is_reported():
    def body(t):
        if t.rank == 0:
            t.barrier()
        else:
            t.broadcast(torch.zeros(4, dtype=torch.uint8), 0)

    with pytest.raises(TransportError, match="collective mismatch"):
        loopback.spawn(2, body, timeout_s=5)


@pytest.mark.timeout(30)
def test_failure_reaches_sub_transports():
    def body(t):
        sub = t.split(0)
        if t.rank == 2:
            raise RuntimeError("gone")
        with pytest.raises(TransportError, match="rank 2") as info:
            sub.barrier()
        assert info.value.peers == [2]

    with pytest.raises(RuntimeError, match="gone"):
        loopback.spawn(3, body, timeout_s=10)


def test_bad_arguments_fail_locally():
    def body(t):
        with pytest.raises(TransportError, match="not a rank"):
            t.send(torch.zeros(1, dtype=torch.uint8), 5)
        with pytest.raises(TransportError, match="uint8"):
            t.send(torch.zeros(1, dtype=torch.float32), 1 - t.rank)
        with pytest.raises(TransportError, match="tag"):
            t.send(torch.zeros(1, dtype=torch.uint8), 1 - t.rank, tag=-1)
        with pytest.raises(TransportError, match="self"):
            t.recv(torch.zeros(1, dtype=torch.uint8), t.rank)
        with pytest.raises(TransportError, match="2 entries, expected size=2|entries"):
            t.alltoallv(torch.zeros(2, dtype=torch.uint8), [1, 1, 1], torch.zeros(2, dtype=torch.uint8), [1, 1])
        t.close()
        with pytest.raises(TransportError, match="closed"):
            t.barrier()

    loopback.spawn(2, body, timeout_s=5)


def test_split_and_subgroup_membership():
    def body(t):
        evens = t.split(0 if t.rank % 2 == 0 else None)
        g = t.subgroup([3, 1])
        return (None if evens is None else (evens.rank, evens.size), None if g is None else (g.rank, g.size))

    res = loopback.spawn(4, body, timeout_s=5)
    assert res == [((0, 2), None), (None, (1, 2)), ((1, 2), None), (None, (0, 2))]


# ---------------------------------------------------------------------------- runtime
LAUNCH_VARS = ["OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_RANK", "PMI_SIZE",
               "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_GLOO_RENDEZVOUS_ADDR", "RANK",
               "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HIPRESS_TRANSPORT", "HIPRESS_HOSTNAME"]


@pytest.fixture
def clean_env(monkeypatch):
    for k in LAUNCH_VARS:
        monkeypatch.delenv(k, raising=False)
    world.shutdown()
    yield monkeypatch
    world.shutdown()


@pytest.mark.parametrize("env,expect", [
    ({}, ("single", 0, 1, None)),
    ({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1234"}, ("torchrun", 2, 4, 0)),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}, ("mpi", 1, 3, 1)),
    ({"PMI_RANK": "0", "PMI_SIZE": "2"}, ("mpi", 0, 2, None)),
    ({"HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "1.2.3.4",
      "HOROVOD_GLOO_RENDEZVOUS_PORT": "5"}, ("horovod-gloo", 3, 4, 1)),
    # horovodrun --mpi: OpenMPI's variables are the truth
    ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, ("mpi", 1, 2, None)),
])
def test_detect_launch(env, expect):
    info = world.detect_launch(env)
    assert (info.launcher, info.rank, info.size, info.local_rank) == expect


def test_detect_launch_explicit_overrides_env():
    info = world.detect_launch({"RANK": "1", "WORLD_SIZE": "2"}, rank=0, size=3, master_addr="a", master_port=7)
    assert (info.launcher, info.rank, info.size, info.master_addr, info.master_port) == ("explicit", 0, 3, "a", 7)
    with pytest.raises(ValueError):
        world.detect_launch({}, rank=0)


def test_runtime_single_process(clean_env):
    assert not world.is_initialized()
    with pytest.raises(RuntimeError, match="init"):
        world.rank()
    world.init()
    world.init()  # idempotent
    assert (world.rank(), world.size(), world.local_rank(), world.local_size(),
            world.cross_rank(), world.cross_size()) == (0, 1, 0, 1, 0, 1)
    t = world.transport()
    assert t.name == "loopback" and t.size == 1
    run_checks(t)
    world.shutdown()
    assert not world.is_initialized()


def test_runtime_torch_single_process(clean_env):
    clean_env.setenv("HIPRESS_TRANSPORT", " Torch ")  # the variable's value in any case
    world.init()
    t = world.transport()
    assert t.name == "torch/gloo" and (t.rank, t.size) == (0, 1)
    run_checks(t)


def test_runtime_rejects_unknown_transport(clean_env):
    clean_env.setenv("HIPRESS_TRANSPORT", "carrier-pigeon")
    with pytest.raises(ValueError, match="carrier-pigeon"):
        world.init()
    assert not world.is_initialized()


def test_runtime_with_given_transport(clean_env):
    t = loopback.LoopbackTransport(loopback.LoopbackWorld(1), 0)
    world.init(transport=t)
    assert world.transport() is t and world.size() == 1


def test_timeout_env(monkeypatch):
    from hipress.comm.transport.base import default_timeout_s

    monkeypatch.setenv("HIPRESS_TIMEOUT_S", "2.5")
    assert default_timeout_s() == 2.5
    monkeypatch.setenv("HIPRESS_TIMEOUT_S", "0")
    with pytest.raises(ValueError):
        default_timeout_s()


def test_nccl_is_import_safe_and_clearly_unavailable_without_cuda(clean_env):
    import torch

    from hipress.comm.transport import nccl

    if torch.cuda.is_available():
        pytest.skip("CUDA present: this test checks the error path of a machine without CUDA")
    assert not nccl.available()
    assert "CUDA is not available" in nccl.unavailable_reason()
    boot = loopback.LoopbackTransport(loopback.LoopbackWorld(1), 0)
    with pytest.raises(TransportError, match="CUDA is not available"):
        nccl.NcclTransport.create(boot)
    clean_env.setenv("HIPRESS_TRANSPORT", "nccl")
    with pytest.raises(TransportError, match="CUDA is not available"):
        world.init()
    assert not world.is_initialized()
