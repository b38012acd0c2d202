"""COVAP (paper 004): a coarse-grained filter that communicates, in each step, only the
units (fused buckets, or shards of the large ones) whose index t satisfies
(t + step) % I == 0, with the interval I = ceil(CCR), the communication-to-computation
ratio measured at the start of training. On the steps a unit is not selected, in
``mode="local"`` (hipress's default) every rank applies its own gradient to it, and a
selected unit's parameters are averaged across ranks; in ``mode="paper"`` (Algorithm 1) its
gradient stays in a local residual, scaled by a coefficient that rises during training (the
paper's error-feedback scheduler), and goes out the next time the unit is selected.

The rules are plain functions, so they are tested on their own and shared by the
optimizer (``DistributedOptimizer(compression="covap")``, through :class:`Run`) and the DDP
comm hook (``hipress.ddp.register(model, compression="covap")``, through :class:`StreamRun`):

* :func:`interval_from_ccr`: I = ceil(CCR), at least 1 (§III-B).
* :func:`shard_counts`: a bucket of more elements than the median bucket is split evenly
  into floor(numel / median) parts, at most I (§III-C).
* :func:`selected`: unit t is sent at ``step`` iff (t + step) % I == 0 (§III-A).
* :func:`ef_coefficient`: min(init + floor(step / ascend_steps) * ascend_range, 1) (§III-D).
  The paper states the formula without values; the defaults (0.5, 50, 0.1) are those of
  the authors' published reducer.
* :func:`aligned_comm_time`: the distributed profiler's alignment (§III-B, Fig. 3). Ranks
  start a collective at different times, and one that starts early waits for the others
  inside it. A collective ends at the same moment everywhere, so aligning the ranks'
  timelines at its end leaves, as its true duration, the shortest one any rank measured
  (the last rank to arrive did not wait).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from hipress import _C
from hipress.comm import world
from hipress.planner.plan import chunk_bounds
from hipress.sync.undo import UndoLog

# The authors' reducer: ef_init(0.5), decay_step(50), and a rise of 0.1 per decay_step.
EF_INIT = 0.5
ASCEND_STEPS = 50
ASCEND_RANGE = 0.1


def interval_from_ccr(ccr: float) -> int:
    if not math.isfinite(ccr) or ccr < 0:
        raise ValueError(f"COVAP: the communication-to-computation ratio must be a finite number >= 0, got {ccr}")
    return max(1, math.ceil(ccr))


def shard_counts(sizes: Sequence[int], interval: int) -> List[int]:
    """How many parts each bucket (of ``sizes`` elements) is split into."""
    if interval < 1:
        raise ValueError(f"COVAP: interval must be >= 1, got {interval}")
    if not sizes:
        return []
    median = int(torch.tensor(list(sizes), dtype=torch.float64).median().item())  # lower median, as torch
    if median <= 0:
        return [1] * len(sizes)
    return [max(1, min(n // median, interval)) for n in sizes]


def selected(unit: int, step: int, interval: int) -> bool:
    return (unit + step) % interval == 0


def ef_coefficient(step: int, init: float = EF_INIT, ascend_steps: int = ASCEND_STEPS,
                   ascend_range: float = ASCEND_RANGE) -> float:
    return min(init + (step // ascend_steps) * ascend_range, 1.0)


def aligned_comm_time(durations: Sequence[Sequence[float]]) -> float:
    """``durations[r][k]``: rank r's measured time of collective k. The sum over collectives
    of the shortest time any rank measured (see the module docstring)."""
    if not durations:
        return 0.0
    n_ops = {len(d) for d in durations}
    if len(n_ops) != 1:
        raise ValueError(f"COVAP profiler: ranks timed different numbers of collectives: {sorted(n_ops)}")
    return float(sum(min(col) for col in zip(*durations)))


@dataclass(frozen=True)
class Profile:
    """The distributed profiler's result (``opt.covap_profile``)."""
    t_before: float  # s per step before the first gradient is ready (forward, start of backward)
    t_comp: float    # s per step of backward that communication can overlap
    t_comm: float    # s per step of uncompressed communication, aligned across ranks
    ccr: float
    interval: int

    def summary(self) -> str:
        return (f"hipress COVAP: T_before {self.t_before * 1e3:.2f} ms, T_comp {self.t_comp * 1e3:.2f} ms, "
                f"T_comm {self.t_comm * 1e3:.2f} ms per step: CCR {self.ccr:.2f}, interval {self.interval}")


