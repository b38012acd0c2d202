"""In-process transport: N ranks as N threads of one process (for fast tests).

    from hipress.comm.transport import loopback
    results = loopback.spawn(4, lambda t: t.rank * 10)   # [0, 10, 20, 30]

Like gloo's ``test/base_test.h::spawn()``: every thread gets its own :class:`LoopbackTransport`
over a shared :class:`LoopbackWorld`; :func:`spawn` joins them and re-raises the first
error (with its rank). Semantics follow the other backends: sends are buffered (eager),
receives and collectives wait, bounded by ``timeout_s``. A rank whose function raised
or returned is *gone*: a peer waiting on it fails at once with a :class:`TransportError`
naming it, and a peer that is merely late fails after the timeout, also named.
Collectives are matched by sequence number and name, so two ranks calling different
collectives at the same step is reported rather than silently mis-paired.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from typing import Callable, Dict, List, Optional

import torch

from hipress.comm.transport.base import Transport, TransportError

__all__ = ["LoopbackWorld", "LoopbackTransport", "spawn"]


class LoopbackWorld:
    """Shared state of ``size`` in-process ranks: mailboxes and collective slots."""

    def __init__(self, size: int, parent: Optional["LoopbackWorld"] = None, parent_ranks: Optional[List[int]] = None):
        if size < 1:
            raise ValueError("a loopback world needs at least one rank")
        self.size = size
        self.cv = threading.Condition()
        self.mail: Dict[tuple, deque] = defaultdict(deque)   # (src, dst, tag) -> payloads
        self.slots: Dict[int, dict] = {}                      # collective seq -> {rank: (name, payload)}
        self.slot_reads: Dict[int, int] = defaultdict(int)
        self.gone: Dict[int, str] = {}                        # rank -> why it left
        self.children: List[tuple] = []                       # (world, parent_ranks)
        self.splits: Dict[tuple, "LoopbackWorld"] = {}
        self.parent = parent
        if parent is not None:
            with parent.cv:
                parent.children.append((self, parent_ranks))
                for pr, why in parent.gone.items():
                    if pr in parent_ranks:
                        self.gone[parent_ranks.index(pr)] = why

    def mark_gone(self, rank: int, why: str) -> None:
        with self.cv:
            self.gone.setdefault(rank, why)
            children = list(self.children)
            self.cv.notify_all()
        for child, pranks in children:
            if rank in pranks:
                child.mark_gone(pranks.index(rank), why)


class LoopbackTransport(Transport):
    name = "loopback"
    allreduce_dtypes = (torch.float32, torch.bfloat16, torch.float16)

    def __init__(self, world: LoopbackWorld, rank: int, timeout_s: Optional[float] = None, check: Optional[bool] = None):
        super().__init__(rank, world.size, timeout_s, check)
        self.world = world
        self._seq = 0

    def _check_device(self, what, t):
        return None  # copies work on any device

    # ------------------------------------------------------------------ waiting
    def _wait(self, op: str, ready: Callable[[], bool], peers) -> None:
        """Wait (holding world.cv) until ready(); fail at once if an awaited peer is gone.

        ``peers``: the ranks awaited (a list, or a callable returning the ones still missing)."""
        w = self.world
        missing = peers if callable(peers) else (lambda: peers)
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            waiting_on = missing()
            gone = [p for p in waiting_on if p in w.gone]
            if gone:
                why = "; ".join(f"rank {p} {w.gone[p]}" for p in gone)
                raise self._err(op, f"peer(s) left before completing it: {why}", gone)
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._err(op, f"timed out after {self.timeout_s:g} s waiting for rank(s) {waiting_on}", waiting_on)
            w.cv.wait(min(left, 0.5))

    # ------------------------------------------------------------------ point to point
    def _raw_send(self, buf, dst, tag, op):
        w = self.world
        with w.cv:
            w.mail[(self._rank, dst, tag)].append(buf.clone())
            w.cv.notify_all()

    def _raw_recv(self, buf, src, tag, op):
        w = self.world
        key = (src, self._rank, tag)
        with w.cv:
            self._wait(op, lambda: len(w.mail[key]) > 0, [src])
            data = w.mail[key].popleft()
        if data.numel() != buf.numel():
            raise self._err(op, f"rank {src} sent {data.numel()} bytes but the receive buffer holds {buf.numel()}", [src])
        buf.copy_(data)

    def _raw_sendrecv(self, send_buf, dst, recv_buf, src, op):
        self._raw_p2p([] if send_buf is None else [(send_buf, dst)], [] if recv_buf is None else [(recv_buf, src)], op)

    p2p_many = True  # sends are buffered, so posting them all and then receiving cannot deadlock

    def _raw_p2p(self, sends, recvs, op):
        for buf, dst in sends:
            self._raw_send(buf, dst, -1, op)
        for buf, src in recvs:
            self._raw_recv(buf, src, -1, op)

    # ------------------------------------------------------------------ collectives
    def _exchange(self, op: str, payload) -> list:
        """Deposit payload for this collective step; return every rank's payload."""
        w = self.world
        seq = self._seq
        self._seq += 1
        kind = op.split("(")[0]
        with w.cv:
            slot = w.slots.setdefault(seq, {})
            slot[self._rank] = (kind, payload)
            w.cv.notify_all()
            self._wait(op, lambda: len(slot) == w.size, lambda: [p for p in range(w.size) if p not in slot])
            kinds = {r: k for r, (k, _) in slot.items()}
            out = [slot[r][1] for r in range(w.size)]
            w.slot_reads[seq] += 1
            if w.slot_reads[seq] == w.size:
                del w.slots[seq]
                del w.slot_reads[seq]
        if len(set(kinds.values())) != 1:
            raise self._err(op, f"collective mismatch at step {seq}: {kinds}", list(kinds))
        return out

    def _raw_alltoallv(self, send_buf, send_counts, recv_buf, recv_counts, op):
        parts = self._exchange(op, (send_buf, list(send_counts)))
        off = 0
        for i, (sb, sc) in enumerate(parts):
            n = recv_counts[i]
            if sc[self._rank] != n:
                raise self._err(op, f"rank {i} sends {sc[self._rank]} bytes, this rank expects {n}", [i])
            src_off = sum(sc[: self._rank])
            if n:
                recv_buf[off:off + n].copy_(sb[src_off:src_off + n])
            off += n
        self._exchange(op + ".done", None)  # senders may reuse their buffers only after all reads

    def _raw_allgather(self, send_buf, recv_buf, op):
        parts = self._exchange(op, send_buf)
        m = send_buf.numel()
        for i, sb in enumerate(parts):
            if sb.numel() != m:
                raise self._err(op, f"rank {i} contributes {sb.numel()} bytes, this rank {m}", [i])
            recv_buf[i * m:(i + 1) * m].copy_(sb)
        self._exchange(op + ".done", None)

    def _raw_allgatherv(self, send_buf, recv_buf, recv_counts, op):
        parts = self._exchange(op, send_buf)
        off = 0
        for i, sb in enumerate(parts):
            if sb.numel() != recv_counts[i]:
                raise self._err(op, f"rank {i} contributes {sb.numel()} bytes, expected {recv_counts[i]}", [i])
            dst = recv_buf[off:off + sb.numel()]
            if dst.data_ptr() != sb.data_ptr():  # this rank's own part, sent from its place in recv_buf
                dst.copy_(sb)
            off += sb.numel()
        self._exchange(op + ".done", None)

    def _raw_broadcast(self, buf, root, op):
        parts = self._exchange(op, buf if self._rank == root else None)
        if self._rank != root:
            buf.copy_(parts[root])
        self._exchange(op + ".done", None)

    def _raw_allreduce(self, values, op):
        # Copies are deposited, so a rank may overwrite its values before the others have read
        # them; every rank adds them in rank order, so all end with the same bits.
        parts = self._exchange(op, values.clone())
        total = parts[0].clone()
        for i, part in enumerate(parts[1:], 1):
            if part.numel() != total.numel():
                raise self._err(op, f"rank {i} contributes {part.numel()} values, rank 0 {total.numel()}", [i])
            total.add_(part)
        values.copy_(total)

    def _raw_barrier(self, op):
        self._exchange(op, None)

    # ------------------------------------------------------------------ groups
    def _make_split(self, members, colors, color_of):
        w = self.world
        seq = self._seq  # the split's metadata exchange already advanced seq identically on all ranks
        if members is None:
            return None
        color = color_of[self._rank]
        with w.cv:
            key = (seq, color)
            sub = w.splits.get(key)
            if sub is None:
                sub = LoopbackWorld(len(members), parent=w, parent_ranks=list(members))
                w.splits[key] = sub
        return LoopbackTransport(sub, members.index(self._rank), self.timeout_s, self.check)

    def _raw_close(self):
        self.world.mark_gone(self._rank, "closed its transport")


