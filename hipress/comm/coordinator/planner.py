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
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Dict, List, Tuple


@dataclass(frozen=True)
class Msg:
    key: int  # unique per (src, key): what the receiver waits for
    src: int
    dst: int
    nbytes: int


@dataclass
class _Link:
    queue: Deque[Tuple[Msg, int]] = field(default_factory=deque)  # (msg, slot it arrived in)
    nbytes: int = 0


@dataclass
class Slot:
    number: int
    batches: Dict[Tuple[int, int], List[Msg]]  # (src, dst) -> messages in FIFO order

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for b in self.batches.values() for m in b)


class SlotPlanner:
    def __init__(self, n: int, batch_bytes: int = 4 << 20, timeout_slots: int = 0, probes_per_node: int = 4):
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if batch_bytes < 1:
            raise ValueError(f"batch_bytes must be >= 1, got {batch_bytes}")
        self.n = n
        self.batch_bytes = int(batch_bytes)
        self.timeout_slots = int(timeout_slots)
        self.probes = max(1, probes_per_node)
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
            if not link.queue:
                heapq.heappush(self._out[m.src], (self.slot, -m.nbytes, m.dst))
            link.queue.append((m, self.slot))
            link.nbytes += m.nbytes
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
        """
        slot = Slot(self.slot, {})
        order = sorted((h[0][0], -self._out_bytes[s], s) for s, h in enumerate(self._out) if h)
        busy_down = set()
        cap = self.batch_bytes  # raised to the first batch's size: see the module docstring
        for _, _, s in order:
            heap = self._out[s]
            skipped = []
            chosen = None
            while heap and len(skipped) < self.probes:
                entry = heapq.heappop(heap)
                head_slot, _, d = entry
                link = self.links[(s, d)]
                if d in busy_down or not (flush or link.nbytes >= self.batch_bytes
                                          or self.slot - head_slot >= self.timeout_slots):
                    skipped.append(entry)
                    continue
                chosen = (d, link)
                break
            for e in skipped:
                heapq.heappush(heap, e)
            if chosen is None:
                continue
            d, link = chosen
            busy_down.add(d)
            batch, size = [], 0
            while link.queue and (not batch or size + link.queue[0][0].nbytes <= cap):
                m, _ = link.queue.popleft()
                batch.append(m)
                size += m.nbytes
            cap = max(cap, size)
            link.nbytes -= size
            self._out_bytes[s] -= size
            self.queued -= len(batch)
            slot.batches[(s, d)] = batch
            if link.queue:
                heapq.heappush(heap, (link.queue[0][1], -link.nbytes, d))
            else:
                del self.links[(s, d)]  # only non-empty links are kept
        self.slot += 1
        return slot
