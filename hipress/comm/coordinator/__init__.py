"""Global coordinator (paper 000 §3.2): compression-aware bulk synchronization over
non-conflicting links. ``planner.py`` gates and plans slots, ``protocol.py`` is the wire
format, ``executor.py`` runs the rounds and the slots on every rank, ``ahead.py`` declares a
training step's exchanges at the end of the one before.

Every rank's executor runs the same planning over the all-gathered declarations (so every
rank holds the same global plan) on one thread, and its slots on a second one where the
backend allows; control and data ride private duplicates of the job's own transport, so no
socket is opened and only ranks of this job take part.
"""
from __future__ import annotations

import atexit
import functools
import threading
from typing import List

from hipress import config
from hipress.comm.coordinator.executor import Executor, message_key
from hipress.comm.coordinator.planner import DependencyGate, Msg, Slot, SlotPlanner

_lock = threading.Lock()
_executors: List[Executor] = []


def start(world_transport, **kw) -> Executor:
    """Collective: starts an executor over a private duplicate of world_transport; it
    stops at ``world.shutdown()`` (before the transports close) or at exit."""
    from hipress.comm import world

    data = world_transport.split(0, key=world_transport.rank)
    # The control rounds get their own duplicate and thread where the backend can run both at once.
    control = world_transport.split(0, key=world_transport.rank) if world_transport.concurrent_splits else None
    ex = Executor(data, control, trace=_timeline(), **kw)
    with _lock:
        if not _executors:
            world.on_shutdown(shutdown_all)
        _executors.append(ex)
    return ex


TIMELINE_ROW = 4  # the engine's timeline: 0 and 1 its queues, 2 backward, 3 dear


def _timeline():
    """Where HIPRESS_TIMELINE is on, a row of the slots this rank ran: each one's wait for its own
    payloads and its exchange."""
    from hipress.engine import get_engine

    engine = get_engine()
    if not engine.timeline_enabled:
        return None
    engine.timeline_row(TIMELINE_ROW, "coordinator slots")
    return functools.partial(engine.timeline_slice, TIMELINE_ROW)


def stop(ex: Executor, timeout: float = 30.0) -> None:
    """Collective: stops one executor (every rank stops its own at the same point: coordinator="auto"
    keeping the coordinator off) and closes its transports."""
    with _lock:
        if ex in _executors:
            _executors.remove(ex)
    try:
        ex.close(timeout)
    finally:
        for tr in {id(ex.tr): ex.tr, id(ex.ctl): ex.ctl}.values():
            try:
                tr.close()
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass


def replace(ex: Executor, world_transport) -> Executor:
    """Collective, after a failed step and ``world.reconnect()``: a new executor over the new
    world transport in place of ``ex``. ``ex`` is closed first where it still runs (every rank
    calls this, so its CLOSING round completes); where a peer's executor failed, its rounds time
    out (HIPRESS_TIMEOUT_S) and it stops with an error, which is expected here and dropped."""
    try:
        stop(ex, timeout=config.get("HIPRESS_TIMEOUT_S") + 5.0)
    except Exception:  # noqa: BLE001 - the failure reset() recovers from may be this executor's own
        pass
    return start(world_transport, every_rank_declares=ex.every_rank_declares)


def shutdown_all(timeout: float = 30.0) -> None:
    """Collective: stops every executor of this process (each rank must call it)."""
    with _lock:
        exs = list(_executors)
    for ex in exs:
        stop(ex, timeout)


atexit.register(shutdown_all, 10.0)

__all__ = ["DependencyGate", "Executor", "Msg", "Slot", "SlotPlanner", "message_key", "replace", "shutdown_all",
           "start", "stop"]
