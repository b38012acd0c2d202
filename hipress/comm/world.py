"""The world: who am I, how many are we, which transports connect us.

    from hipress.comm import world
    world.init()                   # discovers the launch (hipress.comm.discovery); idempotent, collective
    world.rank(), world.size(), world.local_rank(), world.local_size(), world.cross_rank(), world.cross_size()
    world.transport()              # the world transport (hipress.comm.transport.Transport)
    world.local_transport()        # ranks on this host;   world.cross_transport(): one rank per host
    world.members("local")         # world ranks of a group, in the group's rank order
    world.control_transport()      # all ranks again, apart: control beside the data (or None)
    world.shutdown()

Transport: ``init(transport=...)`` (a name or a Transport object), else the registry's choice
(:func:`hipress.comm.transport.choose`: ``HIPRESS_TRANSPORT``, else the backend the launch calls
for). If torch.distributed is already initialized, the torch transport wraps its default group.

Hosts: ranks are grouped by hostname (``HIPRESS_HOSTNAME`` overrides ``socket.gethostname()``),
exchanged with an allgather: hosts are ordered by their lowest rank, ``local_rank`` is the
position among the ranks of the same host, ``cross_rank`` the position among the ranks with
the same local_rank (one per host). Timeouts: ``HIPRESS_TIMEOUT_S``.
"""
from __future__ import annotations

import atexit
import dataclasses
import socket
import threading
import time
import weakref
from typing import Callable, List, Optional, Union

from hipress import config
from hipress.comm.discovery import LaunchInfo, detect_launch

__all__ = ["init", "is_initialized", "shutdown", "rank", "size", "local_rank", "local_size",
           "cross_rank", "cross_size", "transport", "local_transport", "cross_transport", "control_transport",
           "launch_info", "hostnames", "members", "on_shutdown", "reconnect", "silent_peers"]


# ---------------------------------------------------------------------------- state
@dataclasses.dataclass
class _State:
    launch: LaunchInfo
    world: object
    local: object
    cross: object
    rank: int
    size: int
    hostnames: list
    local_members: list   # world ranks of this host, in local rank order
    cross_members: list   # world ranks with this local_rank, in cross rank order
    control: object = None  # control_transport(), made on its first call

    @property
    def local_rank(self) -> int:
        return self.local_members.index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.local_members)

    @property
    def cross_rank(self) -> int:
        return self.cross_members.index(self.rank)

    @property
    def cross_size(self) -> int:
        return len(self.cross_members)


_lock = threading.RLock()
_state: Optional[_State] = None
_shutdown_hooks: List[Callable[[], None]] = []


def is_initialized() -> bool:
    return _state is not None


def _get() -> _State:
    s = _state
    if s is None:
        raise RuntimeError("hipress is not initialized: call hipress.init() first")
    return s


def _accessor(name: str, doc: str) -> Callable[[], int]:
    """A module-level function returning the initialized world's field ``name``."""
    def get() -> int:
        return getattr(_get(), name)
    get.__name__ = get.__qualname__ = name
    get.__doc__ = doc
    return get


rank = _accessor("rank", "This process's rank in the world.")
size = _accessor("size", "Number of ranks in the world.")
local_rank = _accessor("local_rank", "This process's rank among the ranks on its host.")
local_size = _accessor("local_size", "Number of ranks on this process's host.")
cross_rank = _accessor("cross_rank", "This process's position among the ranks with its local_rank (one per host).")
cross_size = _accessor("cross_size", "Number of ranks with this process's local_rank (one per host).")


def transport():
    """The world transport."""
    return _get().world


def local_transport():
    """Transport over the ranks of this host (rank there = local_rank)."""
    return _get().local


def cross_transport():
    """Transport over the ranks with this rank's local_rank, one per host (rank there = cross_rank)."""
    return _get().cross


def control_transport():
    """A second transport over the world's ranks, for small control exchanges that one thread
    runs while the comm queue's thread runs the data over the world transport (the optimizer's
    per-step agreement, beside the step's last allreduce). None where the world's backend cannot
    run two at once, or with one rank. Collective on its first call after init() or reconnect(),
    which every rank makes at the same point while nothing else communicates (an optimizer's wrap
    or reset())."""
    with _lock:
        s = _get()
        if s.control is None and s.size > 1 and s.world.concurrent_splits:
            s.control = s.world.split(0, key=s.rank)
        return s.control


def launch_info() -> LaunchInfo:
    return _get().launch


def hostnames() -> list:
    """Hostname of every rank, as exchanged at init."""
    return list(_get().hostnames)


def members(group: str) -> List[int]:
    """World ranks of ``group`` ("world", "local" or "cross"), in that group's rank order."""
    s = _get()
    if group == "world":
        return list(range(s.size))
    if group == "local":
        return list(s.local_members)
    if group == "cross":
        return list(s.cross_members)
    raise ValueError(f"group must be 'world', 'local' or 'cross', got {group!r}")


def init(rank: Optional[int] = None, size: Optional[int] = None, master_addr: Optional[str] = None,
         master_port: Optional[int] = None, transport: Union[str, object, None] = None,
         timeout_s: Optional[float] = None) -> None:
    """Discover the launch, connect the ranks, group them by host. Idempotent: a second
    call returns at once (its arguments are ignored). Collective: every rank calls it."""
    global _state
    with _lock:
        if _state is not None:
            return
        from hipress.comm import transport as transports

        timeout = config.get("HIPRESS_TIMEOUT_S") if timeout_s is None else float(timeout_s)
        if isinstance(transport, transports.Transport):
            world = transport
            launch = LaunchInfo("explicit", world.rank, world.size)
        else:
            launch = detect_launch(None, rank, size, master_addr, master_port)
            if not 0 <= launch.rank < launch.size:
                raise ValueError(f"rank {launch.rank} is not in [0, {launch.size}) ({launch.launcher} launch)")
            world = transports.choose(transport, launch).create(launch, timeout)
        try:
            _state = _group_by_host(world, launch)
        except BaseException:
            world.close()
            raise
        _close_at_exit()


