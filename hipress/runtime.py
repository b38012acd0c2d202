"""Process-level runtime: who am I, how many are we, which transport connects us.

    import hipress.runtime as rt
    rt.init()                      # discovers the launcher; idempotent
    rt.rank(), rt.size(), rt.local_rank(), rt.local_size(), rt.cross_rank(), rt.cross_size()
    rt.transport()                 # the world transport (hipress.transport.base.Transport)
    rt.local_transport()           # ranks on this host;   rt.cross_transport(): one rank per host
    rt.shutdown()

Launch discovery, first match wins (explicit ``init`` arguments override the environment):

=================  =====================================================================
explicit           ``init(rank=, size=, master_addr=, master_port=)`` (MASTER_ADDR/PORT as fallback)
horovodrun (gloo)  HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK, HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT:
                   rank 0 publishes a TCPStore address in Horovod's HTTP key-value store
mpirun / horovodrun --mpi
                   OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK (OpenMPI), PMI_RANK/PMI_SIZE (MPICH, Slurm)
torchrun           RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (torch's env:// rendezvous)
none               a single process: size 1
=================  =====================================================================

Transport: ``init(transport=...)`` (a name or a Transport object), else ``HIPRESS_TRANSPORT``
(``mpi``, ``torch``, ``nccl``, ``loopback``, ``horovod``), else Horovod's collectives
(horovod_ext) when ``horovodrun`` started the job and ``horovod.torch`` imports (if it does
not, rank 0 logs one line saying why and the choice goes on), else MPI under an MPI
launcher (when hipress was built with MPI), else torch.distributed (gloo on CPU). A single process with no launcher
gets the in-process loopback transport (nothing to connect). If torch.distributed is already
initialized, the torch transport wraps its default group.

Hosts: ranks are grouped by hostname (``HIPRESS_HOSTNAME`` overrides ``socket.gethostname()``),
exchanged with an allgather: hosts are ordered by their lowest rank, ``local_rank`` is the
position among the ranks of the same host, ``cross_rank`` the position among the ranks with
the same local_rank (one per host). Timeouts: ``HIPRESS_TIMEOUT_S`` (default 60).
"""
from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Optional, Union

__all__ = ["init", "is_initialized", "shutdown", "rank", "size", "local_rank", "local_size",
           "cross_rank", "cross_size", "transport", "local_transport", "cross_transport",
           "launch_info", "detect_launch", "LaunchInfo", "TRANSPORTS"]

TRANSPORTS = ("mpi", "torch", "nccl", "loopback", "horovod")


@dataclasses.dataclass(frozen=True)
class LaunchInfo:
    """What the launcher told this process (before any connection is made)."""

    launcher: str                      # explicit | horovod-gloo | horovod | mpi | torchrun | single
    rank: int
    size: int
    local_rank: Optional[int] = None   # the launcher's hint; the runtime recomputes it from hostnames
    local_size: Optional[int] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    rendezvous_addr: Optional[str] = None   # Horovod's HTTP rendezvous server (gloo mode)
    rendezvous_port: Optional[int] = None

    @property
    def is_mpi(self) -> bool:
        return self.launcher == "mpi"


def _env_int(env, *names) -> Optional[int]:
    for n in names:
        v = env.get(n)
        if v not in (None, ""):
            try:
                return int(v)
            except ValueError:
                raise ValueError(f"environment variable {n}={v!r} is not an integer") from None
    return None