def make_profile(t_before: float, t_comp: float, t_comm: float, max_interval: Optional[int] = None) -> Profile:
    """The profile and its interval, ceil(CCR), at most ``max_interval`` when given."""
    if t_comp <= 0:
        raise ValueError(f"COVAP profiler: backward computation time must be > 0, got {t_comp}")
    ccr = t_comm / t_comp
    interval = interval_from_ccr(ccr)
    return Profile(t_before, t_comp, t_comm, ccr, min(interval, max_interval) if max_interval else interval)


class Average:
    """Mode "local": one unit's parameters being averaged across ranks, applied a step later.

    ``values`` is averaged in place by the sync (``handle``); ``sent`` keeps it as it was. The
    sync runs on while the next step computes, and in step s + 1, before the optimizer's step,
    the rank adds average - sent to the unit's parameters: each rank keeps the local steps it
    took since, on top of the average. ``delta()`` (once the handle is done) turns it into that
    difference alone, which is what a checkpoint holds.

    Two forms, by what travels (``wire``, see :class:`References`):
    * fp32: ``values`` are the unit's parameters when its bucket was ready in the backward of
      step s, and the sync averages them.
    * bf16: ``values`` are their difference from ``base``, the unit's reference (alike on every
      rank), in bf16, and the sync sums them; the average is base + sum / n, so
      average - sent is sum / n - values as sent. Either form, once applied, sets the unit's
      reference in ``refs`` to the average (the fp32 form is how a unit gets its first)."""

    __slots__ = ("name", "start", "values", "sent", "handle", "refs", "key", "base", "n")

    def __init__(self, name: str, start: int, values: torch.Tensor, refs: Optional["References"] = None,
                 key: Optional[str] = None, base: Optional[torch.Tensor] = None, n: int = 1):
        """Before the sync of ``values`` starts (it then sets ``handle``); ``n``: the ranks summed."""
        self.name, self.start, self.values, self.handle = name, start, values, None
        self.refs, self.key, self.base, self.n = refs, key, base, n
        self.sent: Optional[torch.Tensor] = values.clone()

    @classmethod
    def of_delta(cls, name: str, start: int, delta: torch.Tensor) -> "Average":
        """A checkpoint's: the difference alone."""
        a = cls(name, start, delta[:0])
        a.values, a.sent = delta.clone(), None
        return a

    def delta(self) -> torch.Tensor:
        if self.sent is None:
            return self.values
        if self.base is None:
            average = self.values
            self.values = average - self.sent
        else:  # one native pass: mean = sum / n, average = base + mean, values = mean - sent
            total, base, sent = (t.contiguous() for t in (self.values, self.base, self.sent))  # bf16, alike
            delta = torch.empty(total.numel(), dtype=torch.float32)
            average = torch.empty(total.numel(), dtype=torch.bfloat16)
            _C.ops_bf16_average_delta(delta.data_ptr(), average.data_ptr(), total.data_ptr(), base.data_ptr(),
                                      sent.data_ptr(), float(self.n), total.numel())
            self.values = delta
        if self.refs is not None:
            self.refs.values[self.key] = average.to(torch.bfloat16)  # (the bf16 form's: itself)
        self.sent = self.handle = self.base = None
        return self.values


WIRES = ("bf16", "fp32")


