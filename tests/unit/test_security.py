"""docs/security.md, in one process: rank 0's store listens only on the announced address,
the job-secret check, and nothing a peer sends is unpickled by default (broadcast_object,
broadcast_optimizer_state; ranks as threads over the loopback transport).
The same through hipress.launch, with real processes: tests/multiproc/test_security_ranks.py."""
import datetime
import errno
import fcntl
import io
import json
import math
import socket
import struct
import threading
import types

import pytest
import torch

import hipress.torch.functions as F
from hipress.comm import rendezvous
from hipress.comm.transport import loopback
from hipress.comm.transport.base import TransportError


def non_loopback_ipv4():
    """An IPv4 address of this host that is not loopback (None if it has none)."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
        addr = socket.inet_ntoa(raw[20:24])
        if not addr.startswith("127."):
            return addr
    return None


OTHER = non_loopback_ipv4()
needs_other = pytest.mark.skipif(OTHER is None, reason="this host has no non-loopback IPv4 address to connect from")


def _refused(addr, port) -> bool:
    try:
        socket.create_connection((addr, port), timeout=5).close()
        return False
    except OSError as e:
        assert e.errno in (errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH), e
        return True


# ---------------------------------------------------------------------------- where rank 0 listens
@needs_other
def test_listen_binds_the_announced_address_only(monkeypatch):
    monkeypatch.delenv("HIPRESS_BIND_ADDR", raising=False)
    s = rendezvous.listen("127.0.0.1")
    try:
        port = s.getsockname()[1]
        assert s.getsockname()[0] == "127.0.0.1"
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        assert _refused(OTHER, port)
    finally:
        s.close()
    # the control: listening everywhere (what torch's TCPStore does by itself) is reachable from OTHER
    monkeypatch.setenv("HIPRESS_BIND_ADDR", "*")
    s = rendezvous.listen("127.0.0.1")
    try:
        socket.create_connection((OTHER, s.getsockname()[1]), timeout=5).close()
    finally:
        s.close()


def test_bind_address_rules(monkeypatch):
    monkeypatch.delenv("HIPRESS_BIND_ADDR", raising=False)
    assert rendezvous.bind_address("127.0.0.1") == "127.0.0.1"
    assert rendezvous.bind_address("10.1.2.3") == "10.1.2.3"  # a literal: bound as is (fails if not ours)
    assert rendezvous.bind_address("localhost") == "localhost"
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [(socket.AF_INET, 1, 6, "", ("127.0.1.1", 0))])
    with pytest.warns(RuntimeWarning, match="every interface"):
        assert rendezvous.bind_address("myhost") is None  # may be another address on the other hosts
    assert rendezvous.bind_address("myhost", single_host=True) == "myhost"
    monkeypatch.setenv("HIPRESS_BIND_ADDR", "10.9.9.9")
    assert rendezvous.bind_address("127.0.0.1") == "10.9.9.9"
    monkeypatch.setenv("HIPRESS_BIND_ADDR", "*")
    assert rendezvous.bind_address("127.0.0.1") is None


def test_an_address_not_of_this_host_says_what_to_set(monkeypatch):
    monkeypatch.delenv("HIPRESS_BIND_ADDR", raising=False)
    with pytest.raises(TransportError, match="HIPRESS_BIND_ADDR"):
        rendezvous.tcp_store("192.0.2.254" if OTHER != "192.0.2.254" else "198.51.100.254", 0, 2, 0, 5.0)


def _two_ranks(port_holder, secrets_, timeout=20.0, addr="127.0.0.1"):
    """Rank 0 (a thread) and rank 1 (this thread) make the store; returns (rank-0 result, rank-1 result),
    each a store or the exception it raised."""
    listener = rendezvous.listen(addr, 0)
    port = listener.getsockname()[1]
    port_holder.append(port)
    out = {}

    def rank(r):
        try:
            out[r] = rendezvous.tcp_store(addr, port, 2, r, timeout, listener=listener if r == 0 else None,
                                          secret=secrets_[r], tag="t")
        except Exception as e:  # noqa: BLE001 - returned to the test
            out[r] = e

    t = threading.Thread(target=rank, args=(0,), daemon=True)
    t.start()
    rank(1)
    t.join(timeout * 3)
    assert not t.is_alive()
    return out[0], out[1]


@needs_other
def test_store_reachable_on_loopback_not_from_another_address(monkeypatch):
    monkeypatch.delenv("HIPRESS_BIND_ADDR", raising=False)
    ports = []
    s0, s1 = _two_ranks(ports, ["s3cret", "s3cret"])
    assert not isinstance(s0, Exception) and not isinstance(s1, Exception), (s0, s1)
    s0.set("k", "v")
    assert s1.get("k") == b"v"
    stranger = torch.distributed.TCPStore("127.0.0.1", ports[0], 2, False, timeout=datetime.timedelta(seconds=5))
    assert stranger.get("k") == b"v"  # on loopback anyone can (docs/security.md: no access control)
    with pytest.raises(Exception):
        torch.distributed.TCPStore(OTHER, ports[0], 2, False, timeout=datetime.timedelta(seconds=2))
    assert _refused(OTHER, ports[0])


def test_job_secret_mismatch_is_refused_on_both_sides(monkeypatch):
    monkeypatch.delenv("HIPRESS_BIND_ADDR", raising=False)
    s0, s1 = _two_ranks([], ["right", "wrong"], timeout=3.0)
    assert isinstance(s1, TransportError) and "does not know this job's HIPRESS_JOB_SECRET" in str(s1), s1
    assert isinstance(s0, TransportError) and "rank 1" in str(s0), s0  # rank 1 never proved it


def test_job_secret_forged_answer_names_the_rank():
    st = torch.distributed.HashStore()
    st.set_timeout(datetime.timedelta(seconds=5))
    errs = {}

    def rank0():
        try:
            rendezvous._check_secret(st, "k", 0, 2, "x", "here", "torch")
        except TransportError as e:
            errs[0] = e

    t = threading.Thread(target=rank0, daemon=True)
    t.start()
    st.get("hipress/auth/x/nonce")
    st.set("hipress/auth/x/rank1", "0" * 64)  # a stranger who read the nonce but lacks the secret
    t.join(30)
    assert "rank(s) [1]" in str(errs[0])


# ---------------------------------------------------------------------------- broadcast_object
_ran = []


def _payload_ran(tag):
    _ran.append(tag)
    return tag


class Evil:
    def __reduce__(self):  # a peer's payload: unpickling calls _payload_ran (could be os.system)
        return (_payload_ran, ("evil",))


class Plain:
    def __init__(self, x):
        self.x = x


@pytest.fixture
def threads_world(monkeypatch):
    """hipress.torch.functions' `world`, per thread: each loopback rank sees its own transport."""
    local = threading.local()
    fake = types.SimpleNamespace(init=lambda: None, size=lambda: local.t.size, rank=lambda: local.t.rank,
                                 transport=lambda: local.t, quiesce=lambda: None)  # nothing else in flight here
    monkeypatch.setattr(F, "world", fake)

    def run(fn, n=2):
        def body(t):
            local.t = t
            try:
                return fn(t.rank)
            except Exception as e:  # noqa: BLE001 - every rank's outcome goes back to the test
                return e
        return loopback.spawn(n, body, timeout_s=20)
    return run