def detect_launch(env=None, rank: Optional[int] = None, size: Optional[int] = None,
                  master_addr: Optional[str] = None, master_port: Optional[int] = None) -> LaunchInfo:
    """Read the launcher's environment (``env`` defaults to ``os.environ``)."""
    env = os.environ if env is None else env
    m_addr = master_addr or env.get("MASTER_ADDR") or None
    m_port = master_port if master_port is not None else _env_int(env, "MASTER_PORT")
    if rank is not None or size is not None:
        if rank is None or size is None:
            raise ValueError("init(): give both rank= and size=, or neither")
        return LaunchInfo("explicit", int(rank), int(size), _env_int(env, "LOCAL_RANK"), None, m_addr, m_port)
    if env.get("HOROVOD_RANK") is not None and env.get("HOROVOD_SIZE") is not None:
        r, s = _env_int(env, "HOROVOD_RANK"), _env_int(env, "HOROVOD_SIZE")
        lr, ls = _env_int(env, "HOROVOD_LOCAL_RANK"), _env_int(env, "HOROVOD_LOCAL_SIZE")
        if env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"):
            return LaunchInfo("horovod-gloo", r, s, lr, ls, m_addr, m_port, env["HOROVOD_GLOO_RENDEZVOUS_ADDR"],
                              _env_int(env, "HOROVOD_GLOO_RENDEZVOUS_PORT"))
        if env.get("OMPI_COMM_WORLD_SIZE") is None and env.get("PMI_SIZE") is None:
            return LaunchInfo("horovod", r, s, lr, ls, m_addr, m_port)
    if env.get("OMPI_COMM_WORLD_SIZE") is not None:
        return LaunchInfo("mpi", _env_int(env, "OMPI_COMM_WORLD_RANK"), _env_int(env, "OMPI_COMM_WORLD_SIZE"),
                          _env_int(env, "OMPI_COMM_WORLD_LOCAL_RANK"), _env_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"),
                          m_addr, m_port)
    if env.get("PMI_SIZE") is not None and env.get("PMI_RANK") is not None:
        return LaunchInfo("mpi", _env_int(env, "PMI_RANK"), _env_int(env, "PMI_SIZE"),
                          _env_int(env, "MPI_LOCALRANKID"), _env_int(env, "MPI_LOCALNRANKS"), m_addr, m_port)
    if env.get("RANK") is not None and env.get("WORLD_SIZE") is not None:
        return LaunchInfo("torchrun", _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE"),
                          _env_int(env, "LOCAL_RANK"), _env_int(env, "LOCAL_WORLD_SIZE"), m_addr, m_port)
    return LaunchInfo("single", 0, 1)


# ---------------------------------------------------------------------------- state
@dataclasses.dataclass
class _State:
    launch: LaunchInfo
    world: object
    local: object
    cross: object
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hostnames: list


_lock = threading.RLock()
_state: Optional[_State] = None
_generation = 0


def is_initialized() -> bool:
    return _state is not None


def _get() -> _State:
    s = _state
    if s is None:
        raise RuntimeError("hipress is not initialized: call hipress.init() first")
    return s


def rank() -> int:
    return _get().rank


def size() -> int:
    return _get().size


def local_rank() -> int:
    return _get().local_rank


def local_size() -> int:
    return _get().local_size


def cross_rank() -> int:
    return _get().cross_rank


def cross_size() -> int:
    return _get().cross_size


def transport():
    """The world transport."""
    return _get().world


def local_transport():
    """Transport over the ranks of this host (rank there = local_rank)."""
    return _get().local


def cross_transport():
    """Transport over the ranks with this rank's local_rank, one per host (rank there = cross_rank)."""
    return _get().cross


def launch_info() -> LaunchInfo:
    return _get().launch


def hostnames() -> list:
    """Hostname of every rank, as exchanged at init."""
    return list(_get().hostnames)


def init(rank: Optional[int] = None, size: Optional[int] = None, master_addr: Optional[str] = None,
         master_port: Optional[int] = None, transport: Union[str, object, None] = None,
         timeout_s: Optional[float] = None) -> None:
    """Discover the launch, connect the ranks, group them by host. Idempotent: a second
    call returns at once (its arguments are ignored). Collective: every rank calls it."""
    global _state, _generation
    with _lock:
        if _state is not None:
            return
        from hipress.transport.base import Transport, default_timeout_s

        timeout = default_timeout_s() if timeout_s is None else float(timeout_s)
        if isinstance(transport, Transport):
            world = transport
            launch = LaunchInfo("explicit", world.rank, world.size)
        else:
            launch = detect_launch(None, rank, size, master_addr, master_port)
            if not 0 <= launch.rank < launch.size:
                raise ValueError(f"rank {launch.rank} is not in [0, {launch.size}) ({launch.launcher} launch)")
            kind = _choose_transport(transport, launch)
            world = _make_world(kind, launch, timeout)
        _generation += 1
        try:
            _state = _group_by_host(world, launch)
        except BaseException:
            world.close()
            raise


def shutdown() -> None:
    """Close the transports; ``init`` may be called again afterwards."""
    global _state
    if _state is not None:
        # Coordinator executors ride a duplicate of the world transport: stop them first.
        import sys
        coord = sys.modules.get("hipress.coordinator")
        if coord is not None:
            coord.shutdown_all()
    with _lock:
        s, _state = _state, None
        if s is None:
            return
        for t in (s.cross, s.local, s.world):
            try:
                t.close()
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass


