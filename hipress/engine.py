"""Python face of the CaSync task engine (csrc/engine/).

    eng = hipress.engine.get_engine()
    a = eng.submit("encode.fc1", encode_fn)                       # compute queue
    b = eng.submit("send.fc1", send_fn, queue="comm", deps=[a])   # waits for a
    b.wait(timeout=5.0); b.result()

Work is a Python callable (run with the GIL, on the queue's thread) or a
``hipress._C.NativeWork`` (runs in C++ without the GIL). A failing task fails
every task that depends on it; the error surfaces at each handle with the
task's name and the original message.
"""
from __future__ import annotations

import atexit
import threading
import time
from typing import Any, Callable, Iterable, Optional, Sequence, Tuple, Union

from hipress import _C, config

QUEUES = {"compute": 0, "comm": 1}
EngineShutdownError = _C.EngineShutdownError


class TaskError(RuntimeError):
    """A task, or one of its dependencies, failed. ``task`` names the task."""

    def __init__(self, task: str, message: str):
        super().__init__(f"task '{task}' failed: {message}")
        self.task = task
        self.reason = message


class TaskTimeout(TimeoutError):
    pass


_NOT_SET = object()


class Handle:
    """Returned by :meth:`Engine.submit` at once; poll, wait or get a future."""

    __slots__ = ("_task", "_box", "waits_on", "after_all", "exchange_key")

    def __init__(self, task: "_C.TaskHandle", box: list, waits_on: tuple = (), after_all: tuple = ()):
        self._task = task
        self._box = box  # [return value of a Python task], filled by the task itself
        # The unfinished coordinated exchanges this task waits on, directly or through other
        # tasks (the global coordinator plans a message only after them; empty without it).
        self.waits_on = waits_on
        # The same, finished or not: what the task graph says, whatever the timing (the
        # coordinator's prediction of the next step's exchanges compares graphs by it).
        self.after_all = after_all
        self.exchange_key: Optional[int] = None  # set on a coordinated exchange's own handle

    @property
    def name(self) -> str:
        return self._task.name

    @property
    def state(self) -> str:
        return self._task.state

    def poll(self) -> bool:
        """Whether the task finished (successfully or not)."""
        return _observed(self._task.finished)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until finished; False if timeout (seconds) passed first."""
        return _observed(self._task.wait(-1.0 if timeout is None else max(0.0, float(timeout))))

    def exception(self, timeout: Optional[float] = None) -> Optional[TaskError]:
        if not self.wait(timeout):
            raise TaskTimeout(f"task '{self.name}' did not finish within {timeout} s")
        if self._task.state == "done":
            return None
        return TaskError(self.name, self._task.error)

    def result(self, timeout: Optional[float] = None) -> Any:
        """The Python task's return value (None for native tasks); raises TaskError."""
        err = self.exception(timeout)
        if err is not None:
            raise err
        return None if self._box[0] is _NOT_SET else self._box[0]

    def add_done_callback(self, fn: Callable[["Handle"], None]) -> None:
        """fn(handle) runs once the task finished (on the engine thread that finished it)."""
        self._task.add_done_callback(lambda: fn(self))

    def future(self):
        """A ``torch.futures.Future`` completed with :meth:`result` (or its error)."""
        import torch

        fut = torch.futures.Future()

        def _complete(h: "Handle") -> None:
            err = h.exception(0)
            if err is None:
                fut.set_result(None if h._box[0] is _NOT_SET else h._box[0])
            else:
                fut.set_exception(err)

        self.add_done_callback(_complete)
        return fut

    @property
    def native(self) -> "_C.TaskHandle":
        return self._task

    def __repr__(self) -> str:
        return f"<hipress task {self.name!r} {self.state}>"


_LAST_OBSERVED = [0.0]


def _observed(finished: bool) -> bool:
    if finished:
        _LAST_OBSERVED[0] = time.monotonic()
    return finished


def last_observed() -> float:
    """When (time.monotonic()) a wait or poll last found a task finished: after it, the program
    may act on that task's results (the coordinator's step prediction does not plan an
    exchange made after it in one slot with, or ahead of, one made before)."""
    return _LAST_OBSERVED[0]


def exchanges_waited_on(deps: Sequence[Handle]) -> Tuple[tuple, tuple]:
    """(waits_on, after_all) of a task waiting on ``deps``: the coordinated exchanges it waits
    on, unfinished ones only (a finished one's messages have moved, so they were planned long
    ago), and all of them."""
    unfinished: list = []
    every: list = []
    for d in deps:
        for h in d.after_all:
            if h not in every:
                every.append(h)
                if not h._task.finished:
                    unfinished.append(h)
    return tuple(unfinished), tuple(every)


def _batch_key(name: str) -> int:
    import zlib
    return zlib.crc32(name.encode()) or 1


