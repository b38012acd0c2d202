"""Declaring the next step's exchanges ahead, so the coordinator's plan exists before the payloads.

Without this, an exchange is declared when its bucket is submitted, and its first slot waits
for the next control round: two all-gathers, 2.5 ms on an idle cluster of 4 ranks and about 10 ms
while they compute (docs/benchmarks.md). With tensor fusion a step has few buckets, so that round
is paid on nearly every one, and the coordinator lost to leaving it off.

Training runs the same exchanges every step. ``StepPredictor`` records a step's exchanges (the
optimizer says when a step's are all submitted: ``step_submitted``, before it waits for them);
once two steps in a row ran the same ones (names, peers and the exchanges each waits on in the
task graph, in order), it declares the next step's at once, under the keys they will have. Their
rounds then run beside this step's data and the next forward and backward, and a real exchange
that finds its declaration made is *confirmed*: nothing more to declare.

The predictions come in *waves*, all sent in one control round; every rank's planning admits a
rank's wave once everything that rank declared before it is planned (``RoundPlanner.plan`` in
executor.py), so every wave is planned after the one before, as if it had a round of its own,
without paying for one (a round per wave cost 13.5 rounds per step on a BERT-like model).
An exchange starts a new wave

  - if, in the first step of the run of steps that repeat, it came later after its wave's first
    than a ring's worth of small slots (2 (n - 1) of them: what sharing slots saves) or a control
    round: a bucket's slots are not shared with those of a bucket ready much later. Those cuts
    stay while the steps repeat, so every step declares the same waves (timing would move them
    from step to step) and the coordinator reuses its plan (``RoundPlanner``);
  - or if, in the last step, the program had found a task finished (``Handle.wait`` or ``poll``)
    since its wave began: it may have waited for an exchange of the wave before making this one,
    and planned in one slot with it, or ahead of it, the two would wait for each other.

Every rank runs the same exchanges in the same order (the optimizer submits them from its training
thread, in backward-hook order), so every rank confirms the same predictions and gives up the same
ones at the same point: at the first exchange that differs from the prediction, at the step's end
(a shorter step), or at ``reset``. Given up, the predictions left are *voided*
(``Executor.void``): their messages go void in their slots, both ways, so nobody waits for them,
and later key names carry a new epoch, so no real exchange meets a voided key.

Why a prediction cannot deadlock: its exchanges are declared with what they wait on taken from the
task graph (``Handle.after_all``, finished or not) and after every exchange of the wave before, so
the gate plans them in an order the real graph and the program's own waits allow; a confirmed
exchange has that same graph (or it would not be confirmed), and an exchange that is not
confirmed voids every prediction left before it is declared.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Deque, Dict, List, Optional, Sequence, Tuple

from hipress.comm.coordinator.executor import message_key
from hipress.engine import last_observed

# (group, name, world ranks sent to, world ranks heard from, positions in the step of the
# exchanges it waits on)
Entry = Tuple[int, str, Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]


class StepPredictor:
    """Shared by the coordinated exchanges (world, local, cross) of one optimizer; see the module
    docstring."""

    def __init__(self, executor, enabled: bool = True):
        self.executor = executor
        self.enabled = enabled
        self.epoch = 0
        self.occurrences: List[Dict[str, int]] = []  # per group: its name -> uses so far
        self._lock = threading.Lock()
        self._window: List[Entry] = []              # this step's exchanges, in order
        self._times: List[float] = []               # when each was declared
        self._observed: List[float] = []            # when, before each was made, a wait last found a task done
        self._position: Dict[int, int] = {}         # key -> position in _window
        self._last: Optional[List[Entry]] = None
        self._sizes: Dict[int, Dict[int, int]] = {}  # position in the step -> {world dst: bytes it last sent}
        self._pending: Deque[Tuple[Entry, str, int]] = deque()  # predicted, not met yet: (entry, key name, key)
        self._cuts: Optional[set] = None  # positions that start a wave, while the steps repeat (see _predict)
        self.stats = {"predicted": 0, "confirmed": 0, "voided": 0, "waves": 0}

    def add_group(self) -> int:
        self.occurrences.append({})
        return len(self.occurrences) - 1

    def _key_name(self, name: str, occ: int) -> str:
        return f"{name}#{occ}" if not self.epoch else f"{name}#{occ}@{self.epoch}"

    def exchange(self, group: int, name: str, dsts: Sequence[int], srcs: Sequence[int], after_all,
                 waits_on) -> Tuple[str, int, int]:
        """A real exchange of ``group``: returns its (key name, key, position in the step), declared,
        or confirmed."""
        with self._lock:
            uses = self.occurrences[group]
            occ = uses.get(name, 0)  # the same sequence of names on every rank of the group
            uses[name] = occ + 1
            after = tuple(sorted({self._position[h.exchange_key] for h in after_all
                                  if h.exchange_key in self._position}))
            entry = (group, name, tuple(dsts), tuple(srcs), after)
            key_name = self._key_name(name, occ)
            confirmed = False
            if self._pending:
                head, predicted_name, key = self._pending[0]
                if head == entry and predicted_name == key_name:
                    self._pending.popleft()
                    self.stats["confirmed"] += 1
                    confirmed = True
                else:
                    self._void_pending()
                    key_name = self._key_name(name, occ)
            if not confirmed:
                key = message_key(key_name)
                if dsts or srcs:
                    self.executor.declare(key, dsts, srcs, [h.exchange_key for h in waits_on])
            position = self._position[key] = len(self._window)
            self._window.append(entry)
            self._times.append(time.monotonic())
            self._observed.append(last_observed())
            return key_name, key, position

    def posted(self, position: int, sizes: Dict[int, int]) -> None:
        """The exchange at ``position`` in its step sends ``sizes[dst]`` bytes to each world rank
        dst: what its prediction in a later step declares (the slots are as long as the declared
        sizes, and the planner sends small messages to several peers per slot). Sizes are
        advisory: a wrong one costs planning quality, not correctness."""
        with self._lock:
            self._sizes[position] = sizes

    def step_submitted(self) -> None:
        """The step's exchanges are all submitted: learn them, and declare the next step's when
        two steps in a row ran the same."""
        with self._lock:
            self._void_pending()  # a step shorter than predicted
            window, times, observed = self._window, self._times, self._observed
            self._clear()
            repeated, self._last = window == self._last, window
            if not repeated:
                self._cuts = None
            if self.enabled and repeated and window:
                self._predict(window, times, observed)

    def reset(self) -> None:
        """After a failed step: nothing predicted is left, and nothing is predicted until two
        steps in a row ran the same exchanges again."""
        with self._lock:
            self._void_pending()
            self._clear()
            self._last = None
            self._cuts = None
            self._sizes.clear()

    def restart(self, executor) -> None:
        """After ``reset`` and a reconnect: a new executor (the old one's keys mean nothing to it),
        and names counted from zero, so every rank starts over alike whatever exchanges each had
        made of the failed step."""
        with self._lock:
            self.executor = executor
            self.epoch = 0
            self.occurrences = [{} for _ in self.occurrences]
            self._pending.clear()

    def _clear(self) -> None:
        self._window, self._times, self._observed, self._position = [], [], [], {}

    def _predict(self, window: List[Entry], times: List[float], observed: List[float]) -> None:
        ex = self.executor
        window_s = max(ex.round_s, 2 * (ex.n - 1) * ex.slot_s)
        seen: Dict[Tuple[int, str], int] = {}
        keys: List[int] = []
        waves: List[list] = []
        start = None
        frozen, cuts = self._cuts, set()  # the cuts of the first prediction of these repeating steps
        for position, (entry, t, seen_done) in enumerate(zip(window, times, observed)):
            group, name, dsts, srcs, after = entry
            n = seen.get((group, name), 0)
            seen[(group, name)] = n + 1
            key_name = self._key_name(name, self.occurrences[group].get(name, 0) + n)
            key = message_key(key_name)
            keys.append(key)
            self._pending.append((entry, key_name, key))
            if dsts or srcs:
                if start is None or seen_done > start or (
                        position in frozen if frozen is not None else t - start > window_s):
                    waves.append([])
                    cuts.add(position)
                    start = t
                sizes = self._sizes.get(position, {})
                waves[-1].append((key, list(dsts), list(srcs), [keys[j] for j in after],
                                  [sizes.get(d, 0) for d in dsts]))
        if frozen is None:
            self._cuts = cuts
        self.executor.declare_ahead(waves)
        self.stats["predicted"] += len(window)
        self.stats["waves"] += len(waves)

    def _void_pending(self) -> None:
        if not self._pending:
            return
        for (_, _, dsts, srcs, _), _, key in self._pending:
            if dsts or srcs:
                self.executor.void(key, dsts, srcs)
        self.stats["voided"] += len(self._pending)
        self._pending.clear()
        self.epoch += 1
