"""Per-rank executor of coordinated bulk communication (paper 000 §3.2, Fig. 2 steps 4-6),
with the coordinator on rank 0.

Strategies hand the executor *exchanges*: a set of messages to send (dst -> payload) and
to receive (src -> sink), each identified by a key both sides derive from the exchange's
name. The exchange is a deferred engine task: it finishes when all its messages have
moved, which releases its dependents (step 6).

The executor thread of every rank runs numbered slots in lock step over a private
duplicate of the world transport (so it never races the comm queue or user collectives):

  1. META   every rank sends rank 0 one fixed-size frame listing its sends posted since
            the last slot (key, destination, bytes) and whether it is closing
            (one alltoallv: a frame to rank 0, nothing to others)
  2. plan   rank 0 adds them to per-link queues and plans the slot with SlotPlanner:
            a matching of non-conflicting links, each with a FIFO batch (planner.py)
  3. PLAN   rank 0 sends every rank its part: what to send to whom, what it receives
            from whom, in which order and size (one alltoallv)
  4. data   one alltoallv moves the slot's batches; zero counts for idle pairs
  5.        received payloads go to their sinks (or wait, if the receive is not posted
            yet); exchanges whose messages have all moved are completed
A slot with nothing planned is IDLE: ranks sleep briefly (backing off up to
``idle_max_s``) before the next one. Shutdown: a closing rank says so in its META; when
every rank is closing and nothing is pending, rank 0 plans STOP and all leave the loop.
A late or dead rank makes the step's collective time out (HIPRESS_TIMEOUT_S) on every
rank; the executor then fails every pending exchange with that error.
Self-messages (src == dst) never touch the network.
"""
from __future__ import annotations

import hashlib
import queue
import random
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from hipress import config
from hipress.comm.coordinator import protocol as P
from hipress.comm.coordinator.planner import Msg, SlotPlanner