def spawn(n: int, fn: Callable[[LoopbackTransport], object], timeout_s: Optional[float] = None,
          check: Optional[bool] = None, join_timeout_s: Optional[float] = None) -> list:
    """Run ``fn(transport)`` on ``n`` threads, one rank each; return their results in rank
    order, or re-raise the first failure (lowest rank among the failures that are not mere
    consequences of another rank's failure)."""
    world = LoopbackWorld(n)
    results: list = [None] * n
    errors: Dict[int, BaseException] = {}
    transports = [LoopbackTransport(world, r, timeout_s, check) for r in range(n)]

    def body(r: int) -> None:
        try:
            results[r] = fn(transports[r])
            world.mark_gone(r, "returned")
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors[r] = e
            world.mark_gone(r, f"failed with {type(e).__name__}: {e}")

    threads = [threading.Thread(target=body, args=(r,), name=f"hipress-loopback-{r}", daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    limit = join_timeout_s if join_timeout_s is not None else (transports[0].timeout_s * 4 + 30)
    deadline = time.monotonic() + limit
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [r for r, t in enumerate(threads) if t.is_alive()]
    if alive:
        raise TimeoutError(f"loopback.spawn: rank(s) {alive} still running after {limit:g} s")
    if errors:
        # Prefer a root cause over the TransportErrors it caused on the other ranks.
        roots = {r: e for r, e in errors.items() if not isinstance(e, TransportError)}
        r = min(roots or errors)
        e = errors[r]
        others = {q: f"{type(x).__name__}: {x}" for q, x in errors.items() if q != r}
        note = f"raised by loopback rank {r} of {n}"
        if others:
            note += f"; other ranks failed too: {others}"
        if hasattr(e, "add_note"):  # Python >= 3.11
            e.add_note(note)
        e.loopback_rank = r
        raise e
    return results


def _connect(launch, timeout: float) -> "LoopbackTransport":
    if launch.size != 1:
        raise ValueError(f"the loopback transport runs all ranks in one process (loopback.spawn); "
                         f"it cannot connect {launch.size} processes")
    return LoopbackTransport(LoopbackWorld(1), 0, timeout)


from hipress.comm.transport import Backend, register  # noqa: E402 - the registry imports this module

register(Backend("loopback", _connect, claims=lambda launch: launch.size == 1, priority=0))
