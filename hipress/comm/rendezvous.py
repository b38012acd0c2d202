"""Rendezvous: a torch Store every rank of the job can reach, for the transports that
need one (torch.distributed, and NCCL's bootstrap).

Where the address comes from: torchrun's agent store; MASTER_ADDR/MASTER_PORT (or
``init(master_addr=, master_port=)``); under horovodrun (gloo) rank 0 publishes a fresh
address in Horovod's HTTP key-value store; under an MPI launcher rank 0 picks one and MPI
broadcasts it. ``HIPRESS_ADDR`` overrides the address rank 0 announces.

Security (docs/security.md): rank 0's TCPStore listens only on the address the ranks are
told (``MASTER_ADDR``: loopback for ``hipress.launch``), not on every interface as torch's
TCPStore does by itself: rank 0 binds the listening socket and hands it to the store
(``master_listen_fd``). ``HIPRESS_BIND_ADDR`` names another address (``*``: every
interface). With ``HIPRESS_JOB_SECRET`` set (``hipress.launch`` sets a fresh one per job),
the ranks check that the store is their job's: rank 0 and every other rank each show an
HMAC of a fresh nonce under the secret. That is no access control: TCPStore has none, and
anyone who can connect to it can read and write every key (docs/security.md).
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import socket
import time
import urllib.error
import urllib.request
import warnings
from typing import List, Optional, Tuple

from hipress import config
from hipress.comm.discovery import LaunchInfo
from hipress.comm.transport.base import TransportError
from hipress.comm.transport.mpi import available as with_mpi

__all__ = ["store", "tcp_store", "listen", "bind_address"]

# Each world made in this process publishes under its own key (init, shutdown, init again).
_generation = 0


def store(launch: LaunchInfo, timeout: float):
    """A torch Store shared by all ranks."""
    global _generation
    _generation += 1
    import datetime

    import torch.distributed as dist

    td = datetime.timedelta(seconds=timeout)
    if launch.size == 1:
        return dist.HashStore()
    if launch.launcher == "torchrun" and launch.agent_store and launch.master_addr and launch.master_port:
        # torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE): every rank is a client of
        # it; torchrun chose where it listens (docs/security.md). Without an agent (hipress.launch,
        # a torchrun-style environment set by hand) rank 0 hosts the store below, not torch's
        # env:// handler, whose TCPStore listens on every interface.
        agent_store, _, _ = next(dist.rendezvous("env://", launch.rank, launch.size, timeout=td))
        return agent_store
    addr, port, listener = launch.master_addr, launch.master_port, None
    if (addr is None or port is None) and launch.launcher == "horovod-gloo":
        addr, port, listener = _horovod_master(launch, timeout, _generation)
    if (addr is None or port is None) and launch.is_mpi and with_mpi():
        addr, port, listener = _mpi_master(launch, timeout)
    if addr is None or port is None:
        raise RuntimeError(f"{launch.launcher} launch of {launch.size} ranks: the torch transport needs a master "
                           f"address; set MASTER_ADDR and MASTER_PORT or call init(master_addr=, master_port=)")
    single_host = launch.local_size is not None and launch.local_size == launch.size
    return tcp_store(addr, int(port), launch.size, launch.rank, timeout, listener=listener,
                     secret=config.get("HIPRESS_JOB_SECRET"), tag=f"g{_generation}", single_host=single_host)


def tcp_store(addr: str, port: int, size: int, rank: int, timeout: float, listener: Optional[socket.socket] = None,
              secret: Optional[str] = None, tag: str = "", single_host: bool = False, transport: str = "torch"):
    """A TCPStore at ``addr:port``: rank 0 hosts it, listening only on :func:`bind_address`
    (or on ``listener``, a listening socket it then owns). With ``secret``, every rank
    checks that the store is its job's (:func:`_check_secret`) before it is returned."""
    import datetime

    import torch.distributed as dist

    td = datetime.timedelta(seconds=timeout)
    is_master = rank == 0
    if is_master and listener is None:
        try:
            listener = listen(addr, port, size, single_host)
        except OSError as e:
            raise TransportError("rendezvous", f"rank 0 cannot listen for the TCPStore on {addr}:{port}: {e}. The "
                                 f"store listens only on the address the ranks are told (MASTER_ADDR); if that is "
                                 f"not an address of this host (NAT, a forwarded port), set HIPRESS_BIND_ADDR to "
                                 f"the local address to listen on", None, rank, transport) from e
    try:
        if is_master:
            port = listener.getsockname()[1]
            fd = listener.detach()  # the store owns and closes it
            st = dist.TCPStore(addr, int(port), size, True, timeout=td, wait_for_workers=False, master_listen_fd=fd)
        else:
            st = dist.TCPStore(addr, int(port), size, False, timeout=td, wait_for_workers=False)
    except Exception as e:  # noqa: BLE001
        if not is_master:  # a client could not reach the store: rank 0 never came (or listens elsewhere)
            raise TransportError("rendezvous", f"rank 0 never arrived at the rendezvous: no TCPStore answered at "
                                 f"{addr}:{port} within {timeout:g} s (HIPRESS_TIMEOUT_S); is rank 0 running, and "
                                 f"told the same MASTER_ADDR/MASTER_PORT? ({e})", [0], rank, transport) from e
        raise TransportError("rendezvous", f"TCPStore at {addr}:{port} for {size} ranks failed: {e}",
                             None, rank, transport) from e
    _arrive(st, rank, size, timeout, tag, f"{addr}:{port}", transport)
    if secret:
        _check_secret(st, secret, rank, size, tag, f"{addr}:{port}", transport)
    return st


