"""Per-rank executor of coordinated communication (paper 000 §3.2, Fig. 2 steps 4-6), planning
ahead of the data (§5.1: the coordination of a batch runs asynchronously with the transfers
of the batches before it).

Strategies hand the executor *exchanges*: messages to send (dst -> payload) and to receive
(src -> sink), identified by a key both sides derive from the exchange's name. An exchange
is **declared** when it is submitted: its peers, and the earlier exchanges its tasks wait on
(``hipress.engine.Handle.waits_on``), long before its payloads exist. It is **posted** when
its dependencies are done (a deferred engine task), and finishes when all its messages have
moved, which releases its dependents (step 6).

Control rounds, every rank in lock step over a private duplicate of the world transport
(protocol.py): an all-gather of every rank's HEAD and, when someone declared something, an
all-gather of the declarations. The coordinator's planning then runs on every rank over the
same declarations in the same order, so every rank derives the same global plan and no plan
has to travel back from rank 0 (two collectives per round instead of four; one when idle):

  - DependencyGate holds each message back until both its ends have declared it and their
    parts of the exchanges they wait on are planned;
  - SlotPlanner plans slots of non-conflicting links, each link's queue in one batch, until
    nothing admitted is left: a whole ring is planned in one round, its steps in
    consecutive slots, and the steps of buckets declared together share slots.

Data, every rank over another duplicate: its slots in global order, each one ``exchange``
with its destinations and sources once the payloads it sends are posted (one destination and
one source, but several where the slot holds small messages and the backend can post them at
once). Each link's batch starts with its messages' sizes and is as long as the plan expects
from the declared sizes; a longer one sends the rest in a second round (``_run_slot``). There
is no lock step: a rank waits only for the peers of its own slots. Where the backend can run
two transports at once (``concurrent_splits``) the rounds have their own thread beside the
data, so planning is off the data's path; elsewhere one thread runs a round, then that round's
slots.

Why this cannot deadlock: every rank runs its slots in the same global order, and each of a
rank's messages is planned in a slot after all of that rank's messages of the exchanges it
waits on (and so, by induction, of everything its payload needs), so a slot's payloads are
ready from earlier slots' data and local compute.

A round where nobody declared anything is idle: ranks sleep briefly (backing off up to
``idle_max_s``) before the next one; a declaration (or a void, or ``close``) ends the sleep. Where
every exchange spans every rank (``every_rank_declares``: no group of a few ranks), every rank
makes every declaration itself, so a sleeping rank is woken by its own when a round is due
(the others block in that round's all-gather until then): it sleeps up to ``idle_max_s``
without backing off, and a steady training step, whose exchanges were all declared ahead,
runs one idle round (after the round of its predictions) where it ran about four. Shutdown: a
closing rank says so in its HEAD once every exchange it posted has finished; when every rank
says so in one round, all leave. A message may be **void**: its sender gives it up (``void``: a
prediction of the next step that did not come true; or, after ``close()``, a payload never
posted) and sends a size of -1 in its slot instead of the payload, so nobody waits for it; its
receiver drops it if it gave the exchange up too, and fails the exchange that waited for it
otherwise. A late or dead rank makes a transfer or a round time out (HIPRESS_TIMEOUT_S); the
executor then fails every pending exchange with that error. Self-messages (src == dst) never touch the network
and are not declared.
"""
from __future__ import annotations

import hashlib
import queue
import random
import struct
import threading
import time
from collections import deque
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hipress._C import now_ns
from hipress.comm.coordinator import protocol as P
from hipress.comm.coordinator.planner import DependencyGate, SlotPlanner


# One rank's part of a slot: (slot, {destination: (keys sent, bytes expected)}, {source: (keys
# received, bytes expected)}); several peers where the planner put small messages beside the
# slot's matching (planner.py). Bytes expected: see Executor._run_slot.
Part = Tuple[int, Dict[int, Tuple[List[int], int]], Dict[int, Tuple[List[int], int]]]