class Completion:
    """Finishes one posted deferred task (see :meth:`Engine.submit_deferred`)."""

    __slots__ = ("_engine", "_task")

    def __init__(self, engine: "_C.Engine", task: "_C.TaskHandle"):
        self._engine = engine
        self._task = task

    @property
    def name(self) -> str:
        return self._task.name

    def done(self) -> None:
        self._engine.complete(self._task, True, "")

    def fail(self, message: str) -> None:
        self._engine.complete(self._task, False, str(message))


Work = Union[Callable[[], Any], "_C.NativeWork"]


class Engine:
    """Two queues (compute, comm), each drained by its own thread; a dependency graph."""

    def __init__(self, timeline_path: Optional[str] = None, rank: int = 0):
        self._engine = _C.Engine(timeline_path or "", rank)
        self.timeline_path = timeline_path

    def submit(self, name: str, work: Work, queue: str = "compute", deps: Iterable[Handle] = (),
               batch: Optional[str] = None, keep: Any = None) -> Handle:
        """batch: tasks queued back to back with the same batch name run as one batch
        (one hand-off, one completion pass, one timeline slice): batch compression.
        keep: what a native work reads or writes (tensors), kept alive as long as the handle."""
        if queue not in QUEUES:
            raise ValueError(f"unknown queue {queue!r}; expected one of {sorted(QUEUES)}")
        box = [_NOT_SET, keep]
        if isinstance(work, _C.NativeWork):
            body = work
        elif callable(work):
            def body(work=work, box=box):
                box[0] = work()
        else:
            raise TypeError(f"task work must be callable or a hipress._C.NativeWork, got {type(work).__name__}")
        deps = list(deps)
        for d in deps:
            if not isinstance(d, Handle):
                raise TypeError(f"dependencies of task {name!r} must be Handles, got {type(d).__name__}")
        key = _batch_key(batch) if batch else 0
        return Handle(self._engine.submit(name, QUEUES[queue], body, [d._task for d in deps], key), box,
                      *exchanges_waited_on(deps))

    def submit_deferred(self, name: str, post: Callable[["Completion"], None], queue: str = "comm",
                        deps: Iterable[Handle] = ()) -> Handle:
        """A task that hands its job to someone else: when ready, post(completion) runs on
        the queue's thread and must return quickly; the task finishes (and its dependents
        are released) when someone calls completion.done() or completion.fail(message),
        from any thread. Used by the coordinator's executor for bulk communication."""
        if queue not in QUEUES:
            raise ValueError(f"unknown queue {queue!r}; expected one of {sorted(QUEUES)}")
        deps = list(deps)
        eng = self._engine
        task = eng.submit_deferred(name, QUEUES[queue], lambda h: post(Completion(eng, h)), [d._task for d in deps])
        return Handle(task, [_NOT_SET], *exchanges_waited_on(deps))

    def shutdown(self, drain: bool = True, timeout: Optional[float] = None) -> None:
        self._engine.shutdown(drain, -1.0 if timeout is None else float(timeout))

    @property
    def is_shut_down(self) -> bool:
        return self._engine.is_shut_down

    def counters(self) -> dict:
        return self._engine.counters()

    @property
    def timeline_enabled(self) -> bool:
        return self._engine.timeline_enabled

    def timeline_row(self, row: int, name: str) -> None:
        """Names an extra timeline row (rows 0 and 1 are the queues)."""
        self._engine.timeline_row(row, name)

    def timeline_slice(self, row: int, name: str, start_ns: int, end_ns: int) -> None:
        """Adds an event from outside the engine (times from ``hipress._C.now_ns()``)."""
        self._engine.timeline_slice(row, name, start_ns, end_ns)


_lock = threading.Lock()
_engine: Optional[Engine] = None


def _timeline_rank() -> int:
    """This process's rank, the timeline's pid: hipress's world rank once ``hipress.init()``
    ran (``init(rank=...)`` included), else the rank the launcher set (mpirun, torchrun,
    horovodrun; see :mod:`hipress.comm.discovery`), else 0."""
    from hipress.comm import world  # imported here: the comm seam sits above the engine
    from hipress.comm.discovery import detect_launch

    if world.is_initialized():
        return world.rank()
    return detect_launch().rank


def get_engine() -> Engine:
    """The process-wide engine, created on first use; HIPRESS_TIMELINE=path enables the timeline."""
    global _engine
    with _lock:
        if _engine is None or _engine.is_shut_down:
            path = config.get("HIPRESS_TIMELINE") or None
            rank = _timeline_rank() if path else 0
            if path and "{rank}" in path:
                path = path.format(rank=rank)
            _engine = Engine(path, rank)
        return _engine


def shutdown_engine(drain: bool = True, timeout: Optional[float] = 30.0) -> None:
    """Stops the process-wide engine (drains, then cancels what is left)."""
    global _engine
    with _lock:
        eng, _engine = _engine, None
    if eng is not None:
        eng.shutdown(drain=drain, timeout=timeout)


# Queue threads must stop while the interpreter can still run Python tasks.
atexit.register(shutdown_engine, True, 10.0)