# ---------------------------------------------------------------------------- transport choice
def _choose_transport(requested, launch: LaunchInfo) -> str:
    kind = requested or os.environ.get("HIPRESS_TRANSPORT", "").strip().lower() or None
    if kind is not None:
        if kind not in TRANSPORTS:
            raise ValueError(f"unknown transport {kind!r}; expected one of {TRANSPORTS} "
                             f"(from {'init(transport=)' if requested else 'HIPRESS_TRANSPORT'})")
        return kind
    if launch.launcher != "explicit" and _horovod_usable(launch):
        return "horovod"
    if launch.is_mpi and _with_mpi():
        return "mpi"
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return "torch"
    if launch.size == 1:
        return "loopback"
    return "torch"


_horovod_warned = False


def _horovod_usable(launch: LaunchInfo) -> bool:
    """horovodrun started the job and horovod.torch imports; else say once (rank 0) why not."""
    global _horovod_warned
    try:
        import horovod_ext
    except ImportError:  # pragma: no cover - shipped with hipress
        return False
    if not horovod_ext.started_by_horovodrun():
        return False
    reason = horovod_ext.unavailable_reason()
    if reason is None:
        return True
    if not _horovod_warned and launch.rank == 0:
        import logging

        logging.getLogger("hipress").warning("hipress: started by horovodrun but the Horovod transport is unavailable "
                                             "(%s); using hipress's own transport instead", reason)
    _horovod_warned = True
    return False


def _with_mpi() -> bool:
    try:
        from hipress import _C
    except ImportError:
        return False
    return bool(getattr(_C, "with_mpi", False))


def _make_world(kind: str, launch: LaunchInfo, timeout: float):
    if kind == "loopback":
        if launch.size != 1:
            raise ValueError(f"the loopback transport runs all ranks in one process (loopback.spawn); "
                             f"it cannot connect {launch.size} processes")
        from hipress.transport.loopback import LoopbackTransport, LoopbackWorld

        return LoopbackTransport(LoopbackWorld(1), 0, timeout)
    if kind == "horovod":
        import horovod_ext

        reason = horovod_ext.unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"the horovod transport was asked for but {reason}")
        from horovod_ext.transport import HorovodTransport

        t = HorovodTransport.world(timeout_s=timeout)
        if launch.launcher not in ("single",) and (t.rank, t.size) != (launch.rank, launch.size):
            t.close()
            raise RuntimeError(f"Horovod says rank {t.rank} of {t.size} but the {launch.launcher} launch says "
                               f"rank {launch.rank} of {launch.size}")
        return t
    if kind == "mpi":
        from hipress.transport.mpi import MpiTransport

        t = MpiTransport.world(timeout_s=timeout)
        if launch.launcher not in ("single",) and (t.rank, t.size) != (launch.rank, launch.size):
            raise RuntimeError(f"MPI says rank {t.rank} of {t.size} but the {launch.launcher} launch says "
                               f"rank {launch.rank} of {launch.size}")
        return t
    if kind in ("torch", "nccl"):
        import torch
        import torch.distributed as dist

        from hipress.transport.torch_dist import TorchDistTransport

        if kind == "torch" and dist.is_available() and dist.is_initialized():
            return TorchDistTransport.from_default_group(timeout_s=timeout)
        store = _rendezvous_store(launch, timeout)
        if kind == "nccl":
            from hipress.transport.nccl import NcclTransport

            boot = TorchDistTransport.create(launch.rank, launch.size, backend="gloo", timeout_s=timeout, store=store)
            try:
                return NcclTransport.create(boot, timeout_s=timeout)
            except BaseException:
                boot.close()
                raise
        backend = os.environ.get("HIPRESS_TORCH_BACKEND", "gloo").strip().lower()
        if backend == "nccl" and not torch.cuda.is_available():
            raise RuntimeError("HIPRESS_TORCH_BACKEND=nccl but CUDA is not available")
        return TorchDistTransport.create(launch.rank, launch.size, backend=backend, timeout_s=timeout, store=store)
    raise ValueError(f"unknown transport {kind!r}")


