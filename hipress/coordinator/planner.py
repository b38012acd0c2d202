"""Slot planning of the global coordinator (paper 000 §3.2, Fig. 3).

Messages wait in per-link FIFO queues (src -> dst). Each time slot, the planner picks a
set of non-conflicting links (a matching: every node sends on at most one uplink and
receives on at most one downlink) and, for each chosen link, a batch of its queued
messages in FIFO order, up to ``batch_bytes`` (always at least one message).

Which links: the eligible ones (queued bytes >= batch_bytes, or the oldest message has
waited >= ``timeout_slots``, or ``flush``), greedily in order of the age of their
oldest message, then by queued bytes (largest first). Oldest-first makes it
starvation-free: a link whose head message is the oldest in the system is always
chosen, so every message is scheduled within (number of links) slots of becoming the
oldest. Larger-first among equals fills the slot with useful bytes. Batches are cut at
``batch_bytes``, which keeps the batches of one slot balanced when links are busy.
"""
from __future__ import annotations

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
    def __init__(self, n: int, batch_bytes: int = 4 << 20, timeout_slots: int = 0):
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if batch_bytes < 1:
            raise ValueError(f"batch_bytes must be >= 1, got {batch_bytes}")
        self.n = n
        self.batch_bytes = int(batch_bytes)
        self.timeout_slots = int(timeout_slots)
        self.links: Dict[Tuple[int, int], _Link] = {}
        self.slot = 0
        self.queued = 0

    def add(self, msgs: List[Msg]) -> None:
        for m in msgs:
            if not (0 <= m.src < self.n and 0 <= m.dst < self.n) or m.src == m.dst:
                raise ValueError(f"bad message {m} for {self.n} nodes")
            if m.nbytes < 0:
                raise ValueError(f"negative size in {m}")
            link = self.links.setdefault((m.src, m.dst), _Link())
            link.queue.append((m, self.slot))
            link.nbytes += m.nbytes
            self.queued += 1

    def pending(self) -> int:
        return self.queued

    def plan(self, flush: bool = False) -> Slot:
        """Picks the next slot; messages in it leave their queues."""
        slot = Slot(self.slot, {})
        cands = []
        for (s, d), link in self.links.items():
            age = self.slot - link.queue[0][1]
            if flush or link.nbytes >= self.batch_bytes or age >= self.timeout_slots:
                cands.append((link.queue[0][1], -link.nbytes, s, d))
        cands.sort()
        busy_up, busy_down = set(), set()
        for _, _, s, d in cands:
            if s in busy_up or d in busy_down:
                continue
            busy_up.add(s)
            busy_down.add(d)
            link = self.links[(s, d)]
            batch, size = [], 0
            while link.queue and (not batch or size + link.queue[0][0].nbytes <= self.batch_bytes):
                m, _ = link.queue.popleft()
                batch.append(m)
                size += m.nbytes
            link.nbytes -= size
            self.queued -= len(batch)
            slot.batches[(s, d)] = batch
            if not link.queue:
                del self.links[(s, d)]  # only non-empty links are kept, so a slot costs O(busy links)
        self.slot += 1
        return slot
