"""Per-gradient plans: compress or not, and K partitions, from the cost model.

    model = CostModel(send, enc, dec, n=16, strategy="paper_ps_colocated", category="quantization", rate=1/16)
    plan = make_plan([("fc.weight", 411041792), ("fc.bias", 16384)], model,
                     Overrides(min_compress_bytes=1 << 20, force={"fc.bias": False}))
    plan["fc.weight"].compress, plan["fc.weight"].k
    plan.bounds("fc.weight", numel)          # [(start, end), ...] K contiguous ranges

:meth:`Plan.bounds` also answers for names not in the plan (it plans them on the
fly from numel), so an optimizer can call it for every gradient it submits.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from hipress.planner.cost_model import CostModel, Decision

Bounds = List[Tuple[int, int]]


@dataclass
class Overrides:
    """User pins applied on top of the model's choice.

    min_compress_bytes: never compress gradients smaller than this.
    max_compress_bytes: never compress gradients larger than this (None: no limit).
    max_partitions: upper bound on K (default: N, the paper's range; may exceed N,
        then partitions run in ceil(K/N) rounds).
    min_partition_bytes: never make partitions smaller than this (caps K at m / this).
    force: per-name decision: True/False forces compress on/off (K still chosen by
        the model), an int forces K (compression still chosen), a (bool, int) pair
        forces both.
    bf16: how an uncompressed gradient travels where the backend's allreduce sums bf16
        (CostModel.plain16; hipress.sync.allreduce): None, as bf16 where the model says it is
        faster than fp32; True, always as bf16; False, always fp32 (bit for bit uncompressed).
    measure: where the optimizer made the plan from the model (plan="auto", an Overrides or a
        dict, not a Plan) and it compresses something, the steps each candidate is measured over
        while training: the plan with nothing compressed, this plan, and where this plan leaves
        gradients uncompressed that no pin keeps so, the plan compressing them too; a later one is
        kept where it is faster by more than 3% (hipress/torch/plan_trial.py). 0: this plan,
        unmeasured.
    """

    min_compress_bytes: int = 0
    max_compress_bytes: Optional[int] = None
    max_partitions: Optional[int] = None
    min_partition_bytes: int = 0
    force: Dict[str, Union[bool, int, Tuple[bool, int]]] = field(default_factory=dict)
    bf16: Optional[bool] = None
    measure: int = 10

    def __post_init__(self):
        if isinstance(self.measure, bool) or not isinstance(self.measure, int) or self.measure < 0:
            raise ValueError(f"Overrides.measure must be an int >= 0 (steps per candidate plan; 0: no "
                             f"measuring), got {self.measure!r}")


@dataclass(frozen=True)
class PlanEntry(Decision):
    """One gradient's plan: the cost model's Decision with the user's pins applied.

    Times are the model's predictions in seconds. t_orig, t_cpr: best predicted time
    without / with compression over the allowed K (both are always computed, also when a
    pin rules one out); k_orig, k_cpr: the K achieving them. compress, k: the decision;
    bf16: not compressed, and sent as bf16 (here bf16 means the decision, not only the branch).
    name, nbytes: the gradient (give them by keyword; they follow Decision's fields).
    reason: 'model', or which pin decided.
    """

    name: str = ""
    nbytes: int = 0
    reason: str = "model"

    t_pred = Decision.t_best  # the predicted time of the decision

    def bounds(self, numel: int) -> Bounds:
        return chunk_bounds(numel, max(1, min(self.k, numel)))


def chunk_bounds(n: int, parts: int) -> Bounds:
    """Splits range(n) into ``parts`` contiguous (start, end) ranges whose sizes differ by at
    most one (the first n % parts get the extra element); some are empty when n < parts
    (a ring needs exactly one chunk per rank). Callers that want no empty partition cap
    ``parts`` at n (:meth:`PlanEntry.bounds`)."""
    n, parts = int(n), int(parts)
    if parts <= 0:
        raise ValueError(f"parts must be positive, got {parts}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    base, extra = divmod(n, parts)
    out, s = [], 0
    for i in range(parts):
        e = s + base + (1 if i < extra else 0)
        out.append((s, e))
        s = e
    return out


def plan_one(name: str, nbytes: int, model: CostModel, overrides: Optional[Overrides] = None) -> PlanEntry:
    ov = overrides or Overrides()
    nbytes = int(nbytes)
    if nbytes < 0:
        raise ValueError(f"{name}: negative size {nbytes}")
    k_max = ov.max_partitions if ov.max_partitions is not None else model.n
    if ov.min_partition_bytes > 0:
        k_max = min(k_max, max(1, nbytes // ov.min_partition_bytes))
    k_max = max(1, min(k_max, max(1, nbytes // 4)))  # at least one fp32 element per partition
    allow, reason = True, "model"
    if nbytes < ov.min_compress_bytes:
        allow, reason = False, "min_compress_bytes"
    if ov.max_compress_bytes is not None and nbytes > ov.max_compress_bytes:
        allow, reason = False, "max_compress_bytes"
    forced_c, forced_k = None, None
    if name in ov.force:
        f = ov.force[name]
        if isinstance(f, bool):
            forced_c = f
        elif isinstance(f, int):
            forced_k = f
        elif isinstance(f, (tuple, list)) and len(f) == 2 and isinstance(f[0], bool) and isinstance(f[1], int):
            forced_c, forced_k = f
        else:
            raise ValueError(f"force[{name!r}] must be a bool, an int K, or (bool, K); got {f!r}")
        if forced_k is not None and forced_k < 1:
            raise ValueError(f"force[{name!r}]: K must be >= 1, got {forced_k}")
        reason = "force"
    lo, hi = (forced_k, forced_k) if forced_k is not None else (1, k_max)
    if forced_c is not None:
        allow = forced_c
    d: Decision = model.decide(nbytes, k_max=hi, k_min=lo, allow_compress=True,  # both branches, for display
                               bf16=ov.bf16)
    if forced_c is True:
        compress = True
    elif not allow:
        compress = False
    else:
        compress = d.compress
    k = d.k_cpr if compress else d.k_orig
    return PlanEntry(compress, k, d.t_orig, d.k_orig, d.t_cpr, d.k_cpr, d.bf16 and not compress,
                     name=name, nbytes=nbytes, reason=reason)


class Plan:
    """Ordered per-gradient plan entries with lookup by name."""

    def __init__(self, entries: Iterable[PlanEntry], model: CostModel, overrides: Optional[Overrides] = None):
        self.entries: List[PlanEntry] = list(entries)
        self.model = model
        self.overrides = overrides or Overrides()
        self._by_name = {e.name: e for e in self.entries}

    def __getitem__(self, name: str) -> PlanEntry:
        return self._by_name[name]

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def __iter__(self):
        return iter(self.entries)

    def __len__(self):
        return len(self.entries)

    def entry(self, name: str, numel: int) -> PlanEntry:
        """The plan for ``name``; planned from ``numel`` fp32 elements if not in the plan.

        A planned entry whose size disagrees with numel is re-planned (a stale plan).
        """
        e = self._by_name.get(name)
        if e is None or e.nbytes != 4 * int(numel):
            e = plan_one(name, 4 * int(numel), self.model, self.overrides)
            self._by_name[name] = e
        return e

    def regroup_uncompressed(self, names: Sequence[str], groups: Sequence[Tuple[str, int, int]]) -> None:
        """Replaces the entries of ``names`` (all planned uncompressed, consecutive) by one
        uncompressed entry per ``(name, bytes, gradients)`` of ``groups``, which cover the same
        bytes: the optimizer regroups such gradients into DDP's buckets after planning, one
        allreduce each. An entry of ``names`` that comes back under its name and size is kept;
        the others are planned by the model for their size (fp32 or bf16 on the wire, one
        partition)."""
        old = [self._by_name[n] for n in names]
        if not old or any(e.compress for e in old):
            raise ValueError(f"regroup_uncompressed: {list(names)} must be planned entries, none compressed")
        at = self.entries.index(old[0])
        if self.entries[at:at + len(old)] != old:
            raise ValueError(f"regroup_uncompressed: {list(names)} are not consecutive in the plan")
        if sum(nbytes for _, nbytes, _ in groups) != sum(e.nbytes for e in old):
            raise ValueError(f"regroup_uncompressed: the groups do not cover the bytes of {list(names)}")
        alone = dataclasses.replace(self.model, plain_fusion_bytes=0.0)  # each bucket is sent as it is
        kept = {e.name: e for e in old}
        new = []
        for name, nbytes, count in groups:
            e = kept.get(name)
            if e is None or e.nbytes != nbytes:
                pinned = dataclasses.replace(self.overrides, force={name: (False, 1)})
                e = dataclasses.replace(plan_one(name, nbytes, alone, pinned), reason=f"fused: {count} uncompressed")
            new.append(e)
        self.entries[at:at + len(old)] = new
        for n in names:
            del self._by_name[n]
        self._by_name.update((e.name, e) for e in new)

    def compress(self, name: str, numel: int) -> bool:
        return self.entry(name, numel).compress

    def bounds(self, name: str, numel: int) -> Bounds:
        """Partition bounds for a gradient of ``numel`` fp32 elements (what CaSync strategies take)."""
        return self.entry(name, numel).bounds(numel)

    def predicted_time(self) -> Tuple[float, float, float]:
        """(all uncompressed at best K, all compressed at best K, as planned), summed over entries."""
        return (sum(e.t_orig for e in self.entries), sum(e.t_cpr for e in self.entries),
                sum(e.t_pred for e in self.entries))

    def to_dicts(self) -> List[dict]:
        return [asdict(e) for e in self.entries]

    def table(self) -> str:
        return format_table(self.entries, self.model)


def make_plan(gradients: Union[Mapping[str, int], Sequence[Tuple[str, int]]], model: CostModel,
              overrides: Optional[Overrides] = None) -> Plan:
    """Plan every (name, bytes) gradient with ``model`` and ``overrides``."""
    items = list(gradients.items()) if isinstance(gradients, Mapping) else list(gradients)
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        raise ValueError("gradient names must be unique")
    return Plan((plan_one(n, b, model, overrides) for n, b in items), model, overrides)


def fastest_plan(gradients: Union[Mapping[str, int], Sequence[Tuple[str, int]]], models: Sequence[CostModel],
                 overrides: Optional[Overrides] = None) -> Plan:
    """The plan, among one per model (e.g. one per strategy, on the same profile), whose predicted
    time summed over the gradients is lowest; a tie goes to the first model listed."""
    if not models:
        raise ValueError("fastest_plan needs at least one model")
    plans = [make_plan(gradients, m, overrides) for m in models]
    return min(plans, key=lambda p: p.predicted_time()[2])  # min keeps the first of equals


# ---------------------------------------------------------------------------- printing
def fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.3g}{unit}"
    return f"{int(n)}B"


def _ms(t: float) -> str:
    return "-" if math.isinf(t) else f"{t * 1e3:.3f}"


def format_table(entries: Sequence[PlanEntry], model: CostModel) -> str:
    head = (f"# N={model.n} strategy={model.strategy} category={model.category} rate={model.rate:g}\n"
            f"# times are model predictions in ms; orig@K / cpr@K: best time without / with compression "
            f"and the K achieving it\n")
    cols = ("gradient", "size", "compress", "K", "orig ms", "@K", "cpr ms", "@K", "speedup", "by")
    rows = []
    for e in entries:
        sp = e.t_orig / e.t_pred if e.t_pred > 0 else 1.0
        rows.append((e.name, fmt_bytes(e.nbytes), "yes" if e.compress else ("bf16" if e.bf16 else "no"), str(e.k), _ms(e.t_orig),
                     str(e.k_orig), _ms(e.t_cpr), str(e.k_cpr) if not math.isinf(e.t_cpr) else "-",
                     f"{sp:.2f}x", e.reason))
    w = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    line = lambda r: "  ".join(x.ljust(w[i]) if i == 0 else x.rjust(w[i]) for i, x in enumerate(r))
    out = [line(cols), line(tuple("-" * x for x in w))] + [line(r) for r in rows]
    if entries:
        o = sum(e.t_orig for e in entries)
        p = sum(e.t_pred for e in entries)
        out.append(f"# total: never compress {o * 1e3:.3f} ms, as planned {p * 1e3:.3f} ms")
    return head + "\n".join(out)