def test_broadcast_object_plain_data_by_default(threads_world):
    obj = {"epoch": 3, "lr": 0.1, "names": ["a", "b"], "t": torch.arange(4.0), "none": None, "pair": (1, 2)}
    out = threads_world(lambda r: F.broadcast_object(obj if r == 0 else None))
    for got in out:
        assert got["epoch"] == 3 and got["names"] == ["a", "b"] and got["pair"] == (1, 2) and got["none"] is None
        assert torch.equal(got["t"], torch.arange(4.0))


def test_malicious_payload_is_refused_by_default_and_never_runs(threads_world):
    """A root that skips its own check (a hostile peer) sends a pickle whose __reduce__ calls a
    function: the receiving rank refuses it without calling it."""
    _ran.clear()

    def rank(r):
        if r == 0:  # speaks broadcast_object's wire format directly
            bio = io.BytesIO()
            torch.save({"x": Evil()}, bio)
            data = bio.getvalue()
            tr = F.world.transport()
            F._send_header(tr, len(data), 0)
            tr.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0)
            return None
        return F.broadcast_object(None)

    out = threads_world(rank)
    assert isinstance(out[1], F.UnsafeObjectError), out[1]
    assert "allow_pickle=True" in str(out[1]) and "_payload_ran" in str(out[1])
    assert _ran == []


def test_unsafe_object_raises_on_every_rank_and_opt_in_loads_it(threads_world):
    _ran.clear()
    out = threads_world(lambda r: F.broadcast_object(Evil() if r == 0 else None))
    assert all(isinstance(e, F.UnsafeObjectError) for e in out), out
    assert _ran == []  # root checked its own payload with weights_only=True: nothing ran there either
    out = threads_world(lambda r: F.broadcast_object(Plain(7) if r == 0 else None))
    assert all(isinstance(e, F.UnsafeObjectError) for e in out), out
    out = threads_world(lambda r: F.broadcast_object(Plain(7) if r == 0 else None, allow_pickle=True))
    assert isinstance(out[1], Plain) and out[1].x == 7
    out = threads_world(lambda r: F.broadcast_object(Evil() if r == 0 else None, allow_pickle=True))
    assert out[1] == "evil" and _ran == ["evil"]  # opted in: the payload's code ran on rank 1