class References:
    """Mode "local", ``wire="bf16"``: each unit's reference, a value every rank holds alike (its
    last average, rounded to bf16), keyed by bucket and range. A selected unit with a reference
    sends its parameters' difference from it, in bf16: half the bytes of fp32 parameters. That
    difference is the few local steps since the last average (plus the reference's rounding),
    so bf16's 8-bit mantissa loses about 2^-9 of an update, not of a weight; what a rank's
    difference loses to rounding stays in its own parameters (it adds sum / n - what it sent).
    A unit without one (its first average, and after :meth:`clear`) is averaged in fp32."""

    def __init__(self):
        self.values: Dict[str, torch.Tensor] = {}

    @staticmethod
    def key(name: str, s: int, e: int) -> str:
        return f"{name}@{s}:{e}"

    def clear(self) -> None:
        """Forgets every reference (a new filter: its units may differ)."""
        self.values.clear()

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.values.items()}

    def load_state_dict(self, sd: Dict[str, torch.Tensor]) -> None:
        self.values = {k: v.to(torch.bfloat16).clone() for k, v in sd.items()}


def bf16_sync(sync):
    """The sync that sums a bf16 difference (``wire="bf16"``): the backend's allreduce, sum, on
    ``sync``'s own exchange (so one order of communication per rank). None where ``sync`` is not
    the backend's allreduce (local aggregation, the coordinator without plain exchanges beside it)
    or the backend does not sum bf16 (MPI): the averages then travel in fp32."""
    from hipress.sync.allreduce import AllreduceStrategy
    from hipress.sync.factory import Sync
    ex = sync.ctx.exchange
    if (not isinstance(sync.strategy, AllreduceStrategy) or not ex.has_allreduce
            or torch.bfloat16 not in ex.transport.allreduce_dtypes):
        return None
    return Sync(AllreduceStrategy(average=False, wire=torch.bfloat16), sync.ctx)


def averages_state(averages: Sequence[Average]) -> List[dict]:
    """The checkpoint's form of (done) averages: each one's difference."""
    return [{"bucket": a.name, "start": a.start, "delta": a.delta().clone()} for a in averages]


def averages_from_state(saved: Sequence[dict]) -> List[Average]:
    return [Average.of_delta(a["bucket"], a["start"], a["delta"]) for a in saved]


def start_averages(bucket, units, build, build16=None, refs: Optional[References] = None, n: int = 1) -> List[Average]:
    """An :class:`Average` of each selected unit (index, range) of ``bucket`` (the optimizer's
    ``_Bucket``), started by ``build(key, values, bounds)`` (the sync's). With ``refs`` and
    ``build16`` (``wire="bf16"``), a unit with a reference sends its bf16 difference from it by
    ``build16`` (a sum over the ``n`` ranks), and every unit's average becomes its reference."""
    out = []
    for t, (s, e) in units:
        key = References.key(bucket.name, s, e)
        base = refs.values.get(key) if refs is not None and build16 is not None else None
        values = bucket.param_values(s, e)
        if base is None:
            avg = Average(bucket.name, s, values, refs if build16 is not None else None, key)
            avg.handle = build(f"{bucket.name}/u{t}", avg.values, [(0, e - s)])
        else:
            diff, base = torch.empty(e - s, dtype=torch.bfloat16), base.contiguous()
            _C.ops_bf16_difference(diff.data_ptr(), values.data_ptr(), base.data_ptr(), e - s)  # values - base, as bf16
            avg = Average(bucket.name, s, diff, refs, key, base, n)
            avg.handle = build16(f"{bucket.name}/u{t}", avg.values, [(0, e - s)])
        out.append(avg)
    return out


def wait_averages(averages: Sequence[Average], timeout_s: float, waiting_for) -> None:
    """Waits for every average's sync, all within ``timeout_s``; raises naming the unit's bucket
    (and ``waiting_for()``: the peers waited for) if one failed or is late."""
    end = time.monotonic() + timeout_s
    for a in averages:
        if a.handle is None:
            continue
        if not a.handle.wait(max(0.0, end - time.monotonic())):
            raise TimeoutError(f"hipress: the average of the parameters of '{a.name}' not done within "
                               f"{timeout_s:g} s (HIPRESS_TIMEOUT_S); {waiting_for()}")
        if a.handle.exception(0) is not None:
            raise RuntimeError(f"hipress: the average of the parameters of '{a.name}' failed: {a.handle.exception(0)}")


