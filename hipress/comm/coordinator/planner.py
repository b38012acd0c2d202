"""Slot planning of the global coordinator (paper 000 §3.2, Fig. 3).

Messages wait in per-link FIFO queues (src -> dst). Each time slot, the planner picks a
set of non-conflicting links (a matching: every node sends on at most one uplink and
receives on at most one downlink) and, for each chosen link, a batch of its queued
messages in FIFO order, up to ``batch_bytes`` (always at least one message).

Which links: the eligible ones (queued bytes >= batch_bytes, or the oldest message has
waited >= ``timeout_slots``, or ``flush``), chosen greedily source by source (see
``SlotPlanner.plan``), so a slot costs O(n log n + n * probes * log L), not O(L).
Oldest-first makes it starvation-free: the source holding the oldest message is served
first and takes its oldest link, so every message is scheduled within (number of links)
slots of becoming the oldest. Busiest-first among equals serves the node that bounds the
iteration, and larger-first among a node's links fills the slot with useful bytes.
Batches are cut at ``batch_bytes``, or at the size of the slot's largest batch so far
when that is larger: the slot lasts as long as its largest batch anyway, so the others
fill up to it (balanced batches, more useful bytes per slot).

Small messages (of known size) are the exception: latency, not bandwidth, so they go beside
the matching, to and from any peer, up to ``fan_bytes`` into and out of each node per slot
(``SlotPlanner.plan``).

``DependencyGate`` decides when a declared message may enter the queues at all (see it).
"""
from __future__ import annotations

import heapq
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Dict, List, Tuple


@dataclass(frozen=True)
class Msg:
    key: int  # unique per (src, key): what the receiver waits for
    src: int
    dst: int
    nbytes: int


@dataclass
class _Link:
    """A link's FIFO queue as lists with a head index, so that a batch is one bisect over the
    running byte sums and one slice (per-message Python work made planning 1-1.6 ms per slot
    at 128 ranks)."""
    msgs: List[Msg] = field(default_factory=list)
    arrived: List[int] = field(default_factory=list)  # the slot each message arrived in
    ends: List[int] = field(default_factory=list)     # bytes of msgs[:i + 1], counted from the link's start
    head: int = 0                                     # msgs[head:] are queued
    sent: int = 0                                     # bytes of msgs[:head]

    @property
    def nbytes(self) -> int:
        return self.ends[-1] - self.sent if self.ends else 0

    def append(self, m: Msg, slot: int) -> None:
        self.msgs.append(m)
        self.arrived.append(slot)
        self.ends.append((self.ends[-1] if self.ends else 0) + m.nbytes)

    def take(self, cap: int) -> Tuple[List[Msg], int]:
        """The head's FIFO batch: at least one message, then more while the batch stays within
        ``cap`` bytes; returns it and its bytes."""
        return self._advance(max(self.head + 1, bisect_right(self.ends, self.sent + cap, self.head)))

    def take_small(self, cap: int) -> Tuple[List[Msg], int]:
        """The head (of known size), then more of known size (> 0 bytes) while the batch stays
        within ``cap`` bytes."""
        end, size = self.head + 1, self.msgs[self.head].nbytes
        while end < len(self.msgs) and 0 < self.msgs[end].nbytes <= cap - size:
            size += self.msgs[end].nbytes
            end += 1
        return self._advance(end)

    def _advance(self, end: int) -> Tuple[List[Msg], int]:
        batch = self.msgs[self.head:end]
        size = self.ends[end - 1] - self.sent
        self.head, self.sent = end, self.ends[end - 1]
        if self.head > 64 and 2 * self.head > len(self.msgs):  # drop what left (ends stay absolute)
            del self.msgs[:self.head], self.arrived[:self.head], self.ends[:self.head]
            self.head = 0
        return batch, size

    @property
    def empty(self) -> bool:
        return self.head == len(self.msgs)


@dataclass
class Slot:
    number: int
    batches: Dict[Tuple[int, int], List[Msg]]  # (src, dst) -> messages in FIFO order

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for b in self.batches.values() for m in b)


