"""One supervisor for N rank processes: `hipress.launch` and `hipress.bench.cluster` both run ranks with it.

``supervise(spawn, np, ...)`` starts rank r as ``spawn(r, **io)`` (``io`` asks for a piped,
merged, text stdout in a new session: each rank leads its own process group), streams each
rank's output line by line with the prefix ``[r] `` (and keeps it), and stops every rank as
soon as one fails, on timeout, or when the caller is interrupted. The code it returns:

  * 0 when every rank exited 0;
  * the first failing rank's exit code (a rank killed by signal N counts as ``128 + N``,
    the way a shell reports it);
  * 124 on timeout.

Every wait is bounded: stopping sends SIGTERM to each rank's process group, SIGKILL after a
grace period, then SIGKILL to whatever is left in the group (children that outlived their
leader). ``Terminated`` and ``terminate_on_signals`` turn SIGTERM/SIGHUP into an exception
in the main thread, so a CLI's ``finally`` blocks stop the ranks (exit ``128 + signum``).

Standard library only.
"""
from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

# what supervise() asks of every rank's Popen
RANK_IO = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on host right now, for a listener that starts a moment later (rank 0's
    rendezvous store). Chosen below the kernel's ephemeral range where possible: outgoing
    connections (every other job's ranks connect to each other) take ephemeral ports, and one
    of them took a port the OS had just handed out before rank 0 listened on it (EADDRINUSE,
    two convergence runs side by side)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()  # not the global one: user code may have seeded it identically everywhere
    candidates = [rng.randrange(max(1024, low - 8192), low) for _ in range(64)] if low > 2048 else []
    for port in candidates + [0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError(f"no free TCP port on {host}")


def exit_code(returncode: int) -> int:
    """A Popen return code as a shell reports it: killed by signal N -> 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def pump(stream, prefix: str, sink, lines: List[str], lock: threading.Lock) -> None:
    """Copies stream's lines into lines and, unless sink is None, to sink with prefix (whole lines)."""
    for line in iter(stream.readline, ""):
        lines.append(line)
        if sink is not None:
            with lock:
                sink.write(prefix + line)
                sink.flush()
    stream.close()


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_groups(procs: Sequence[subprocess.Popen], grace: float = 3.0) -> None:
    """Stops each process's group: SIGTERM, up to `grace` seconds shared by all, then SIGKILL."""
    for p in procs:
        if p.poll() is None:
            _killpg(p.pid, signal.SIGTERM)
    deadline = time.time() + grace
    for p in procs:
        while p.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        if p.poll() is None:
            _killpg(p.pid, signal.SIGKILL)
            try:  # bounded: a signal that interrupted an earlier poll() can leave Popen's wait lock held
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        _killpg(p.pid, signal.SIGKILL)  # whatever is left in the group (children that outlived the leader)


class Terminated(BaseException):
    """Raised in the main thread by SIGTERM/SIGHUP (see terminate_on_signals) so that `finally` blocks run."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.code = 128 + signum


def _raise_terminated(signum, _frame):
    raise Terminated(signum)


def terminate_on_signals() -> Dict[int, object]:
    """Makes SIGTERM and SIGHUP raise Terminated where they would kill the process (default handler).

    Only in the main thread (elsewhere signal handlers cannot be set). Returns the replaced
    handlers, for restore_signals.
    """
    old: Dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(s) in (signal.SIG_DFL, None):
                old[s] = signal.signal(s, _raise_terminated)
    return old


def restore_signals(old: Dict[int, object]) -> None:
    for s, h in old.items():
        try:
            signal.signal(s, h)
        except (ValueError, OSError):
            pass
    old.clear()


@contextlib.contextmanager
def _signals_deferred():
    """Holds SIGINT/SIGTERM/SIGHUP back while ranks are being started, then delivers one that
    came. Raised inside Popen (after the fork), KeyboardInterrupt would lose the new rank's
    handle, and the rank would outlive the supervisor."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: List[int] = []
    old = {s: signal.signal(s, lambda signum, _frame: pending.append(signum))
           for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        restore_signals(old)
        if pending:
            signal.raise_signal(pending[0])  # now with the caller's handlers in place


def supervise(spawn: Callable[..., subprocess.Popen], np: int, timeout: Optional[float] = None,
              quiet: bool = False, tag: str = "launch",
              after_stop: Optional[Callable[[], None]] = None) -> Tuple[int, List[str]]:
    """Runs ranks 0..np-1 (rank r is ``spawn(r, **RANK_IO)``) to the end; returns (code, [output per rank]).

    code as in the module docstring. quiet: no streaming and no ``[tag]`` messages (the
    output is still returned). after_stop runs once every rank is stopped, before the
    output streams are drained. Nothing spawn started is left running when this returns
    or raises.
    """
    procs: List[subprocess.Popen] = []
    pumps: List[threading.Thread] = []
    outputs: List[List[str]] = [[] for _ in range(np)]
    sink = None if quiet else sys.stdout
    lock = threading.Lock()
    code = 0
    try:
        with _signals_deferred():
            for r in range(np):
                p = spawn(r, **RANK_IO)
                procs.append(p)
                t = threading.Thread(target=pump, args=(p.stdout, f"[{r}] ", sink, outputs[r], lock), daemon=True)
                t.start()
                pumps.append(t)
        deadline = None if timeout is None else time.time() + timeout
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                code = exit_code(failed[0][1])
                if not quiet:
                    print(f"[{tag}] rank {failed[0][0]} exited with {code}; stopping the others", file=sys.stderr)
                break
            if all(c == 0 for c in codes):
                break
            if deadline is not None and time.time() > deadline:
                code = 124
                if not quiet:
                    print(f"[{tag}] timeout after {timeout} s; stopping all ranks", file=sys.stderr)
                break
            time.sleep(0.05)
    finally:
        stop_groups(procs)
        if after_stop is not None:
            after_stop()
        for t in pumps:
            t.join(timeout=5)
    return code, ["".join(o) for o in outputs]