class Filter:
    """The per-rank filter state: units of each bucket, their residuals and the step.

    ``apply(name, flat)`` runs once per bucket per step, before the bucket is synced: it
    adds the scaled residual to each unit, keeps what is not selected as the new residual
    (zeroing it in ``flat``), and returns the selected units' ranges, which are the only
    ones to synchronize. ``advance()`` ends the step."""

    def __init__(self, bucket_sizes: Dict[str, int], interval: int, *, shard: bool = True,
                 ef_init: float = EF_INIT, ascend_steps: int = ASCEND_STEPS, ascend_range: float = ASCEND_RANGE):
        if not 0 <= ef_init <= 1:
            raise ValueError(f"COVAP: ef_init must be in [0, 1], got {ef_init}")
        if ascend_steps < 1:
            raise ValueError(f"COVAP: ascend_steps must be >= 1, got {ascend_steps}")
        if ascend_range < 0:
            raise ValueError(f"COVAP: ascend_range must be >= 0, got {ascend_range}")
        self.interval = int(interval)
        names = list(bucket_sizes)
        counts = shard_counts([bucket_sizes[n] for n in names], self.interval) if shard else [1] * len(names)
        # units numbered in bucket order (the same on every rank): (bucket, range within it)
        self.units: Dict[str, List[Tuple[int, Tuple[int, int]]]] = {}
        t = 0
        for name, parts in zip(names, counts):
            self.units[name] = []
            for rng in chunk_bounds(bucket_sizes[name], parts):
                self.units[name].append((t, rng))
                t += 1
        self.ef = (float(ef_init), int(ascend_steps), float(ascend_range))
        self.step = 0
        self.residual: Dict[str, torch.Tensor] = {}
        self.undo_log = UndoLog()  # this step's residual changes (hipress.sync.undo)

    def undo(self) -> None:
        """Every residual as before this step (the step is not advanced either)."""
        def restore(name, copies, _):
            if copies is None:
                self.residual.pop(name, None)
            else:
                self.residual[name].copy_(copies[0])

        self.undo_log.undo(restore)

    @property
    def coefficient(self) -> float:
        return ef_coefficient(self.step, *self.ef)

    def selected_units(self, name: str) -> List[Tuple[int, Tuple[int, int]]]:
        """The units (index, range) of bucket ``name`` selected this step."""
        return [(t, r) for t, r in self.units[name] if r[1] > r[0] and selected(t, self.step, self.interval)]

    def apply(self, name: str, flat: torch.Tensor) -> List[Tuple[int, int]]:
        if self.interval == 1:  # every unit sent every step: no residual ever (a fast link, CCR <= 1)
            return [r for _, r in self.units[name] if r[1] > r[0]]
        res = self.residual.get(name)
        if res is None:
            self.undo_log.created(name)
            res = self.residual[name] = torch.zeros(flat.numel(), dtype=torch.float32)
        else:
            self.undo_log.touch(name, [res])
        coeff = self.coefficient
        sent = []
        for t, (s, e) in self.units[name]:
            if e <= s:
                continue
            g, r = flat[s:e], res[s:e]
            r.mul_(coeff).add_(g)        # residual = coeff * residual + gradient
            if selected(t, self.step, self.interval):
                g.copy_(r)               # sent: all of it
                r.zero_()
                sent.append((s, e))
            else:
                g.zero_()                # kept: nothing sent, nothing applied
        return sent

    def advance(self) -> None:
        self.undo_log.commit()
        self.step += 1

    def state_dict(self) -> dict:
        return {"step": self.step, "interval": self.interval,
                "residual": {k: v.clone() for k, v in self.residual.items()}}

    def load_state_dict(self, sd: dict) -> None:
        if int(sd["interval"]) != self.interval:
            raise ValueError(f"COVAP: the checkpoint was made with interval {sd['interval']}, "
                             f"this optimizer has {self.interval}")
        self.undo_log.commit()
        self.step = int(sd["step"])
        self.residual = {k: v.clone() for k, v in sd["residual"].items()}


def check_interval(interval) -> Optional[int]:
    """``interval``: "auto" (None here: profile) or an int >= 1."""
    if interval == "auto":
        return None
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ValueError(f"COVAP: interval must be 'auto' or an int >= 1, got {interval!r}")
    return interval