def _arrive(st, rank: int, size: int, timeout: float, tag: str, where: str, transport: str) -> None:
    """Every rank marks its arrival in the store; rank 0 waits (up to ``timeout``) until all have
    and publishes the outcome: every rank then returns, or raises naming the ranks that never
    arrived (instead of torch's own wait for workers, whose DistStoreError says only how many)."""
    key = f"hipress/arrived/{tag}"
    st.set(f"{key}/{rank}", "1")
    end = time.monotonic() + timeout
    if rank == 0:
        missing = list(range(1, size))
        while missing and time.monotonic() < end:
            missing = [r for r in missing if not st.check([f"{key}/{r}"])]
            if missing:
                time.sleep(0.02)
        st.set(f"{key}/outcome", ",".join(map(str, missing)))
        if missing:  # the ranks that came read the outcome before this rank (and its store) goes
            came = [r for r in range(1, size) if r not in missing]
            while came and time.monotonic() < end + 2.0:
                came = [r for r in came if not st.check([f"{key}/read{r}"])]
                time.sleep(0.02)
    else:
        try:
            while not st.check([f"{key}/outcome"]):
                if time.monotonic() > end + timeout:  # rank 0 decides within timeout; it is gone
                    raise TransportError("rendezvous", f"rank 0 did not complete the rendezvous at {where}",
                                         [0], rank, transport)
                time.sleep(0.02)
            outcome = st.get(f"{key}/outcome").decode()
            st.set(f"{key}/read{rank}", "1")
        except TransportError:
            raise
        except Exception as e:  # noqa: BLE001 - the store closed under us: rank 0 left
            raise TransportError("rendezvous", f"rank 0 left the rendezvous at {where} before it completed: {e}",
                                 [0], rank, transport) from e
        missing = [int(r) for r in outcome.split(",")] if outcome else []
    if missing:
        raise TransportError("rendezvous", f"rank(s) {missing} never arrived at the rendezvous at {where} within "
                             f"{timeout:g} s (HIPRESS_TIMEOUT_S) ({size - len(missing)} of {size} ranks did); did "
                             f"they start, with the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE?",
                             missing, rank, transport)


# ---------------------------------------------------------------------------- where rank 0 listens
def _is_loopback_name(host: str) -> bool:
    return host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")


def bind_address(addr: str, single_host: bool = False) -> Optional[str]:
    """The local address rank 0's store listens on when the ranks are told ``addr``:
    ``HIPRESS_BIND_ADDR`` if set (``*``: every interface, returned as None), else ``addr``
    itself. Exception: a host *name* (not an address, not localhost) that resolves here
    only to loopback (Debian's ``127.0.1.1 myhost`` in /etc/hosts) may well resolve to
    this host's network address on the other hosts; unless the launch says every rank is
    on this host, that falls back to every interface, with a warning."""
    forced = config.get("HIPRESS_BIND_ADDR")
    if forced:
        return None if forced in ("*", "0.0.0.0", "::") else forced
    try:
        ipaddress.ip_address(addr)
        return addr  # an address literal: exactly what the ranks connect to
    except ValueError:
        pass
    if _is_loopback_name(addr) or single_host:
        return addr
    try:
        found = {ai[4][0] for ai in socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)}
    except OSError:
        return addr  # the bind fails and says so
    if found and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in found):
        warnings.warn(f"hipress rendezvous: MASTER_ADDR={addr} resolves to loopback ({', '.join(sorted(found))}) on "
                      f"rank 0's host but the job may span hosts, so the TCPStore listens on every interface; set "
                      f"MASTER_ADDR to an address, or HIPRESS_BIND_ADDR, to listen on one (docs/security.md)",
                      RuntimeWarning, stacklevel=3)
        return None
    return addr


def listen(addr: str, port: int = 0, backlog: int = 128, single_host: bool = False) -> socket.socket:
    """A listening TCP socket for rank 0's store on :func:`bind_address` of ``addr``
    (port 0: the OS picks one)."""
    host = bind_address(addr, single_host)
    if host is None:
        if socket.has_dualstack_ipv6():
            return socket.create_server(("", port), family=socket.AF_INET6, backlog=backlog, reuse_port=False,
                                        dualstack_ipv6=True)
        return socket.create_server(("", port), backlog=backlog)
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    infos.sort(key=lambda ai: ai[0] != socket.AF_INET)  # IPv4 first, as the ranks' connect tries it first
    errors: List[str] = []
    for family, kind, proto, _, sockaddr in infos:
        s = socket.socket(family, kind, proto)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own server does
            s.bind(sockaddr)
            s.listen(max(backlog, 1))
            return s
        except OSError as e:
            s.close()
            errors.append(f"{sockaddr[0]}: {e.strerror or e}")
    raise OSError(f"no address of {host} to listen on ({'; '.join(errors) or 'it resolves to none'})")