def message_key(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") >> 1


class PostedExchange:
    """One posted exchange: sends {dst: payload}, receives {src: sink(payload)}."""

    __slots__ = ("name", "key", "sends", "sinks", "completion", "left")

    def __init__(self, name, key, sends, sinks, completion):
        self.name, self.key, self.sends, self.sinks, self.completion = name, key, sends, sinks, completion
        self.left = len(sends) + len(sinks)


class Executor:
    def __init__(self, transport, batch_bytes: Optional[int] = None, batch_timeout_ms: Optional[float] = None,
                 max_entries: int = 512, idle_max_s: float = 0.002):
        self.tr = transport
        self.rank, self.n = transport.rank, transport.size
        self.batch_bytes = int(batch_bytes if batch_bytes is not None
                               else config.get("HIPRESS_BATCH_BYTES"))
        timeout_ms = batch_timeout_ms if batch_timeout_ms is not None else config.get("HIPRESS_BATCH_TIMEOUT_MS")
        self.max_entries = max_entries
        self.idle_max_s = idle_max_s
        self.frame = P.frame_bytes(max_entries)
        self._posted: "queue.Queue[PostedExchange]" = queue.Queue()
        self._closing = threading.Event()
        self._error: Optional[str] = None
        self.stats = {"slots": 0, "idle_slots": 0, "bytes": 0, "messages": 0, "plan_s": 0.0}
        # Receiver side: (src, key) -> exchange waiting for it, and payloads that came first.
        self._expect: Dict[Tuple[int, int], PostedExchange] = {}
        self._early: Dict[Tuple[int, int], torch.Tensor] = {}
        self._outbox: List[Tuple[int, int, torch.Tensor, PostedExchange]] = []  # (key, dst, payload, ex) to report
        self._reported: Dict[Tuple[int, int], Tuple[torch.Tensor, PostedExchange]] = {}  # (dst, key) -> payload
        # Job token: rank 0 draws it, everyone learns it; every frame must carry it.
        tok = torch.tensor([random.getrandbits(62) if self.rank == 0 else 0], dtype=torch.int64)
        self.tr.broadcast(tok.view(torch.uint8), 0)
        self.token = int(tok[0])
        if self.rank == 0:
            # Slots are the planner's unit of time; the timeout becomes a number of slots
            # (a slot takes at least ~0.1 ms of control traffic).
            self.planner = SlotPlanner(self.n, self.batch_bytes, timeout_slots=int(timeout_ms / 0.1))
            self._closing_ranks = set()
        self._thread = threading.Thread(target=self._loop, name="hipress-executor", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ posting side
    def post(self, name: str, sends: Dict[int, torch.Tensor], sinks: Dict[int, Callable], completion) -> None:
        """Called on the comm queue thread by a deferred task."""
        ex = PostedExchange(name, message_key(name), sends, sinks, completion)
        if self._error is not None:
            completion.fail(f"coordinated exchange '{name}' cannot run: {self._error}")
            return
        if ex.left == 0:
            completion.done()
            return
        self._posted.put(ex)

    def close(self, timeout: float = 30.0) -> None:
        """Collective: every rank closes; returns once the loop has stopped."""
        self._closing.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"coordinator executor on rank {self.rank} did not stop within {timeout} s")

    # ------------------------------------------------------------------ loop
    def _take_posted(self) -> None:
        while True:
            try:
                ex = self._posted.get_nowait()
            except queue.Empty:
                return
            for src, sink in ex.sinks.items():
                k = (src, ex.key)
                if k in self._expect:
                    raise RuntimeError(f"two pending receives of '{ex.name}' from rank {src}")
                self._expect[k] = ex
            for dst, payload in ex.sends.items():
                payload = payload.contiguous().view(torch.uint8).view(-1)
                if dst == self.rank:
                    self._deliver(self.rank, ex.key, payload)
                    self._progress(ex)
                else:
                    self._outbox.append((ex.key, dst, payload, ex))
            for src in list(ex.sinks):  # payloads that arrived before the receive was posted
                k = (src, ex.key)
                if k in self._early:
                    self._deliver(src, ex.key, self._early.pop(k))

    def _deliver(self, src: int, key: int, payload: torch.Tensor) -> None:
        ex = self._expect.pop((src, key), None)
        if ex is None:
            self._early[(src, key)] = payload
            return
        ex.sinks[src](payload)
        self._progress(ex)

    def _progress(self, ex: PostedExchange) -> None:
        ex.left -= 1
        if ex.left == 0:
            ex.completion.done()

    def _alltoall_frames(self, send_frames: Dict[int, bytes], recv_from: List[int]) -> Dict[int, bytes]:
        n, f = self.n, self.frame
        send_counts = [f if j in send_frames else 0 for j in range(n)]
        recv_counts = [f if j in recv_from else 0 for j in range(n)]
        sbuf = torch.frombuffer(bytearray(b"".join(send_frames[j] for j in range(n) if j in send_frames)),
                                dtype=torch.uint8) if send_frames else torch.empty(0, dtype=torch.uint8)
        rbuf = torch.empty(sum(recv_counts), dtype=torch.uint8)
        self.tr.alltoallv(sbuf, send_counts, rbuf, recv_counts)
        raw = rbuf.numpy().tobytes()
        out, off = {}, 0
        for j in range(n):
            if recv_counts[j]:
                out[j] = raw[off:off + f]
                off += f
        return out

    def _slot(self, slot: int) -> str:
        """Runs one slot; returns "stop" (coordinator said STOP), "idle" or "busy"."""
        self._take_posted()
        report, self._outbox = self._outbox[:self.max_entries], self._outbox[self.max_entries:]
        for key, dst, payload, ex in report:
            self._reported[(dst, key)] = (payload, ex)
        closing = self._closing.is_set() and not self._outbox and self._posted.empty()
        meta = P.pack(P.META, self.rank, self.token, slot, P.CLOSING if closing else 0,
                      [(key, dst, P.SEND, payload.numel()) for key, dst, payload, _ in report], self.max_entries)
        got = self._alltoall_frames({0: meta}, list(range(self.n)) if self.rank == 0 else [])
        plans = {}
        if self.rank == 0:
            t0 = time.perf_counter()
            for src, raw in got.items():
                flags, entries = P.unpack(raw, P.META, self.token, slot, src, self.max_entries, self.n)
                if flags & P.CLOSING:
                    self._closing_ranks.add(src)
                else:
                    self._closing_ranks.discard(src)
                self.planner.add([Msg(key, src, dst, nbytes) for key, dst, _, nbytes in entries])
            planned = self.planner.plan()
            parts: Dict[int, list] = {r: [] for r in range(self.n)}
            for (s, d), batch in planned.batches.items():
                for m in batch:
                    parts[s].append((m.key, d, P.SEND, m.nbytes))
                    parts[d].append((m.key, s, P.RECV, m.nbytes))
            stop = len(self._closing_ranks) == self.n and self.planner.pending() == 0
            flags = (P.STOP if stop else 0) | (P.IDLE if not planned.batches else 0)
            for r in range(self.n):
                if len(parts[r]) > self.max_entries:
                    raise P.ProtocolError(f"slot part for rank {r} exceeds {self.max_entries} entries")
                plans[r] = P.pack(P.PLAN, r, self.token, slot, flags, parts[r], self.max_entries)
            self.stats["plan_s"] += time.perf_counter() - t0
        got = self._alltoall_frames(plans, [0])
        flags, entries = P.unpack(got[0], P.PLAN, self.token, slot, self.rank, self.max_entries, self.n)
        self.stats["slots"] += 1
        if flags & P.STOP:
            return "stop"
        if flags & P.IDLE:
            self.stats["idle_slots"] += 1
            return "idle"
        # Data: one alltoallv with this rank's batch to its one destination, from its one source.
        send_counts, recv_counts = [0] * self.n, [0] * self.n
        sends, recvs = [], []
        for key, peer, kind, nbytes in entries:
            if kind == P.SEND:
                payload, ex = self._reported.pop((peer, key))
                if payload.numel() != nbytes:
                    raise P.ProtocolError(f"planned {nbytes} bytes for '{ex.name}', payload has {payload.numel()}")
                sends.append((peer, payload, ex))
                send_counts[peer] += nbytes
            else:
                recvs.append((peer, key, nbytes))
                recv_counts[peer] += nbytes
        order = sorted(range(len(sends)), key=lambda i: sends[i][0])  # segments in rank order, FIFO within
        sbuf = torch.cat([sends[i][1] for i in order]) if sends else torch.empty(0, dtype=torch.uint8)
        rbuf = torch.empty(sum(recv_counts), dtype=torch.uint8)
        self.tr.alltoallv(sbuf, send_counts, rbuf, recv_counts)
        offsets, off = {}, 0
        for j in range(self.n):
            offsets[j] = off
            off += recv_counts[j]
        for src, key, nbytes in recvs:
            o = offsets[src]
            self._deliver(src, key, rbuf[o:o + nbytes])
            offsets[src] = o + nbytes
        for _, _, ex in sends:
            self._progress(ex)
        self.stats["bytes"] += int(sbuf.numel())
        self.stats["messages"] += len(sends)
        return "busy"

    def _pending_exchanges(self) -> List[PostedExchange]:
        seen = {id(e): e for e in self._expect.values()}
        seen.update({id(e): e for _, _, _, e in self._outbox})
        seen.update({id(e): e for _, e in self._reported.values()})
        while True:
            try:
                e = self._posted.get_nowait()
            except queue.Empty:
                break
            seen[id(e)] = e
        return [e for e in seen.values() if e.left > 0]

    def _loop(self) -> None:
        slot, idle = 0, 0.0
        try:
            while True:
                state = self._slot(slot)
                if state == "stop":
                    break
                slot += 1
                if state == "idle" and self._posted.empty() and not self._outbox:
                    idle = min(self.idle_max_s, idle * 2 or 5e-5)  # back off while nothing moves
                    time.sleep(idle)
                else:
                    idle = 0.0
        except Exception as e:  # noqa: BLE001 - reported to every waiting exchange
            self._error = f"coordinator slot {slot} failed on rank {self.rank}: {type(e).__name__}: {e}"
            for ex in self._pending_exchanges():
                try:
                    ex.completion.fail(self._error)
                except Exception:  # noqa: BLE001 - already finished or cancelled
                    pass