# ---------------------------------------------------------------- the optimizer's side

PARAMS = ("interval", "max_interval", "mode", "ef_init", "ascend_steps", "ascend_range", "shard", "inner",
          "profile_steps", "wire")
# What a unit does on the steps it is not selected (docs/covap.md, "Local updates"):
#   "local": every rank applies its own gradient to it at once, and a selected unit's
#            parameters are averaged across ranks (each unit is a local-SGD replica with
#            period I, the units staggered). Every unit moves every step.
#   "paper": the paper's Algorithm 1: the gradient waits in the residual and the unit does
#            not move; a selected unit's gradient (with the residual) is averaged.
# At interval 1 both are plain gradient averaging.
MODES = ("local", "paper")


def split_options(kwargs: dict) -> Tuple[dict, str, dict]:
    """``compression="covap"``'s keyword arguments -> (COVAP's, the inner algorithm, its own)."""
    mine = {k: kwargs[k] for k in PARAMS if k in kwargs}
    rest = {k: v for k, v in kwargs.items() if k not in PARAMS}
    inner = mine.pop("inner", "none")
    check_interval(mine.get("interval", "auto"))
    mode = mine.setdefault("mode", "local")
    if mode not in MODES:
        raise ValueError(f"COVAP: mode must be one of {MODES}, got {mode!r}")
    if mode == "local" and inner != "none":
        raise ValueError(f"COVAP: mode='local' averages the selected units' parameters, which are not compressed; "
                         f"pass mode='paper' to send the selected units' gradients compressed with {inner!r}")
    mine.setdefault("max_interval", MAX_INTERVAL[mode])
    if mine.get("wire", "fp32") not in WIRES:
        raise ValueError(f"COVAP: wire must be one of {WIRES}, got {mine['wire']!r}")
    if mode == "paper" and "wire" in mine:
        raise ValueError("COVAP: wire= is what mode='local' sends its parameters' averages in; "
                         "mode='paper' sends gradients (compress them with inner=)")
    for key, v in (("profile_steps", mine.get("profile_steps", PROFILE_STEPS)), ("max_interval", mine["max_interval"])):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"COVAP: {key} must be an int >= 1, got {v!r}")
    return mine, inner, rest


PROFILE_STEPS = 5  # steps timed after one warm-up step (the paper profiles one iteration)
# hipress's cap on the profiled interval, per mode (not the paper's; an int interval is used
# as given). On a slow link a small model can measure CCR 15 (digits over loopback gloo).
# "paper": every unit still moves at least every 4th step. The paper's CCRs were 2.1-4.0 and
# its speed-up stopped growing past I = 4 (Fig. 5); the digits run does not train at I = 3.
# "local": every unit moves every step; its parameters are averaged at least every 8th. The
# digits run keeps its accuracy up to I = 8 there (docs/covap.md, "Local updates").
MAX_INTERVAL = {"local": 8, "paper": 4}


def changed_units(old: Optional[Filter], new: Filter) -> List[Tuple[str, int, Tuple[int, int]]]:
    """(bucket, unit index, range in ``old``) of the units of ``old`` that ``new`` gives another
    range or drops (sharding follows the interval): their inner compressor states, keyed by the
    unit's index, no longer fit it."""
    if old is None:
        return []
    return [(name, t, r) for name, units in old.units.items() for t, r in units
            if dict(new.units.get(name, [])).get(t) != r]