def _rendezvous_store(launch: LaunchInfo, timeout: float):
    """A torch Store shared by all ranks."""
    import datetime

    import torch.distributed as dist

    td = datetime.timedelta(seconds=timeout)
    if launch.size == 1:
        return dist.HashStore()
    if launch.launcher == "torchrun" and launch.master_addr and launch.master_port:
        # torch's env:// handler knows torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE)
        store, _, _ = next(dist.rendezvous("env://", launch.rank, launch.size, timeout=td))
        return store
    addr, port = launch.master_addr, launch.master_port
    if (addr is None or port is None) and launch.launcher == "horovod-gloo":
        addr, port = _horovod_master(launch, timeout)
    if (addr is None or port is None) and launch.is_mpi and _with_mpi():
        addr, port = _mpi_master(launch, timeout)
    if addr is None or port is None:
        raise RuntimeError(f"{launch.launcher} launch of {launch.size} ranks: the torch transport needs a master "
                           f"address; set MASTER_ADDR and MASTER_PORT or call init(master_addr=, master_port=)")
    try:
        return dist.TCPStore(addr, int(port), launch.size, launch.rank == 0, timeout=td, wait_for_workers=True)
    except Exception as e:  # noqa: BLE001
        from hipress.transport.base import TransportError

        raise TransportError("rendezvous", f"TCPStore at {addr}:{port} for {launch.size} ranks failed: {e}",
                             None, launch.rank, "torch") from e


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _my_address(toward: Optional[str] = None) -> str:
    """This host's address as seen on the route to ``toward`` (no packet is sent)."""
    if os.environ.get("HIPRESS_ADDR"):
        return os.environ["HIPRESS_ADDR"]
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


def _horovod_master(launch: LaunchInfo, timeout: float):
    """Rank 0 publishes ``addr:port`` of a fresh TCPStore in Horovod's HTTP KV store."""
    base = f"http://{launch.rendezvous_addr}:{launch.rendezvous_port}/hipress/master{_generation}"
    if launch.rank == 0:
        addr, port = _my_address(launch.rendezvous_addr), _free_port()
        req = urllib.request.Request(base, data=f"{addr}:{port}".encode(), method="PUT")
        urllib.request.urlopen(req, timeout=timeout).read()
        return addr, port
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = urllib.request.urlopen(base, timeout=timeout).read().decode()
            addr, port = value.rsplit(":", 1)
            return addr, int(port)
        except urllib.error.HTTPError as e:
            if e.code != 404:
                raise
        if time.monotonic() > deadline:
            from hipress.transport.base import TransportError

            raise TransportError("rendezvous", f"rank 0 did not publish its address at {base} within {timeout:g} s",
                                 [0], launch.rank, "torch")
        time.sleep(0.05)


def _mpi_master(launch: LaunchInfo, timeout: float):
    """Under an MPI launcher without MASTER_ADDR: rank 0 picks an address, MPI broadcasts it."""
    import torch

    from hipress.transport.mpi import MpiTransport

    boot = MpiTransport.world(timeout_s=timeout)
    try:
        buf = torch.zeros(256, dtype=torch.uint8)
        if boot.rank == 0:
            raw = f"{_my_address()}:{_free_port()}".encode()
            buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        boot.broadcast(buf, 0)
        addr, port = bytes(buf.tolist()).rstrip(b"\0").decode().rsplit(":", 1)
        return addr, int(port)
    finally:
        boot.close()


# ---------------------------------------------------------------------------- hosts
def _hostname() -> str:
    return os.environ.get("HIPRESS_HOSTNAME") or socket.gethostname()


def _group_by_host(world, launch: LaunchInfo) -> _State:
    import torch

    n = world.size
    if n == 1:
        return _State(launch, world, world, world, 0, 1, 0, 1, 0, 1, [_hostname()])
    raw = _hostname().encode()[:255]
    mine = torch.zeros(256, dtype=torch.uint8)
    mine[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    mine = mine.to(_buffer_device(world))
    allb = torch.empty(256 * n, dtype=torch.uint8, device=mine.device)
    world.allgather(mine, allb)
    allb = allb.cpu()
    names = [bytes(allb[i * 256:(i + 1) * 256].tolist()).rstrip(b"\0").decode(errors="replace") for i in range(n)]
    hosts = list(dict.fromkeys(names))  # first appearance = lowest rank
    me = world.rank
    host_of = [hosts.index(h) for h in names]
    local_of = [sum(1 for q in range(r) if host_of[q] == host_of[r]) for r in range(n)]
    lr = local_of[me]
    ls = host_of.count(host_of[me])
    cross_members = [r for r in range(n) if local_of[r] == lr]
    cr, cs = cross_members.index(me), len(cross_members)
    local = world.split(host_of[me], key=me)
    cross = world.split(lr, key=me)
    return _State(launch, world, local, cross, me, n, lr, ls, cr, cs, names)


def _buffer_device(world):
    dev = getattr(world, "device", None)
    return dev if dev is not None else "cpu"