def test_unpicklable_object_fails_on_every_rank_without_waiting(threads_world):
    out = threads_world(lambda r: F.broadcast_object((lambda: 1) if r == 0 else None, allow_pickle=True))
    assert not isinstance(out[0], TransportError) and isinstance(out[0], Exception), out
    assert isinstance(out[1], F.UnsafeObjectError), out


# ---------------------------------------------------------------------------- broadcast_optimizer_state
class _Opt(torch.optim.Adam):
    """Adam with a per-rank "hipress" entry, as DistributedOptimizer's state_dict has."""

    def __init__(self, params, rank):
        super().__init__(params, lr=1e-3 * (rank + 1), betas=(0.9, 0.99 - rank * 0.01))
        self.rank, self.loaded = rank, None

    def state_dict(self):
        sd = super().state_dict()
        sd["hipress"] = {"rank": self.rank}
        return sd

    def load_state_dict(self, sd):
        self.loaded = sd.get("hipress")
        sd = dict(sd)
        sd.pop("hipress", None)
        super().load_state_dict(sd)


def test_broadcast_optimizer_state_without_pickle(threads_world, monkeypatch):
    def forbidden(*a, **k):
        raise AssertionError("broadcast_optimizer_state unpickled something")

    monkeypatch.setattr(torch, "load", forbidden)
    import pickle
    monkeypatch.setattr(pickle, "loads", forbidden)

    def rank(r):
        torch.manual_seed(r)
        w = torch.nn.Parameter(torch.randn(3, 2))
        b = torch.nn.Parameter(torch.randn(2, dtype=torch.float64))
        opt = _Opt([{"params": [w]}, {"params": [b], "weight_decay": 0.5 + r}], r)
        for _ in range(r + 1):
            (w.sum() + b.sum()).backward()
            opt.step()
        F.broadcast_optimizer_state(opt, 0)
        sd = torch.optim.Adam.state_dict(opt)
        return sd, opt.loaded

    (sd0, own0), (sd1, own1) = threads_world(rank)
    assert own0 == {"rank": 0} and own1 == {"rank": 1}  # each rank kept its own hipress state
    assert sd1["param_groups"] == sd0["param_groups"]
    assert sd0["param_groups"][0]["betas"] == (0.9, 0.99)
    assert sd1["state"].keys() == sd0["state"].keys()
    for k in sd0["state"]:
        for name, v in sd0["state"][k].items():
            assert sd1["state"][k][name].dtype == v.dtype and torch.equal(sd1["state"][k][name], v), (k, name)


def test_optimizer_state_with_an_arbitrary_object_fails_on_every_rank(threads_world):
    class Odd(torch.optim.SGD):
        def state_dict(self):
            sd = super().state_dict()
            sd["param_groups"][0]["extra"] = Plain(1)
            return sd

    out = threads_world(lambda r: F.broadcast_optimizer_state(Odd([torch.nn.Parameter(torch.zeros(1))], lr=0.1)))
    assert all(isinstance(e, TypeError) for e in out), out
    assert "param_groups" in str(out[0]) and "Plain" in str(out[0])


def test_state_structure_round_trip_and_malformed_input():
    sd = {"state": {0: {"step": torch.tensor(3.0), "m": torch.ones(2, 2, dtype=torch.bfloat16)}},
          "param_groups": [{"params": [0], "lr": 1e-3, "betas": (0.9, 0.999), "nesterov": False,
                            "foreach": None, "eps": float("inf"), "bad": float("nan"), "name": "g"}],
          ("tuple", 1): [], "T": {"T": 5}}  # a real one-key dict named like the tensor marker
    sent = []
    raw = json.dumps(F._encode(sd, sent, "sd"))
    got_t = []
    got = F._decode(json.loads(raw), got_t, 0)
    assert [t.dtype for t in got_t] == [t.dtype for t in sent] and [t.shape for t in got_t] == [t.shape for t in sent]
    assert got["T"] == {"T": 5} and got[("tuple", 1)] == []
    g = got["param_groups"][0]
    assert g["betas"] == (0.9, 0.999) and g["foreach"] is None and g["nesterov"] is False and math.isnan(g["bad"])
    assert list(got["state"].keys()) == [0]
    for bad in ({"T": [0, "Tensor", [2]]},        # not a dtype: torch.Tensor is a class, not a dtype
                {"T": [0, "float32", [-1]]},
                {"T": [1, "float32", [2]]},       # out of order
                {"x": []}, {"d": [[1]]}, [1, 2]):
        with pytest.raises(ValueError, match="malformed"):
            F._decode(bad, [], 0)