class Run:
    """COVAP inside one DistributedOptimizer: profiles (interval="auto"), then filters.

    While profiling, every bucket is synced whole and timed: ``submitted``/``completed``
    per bucket, ``grad_ready`` per gradient, ``step_end`` per step. ``finish_step(gather)``
    closes a step; after the last timed one it computes the profile from every rank's
    figures (``gather``: an allgather of a float64 vector, the same result on every rank)
    and builds the filter."""

    def __init__(self, bucket_sizes: Dict[str, int], interval="auto", max_interval: Optional[int] = None,
                 mode: str = "local", ef_init: float = EF_INIT,
                 ascend_steps: int = ASCEND_STEPS, ascend_range: float = ASCEND_RANGE, shard: bool = True,
                 profile_steps: int = PROFILE_STEPS, wire: str = "fp32"):
        self.sizes = dict(bucket_sizes)
        self.filter_args = dict(shard=bool(shard), ef_init=ef_init, ascend_steps=ascend_steps,
                                ascend_range=ascend_range)
        self.profile_steps = profile_steps
        self.max_interval = MAX_INTERVAL[mode] if max_interval is None else max_interval
        self.mode = mode
        # the units' references for averages sent as bf16 differences (References)
        self.refs: Optional[References] = References() if mode == "local" and wire == "bf16" else None
        self.profile: Optional[Profile] = None
        self._keep: Optional[Filter] = None  # the filter being re-profiled
        self.on_filter = None  # called with each filter made after profiling (the optimizer declares its units)
        fixed = check_interval(interval)
        self.filter: Optional[Filter] = Filter(self.sizes, fixed, **self.filter_args) if fixed else None
        self._reset_timing()

    def _reset_timing(self):
        self._step = 0            # profiling steps seen (the first is warm-up)
        self._t = {"before": [], "comp": [], "comm": []}
        self._cur = {"start": None, "first": None, "last": None, "sub": {}, "done": {}}

    def reprofile(self) -> None:
        """Measure again from the next step (the filter is off meanwhile, its residuals kept)."""
        self._keep = self.filter
        self.filter = None
        self._reset_timing()

    @property
    def profiling(self) -> bool:
        return self.filter is None

    def unit_layouts(self) -> List[Tuple[str, int, Tuple[int, int]]]:
        """(bucket, unit index, range) of every unit whose inner compressor states may exist: the
        filter in force's, then those of the filter set aside while re-profiling that it lacks."""
        out, seen = [], set()
        for filt in (self.filter, self._keep):
            for name, units in (filt.units.items() if filt is not None else ()):
                out += [(name, t, r) for t, r in units if (name, t) not in seen]
                seen.update((name, t) for t, _ in units)
        return out

    @property
    def local(self) -> bool:
        """This step averages the selected units' parameters, and every gradient stays local."""
        return self.mode == "local" and self.filter is not None and self.filter.interval > 1

    # timing hooks (profiling only)
    def grad_ready(self, now: float) -> None:
        c = self._cur
        if c["first"] is None:
            c["first"] = now
        c["last"] = now

    def submitted(self, name: str, now: float) -> None:
        self._cur["sub"][name] = now

    def completed(self, name: str, now: float) -> None:
        self._cur["done"][name] = now

    def step_end(self, now: float) -> None:
        self._cur = {"start": now, "first": None, "last": None, "sub": {}, "done": {}}

    def select(self, name: str, flat: torch.Tensor) -> Optional[List[Tuple[int, Tuple[int, int]]]]:
        """None while profiling (sync all of ``flat``); else the selected units (index,
        range): with :attr:`local`, the units whose parameters to average (``flat``, the
        gradient, stays as it is); otherwise ``flat`` now holds what to send."""
        if self.filter is None:
            return None
        if self.local:
            return self.filter.selected_units(name)
        ranges = self.filter.apply(name, flat)
        return [(t, r) for t, r in self.filter.units[name] if r in ranges]

    def finish_step(self, gather) -> Optional[Profile]:
        """End of a synchronized step; returns the profile when it was just computed."""
        if self.filter is not None:
            self.filter.advance()
            return None
        c = self._cur
        # (a job resumed from a checkpoint taken while profiling has no previous step end: its
        # first step's T_before is unknown, its T_comp and T_comm count)
        if self._step > 0 and c["first"] is not None:
            # bucket k communicates from when it can (submitted, and bucket k-1 done) to done
            per_bucket, prev_end = {}, None
            for name in sorted(c["sub"], key=c["sub"].get):
                start = c["sub"][name] if prev_end is None else max(c["sub"][name], prev_end)
                end = c["done"].get(name, start)
                per_bucket[name] = max(0.0, end - start)
                prev_end = end
            if c["start"] is not None:
                self._t["before"].append(c["first"] - c["start"])
            self._t["comp"].append(max(c["last"] - c["first"], 1e-9))
            self._t["comm"].append([per_bucket.get(n, 0.0) for n in self.sizes])
        self._step += 1
        if len(self._t["comm"]) < self.profile_steps:
            return None
        mine = [statistics.median(self._t["before"] or [0.0]), statistics.median(self._t["comp"])]
        mine += [statistics.median(col) for col in zip(*self._t["comm"])]
        rows = gather(torch.tensor(mine, dtype=torch.float64)).tolist()  # one row per rank
        # the slowest rank's computation; each collective's duration aligned at its end
        self.profile = make_profile(max(r[0] for r in rows), max(r[1] for r in rows),
                                    aligned_comm_time([r[2:] for r in rows]), self.max_interval)
        keep, self._keep = self._keep, None
        self.filter = Filter(self.sizes, self.profile.interval, **self.filter_args)
        if self.refs is not None:  # its units may differ (sharding follows the interval)
            self.refs.clear()
        if keep is not None:  # the residuals are per bucket, whatever the units: kept, and the schedule goes on
            self.filter.residual, self.filter.step = keep.residual, keep.step
        if self.on_filter is not None:
            self.on_filter(self.filter)
        return self.profile

    def state_dict(self) -> dict:
        sd = {"profile": None if self.profile is None else dataclasses.asdict(self.profile)}
        if self.filter is not None:
            sd["filter"] = self.filter.state_dict()
        else:  # profiling: the steps measured so far (a resumed job goes on from them, so its
            # filter starts at the same step), and while re-profiling the filter whose residuals wait
            sd["profiling"] = {"step": self._step, "times": {k: list(v) for k, v in self._t.items()}}
            c = self._cur
            if c["first"] is not None:  # a step timed but not closed yet (the DDP hook closes it at the
                # next step's first bucket): its times relative to its first gradient, as another
                # process's clock has another origin
                base = c["first"]
                sd["profiling"]["current"] = {
                    "start": None if c["start"] is None else c["start"] - base, "first": 0.0,
                    "last": c["last"] - base, "sub": {n: t - base for n, t in c["sub"].items()},
                    "done": {n: t - base for n, t in c["done"].items()}}
            if self._keep is not None:
                sd["profiling"]["kept_filter"] = self._keep.state_dict()
        if self.refs is not None:  # after the averages' checkpoint form (applying one sets a reference)
            sd["refs"] = self.refs.state_dict()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("profile") is not None:
            self.profile = Profile(**sd["profile"])
        prof = sd.get("profiling")
        if prof is not None and self.filter is not None and "kept_filter" in prof:
            raise ValueError("the checkpoint was saved while COVAP re-profiled, its filter's residuals waiting; "
                             "this optimizer has a fixed interval: resume with interval='auto'")
        if prof is not None and self.filter is None:  # (a fixed interval has nothing to measure)
            self._reset_timing()
            self._step = int(prof["step"])
            self._t = {k: list(v) for k, v in prof["times"].items()}
            if "current" in prof:
                self._cur = {k: dict(v) if isinstance(v, dict) else v for k, v in prof["current"].items()}
            if "kept_filter" in prof:
                self._keep = Filter(self.sizes, int(prof["kept_filter"]["interval"]), **self.filter_args)
                self._keep.load_state_dict(prof["kept_filter"])
        if "filter" in sd:
            if self.filter is None:  # "auto", profiled before the checkpoint: keep its interval
                self.filter = Filter(self.sizes, int(sd["filter"]["interval"]), **self.filter_args)
                if self.on_filter is not None:
                    self.on_filter(self.filter)
            self.filter.load_state_dict(sd["filter"])
        if self.refs is not None:
            self.refs.load_state_dict(sd.get("refs", {}))



