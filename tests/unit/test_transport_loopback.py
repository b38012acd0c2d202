"""Transport checks on the in-process loopback transport (N ranks as threads), the failure
semantics of the interface, and runtime launch discovery. The byte-exact checks are the
same functions the multi-process gloo and MPI tests run (hipress.comm.transport.testing)."""
import threading
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


@pytest.mark.timeout(120)
def test_failed_rank_ends_the_others_waits_at_once():
    # Load-proof: "at once, not after the timeout" is shown by the error itself (it names the
    # failure, and a timeout would say "timed out after 60 s"), not by an elapsed-time bound.
    seen = {}

    def body(t):
        if t.rank == 1:
            raise ValueError("boom on purpose")
        try:
            t.alltoallv(torch.zeros(3, dtype=torch.uint8), [1, 1, 1], torch.zeros(3, dtype=torch.uint8), [1, 1, 1])
        except TransportError as e:
            seen[t.rank] = e
            raise

    with pytest.raises(ValueError, match="boom on purpose") as info:
        loopback.spawn(3, body, timeout_s=60)
    assert info.value.loopback_rank == 1  # the root cause, not the consequences
    for r in (0, 2):
        e = seen[r]
        assert e.peers == [1] and e.op == "alltoallv" and "rank 1 failed with ValueError" in str(e)
        assert "timed out" not in str(e), "a dead peer must be noticed at once, not after the timeout"


@pytest.mark.timeout(60)
def test_late_rank_times_out_with_its_name():
    # Load-proof: the late rank stays alive and silent until both others have timed out (it
    # once slept 2 s, which a slow start of the others could outlast), and the wait is
    # checked from below only: the timeout never fires early, load can only make it late.
    seen, lock, both_failed = {}, threading.Lock(), threading.Event()

    def body(t):
        if t.rank == 2:
            both_failed.wait(30)
            return
        t0 = time.monotonic()
        try:
            t.barrier()
        except TransportError as e:
            with lock:
                seen[t.rank] = (e, time.monotonic() - t0)
                if len(seen) == 2:
                    both_failed.set()
            raise

    with pytest.raises(TransportError):
        loopback.spawn(3, body, timeout_s=0.5)
    for r in (0, 1):
        e, dt = seen[r]
        assert e.peers == [2] and "timed out after 0.5 s" in str(e), e
        assert dt >= 0.5 - 0.01, dt  # (0.01 s: the clock's and the wait's rounding)


@pytest.mark.timeout(60)
def test_recv_from_silent_peer_names_it():
    # Load-proof: the peers stay alive and silent until rank 0 has timed out (they once slept
    # 0.8 s, which a slow start of rank 0 could outlast, making the peer gone, not silent).
    recv_failed = threading.Event()

    def body(t):
        if t.rank == 0:
            try:
                with pytest.raises(TransportError, match=r"recv\(src=2, tag=5\).*timed out") as info:
                    t.recv(torch.zeros(4, dtype=torch.uint8), 2, tag=5)
                assert info.value.peers == [2]
            finally:
                recv_failed.set()
        else:
            recv_failed.wait(30)

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


# ---- receivers bound what peers announce (max_bytes) ---------------------------------------
HUGE = 1 << 50  # an announcement no allocator can serve: allocating it raises RuntimeError


def _announce(t, nbytes):
    """Make this rank's transport announce nbytes for any non-empty send (a forged size)."""
    real = t._header
    t._header = lambda n, like: real(nbytes if n > 0 else n, like)