def message_key(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") >> 1


SMALL_SLOT_BYTES = 64 << 10  # a slot moving no more is latency, not bandwidth (slot_s)
# Small messages each rank may send and receive per slot beside the slot's matching (the planner's
# fan_bytes): 2 ms at 1 Gbit/s, where the n - 1 matchings they would take cost a round of latency each.
FAN_BYTES = 256 << 10
# The longest idle sleep between control rounds. Backing off from 0.5 ms to 10 ms, a rank that
# does not declare an exchange (a group of a few ranks) joins its round within 10 ms. Where every
# rank declares every exchange, a sleep ends by this rank's declaration, close(), or the last
# exchange finishing after close(): the bound is a backstop (at 0.1 s, a BERT-like step of 0.5 s
# ran 4.4 idle rounds).
IDLE_MAX_S = 0.01
IDLE_MAX_S_EVERY_RANK = 1.0
PLANS_KEPT = 8  # the round shapes whose plans are kept (RoundPlanner.plan): a step's, and a few others
_GAVE_UP = "gave its part up (at shutdown, or its exchanges in this step differ from this rank's)"


def _pad(nbytes: int) -> int:
    """Zero bytes after a payload of ``nbytes`` in a slot's batch, so the next starts 8-aligned:
    a decoder may view its bytes as floats (the identity compressor does, without a copy)."""
    return -nbytes % 8


def _fit(buf: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``buf``'s first ``nbytes``, zero-padded where it is shorter."""
    if buf.numel() == nbytes:
        return buf
    if buf.numel() > nbytes:
        return buf[:nbytes]
    return torch.cat([buf, torch.zeros(nbytes - buf.numel(), dtype=torch.uint8)])


def _batch_length(sizes: List[int]) -> int:
    """The bytes of a batch of messages of these sizes (-1: void): the sizes, then each payload padded."""
    return 8 * len(sizes) + sum(s + _pad(s) for s in sizes if s > 0)


def _shape(declared: Dict[int, List[P.Group]]) -> Tuple[tuple, List[int]]:
    """A round's declarations with every key renamed to its place among the round's declared keys
    (a predecessor declared in an earlier round: -1), and those keys. From a settled start (nothing
    pending), two rounds of one shape plan the same slots, up to the renaming: the gate and the
    planner look at keys only to tell them apart, and at predecessors of earlier rounds not at all."""
    keys: List[int] = []
    index: Dict[int, int] = {}
    for src in sorted(declared):
        for _, decls in declared[src]:
            for d in decls:
                if d[0] not in index:
                    index[d[0]] = len(keys)
                    keys.append(d[0])

    def renamed(decls):
        return tuple((index[key], tuple(dsts), tuple(srcs), tuple(index.get(a, -1) for a in after), tuple(sizes))
                     for key, dsts, srcs, after, sizes in decls)

    shape = tuple((src, tuple((wave, renamed(decls)) for wave, decls in declared[src])) for src in sorted(declared))
    return shape, keys


def _rekeyed(parts: List[Part], key_of: Callable[[int], int], shift: int) -> List[Part]:
    """``parts`` with every key k as ``key_of(k)`` and every slot number moved by ``shift``: a plan
    stored by key index (RoundPlanner._plans), or taken back under a round's keys."""
    return [(slot + shift, {d: ([key_of(k) for k in ks], b) for d, (ks, b) in sends.items()},
             {s: ([key_of(k) for k in ks], b) for s, (ks, b) in recvs.items()}) for slot, sends, recvs in parts]


def _link_part(batch) -> Tuple[List[int], int]:
    """A link's keys in a slot, and the bytes its batch takes if every message is as large as declared."""
    return [m.key for m in batch], _batch_length([m.nbytes for m in batch])


class RoundPlanner:
    """The planning of the control rounds' declarations, the same on every rank (each keeps the
    part of the plan it takes part in): the gate, the slot planner, each rank's declarations
    not yet admitted, and the plans of the round shapes seen last."""

    def __init__(self, n: int, rank: int, fan_bytes: int = 0):
        self.rank = rank
        self.slots = SlotPlanner(n, fan_bytes=fan_bytes)
        self.gate = DependencyGate()
        # Each rank's groups received and not yet admitted, in its order (see plan).
        self._queued: Dict[int, "deque[P.Group]"] = {r: deque() for r in range(n)}
        self._plans: Dict[tuple, Tuple[int, list]] = {}  # a round's shape -> (slots, parts by key index)
        self.reused = 0  # rounds whose plan was taken from _plans

    def plan(self, declared: Dict[int, List[P.Group]]) -> List[Part]:
        """Every rank: the same planning of the same declarations; returns this rank's part.

        Each rank's declarations are admitted in its order: a wave once everything the rank
        declared before it is planned, declarations made on submission at once after what is
        ahead of them (their ``after`` may name exchanges of a wave still queued, which the gate
        must know first). Each admission of every rank's ready waves is planned to the end
        before the next, as if each had a round of its own.

        A round that starts and ends with nothing pending is a function of its declarations' shape
        (keys renamed in order of appearance): a training step declared ahead repeats the last
        one's, so its plan is taken from ``_plans`` with this round's keys (planning every slot
        of a step took 2.9 ms of Python per step on a BERT-like model's ring, the reuse 0.5-0.8)."""
        shape = keys = None
        if self._settled():
            shape, keys = _shape(declared)
            cached = self._plans.get(shape)
            if cached is not None:
                slots, parts = cached
                mine = _rekeyed(parts, keys.__getitem__, self.slots.slot)
                self.slots.slot += slots
                self.reused += 1
                return mine
        first = self.slots.slot
        mine = self._plan_slots(declared)
        if shape is not None and self._settled():
            index = {k: i for i, k in enumerate(keys)}
            self._plans[shape] = (self.slots.slot - first, _rekeyed(mine, index.__getitem__, -first))
            while len(self._plans) > PLANS_KEPT:
                del self._plans[next(iter(self._plans))]  # the oldest shape
        return mine

    def _settled(self) -> bool:
        """Nothing declared is unplanned: no planning carries over into the next round."""
        return (not self.slots.pending() and not self.gate.open and not self.gate.waiting
                and not any(self._queued.values()))

    def _plan_slots(self, declared: Dict[int, List[P.Group]]) -> List[Part]:
        planner, gate = self.slots, self.gate
        for src, groups in declared.items():
            self._queued[src].extend(groups)
        mine: List[Part] = []
        while True:
            admitted = False
            for src, queued in self._queued.items():
                while queued and not (queued[0][0] and gate.unplanned.get(src)):
                    for key, dsts, srcs, after, sizes in queued.popleft()[1]:
                        planner.add(gate.declare(src, key, dsts, srcs, after, sizes))
                    admitted = True
            if not admitted:
                break
            while planner.pending():
                slot = planner.plan(flush=True)
                sends = {d: _link_part(b) for (s, d), b in slot.batches.items() if s == self.rank}
                recvs = {s: _link_part(b) for (s, d), b in slot.batches.items() if d == self.rank}
                if sends or recvs:
                    mine.append((slot.number, sends, recvs))
                planner.add(gate.planned([m for b in slot.batches.values() for m in b]))
        return mine


class PostedExchange:
    """One posted exchange: receives {src: sink(payload)}; ``left`` messages still to move."""

    __slots__ = ("name", "key", "sinks", "completion", "left", "networked")

    def __init__(self, name, key, sinks, completion, left, networked):
        self.name, self.key, self.sinks, self.completion = name, key, sinks, completion
        self.left, self.networked = left, networked


class Executor:
    def __init__(self, transport, control=None, idle_max_s: Optional[float] = None,
                 every_rank_declares: bool = False, trace: Optional[Callable[[str, int, int], None]] = None):
        """``transport``: the data's private duplicate of the world transport; ``control``: a
        second one for the rounds, run on their own thread (None: one thread runs both);
        ``every_rank_declares``: every exchange spans all ranks (see the module docstring);
        ``trace(name, start_ns, end_ns)``: where each slot's wait and exchange go (the timeline);
        ``idle_max_s``: the longest idle sleep (None: IDLE_MAX_S, or IDLE_MAX_S_EVERY_RANK)."""
        if transport.p2p_needs_all_ranks:
            raise ValueError(f"the coordinator pairs a few ranks per slot, and the {transport.name} transport's "
                             "point-to-point calls need every rank (use a backend with pairwise messages)")
        self.tr = transport
        self.ctl = control if control is not None else transport
        self.overlap = control is not None
        self.rank, self.n = transport.rank, transport.size
        self._trace = trace
        if idle_max_s is None:
            idle_max_s = IDLE_MAX_S_EVERY_RANK if every_rank_declares else IDLE_MAX_S
        self.idle_max_s = idle_max_s
        self.every_rank_declares = every_rank_declares
        self._cv = threading.Condition()
        self._declared: List[P.Group] = []  # since the last round: on submission (declare) or ahead, in order
        self.round_s = 0.0025  # how long a round with declarations takes (a moving average)
        self.slot_s = 0.0      # how long a slot of small batches takes (a moving average; 0: none yet)
        self._unfinished = 0            # posted exchanges with messages on the network, not finished
        self._sends: Dict[Tuple[int, int], Tuple[torch.Tensor, PostedExchange]] = {}  # (dst, key) -> posted payload
        self._expect: Dict[Tuple[int, int], PostedExchange] = {}   # (src, key) -> exchange waiting for it
        self._early: Dict[Tuple[int, int], torch.Tensor] = {}      # (src, key) -> payload that came first
        self._in_flight: List[PostedExchange] = []                  # senders of the slot being moved
        self._abandoned: set = set()  # (src, key) that came void before this rank posted (or voided) its exchange
        self._dropped: set = set()    # (src, key) of exchanges this rank voided: what comes is dropped
        self._slots: "queue.Queue[Optional[Part]]" = queue.Queue()
        self._closing = threading.Event()
        self._woken = threading.Event()  # set by a declaration: an idle control thread starts its round
        self._error: Optional[str] = None
        self.stats = {"rounds": 0, "idle_rounds": 0, "declaring_rounds": 0, "slots": 0, "fan_slots": 0,
                      "second_rounds": 0, "bytes": 0, "messages": 0, "plan_s": 0.0}
        # Job token: rank 0 draws it, everyone learns it; every frame must carry it.
        tok = torch.tensor([random.getrandbits(62) if self.rank == 0 else 0], dtype=torch.int64)
        self.ctl.broadcast(tok.view(torch.uint8), 0)
        self.token = int(tok[0])
        # Every rank plans the same slots from the same declarations (see the module docstring).
        # A link's batch is all it holds; messages declared with a size may go to several peers in one
        # slot, up to FAN_BYTES per rank, where the backend posts them at once.
        self.rounds = RoundPlanner(self.n, self.rank, fan_bytes=FAN_BYTES if transport.p2p_many else 0)
        self._threads = [threading.Thread(target=self._control_loop, name="hipress-coordinator", daemon=True)]
        if self.overlap:
            self._threads.append(threading.Thread(target=self._data_loop, name="hipress-coordinated-data",
                                                  daemon=True))
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ strategies' side
    def declare(self, key: int, dsts: Sequence[int], srcs: Sequence[int], after: Sequence[int]) -> None:
        """At submission: this rank will send exchange ``key``'s messages to ``dsts`` and hear from
        ``srcs`` (world ranks, not this one), once the exchanges ``after`` (keys) are planned. Their
        sizes are not known yet (a step declared ahead knows them: declare_ahead)."""
        if not dsts and not srcs:
            return
        with self._cv:
            if not self._declared or self._declared[-1][0]:
                self._declared.append((False, []))
            self._declared[-1][1].append((key, list(dsts), list(srcs), list(after), [0] * len(dsts)))
        self._woken.set()

    def declare_ahead(self, waves: List[List[P.Decl]]) -> None:
        """Declarations of exchanges not submitted yet (hipress.comm.coordinator.ahead), in
        waves, all sent in the next round: every rank's planning admits a wave once everything
        this rank declared before it is planned, so every message of this rank's wave goes in
        a later slot than all its earlier ones."""
        with self._cv:
            self._declared.extend((True, w) for w in waves)
        self._woken.set()

    def void(self, key: int, dsts: Sequence[int], srcs: Sequence[int]) -> None:
        """This rank will not run declared exchange ``key`` (a prediction that did not come true):
        its messages to ``dsts`` go void in their slots, and what comes from ``srcs`` is dropped."""
        with self._cv:
            for dst in dsts:
                self._sends[(dst, key)] = (None, None)
            for src in srcs:
                if self._early.pop((src, key), None) is None and (src, key) not in self._abandoned:
                    self._dropped.add((src, key))
                self._abandoned.discard((src, key))
            self._cv.notify_all()

    def post(self, name: str, key: int, sends: Dict[int, torch.Tensor], sinks: Dict[int, Callable], completion) -> None:
        """When the exchange's dependencies are done (on the comm queue's thread)."""
        networked = any(d != self.rank for d in sends) or any(s != self.rank for s in sinks)
        ex = PostedExchange(name, key, sinks, completion, len(sends) + len(sinks), networked)
        now: List[Tuple[int, torch.Tensor]] = []  # deliveries to make outside the lock
        with self._cv:
            if self._error is not None:
                completion.fail(f"coordinated exchange '{name}' cannot run: {self._error}")
                return
            self._unfinished += networked
            given_up = [src for src in sinks if (src, key) in self._abandoned]
            self._abandoned.difference_update((src, key) for src in given_up)
            for src in sinks:
                if src == self.rank or src in given_up:
                    continue
                if (src, key) in self._expect:
                    raise RuntimeError(f"two pending receives of '{name}' from rank {src}")
                early = self._early.pop((src, key), None)
                if early is None:
                    self._expect[(src, key)] = ex
                else:
                    now.append((src, early))
            for dst, payload in sends.items():
                payload = payload.contiguous().view(torch.uint8).view(-1)
                if dst == self.rank:
                    now.append((dst, payload))
                else:
                    self._sends[(dst, key)] = (payload, ex)
            self._cv.notify_all()
        if not sends and not sinks:
            completion.done()
        if given_up:
            self._abandon(ex, f"rank(s) {given_up} {_GAVE_UP}")
            return
        for src, payload in now:
            ex.sinks[src](payload)
            self._progress(ex, 2 if src == self.rank else 1)  # a self-message is its send and its receive

    def close(self, timeout: float = 30.0) -> None:
        """Collective: every rank closes; returns once the executor has stopped. Exchanges not
        posted by now are given up."""
        with self._cv:
            self._closing.set()
            self._cv.notify_all()
        self._woken.set()  # an idle control thread says CLOSING in its next round at once
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise RuntimeError(f"coordinator executor on rank {self.rank} did not stop within {timeout} s")

    # ------------------------------------------------------------------ delivery
    def _progress(self, ex: PostedExchange, moved: int = 1) -> None:
        with self._cv:
            ex.left -= moved
            finished = ex.left == 0
            if finished and ex.networked:
                self._unfinished -= 1
                self._wake_to_close()
        if finished:
            ex.completion.done()

    def _wake_to_close(self) -> None:
        """(Under the lock.) After close(), the last exchange finishing lets this rank say CLOSING."""
        if self._unfinished == 0 and self._closing.is_set():
            self._woken.set()

    def _deliver(self, src: int, key: int, payload: Optional[torch.Tensor]) -> None:
        """``payload`` from ``src`` for exchange ``key``; None: ``src`` sent it void. A void message
        fails the exchange waiting for it here, now or when it is posted, so that it does not keep
        this rank from closing."""
        with self._cv:
            if (src, key) in self._dropped:  # this rank gave the exchange up too
                self._dropped.discard((src, key))
                return
            ex = self._expect.pop((src, key), None)
            if ex is None:
                if payload is None:
                    self._abandoned.add((src, key))
                else:
                    self._early[(src, key)] = payload
                return
        if payload is None:
            self._abandon(ex, f"rank {src} {_GAVE_UP}")
            return
        ex.sinks[src](payload)
        self._progress(ex)

    def _abandon(self, ex: PostedExchange, why: str) -> None:
        with self._cv:
            if ex.left <= 0:
                return
            ex.left = 0
            self._unfinished -= ex.networked
            self._wake_to_close()
        ex.completion.fail(f"coordinated exchange '{ex.name}': {why}")

    def _fail(self, message: str) -> None:
        with self._cv:
            if self._error is None:
                self._error = message
            pending = {id(e): e for e in self._expect.values()}
            pending.update({id(e): e for _, e in self._sends.values() if e is not None})
            pending.update({id(e): e for e in self._in_flight})
            self._expect.clear()
            self._sends.clear()
            self._cv.notify_all()
        for ex in pending.values():
            try:
                ex.completion.fail(self._error)
            except Exception:  # noqa: BLE001 - already finished or cancelled
                pass

    # ------------------------------------------------------------------ data
    def _run_slot(self, part: Part) -> None:
        """One rank's part of a slot. Each link's batch goes as one message of the bytes its plan
        expects (zero-padded if smaller), so no size travels first: one round of latency where the
        declared sizes hold (a step declared ahead carries the last step's). Where a batch is
        larger (an unknown size is 0), the rest follows in a second round, which both ends know
        of: the sender from its batch, the receiver from the sizes at the batch's head."""
        slot, sends, recvs = part
        items: Dict[int, List[Tuple[Optional[torch.Tensor], Optional[PostedExchange]]]] = {}
        begun = now_ns() if self._trace else 0
        if sends:
            with self._cv:  # the payloads are posted once their tasks ran (local compute, earlier slots)
                while not all((dst, k) in self._sends for dst, (keys, _) in sends.items() for k in keys):
                    if self._error is not None:
                        return
                    if self._closing.is_set():  # nobody posted the rest by now (a step given up):
                        break                   # they go void, so no peer waits for them
                    self._cv.wait(0.1)
                items = {dst: [self._sends.pop((dst, k), (None, None)) for k in keys]
                         for dst, (keys, _) in sends.items()}
                self._in_flight = [ex for its in items.values() for _, ex in its if ex is not None]
        if self._trace:
            ready = now_ns()
            self._trace(f"slot {slot}: waits for payloads", begun, ready)
        bufs = {dst: self._batch(its) for dst, its in items.items()}
        t0 = time.perf_counter()
        heads = {src: torch.empty(expected, dtype=torch.uint8) for src, (_, expected) in recvs.items()}
        self.tr.exchange({dst: _fit(buf, sends[dst][1]) for dst, buf in bufs.items()}, heads)
        sizes = {src: self._head_sizes(slot, src, len(recvs[src][0]), head) for src, head in heads.items()}
        totals = {src: _batch_length(s) for src, s in sizes.items()}
        rest_in = {src: torch.empty(t - heads[src].numel(), dtype=torch.uint8)
                   for src, t in totals.items() if t > heads[src].numel()}
        rest_out = {dst: buf[sends[dst][1]:] for dst, buf in bufs.items() if buf.numel() > sends[dst][1]}
        if rest_in or rest_out:
            self.tr.exchange(rest_out, rest_in)
        moved = sum(b.numel() for b in bufs.values()) + sum(totals.values())
        if moved <= SMALL_SLOT_BYTES:
            took = time.perf_counter() - t0
            self.slot_s += 0.25 * (took - self.slot_s) if self.slot_s else took
        # Counted before any exchange of the slot finishes, so a program that saw it finish sees them.
        self.stats["slots"] += 1
        self.stats["fan_slots"] += len(sends) > 1 or len(recvs) > 1
        self.stats["second_rounds"] += bool(rest_in or rest_out)
        self.stats["messages"] += sum(p is not None for its in items.values() for p, _ in its)
        self.stats["bytes"] += sum(b.numel() for b in bufs.values())
        for src, (keys, _) in recvs.items():
            got = torch.cat([heads[src], rest_in[src]]) if src in rest_in else heads[src][:totals[src]]
            self._unbatch(src, keys, sizes[src], got)
        self._in_flight = []
        for its in items.values():
            for _, ex in its:
                if ex is not None:
                    self._progress(ex)
        if self._trace:
            self._trace(f"slot {slot}: to {sorted(sends)} from {sorted(recvs)}, {moved} bytes", ready, now_ns())

    @staticmethod
    def _batch(items) -> torch.Tensor:
        """One link's batch: its messages' sizes (a void message's is -1), then each payload, each
        starting 8-aligned so that decoders can view it as floats. Written through numpy and struct
        into one allocation, where a tensor of the sizes, a zero pad per payload and a cat took 100 us
        of CPU per batch in training (4 ranks on 2 cores, PS TernGrad, VGG19-like), 68 us this way."""
        sizes = [-1 if p is None else p.numel() for p, _ in items]
        out = torch.empty(_batch_length(sizes), dtype=torch.uint8)
        view = out.numpy()
        struct.pack_into(f"<{len(sizes)}q", view, 0, *sizes)
        at = 8 * len(sizes)
        for (p, _), n in zip(items, sizes):
            if n > 0:
                end = at + n + _pad(n)
                view[at:at + n] = p.numpy()
                view[at + n:end] = 0
                at = end
        return out

    @staticmethod
    def _head_sizes(slot: int, src: int, count: int, head: torch.Tensor) -> List[int]:
        """The sizes of the ``count`` messages of ``src``'s batch, read from its head."""
        sizes = list(struct.unpack_from(f"<{count}q", head.numpy())) if head.numel() >= 8 * count else None
        if sizes is None or min(sizes, default=0) < -1:
            raise P.ProtocolError(f"slot {slot}: rank {src}'s batch does not start with {count} message sizes")
        return sizes

    def _unbatch(self, src: int, keys: List[int], sizes: List[int], got: torch.Tensor) -> None:
        off = 8 * len(keys)
        for key, size in zip(keys, sizes):
            self._deliver(src, key, None if size < 0 else got[off:off + size])
            off += max(size, 0) + _pad(max(size, 0))

    def _data_loop(self) -> None:
        part = None
        try:
            while True:
                part = self._slots.get()
                if part is None or self._error is not None:
                    return
                self._run_slot(part)
        except Exception as e:  # noqa: BLE001 - reported to every waiting exchange
            self._fail(f"coordinator slot {part[0] if part else '?'} failed on rank {self.rank}: "
                       f"{type(e).__name__}: {e}")

    # ------------------------------------------------------------------ control
    def _gather(self, rnd: int, groups: List[P.Group], flags: int) -> Tuple[List[int], Dict[int, List[P.Group]]]:
        """One round's exchange: every rank's flags and, if any, every rank's declarations."""
        body = P.pack_decls(groups)
        count = sum(len(decls) for _, decls in groups)
        heads = torch.empty(self.n * P.HEAD_BYTES, dtype=torch.uint8)
        mine = torch.frombuffer(bytearray(P.pack_head(self.rank, self.token, rnd, flags, count, len(body))),
                                dtype=torch.uint8)
        self.ctl.allgather(mine, heads, sizes_agreed=True)  # the HEAD's size is the protocol's
        raw = heads.numpy().tobytes()
        parsed = [P.unpack_head(raw[j * P.HEAD_BYTES:(j + 1) * P.HEAD_BYTES], self.token, rnd, j)
                  for j in range(self.n)]
        lengths = [nbytes for _, _, nbytes in parsed]
        if not sum(lengths):
            return [f for f, _, _ in parsed], {}
        bodies = torch.empty(sum(lengths), dtype=torch.uint8)
        send = torch.frombuffer(bytearray(body), dtype=torch.uint8) if body else torch.empty(0, dtype=torch.uint8)
        self.ctl.allgatherv(send, bodies, lengths, sizes_agreed=True)  # every rank read them from the heads
        raw, out, off = bodies.numpy().tobytes(), {}, 0
        for j, (_, count, nbytes) in enumerate(parsed):
            out[j] = P.unpack_decls(raw[off:off + nbytes], count, j, self.n)
            off += nbytes
        return [f for f, _, _ in parsed], out

    def _control_loop(self) -> None:
        rnd, idle = 0, 0.0
        try:
            while self._error is None:
                self._woken.clear()  # before taking the declarations: one made after ends the next sleep
                with self._cv:
                    groups, self._declared = self._declared, []
                    closing = self._closing.is_set() and self._unfinished == 0 and not groups
                t0 = time.perf_counter()
                flags, declared = self._gather(rnd, groups, P.CLOSING if closing else 0)
                rnd += 1
                self.stats["rounds"] += 1
                self.stats["declaring_rounds"] += bool(groups)  # this rank's own declarations
                if all(f & P.CLOSING for f in flags):
                    break  # nothing of anyone's is pending
                if not declared:
                    self.stats["idle_rounds"] += 1
                    # Back off while nothing is declared; a declaration here ends the wait (the
                    # other ranks, declaring the same collectives, wake the same way).
                    idle = self.idle_max_s if self.every_rank_declares else min(self.idle_max_s, idle * 2 or 5e-4)
                    self._woken.wait(idle)
                    continue
                idle = 0.0
                self.round_s += 0.25 * (time.perf_counter() - t0 - self.round_s)
                t1 = time.perf_counter()
                parts = self.rounds.plan(declared)
                self.stats["plan_s"] += time.perf_counter() - t1
                for part in parts:
                    if self.overlap:
                        self._slots.put(part)
                    else:
                        self._run_slot(part)
        except Exception as e:  # noqa: BLE001 - reported to every waiting exchange
            self._fail(f"coordinator round {rnd} failed on rank {self.rank}: {type(e).__name__}: {e}")
        finally:
            self._slots.put(None)  # the data thread leaves after the slots already handed to it