def gather_rows(transport, v: torch.Tensor) -> torch.Tensor:
    """Every rank's float64 vector ``v`` over ``transport`` (an allgather), one row per rank:
    the profiler's ``gather``. Call it when nothing else of this rank's step is in flight on it
    (what an object left running past its step, world.quiesce() waits for here)."""
    world.quiesce()
    out = torch.empty(transport.size * v.numel(), dtype=torch.float64)
    transport.allgather(v.contiguous().view(torch.uint8), out.view(torch.uint8))
    return out.view(transport.size, v.numel())


# ---------------------------------------------------------------- the DDP hook's side

class StreamRun:
    """COVAP where buckets arrive one at a time and are not known up front: DDP's comm hook
    (hipress/torch/ddp.py). DDP makes its buckets itself and regroups them after its first
    step, and the median rule and the unit numbering need every bucket. So buckets are synced
    whole until a step shows the same buckets (names and sizes) as the step before; a
    :class:`Run` over those buckets starts at the next step (with interval="auto", by
    profiling). A step ends with its last bucket (DDP's ``GradBucket.is_last()``):
    :meth:`end_step`. The profiler's figures are gathered from every rank at the next step's
    first event (:meth:`begin`), when nothing of the step before is in flight."""

    def __init__(self, args: dict):
        self.args = dict(args)  # Run's keywords (split_options' first result)
        check_interval(self.args.get("interval", "auto"))
        self.run: Optional[Run] = None
        self._prev: Optional[Dict[str, int]] = None  # the last step's buckets (name -> elements)
        self._cur: Dict[str, int] = {}
        self._profile_due = False  # a profiled step ended; its figures are taken at the next begin()
        self._last_done: Optional[float] = None  # when the last profiled bucket completed

    @property
    def profiling(self) -> bool:
        return self.run is not None and self.run.profiling

    def begin(self, now: float, gather) -> Optional[Profile]:
        """Called at every gradient and bucket; at a step's first one, it closes the profiled
        step before it. Returns the profile when it was just computed."""
        if not self._profile_due:
            return None
        self._profile_due = False
        profile = self.run.finish_step(gather)
        if self.run.profiling:
            self.run.step_end(self._last_done if self._last_done is not None else now)
        return profile

    def grad_ready(self, now: float) -> None:
        if self.profiling:
            self.run.grad_ready(now)

    def select(self, name: str, flat: torch.Tensor, now: float) -> Optional[List[Tuple[int, Tuple[int, int]]]]:
        """None: sync all of ``flat`` (time it with :meth:`submitted`/:meth:`completed` while
        :attr:`profiling`); else the selected units, ``flat`` now holding what to send."""
        self._cur[name] = flat.numel()
        if self.run is None:
            return None
        if self.run.profiling:
            self.run.grad_ready(now)  # the bucket is ready, so its gradients are (without gradient hooks)
            return None
        if name not in self.run.filter.units:  # a resumed job's first step, before DDP regrouped its buckets
            return None
        return self.run.select(name, flat)

    def submitted(self, name: str, now: float) -> None:
        self.run.submitted(name, now)

    def completed(self, name: str, now: float) -> None:
        self.run.completed(name, now)
        self._last_done = now

    def end_step(self) -> None:
        """The step's last bucket was handed out."""
        cur, self._cur = self._cur, {}
        if self.run is None:
            if cur == self._prev:
                self.run = Run(cur, **self.args)
            self._prev = cur
        elif self.run.profiling:
            self._profile_due = True
        elif set(cur) <= set(self.run.sizes):  # the filter's buckets: its step is over
            self.run.finish_step(None)

    def state_dict(self) -> dict:
        return {"sizes": None if self.run is None else dict(self.run.sizes),
                "run": None if self.run is None else self.run.state_dict(), "profile_due": self._profile_due}

    def load_state_dict(self, sd: dict) -> None:
        # a profiled step that ended before the checkpoint is closed at the resumed job's first bucket
        self._cur, self._profile_due, self._last_done = {}, bool(sd.get("profile_due", False)), None
        if sd.get("sizes") is None:
            self.run, self._prev = None, None
            return
        self.run = Run(sd["sizes"], **self.args)
        self.run.load_state_dict(sd["run"])
        self._prev = dict(sd["sizes"])