# ---------------------------------------------------------------------------- the job secret
def _mac(secret: str, what: str) -> str:
    return hmac.new(secret.encode(), what.encode(), hashlib.sha256).hexdigest()


def _check_secret(st, secret: str, rank: int, size: int, tag: str, where: str, transport: str) -> None:
    """Rank 0 publishes a fresh nonce and HMAC(secret, "store|nonce|size"); every other rank
    checks it (is this store my job's?) and answers HMAC(secret, "rank r|nonce"), which rank 0
    checks (is every rank of my job?). A mismatch or a missing answer raises, naming the rank.

    What this is not: access control. The keys travel in the clear and anyone who can
    connect to the store can read or overwrite them (docs/security.md)."""
    key = f"hipress/auth/{tag}"

    def get(k: str, who: str) -> str:
        try:
            return st.get(k).decode()
        except Exception as e:  # noqa: BLE001 - the store's timeout
            raise TransportError("rendezvous", f"{who} at {where}: {e}", None, rank, transport) from e

    if rank == 0:
        nonce = secrets.token_hex(16)
        st.set(f"{key}/nonce", nonce)
        st.set(f"{key}/store", _mac(secret, f"store|{nonce}|{size}"))
        bad = []
        for r in range(1, size):
            got = get(f"{key}/rank{r}", f"rank {r} did not answer the job-secret check (is HIPRESS_JOB_SECRET set "
                                        f"on every rank?)")
            if not hmac.compare_digest(got, _mac(secret, f"rank{r}|{nonce}")):
                bad.append(r)
        if bad:
            raise TransportError("rendezvous", f"rank(s) {bad} joined the store at {where} without this job's "
                                 f"HIPRESS_JOB_SECRET", bad, rank, transport)
        return
    nonce = get(f"{key}/nonce", "no job-secret nonce from rank 0 (is HIPRESS_JOB_SECRET set on rank 0?)")
    proof = get(f"{key}/store", "no job-secret proof from rank 0")
    if not hmac.compare_digest(proof, _mac(secret, f"store|{nonce}|{size}")):
        raise TransportError("rendezvous", f"the store at {where} does not know this job's HIPRESS_JOB_SECRET: it "
                             f"is another job's, or rank 0 has another secret", [0], rank, transport)
    st.set(f"{key}/rank{rank}", _mac(secret, f"rank{rank}|{nonce}"))


def _listener_near(toward: Optional[str] = None) -> Tuple[str, int, socket.socket]:
    """Rank 0's announced address and a socket listening on it, on a port the OS picks
    (kept open from here on, so no other process can take the port in between)."""
    addr = _my_address(toward)
    s = listen(addr, 0)
    return addr, s.getsockname()[1], s


def _my_address(toward: Optional[str] = None) -> str:
    """This host's address as seen on the route to ``toward`` (no packet is sent)."""
    forced = config.get("HIPRESS_ADDR")
    if forced:
        return forced
    if toward:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((toward, 9))
                return s.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _horovod_master(launch: LaunchInfo, timeout: float, generation: int):
    """Rank 0 publishes ``addr:port`` of a fresh TCPStore in Horovod's HTTP KV store."""
    base = f"http://{launch.rendezvous_addr}:{launch.rendezvous_port}/hipress/master{generation}"
    if launch.rank == 0:
        addr, port, listener = _listener_near(launch.rendezvous_addr)
        req = urllib.request.Request(base, data=f"{addr}:{port}".encode(), method="PUT")
        try:
            urllib.request.urlopen(req, timeout=timeout).read()
        except BaseException:
            listener.close()
            raise
        return addr, port, listener
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = urllib.request.urlopen(base, timeout=timeout).read().decode()
            addr, port = value.rsplit(":", 1)
            return addr, int(port), None
        except urllib.error.HTTPError as e:
            if e.code != 404:
                raise
        if time.monotonic() > deadline:
            raise TransportError("rendezvous", f"rank 0 did not publish its address at {base} within {timeout:g} s",
                                 [0], launch.rank, "torch")
        time.sleep(0.05)


def _mpi_master(launch: LaunchInfo, timeout: float):
    """Under an MPI launcher without MASTER_ADDR: rank 0 picks an address, MPI broadcasts it."""
    import torch

    from hipress.comm.transport.mpi import MpiTransport

    boot = MpiTransport.world(timeout_s=timeout)
    listener = None
    try:
        buf = torch.zeros(256, dtype=torch.uint8)
        if boot.rank == 0:
            addr, port, listener = _listener_near()
            raw = f"{addr}:{port}".encode()
            buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        boot.broadcast(buf, 0)
        addr, port = bytes(buf.tolist()).rstrip(b"\0").decode().rsplit(":", 1)
        return addr, int(port), listener
    except BaseException:
        if listener is not None:
            listener.close()
        raise
    finally:
        boot.close()