def reconnect() -> None:
    """Replaces the world's transports by fresh connections among the same ranks (collective:
    every rank calls it). For recovering after a failed operation, which may leave a transport
    unusable (gloo closes every connection of a group after a timeout). Needs a transport that
    can reconnect (torch/gloo: a new group over the same store); others raise RuntimeError."""
    global _state
    with _lock:
        s = _get()
        if s.size == 1:
            return
        fresh = getattr(s.world, "reconnect", None)
        if fresh is None:
            raise RuntimeError(f"the {s.world.name} transport cannot reconnect after a failure")
        new_world = fresh()
        for t in {id(t): t for t in (s.cross, s.local, s.world, s.control) if t is not None}.values():
            try:
                t.close()
            except Exception:  # noqa: BLE001 - best effort: the old connections may be broken
                pass
        _state = _group_by_host(new_world, s.launch)


def silent_peers(window_s: float, grace_s: float = 2.0) -> Optional[List[int]]:
    """After a failed operation, which peers did not fail too. This rank writes the time into the
    rendezvous store (``hipress/waiting/<rank>``), then reads the other ranks' entries for up to
    ``grace_s``: a peer whose entry is at most ``window_s`` old failed as well (it is alive: it
    timed out waiting on someone else, or lost a connection), the others are silent: stalled,
    dead, or still running. None when there is no
    store (transports other than torch) or it cannot be reached (rank 0, which hosts it, is
    gone). Costs nothing until called: nothing is written on the normal path."""
    s = _get()
    store = getattr(s.world, "store", None)
    if store is None or s.size == 1:
        return None
    now = time.time()
    try:
        store.set(f"hipress/waiting/{s.rank}", repr(now))
        end = time.monotonic() + grace_s
        while True:
            silent = []
            for r in range(s.size):
                key = f"hipress/waiting/{r}"
                if r != s.rank and not (store.check([key]) and abs(now - float(store.get(key))) <= window_s):
                    silent.append(r)
            if not silent or time.monotonic() > end:
                return silent
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store's host is gone too
        return None


def init_private_gloo(store, prefix: str, rank: int, size: int, timeout_s: float) -> None:
    """The world over a private gloo group on ``store`` (see TorchDistTransport.private_gloo)."""
    from hipress.comm.transport.torch_dist import TorchDistTransport

    init(transport=TorchDistTransport.private_gloo(store, prefix, rank, size, timeout_s))


# Work that an object leaves on the world transport after its call returns: COVAP's local mode
# averages parameters while the next step computes. An operation on the transport from the
# calling thread (an eager collective, a broadcast, a new optimizer's checks) must not run
# beside it, or the ranks could see the two in different orders. Such an operation calls
# quiesce() first: it waits for every registered object's work in flight.
_inflight: List["weakref.WeakMethod"] = []


def on_quiesce(wait: Callable[[], None]) -> None:
    """Registers a bound method that waits for its object's work in flight (weakly: the object
    may go away)."""
    _inflight.append(weakref.WeakMethod(wait))


def quiesce() -> None:
    """Waits for every registered object's work in flight on the transports (see on_quiesce)."""
    alive = []
    for ref in list(_inflight):
        wait = ref()
        if wait is not None:
            alive.append(ref)
            wait()
    _inflight[:] = alive


def on_shutdown(hook: Callable[[], None]) -> None:
    """Runs ``hook`` (once) at the next :func:`shutdown`, before the transports close:
    what rides on them (the coordinator's executors) stops first."""
    _shutdown_hooks.append(hook)


_exit_registered = False


def _close_at_exit() -> None:
    """Closes the transports while the interpreter is still whole. A gloo process group left to
    the interpreter's final teardown can abort the process ("terminate called without an
    active exception", SIGABRT; pytorch/pytorch#190489): seen at exit of finished ranks under
    load. The engine stops first (its tasks may use the transports); atexit runs handlers in
    reverse order, and this one is registered after the engine's own."""
    global _exit_registered
    if _exit_registered:
        return
    _exit_registered = True

    def close():
        from hipress.engine import shutdown_engine

        shutdown_engine(True, 10.0)
        shutdown()

    atexit.register(close)


def shutdown() -> None:
    """Close the transports; ``init`` may be called again afterwards."""
    global _state
    while _shutdown_hooks:
        _shutdown_hooks.pop(0)()
    with _lock:
        s, _state = _state, None
        if s is None:
            return
        for t in (s.control, s.cross, s.local, s.world):
            if t is None:
                continue
            try:
                t.close()
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass


# ---------------------------------------------------------------------------- hosts
def _hostname() -> str:
    return config.get("HIPRESS_HOSTNAME") or socket.gethostname()


def _group_by_host(world, launch: LaunchInfo) -> _State:
    import torch

    n = world.size
    if n == 1:
        return _State(launch, world, world, world, 0, 1, [_hostname()], [0], [0])
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
    local = world.split(host_of[me], key=me)
    cross = world.split(local_of[me], key=me)
    local_members = [r for r in range(n) if host_of[r] == host_of[me]]
    cross_members = [r for r in range(n) if local_of[r] == local_of[me]]
    return _State(launch, world, local, cross, me, n, names, local_members, cross_members)


def _buffer_device(world):
    dev = getattr(world, "device", None)
    return dev if dev is not None else "cpu"