def _outcome(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the outcome is what the test checks
        return e


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bounded", [True, False])
def test_sendrecv_alloc_refuses_announcement_over_max_bytes(bounded):
    """Rank 0 announces 2^50 bytes to rank 1. With max_bytes, rank 1 raises a TransportError
    naming rank 0 before allocating, and still sends its own payload on (rank 2 gets it).
    Without it (the control), rank 1 tries to allocate 2^50 bytes."""
    def body(t):
        n, r = t.size, t.rank
        if r == 0:
            _announce(t, HUGE)
        send = torch.full((10 + r,), r, dtype=torch.uint8)
        return _outcome(lambda: t.sendrecv_alloc(send, (r + 1) % n, (r - 1) % n,
                                                 max_bytes=100 if bounded else None))

    res = loopback.spawn(3, body, timeout_s=10)
    if not bounded:  # allocation attempted; rank 1's payload never goes on, so rank 2 fails too
        assert isinstance(res[1], RuntimeError) and not isinstance(res[1], TransportError)
        assert isinstance(res[2], TransportError)
        return
    assert isinstance(res[1], TransportError) and res[1].peers == [0], res[1]
    assert f"announced {HUGE} bytes, more than the 100" in str(res[1])
    assert torch.equal(res[2], torch.full((11,), 1, dtype=torch.uint8))  # rank 1's payload arrived
    assert torch.equal(res[0], torch.full((12,), 2, dtype=torch.uint8))


@pytest.mark.timeout(60)
def test_sendrecv_alloc_max_bytes_allows_up_to_the_bound_and_checks_its_type():
    def body(t):
        r = t.rank
        got = t.sendrecv_alloc(torch.full((7,), r, dtype=torch.uint8), 1 - r, 1 - r, max_bytes=7)
        bad = _outcome(lambda: t.sendrecv_alloc(torch.zeros(1, dtype=torch.uint8), 1 - r, 1 - r, max_bytes=-1))
        return got, bad

    res = loopback.spawn(2, body, timeout_s=10)
    for r, (got, bad) in enumerate(res):
        assert torch.equal(got, torch.full((7,), 1 - r, dtype=torch.uint8))
        assert isinstance(bad, TransportError) and "max_bytes" in str(bad)


@pytest.mark.timeout(60)
def test_alltoallv_alloc_max_bytes_checked_every_rank_raises_the_same_and_stays_usable():
    """With checking, the receivers' bounds travel in the validating all-gather: every rank
    raises the same error naming sender and receiver, and the transport stays usable."""
    def body(t):
        n, r = t.size, t.rank
        sc = [10 if (r, j) == (2, 0) else 1 for j in range(n)]
        send = torch.full((sum(sc),), r, dtype=torch.uint8)
        limits = [None, None, 5] if r == 0 else 100
        err = _outcome(lambda: t.alltoallv_alloc(send, sc, max_bytes=limits))
        ok = t.alltoallv_alloc(torch.full((n,), r, dtype=torch.uint8), [1] * n, max_bytes=[1] * n)
        return err, ok

    res = loopback.spawn(3, body, timeout_s=10)
    msgs = set()
    for r, (err, ok) in enumerate(res):
        assert isinstance(err, TransportError) and err.peers == [0, 2], err
        msgs.add(str(err).split(" failed on ")[1].split(": ", 1)[1])
        buf, rc = ok
        assert rc == [1, 1, 1] and buf.tolist() == [0, 1, 2]
    assert len(msgs) == 1 and "rank 2 announced 10 bytes to rank 0, which accepts at most 5" in msgs.pop()


@pytest.mark.timeout(60)
def test_alltoallv_alloc_max_bytes_unchecked_receiver_raises_before_allocating():
    """Without checking only the receiver knows: it raises naming the sender (before the
    payload buffer exists); the others' payload collective then fails, naming it."""
    def body(t):
        n, r = t.size, t.rank
        sc = [HUGE if (r, j) == (1, 0) else 1 for j in range(n)]
        # rank 1 announces 2^50 bytes to rank 0 (its buffer could never hold them: count only)
        t._segments = lambda op, side, buf, counts, problems: [int(c) for c in counts]
        return _outcome(lambda: t.alltoallv_alloc(torch.zeros(n, dtype=torch.uint8), sc,
                                                  max_bytes=1000 if r == 0 else None))

    res = loopback.spawn(3, body, timeout_s=5, check=False)
    assert isinstance(res[0], TransportError) and res[0].peers == [1]
    assert f"rank 1 announced {HUGE} bytes, this rank accepts at most 1000" in str(res[0])
    for r in (1, 2):
        assert isinstance(res[r], TransportError) and 0 in res[r].peers