class SlotPlanner:
    def __init__(self, n: int, batch_bytes: int = 4 << 20, timeout_slots: int = 0, probes_per_node: int = 4,
                 fan_bytes: int = 0):
        """``fan_bytes``: what each node may send and receive per slot in small messages beside the
        matching (messages of known size, ``nbytes`` > 0); 0: none. See ``plan``."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if batch_bytes < 1:
            raise ValueError(f"batch_bytes must be >= 1, got {batch_bytes}")
        self.n = n
        self.batch_bytes = int(batch_bytes)
        self.timeout_slots = int(timeout_slots)
        self.probes = max(1, probes_per_node)
        self.fan_bytes = int(fan_bytes)
        self.links: Dict[Tuple[int, int], _Link] = {}
        self.slot = 0
        self.queued = 0
        # Per source: a heap of (arrival slot of the link's head, -queued bytes when pushed,
        # dst), one live entry per non-empty link, refreshed whenever the link's head changes.
        self._out: List[List[Tuple[int, int, int]]] = [[] for _ in range(n)]
        self._out_bytes = [0] * n

    def add(self, msgs: List[Msg]) -> None:
        for m in msgs:
            if not (0 <= m.src < self.n and 0 <= m.dst < self.n) or m.src == m.dst:
                raise ValueError(f"bad message {m} for {self.n} nodes")
            if m.nbytes < 0:
                raise ValueError(f"negative size in {m}")
            link = self.links.get((m.src, m.dst))
            if link is None:
                link = self.links[(m.src, m.dst)] = _Link()
            if link.empty:
                heapq.heappush(self._out[m.src], (self.slot, -m.nbytes, m.dst))
            link.append(m, self.slot)
            self._out_bytes[m.src] += m.nbytes
            self.queued += 1

    def pending(self) -> int:
        return self.queued

    def plan(self, flush: bool = False) -> Slot:
        """Picks the next slot; messages in it leave their queues.

        Sources are served in order of their oldest waiting message, then of their
        queued bytes (the busiest node first: it bounds the iteration); each takes the
        first link of its own heap (oldest head, then largest) whose destination is
        still free, looking at no more than ``probes_per_node`` links.

        Small messages are latency, not bandwidth: a link whose head message has a known size
        that fits what both its ends have left of ``fan_bytes`` in this slot sends its head
        messages that fit, whatever else the two ends do in the slot. So a rank may send to and
        hear from several ranks in one slot (one all-to-all of a PS's small partitions instead of
        n - 1 matchings), and no node takes in more than ``fan_bytes`` of them at once, whatever
        the number of senders (no incast); the matching rule holds for the rest.
        """
        slot = Slot(self.slot, {})
        order = sorted((h[0][0], -self._out_bytes[s], s) for s, h in enumerate(self._out) if h)
        busy_down = set()
        cap = self.batch_bytes  # raised to the first batch's size: see the module docstring
        fan_in: Dict[int, int] = {}  # small bytes into each node in this slot
        for _, _, s in order:
            heap = self._out[s]
            skipped = []
            chosen = False
            fan_left = self.fan_bytes  # small bytes this source may still send in this slot
            while heap and len(skipped) < self.probes:
                entry = heapq.heappop(heap)
                head_slot, _, d = entry
                link = self.links[(s, d)]
                if not (flush or link.nbytes >= self.batch_bytes or self.slot - head_slot >= self.timeout_slots):
                    skipped.append(entry)
                    continue
                head = link.msgs[link.head].nbytes
                small = 0 < head <= self.fan_bytes
                room = min(fan_left, self.fan_bytes - fan_in.get(d, 0))
                if small and head <= room:
                    batch, size = link.take_small(room)
                    fan_left -= size
                    fan_in[d] = fan_in.get(d, 0) + size
                elif small or chosen or d in busy_down:  # a small one waits for a slot with room
                    skipped.append(entry)
                    continue
                else:
                    chosen = True
                    busy_down.add(d)
                    batch, size = link.take(cap)
                    cap = max(cap, size)
                self._out_bytes[s] -= size
                self.queued -= len(batch)
                slot.batches[(s, d)] = batch
                if not link.empty:  # not again in this slot: back with the skipped
                    skipped.append((link.arrived[link.head], -link.nbytes, d))
                else:
                    del self.links[(s, d)]  # only non-empty links are kept
                if chosen and not small and not self.fan_bytes:
                    break  # nothing else can join this source's part of the slot
            for e in skipped:
                heapq.heappush(heap, e)
        self.slot += 1
        return slot


class DependencyGate:
    """Holds a declared message back until both its ends' parts of every exchange they wait on
    have been planned in earlier slots.

    Plans are made ahead of the data, so a rank that runs its slots in order must never reach
    a send whose payload needs data of a later slot: that would stall every rank behind it.
    Each rank declares, with an exchange, the earlier exchanges its tasks wait on (``after``).
    A message enters the planner once its sender and its receiver have both declared it, and
    each one's sends and receives of its own ``after`` exchanges are in planned slots. The
    receiver counts too: a rank that only receives in exchange q, and waits on p before it
    (its task graph joins p's result with q's), must not see q's message before p's, or a
    later exchange that waits on q would be planned ahead of p on that rank.

    ``open[(rank, key)]`` counts the messages of exchange ``key`` that ``rank`` declared and
    that are not planned yet; an absent entry means nothing is left to wait for;
    ``unplanned[rank]``, all of them."""

    def __init__(self):
        self.open: Dict[Tuple[int, int], int] = {}
        self.unplanned: Dict[int, int] = {}
        self._half: Dict[Tuple[int, int, int], Tuple[int, list, int]] = {}  # (key, src, dst) -> (rank, after, bytes)
        self._blocked: Dict[Tuple[int, int], List[list]] = {}          # (rank, key) -> [[msg, unmet], ...]
        self.held = 0

    def declare(self, rank: int, key: int, dsts, srcs, after, sizes=()) -> List[Msg]:
        """``rank`` sends exchange ``key``'s messages to ``dsts`` and hears from ``srcs``, after its
        exchanges ``after``; returns the messages this admits to planning. ``sizes``: the bytes
        this rank expects to send each destination (0 or none: unknown)."""
        if dsts or srcs:
            self.open[(rank, key)] = self.open.get((rank, key), 0) + len(dsts) + len(srcs)
            self.unplanned[rank] = self.unplanned.get(rank, 0) + len(dsts) + len(srcs)
        ready: List[Msg] = []
        sizes = list(sizes) or [0] * len(dsts)
        if len(sizes) != len(dsts):
            raise ValueError(f"{len(sizes)} sizes for {len(dsts)} destinations of exchange {key}")
        for src, dst, nbytes in [(rank, d, b) for d, b in zip(dsts, sizes)] + [(s, rank, 0) for s in srcs]:
            other = self._half.pop((key, src, dst), None)
            if other is None:  # the other end has not declared it yet
                self._half[(key, src, dst)] = (rank, after, nbytes)
                continue
            m = Msg(key, src, dst, nbytes if rank == src else other[2])  # the sender's size
            unmet = [(r, p) for r, waits, _ in (other, (rank, after, nbytes)) for p in waits if (r, p) in self.open]
            if not unmet:
                ready.append(m)
                continue
            entry = [m, len(unmet)]
            for end in unmet:
                self._blocked.setdefault(end, []).append(entry)
            self.held += 1
        return ready

    def planned(self, msgs) -> List[Msg]:
        """Takes planned messages off their ends' counts; returns the messages this releases."""
        released: List[Msg] = []
        for m in msgs:
            for end in ((m.src, m.key), (m.dst, m.key)):
                self.unplanned[end[0]] -= 1
                left = self.open[end] - 1
                if left:
                    self.open[end] = left
                    continue
                del self.open[end]
                for entry in self._blocked.pop(end, ()):
                    entry[1] -= 1
                    if entry[1] == 0:
                        released.append(entry[0])
                        self.held -= 1
        return released

    @property
    def waiting(self) -> int:
        """Messages declared by one end only, or held: not yet plannable."""
        return len(self._half) + self.held
