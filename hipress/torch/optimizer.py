"""``hipress.DistributedOptimizer``: Horovod-style wrapper around any torch optimizer.

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = hipress.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression="terngrad")   # strategy="auto"
    loss.backward(); opt.step()

How it works:
  1. The optimizer's class is swapped for a dynamic subclass of it (its state, param
     groups and defaults stay as they are), adding the methods below.
  2. Each parameter gets a post-accumulate-grad hook. When a gradient is final for
     this step (after ``backward_passes_per_step`` passes), the hook hands it to the
     chosen CaSync strategy, which submits encode/send/recv/decode/merge tasks to the
     engine and returns at once: synchronization overlaps the rest of backward.
  3. ``step()`` (through ``synchronize()``) submits the parameters whose hook did not
     fire (unused this step: zero gradient, so every rank runs the same collectives),
     waits for all tasks (bounded by ``HIPRESS_TIMEOUT_S``), then runs the wrapped
     optimizer's step.
  4. Non-finite gradients (``nonfinite=``, hipress/torch/nonfinite.py): each gradient is
     checked before it is clipped, momentum-corrected or compressed (a non-finite one is
     sent as zeros); every state is copied on first change in a step; ``synchronize()``
     agrees across ranks (one byte per parameter) and, if any rank saw NaN/Inf, undoes the
     step's state changes on every rank and skips the step (or raises) on every rank.
  5. Failures (docs/reliability.md): the configuration is compared across ranks at wrap time;
     a failed sync names the peers and the optimizer then waits for ``reset()``; ``join()``
     serves uneven inputs; ``requires_grad`` changes rebuild the buckets at the next step.
Semantics: every rank ends with decode(aggregate of decoded gradients) / N; bytes of
compressed gradients are never averaged.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
import json
import math
import time
import warnings
import zlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hipress import _C, config
from hipress import compression as _compression
from hipress.comm import coordinator, world
from hipress.comm.exchange import open_exchanges, waiting_words
from hipress.comm.transport.base import TransportError
from hipress.compression.base import is_f32_flat
from hipress.compression.none import NoneCompressor
from hipress.engine import Handle, get_engine
from hipress.planner import Overrides, Plan, chunk_bounds, fastest_plan, make_plan
from hipress.planner.online import profile_online
from hipress.planner.profile import Profile
from hipress.sync import STRATEGIES, StateStore, make_sync, resolve_strategy, use_local_aggregation
from hipress.sync.base import row_length
from hipress.torch import adasum, bucket_tuner, clipping, covap, dear, momentum, nonfinite, state_layout
from hipress.torch.collectives import Adasum
from hipress.torch.nonfinite import NonFiniteGradientError, NonFiniteGradientWarning  # noqa: F401 (re-exported)
from hipress.torch.plan_trial import CoordinatorTrial, PlanTrial

Average = "average"
Sum = "sum"
# Tensor fusion's bucket size (bucket_bytes="auto"). Uncompressed buckets go through the backend's
# collectives, one engine task and one call each, so fewer, larger ones win: DDP's 25 MiB
# (docs/benchmarks.md: uncompressed hipress at 10 Gbit/s, 0.79-0.82x DDP with 1 MiB buckets,
# 0.93-0.98x with 25 MiB; uncompressed dear, docs/dear.md: 0.79x with 1 MiB, 1.02x with 25 MiB).
# Compressed buckets stay smaller, so encoding starts early in backward: 4 MiB for a single-round
# compressor (docs/benchmarks.md, "Compressed buckets of 4 MiB": onebit PS and ring 7-18% faster
# than with 1 MiB on three models and two links, fewer payloads, messages and tasks), 1 MiB where
# buckets follow COVAP's filter or dear's phases, or where a bucket's partition shares one
# quantization scale (auto_bucket_bytes).
PLAIN_BUCKET_BYTES = 25 << 20
COMPRESSED_BUCKET_BYTES = 4 << 20
BUCKET_BYTES = 1 << 20
# A bucket of at least this many fp32 bytes per rank gets one partition per rank where the
# strategy spreads partitions (PS: one aggregator each; bucket_bounds). One aggregator for a
# large gradient receives N - 1 payloads and sends N - 1 while the other links idle; smaller
# buckets gain less than their extra partitions cost (docs/benchmarks.md, "One aggregator per
# rank for a large gradient": VGG19-like PS 1.29x at 1 Gbit/s; at 10 Gbit/s 1.01x, 0.96x with 1 MiB).
SPREAD_PARTITION_BYTES = 4 << 20


def auto_bucket_bytes(compression, strategy: str = "auto", planned: bool = False,
                      own_schedule: bool = False) -> Tuple[int, Optional[int]]:
    """bucket_bytes="auto": (bucket size, size of the first bucket of backward or None: as the
    others). DDP's rule, PLAIN_BUCKET_BYTES after a first bucket of BUCKET_BYTES (so the
    allreduce starts early in backward), for an uncompressed algorithm without a plan (dear's
    phases, COVAP with "none" inside and the coordinator too, beside which the backend's
    allreduce sums them). COMPRESSED_BUCKET_BYTES for a single-round compressor, with or without
    a plan (which then regroups the runs it leaves uncompressed as DDP's buckets:
    fuse_uncompressed), unless buckets follow a schedule of their ``own_schedule`` (COVAP's
    filter, dear's phases: measured with 1 MiB only) or it is a quantizer on a strategy whose
    partitions span tensors (the ring): each partition is then quantized on one scale, and larger
    buckets put more layers under it (char LM, 4 ranks, ring onebit, seeds 42/1/2: validation
    perplexity 19.6 with 1 MiB, 22.4 with 4 MiB, uncompressed 14.7; docs/benchmarks.md). Else
    BUCKET_BYTES throughout (a low-rank compressor's buckets count its factors' bytes: see
    fusion_buckets)."""
    comp = _compression.get(compression)
    if comp.name == "none":
        return (BUCKET_BYTES, None) if planned else (PLAIN_BUCKET_BYTES, BUCKET_BYTES)
    if own_schedule or comp.lowrank:
        return BUCKET_BYTES, None
    if comp.category == "quantization" and not splits_tensors(comp, resolve_strategy(strategy, comp, planned)):
        return BUCKET_BYTES, None
    return COMPRESSED_BUCKET_BYTES, None


# Bytes before the per-parameter ones in a row of the per-step agreement (_hp_agree).
_AGREE_HEADER = 4
# The per-step agreement's name, as a task and among the step's handles; the last step's, where
# it is waited for a step late (COVAP's local mode: _hp_agrees_late).
_AGREEMENT = "step agreement"
_LAST_AGREEMENT = "last step's agreement"
# Wrapped optimizers of this process, in wrapping order (the same on every rank): names join()'s store keys.
_wrapped = itertools.count()
# Bytes per rank of the configuration record compared at wrap time (_hp_check_same_configuration).
_WRAP_RECORD_BYTES = 4096


class _Bucket:
    """Gradients synchronised as one flat fp32 buffer (tensor fusion).

    A bucket of one fp32, contiguous CPU gradient syncs that gradient in place (no copy);
    otherwise each gradient is copied in when it is final and copied back after the sync
    (also how fp16/bf16 and non-CPU gradients are handled).
    A bucket that travels as bf16 (``send_bf16``: a plan's choice) has a bf16 buffer, ``wire``,
    instead: each gradient's copy into it is also its cast (one pass where two were), and the
    sync writes the average back into the gradients.
    """

    __slots__ = ("params", "name", "offsets", "numel", "segments", "in_place", "flat", "_views", "wire",
                 "_wire_views")

    def __init__(self, params, own_buffer: bool = False):
        self.params = params
        first, last = params[0][0], params[-1][0]
        self.name = first if len(params) == 1 else f"fused[{first}..{last}]"
        self.offsets, off = [], 0
        for _, p in params:
            self.offsets.append(off)
            off += p.numel()
        self.numel = off
        p0 = params[0][1]
        # where each gradient lies, with its shape (a low-rank sync compresses each matrix whole)
        self.segments = [(o, p.numel(), tuple(p.shape)) for o, (_, p) in zip(self.offsets, params)]
        self.in_place = (not own_buffer and len(params) == 1 and p0.dtype == torch.float32
                         and p0.device.type == "cpu")
        self.wire, self._wire_views = None, {}
        self._fp32_buffer()

    def _fp32_buffer(self) -> None:
        self.flat = None if self.in_place else torch.zeros(self.numel, dtype=torch.float32)
        # each gradient's place in the buffer, shaped like it: put/unpack are one copy each (this
        # runs once per gradient per step in backward, where every Python call shows)
        self._views = {} if self.in_place else {id(p): self.flat[o:o + p.numel()].view(p.shape)
                                                 for o, (_, p) in zip(self.offsets, self.params)}

    def send_bf16(self, on: bool) -> None:
        """From now on the bucket travels as bf16 (``on``; every parameter must be an fp32 CPU
        tensor) or as fp32: which buffer put() fills and ``sent`` names. Only that one is kept."""
        if on == (self.wire is not None):
            return
        if not on:
            self.wire, self._wire_views = None, {}
            self._fp32_buffer()
            return
        if not self.fp32_cpu:
            raise ValueError(f"bucket {self.name}: only fp32 CPU gradients are cast to bf16 in their copy")
        self.wire = torch.zeros(self.numel, dtype=torch.bfloat16)
        self._wire_views = {id(p): self.wire[o:o + p.numel()] for o, (_, p) in zip(self.offsets, self.params)}
        self.flat, self._views = None, {}

    @property
    def fp32_cpu(self) -> bool:
        """Whether every parameter is an fp32 CPU tensor: what send_bf16's cast in the copy takes."""
        return all(p.dtype == torch.float32 and p.device.type == "cpu" for _, p in self.params)

    @property
    def sent(self) -> torch.Tensor:
        """The buffer the sync sends: the bf16 one (send_bf16), else ``flat``."""
        return self.flat if self.wire is None else self.wire

    def put(self, p) -> bool:
        """p's final gradient into the bucket. True where its copy also found every element finite
        (an fp32 contiguous CPU gradient: one native pass), so the bucket's non-finite check,
        a second pass over it, can skip it; False where nothing was checked."""
        if self.wire is not None:  # cast in the copy; made contiguous first, as into() needs
            g = p.grad
            if not g.is_contiguous():
                p.grad = g = g.contiguous()
            return _C.ops_copy_finite_bf16(self._wire_views[id(p)].data_ptr(), g.data_ptr(), g.numel())
        if self.in_place:
            g = p.grad
            if not g.is_contiguous():
                p.grad = g = g.contiguous()
            self.flat = g.view(-1)
            return False
        g, view = p.grad, self._views[id(p)]
        if is_f32_flat(g):
            return _C.ops_copy_finite(view.data_ptr(), g.data_ptr(), g.numel())
        view.copy_(g)
        return False

    def unpack(self) -> None:
        for _, p in self.params:
            p.grad.copy_(self._views[id(p)])

    def _spans(self, s: int, e: int):
        """(parameter, its first and end element, where the piece starts in [s, e)) of each
        parameter's piece of the bucket's elements [s, e)."""
        for (off, n, _), (_, p) in zip(self.segments, self.params):
            lo, hi = max(s, off), min(e, off + n)
            if lo < hi:
                yield p, lo - off, hi - off, lo - s

    def param_values(self, s: int, e: int) -> torch.Tensor:
        """Elements [s, e) of the bucket's parameters (not gradients), as a new fp32 CPU tensor."""
        out = torch.empty(e - s, dtype=torch.float32)
        for p, lo, hi, at in self._spans(s, e):
            out[at:at + hi - lo].copy_(p.detach().reshape(-1)[lo:hi])
        return out

    def write_params(self, s: int, values: torch.Tensor, add: bool = False) -> None:
        """Parameters' elements [s, s + len(values)) of the bucket := ``values`` (+= with ``add``)."""
        with torch.no_grad():
            for p, lo, hi, at in self._spans(s, s + values.numel()):
                part = values[at:at + hi - lo].to(p.device, p.dtype)
                flat = p.view(-1) if p.is_contiguous() else p.reshape(-1).clone()
                if add:
                    flat[lo:hi].add_(part)
                else:
                    flat[lo:hi].copy_(part)
                if not p.is_contiguous():
                    p.copy_(flat.view_as(p))

    def into(self) -> Optional[List[Tuple[int, torch.Tensor]]]:
        """(offset, gradient) of each parameter, for a sync that writes its result into the
        gradients themselves (hipress.sync.allreduce: no unpack); None for a bucket synced in
        place (unless it travels as bf16: the average is always written back then), or where a
        gradient is not a contiguous fp32 CPU tensor (unpack converts those)."""
        if self.in_place and self.wire is None:
            return None
        grads = [p.grad for _, p in self.params]
        if any(g is None or not is_f32_flat(g) for g in grads):
            return None
        return list(zip(self.offsets, grads))


def final_gradient(name: str, p: torch.nn.Parameter, grad: Optional[torch.Tensor], clip, mc) -> torch.Tensor:
    """What is synced of p's final gradient of a step: zeros if p was unused (every rank then
    runs the same collectives), else the gradient clipped (``clip``); then momentum
    correction (``mc``). Changes ``grad`` in place and returns it. A function of its own
    because the convergence bench's reference simulator prepares gradients the same way."""
    if grad is None:
        grad = torch.zeros_like(p)
    elif clip is not None:
        clip(name, grad)
    if mc is not None:
        mc.apply(p, grad)
    return grad


def split_at(bounds: List[Tuple[int, int]], cuts: Sequence[int]) -> List[Tuple[int, int]]:
    """``bounds`` (consecutive [start, end) ranges) cut further at every offset in ``cuts``."""
    out = []
    for s, e in bounds:
        inner = sorted(c for c in set(cuts) if s < c < e)
        edges = [s] + inner + [e]
        out += list(zip(edges[:-1], edges[1:]))
    return out


def fill_like_ddp(items: list, nbytes, limit: int, first_limit: int) -> List[list]:
    """``items`` in order, grouped as DDP's Reducer fills its buckets: a group closes once its
    ``nbytes`` reach ``first_limit`` (the first group) or ``limit`` (the others), the item that
    crosses the size included; the last group holds what is left."""
    groups, cur, size = [], [], 0
    for it in items:
        cur.append(it)
        size += nbytes(it)
        if size >= (limit if groups else first_limit):
            groups.append(cur)
            cur, size = [], 0
    if cur:
        groups.append(cur)
    return groups


def fusion_buckets(named, compressor, bucket_bytes, own_buffers: bool = False,
                   first_bucket_bytes: Optional[int] = None) -> List[_Bucket]:
    """Tensor fusion: consecutive gradients, in reverse parameter order (roughly the order
    backward produces them), share one buffer, synced as one gradient. Buckets keep that
    order, so each is complete as early in backward as its gradients allow. A function of its
    own because the convergence bench's reference simulator (hipress/bench/simulate.py)
    compresses the same buckets. ``own_buffers``: every bucket syncs in a buffer of its own,
    never in the gradient (strategy "dear" keeps the reduced gradient past zero_grad()).

    Two rules:

    * ``first_bucket_bytes`` given (uncompressed buckets through the backend's allreduce): DDP's
      rule. A bucket closes once it holds ``first_bucket_bytes`` (the first of backward) or
      ``bucket_bytes`` (the others) or more, the gradient that crosses the size included.
      hipress's buckets are then DDP's, and the first one carries communication from the first
      moments of backward: with a closed-below-the-size rule, VGG19-like's first bucket was its
      last layer alone (22 KB) and the 8 MB layer before it waited for the convolutions, and
      BERT-like's 17 MB went as one bucket after backward (docs/benchmarks.md, "Buckets in
      DDP's layout").
    * otherwise (compressed buckets: the size caps what one exchange sends, so that encoding
      starts early in backward): gradients join a bucket while what it sends stays within
      ``bucket_bytes``; a gradient of ``bucket_bytes`` or more gets a bucket of its own (synced
      in place, no copy), after the bucket being filled is closed. What is sent is the gradient
      itself, except with a multi-round (low-rank) compressor, whose exchanges carry only the
      factors (each matrix of the bucket is still compressed whole): a ResNet50-like model's 161
      gradients then make one bucket rather than 8 (4 ranks on 2 cores: 0.59-0.64 s per step
      instead of 0.69-0.77)."""
    fuse = bool(bucket_bytes)
    order = [(name, p) for name, p in reversed(named) if p.requires_grad]
    if first_bucket_bytes and fuse:
        groups = fill_like_ddp(order, lambda item: 4 * item[1].numel(), bucket_bytes, first_bucket_bytes)
        return [_Bucket(g, own_buffers) for g in groups]
    groups, cur, cur_bytes = [], [], 0

    def close():
        nonlocal cur, cur_bytes
        if cur:
            groups.append(cur)
        cur, cur_bytes = [], 0

    for name, p in order:
        nbytes = 4 * p.numel()
        if not fuse or nbytes >= bucket_bytes:
            close()
            groups.append([(name, p)])
            continue
        sent = compressor.max_encoded_bytes(p.numel(), tuple(p.shape)) if compressor.lowrank else nbytes
        if cur and cur_bytes + sent > bucket_bytes:
            close()
        cur.append((name, p))
        cur_bytes += sent
    close()
    return [_Bucket(g, own_buffers) for g in groups]


def fuse_uncompressed(buckets: List[_Bucket], plan, limit: int, first_limit: int = BUCKET_BYTES) -> List[_Bucket]:
    """After planning: runs of consecutive buckets the plan leaves uncompressed are regrouped,
    since they go through the backend's allreduce, where fewer, larger calls win
    (PLAIN_BUCKET_BYTES), the plan's entries regrouped to match. A run's gradients fill buckets
    as DDP's do (fusion_buckets' plain rule, fill_like_ddp): a bucket closes once it holds
    ``limit`` bytes or more, the first bucket of backward ``first_limit``, the gradient that
    crosses included. So the first one carries communication from early in backward (BERT-like's
    4 MB output layer, where a first bucket of its 32 KB bias alone left the other 17 MB to go
    after backward), whatever size the plan's buckets had (a plan over 4 MiB buckets that
    compresses none of them gets DDP's 1 MiB first bucket). Compressed buckets stay as they are
    and end a run; a bucket that comes back with the same gradients is kept (in place where it
    was)."""
    out: List[_Bucket] = []
    run: List[_Bucket] = []

    def flush():
        if not run:
            return
        same = {tuple(n for n, _ in b.params): b for b in run}
        params = [np for b in run for np in b.params]
        groups = fill_like_ddp(params, lambda item: 4 * item[1].numel(), limit, limit if out else first_limit)
        new = [same.get(tuple(n for n, _ in g)) or _Bucket(g) for g in groups]
        plan.regroup_uncompressed([b.name for b in run], [(b.name, 4 * b.numel, len(b.params)) for b in new])
        out.extend(new)
        run.clear()

    for b in buckets:
        if plan.entry(b.name, b.numel).compress:
            flush()
            out.append(b)
        else:
            run.append(b)
    flush()
    return out


def split_evenly(items: list, n: int) -> List[list]:
    """items cut into n consecutive runs whose lengths differ by at most one (longer ones
    first), empty runs dropped: Horovod's ``groups=n``."""
    q, r = divmod(len(items), n)
    runs, start = [], 0
    for i in range(n):
        end = start + q + (1 if i < r else 0)
        runs.append(items[start:end])
        start = end
    return [run for run in runs if run]


def explicit_groups(named, groups) -> List[list]:
    """``groups`` (Horovod's ``DistributedOptimizer(groups=...)``) as lists of (name, parameter)
    in the optimizer's order, checked: an int n >= 1 (the parameters that need a gradient, in
    the optimizer's order, cut into n runs), or a list of lists of this optimizer's parameters,
    none twice (parameters that need no gradient are left out, as Horovod does; the parameters in
    no group are not in the result)."""
    trainable = [(n, p) for n, p in named if p.requires_grad]
    if isinstance(groups, bool) or not isinstance(groups, (int, list)):
        raise ValueError(f"groups must be a positive int or a list of lists of parameters, got {type(groups).__name__}")
    if isinstance(groups, int):
        if groups < 1:
            raise ValueError(f"groups (or num_groups) must be >= 1, got {groups}")
        return split_evenly(trainable, groups)
    position = {id(p): i for i, (_, p) in enumerate(named)}
    seen: set = set()
    out = []
    for g, group in enumerate(groups):
        if not isinstance(group, (list, tuple)):
            raise ValueError(f"groups[{g}] must be a list of parameters, got {type(group).__name__}")
        for p in group:
            if not isinstance(p, torch.Tensor):
                raise ValueError(f"groups[{g}] holds a {type(p).__name__}; groups must consist of torch.Tensor")
            if id(p) not in position:
                raise ValueError(f"groups[{g}] holds a tensor of shape {tuple(p.shape)} that is not a parameter "
                                 f"of this optimizer")
            if id(p) in seen:
                raise ValueError(f"parameter '{named[position[id(p)]][0]}' appears twice in groups; "
                                 f"a parameter can only be in one group")
            seen.add(id(p))
        # the optimizer's order inside a group, so every rank fills the buffer alike
        members = sorted((position[id(p)] for p in group if p.requires_grad))
        if members:
            out.append([named[i] for i in members])
    return out


def splits_tensors(compressor, strategy: str) -> bool:
    """Whether each tensor of a fused bucket gets partitions (payloads) of its own.

    A quantizer's levels come from its payload's values (onebit's scale, TernGrad's range):
    where partitions cost no messages, each tensor of a fused bucket gets payloads of its
    own, so a layer is not quantized on the scale of another (onebit, digits, 4 ranks,
    allgather: 85.9% -> 92.6%, docs/convergence.md)."""
    return compressor.category == "quantization" and STRATEGIES[strategy].frames_partitions


def bucket_bounds(bucket: _Bucket, partition_bytes: Optional[int], split_tensors: bool,
                  spread: int = 1) -> List[Tuple[int, int]]:
    """The partitions of a bucket without a plan: as many as make each at most
    ``partition_bytes`` (None or 0: one, whatever ``spread``), and at least one per rank of the
    ``spread`` (Sync.spread: PS's aggregators) that keeps each of SPREAD_PARTITION_BYTES; cut at
    whole rows (at_rows), and at its tensors' boundaries if ``split_tensors``. Functions of their own (with
    :func:`fusion_buckets`) because the convergence bench's reference simulator compresses the
    same partitions."""
    numel = bucket.numel
    k = max(1, math.ceil(4 * numel / partition_bytes), min(spread, 4 * numel // SPREAD_PARTITION_BYTES)) \
        if partition_bytes else 1
    bounds = at_rows(chunk_bounds(numel, max(1, min(k, numel))), bucket.segments)
    return split_at(bounds, [off for off, _, _ in bucket.segments]) if split_tensors else bounds


def at_rows(bounds: List[Tuple[int, int]], segments) -> List[Tuple[int, int]]:
    """``bounds`` with every cut inside a tensor of two or more rows moved to its nearest row
    boundary, so that a partition of one matrix is whole rows (partition_shape: onebit's per-row
    scales); cuts that meet leave one partition fewer."""
    cuts = []
    for _, c in bounds[:-1]:
        for off, numel, shape in segments:
            row = row_length(numel, shape) if off < c < off + numel else 0
            if row and row < numel:  # two rows or more
                c = off + round((c - off) / row) * row
                break
        cuts.append(c)
    edges = [bounds[0][0]] + sorted(set(cuts)) + [bounds[-1][1]]
    return [(s, e) for s, e in zip(edges[:-1], edges[1:]) if e > s]


def _resolve_named_parameters(optimizer, named_parameters) -> List[Tuple[str, torch.nn.Parameter]]:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if named_parameters is None:
        return [(f"param.{i}", p) for i, p in enumerate(params)]
    named = list(named_parameters)
    if any(not isinstance(t, tuple) or len(t) != 2 for t in named):
        raise ValueError("named_parameters must be an iterable of (name, parameter) tuples, "
                         "e.g. model.named_parameters()")
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"named_parameters has duplicate names: {dups}")
    by_id = {id(p): n for n, p in named}
    missing = [i for i, p in enumerate(params) if id(p) not in by_id]
    if missing:
        raise ValueError(f"named_parameters does not name {len(missing)} parameter(s) of the optimizer "
                         f"(indices {missing[:10]} in param_groups order)")
    # Keep the optimizer's parameter order: it is the order every rank submits in.
    return [(by_id[id(p)], p) for p in params]


@dataclasses.dataclass(frozen=True)
class Options:
    """The choices of one ``DistributedOptimizer`` (see its docstring), checked on creation."""

    compression: object = "none"          # algorithm name or Compressor instance
    compression_kwargs: dict = dataclasses.field(default_factory=dict)
    strategy: str = "auto"
    backward_passes_per_step: int = 1
    op: str = Average
    partition_bytes: Optional[int] = 64 << 20
    local_aggregation: object = "auto"
    plan: object = None
    coordinator: object = None            # True, False, "auto" (measured: CoordinatorTrial); None: HIPRESS_COORDINATOR
    bucket_bytes: object = "auto"          # an int, None, "auto" (auto_bucket_bytes) or "tune"
    grad_clip: object = "auto"            # hipress.torch.clipping: "auto" (none), "paper", None or a callable
    momentum_correction: object = "auto"  # hipress.torch.momentum: "auto", True or False
    covap: Optional[dict] = None          # compression="covap": hipress.torch.covap.Run's arguments
    nonfinite: str = "skip"               # hipress.torch.nonfinite: "skip", "raise" or "off"
    gradient_predivide_factor: float = 1.0  # Horovod's: op=Average as (sum of g / f) * f / size
    groups: object = None                 # Horovod's: None, an int, or lists of parameters (explicit_groups)
    sparse_as_dense: bool = False         # Horovod's: sparse gradients densified and synchronized
    bucket_tune: Optional[dict] = None    # bucket_bytes="tune": the tuner's knobs (hipress/torch/bucket_tuner.py)
    # derived from bucket_bytes="auto" (auto_bucket_bytes): the first bucket's size (None: as the
    # others); with a plan, runs of buckets it leaves uncompressed are fused up to plain_fusion_bytes
    # after planning, all but the first bucket (fuse_uncompressed); 0: no such fusion
    first_bucket_bytes: Optional[int] = None
    plain_fusion_bytes: int = 0

    @property
    def tune(self) -> bool:
        """bucket_bytes="tune": the size searched online (hipress/torch/bucket_tuner.py)."""
        return self.bucket_bytes == "tune"

    @property
    def dear(self) -> bool:
        """strategy="dear" (hipress/torch/dear.py): the ring's phases one iteration apart."""
        return self.strategy == "dear"

    def __post_init__(self):
        if self.backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {self.backward_passes_per_step}")
        if self.op not in (Average, Sum):
            raise ValueError(f"op must be hipress.Average, hipress.Sum or hipress.Adasum, got {self.op!r}")
        nonfinite.resolve(self.nonfinite)
        f = self.gradient_predivide_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f <= 0:
            raise ValueError(f"gradient_predivide_factor must be a positive finite number, got {f!r}")
        if f != 1.0 and self.op != Average:
            raise ValueError(f"gradient_predivide_factor is only supported with op=hipress.Average "
                             f"(as in Horovod), got op={self.op!r}")
        if self.compression == "covap":  # a filter around the inner algorithm (hipress/torch/covap.py)
            mine, inner, rest = covap.split_options(self.compression_kwargs)
            object.__setattr__(self, "covap", mine)
            object.__setattr__(self, "compression", inner)
            object.__setattr__(self, "compression_kwargs", rest)
        planned = self.compression == "auto"
        if planned:  # TernGrad (docs/convergence.md: the 16x quantizer that keeps uncompressed
            # accuracy), compressed only where the planner says it pays
            object.__setattr__(self, "compression", "terngrad")
            object.__setattr__(self, "plan", self.plan if self.plan is not None else "auto")
        if self.coordinator is None:
            # HIPRESS_COORDINATOR, else: where the planner chooses, measured on and off (after its plan;
            # not beside the other searches, below), and off elsewhere
            env = config.get("HIPRESS_COORDINATOR")
            measured = planned and not (self.tune or self.dear)
            object.__setattr__(self, "coordinator", env if env is not None else "auto" if measured else False)
        if self.coordinator not in (True, False, "auto") or not isinstance(self.coordinator, (bool, str)):
            raise ValueError(f"coordinator must be True, False or 'auto', got {self.coordinator!r}")
        if self.coordinator == "auto":
            # COVAP's own choices, the tuner's rebuilt buckets and dear's phases would each need
            # measuring against both modes; plan="auto"'s choice comes first (_hp_coord_trial_step).
            other = [name for name, on in (("compression='covap'", self.covap is not None),
                                           ("bucket_bytes='tune'", self.tune), ("strategy='dear'", self.dear)) if on]
            if other:
                raise ValueError(f"coordinator='auto' measures the coordinator on and off while training; it cannot "
                                 f"be combined with {', '.join(other)}: use coordinator=True or False with it")
        if self.bucket_tune is not None and not self.tune:
            raise ValueError(f"bucket_tune= configures bucket_bytes='tune'; got bucket_bytes={self.bucket_bytes!r}")
        if self.tune:
            object.__setattr__(self, "bucket_tune", bucket_tuner.check_knobs(self.bucket_tune))
            # What rebuilding buckets cannot follow: a plan's and COVAP's decisions are per bucket,
            # made once; Horovod's groups fix the buckets by hand.
            fixed = [name for name, on in (("plan=", self.plan is not None), ("compression='covap'", self.covap is not None),
                                           ("groups=", self.groups is not None)) if on]
            if fixed:
                raise ValueError(f"bucket_bytes='tune' rebuilds the fusion buckets while training; {', '.join(fixed)} "
                                 f"fix(es) them: use a fixed bucket_bytes with it")
        if self.bucket_bytes == "auto":
            # COVAP (its compression is now the inner algorithm) filters fused buckets: with "none" inside,
            # DDP's buckets, as in its paper (units are those buckets, sharded by the median rule)
            size, first = auto_bucket_bytes(self.compression, self.strategy, self.plan is not None,
                                             self.covap is not None or self.dear)
            object.__setattr__(self, "bucket_bytes", size)
            object.__setattr__(self, "first_bucket_bytes", first)
            if self.plan is not None and self.groups is None:
                object.__setattr__(self, "plain_fusion_bytes", PLAIN_BUCKET_BYTES)
        if self.dear:
            if self.plan is not None:
                raise ValueError("strategy='dear' runs the ring's phases on every bucket; plan= (which picks a "
                                 "sync per bucket) cannot be combined with it")
            if self.covap is not None:
                raise ValueError("strategy='dear' and compression='covap' both reschedule synchronization; use one")
            if self.local_aggregation is True:
                raise ValueError("strategy='dear' runs one flat ring over all ranks; local_aggregation=True "
                                 "(a hierarchical sync) cannot be combined with it")
            if self.gradient_predivide_factor != 1.0 or self.sparse_as_dense:
                # dear updates from its own buffers in the next forward, after the hooks that
                # post-scale or re-sparsify .grad have run
                raise ValueError("strategy='dear' does not support gradient_predivide_factor or sparse_as_dense")


class _HipressOptimizer:
    """Methods mixed into the dynamic subclass (see module docstring)."""

    def _hipress_setup(self, named, options: Options, model: Optional[torch.nn.Module] = None):
        world.init()
        self._hp_transport = world.transport()
        device = getattr(self._hp_transport, "device", None)
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"the {self._hp_transport.name} transport moves {torch.device(device).type} buffers only, "
                             f"but hipress's gradient payloads are CPU tensors; use HIPRESS_TRANSPORT=torch or mpi")
        comp = options.compression
        self._hp_compressor = _compression.get(comp, **options.compression_kwargs) if isinstance(comp, str) else comp
        if options.dear and self._hp_compressor.lowrank:
            raise ValueError(f"strategy='dear' uses the ring's phases, which carry partitions of single-round "
                             f"compressors only; {self._hp_compressor.name!r} is low-rank (whole matrices)")
        self._hp_strategy_name = ("ring" if options.dear
                                  else resolve_strategy(options.strategy, self._hp_compressor, options.plan is not None))
        # strategy "auto" under a plan: PS or allgather, whichever plan the model predicts faster
        # (_hp_make_plans; both priced on PS's profile: allgather's exchange is PS's with N aggregators)
        self._hp_choose_strategy = (options.strategy == "auto" and options.plan is not None and not options.dear
                                    and self._hp_strategy_name == "ps")
        self._hp_clip = clipping.resolve(options.grad_clip, self._hp_compressor.name)
        self._hp_names = {id(p): n for n, p in named}
        self._hp_momentum = (momentum.MomentumCorrection(self, self._hp_names,
                                                         velocity=not momentum.in_compressor(self._hp_compressor))
                             if momentum.resolve(options.momentum_correction, self, self._hp_compressor) else None)
        self._hp_average = options.op == Average
        self._hp_hierarchical = (not options.dear
                                 and use_local_aggregation(options.local_aggregation, world.hostnames()))
        self._hp_named = named
        self._hp_tuner = self._hp_make_tuner(options) if options.tune else None
        self._hp_bucket_bytes = self._hp_tuner.size if self._hp_tuner is not None else options.bucket_bytes
        self._hp_first_bucket_bytes = options.first_bucket_bytes
        self._hp_groups = options.groups
        self._hp_own_buffers = options.dear
        self._hp_buckets = self._hp_build_buckets()
        # before anything collective that depends on the options (the coordinator, the planner)
        self._hp_check_same_configuration(options)
        engine = get_engine()
        self._hp_exchanges = open_exchanges(engine, coordinated=options.coordinator is True)
        # coordinator="auto": the direct exchanges first, then the coordinated ones (opened at the
        # switch), the faster kept (plan_trial.CoordinatorTrial, _hp_use_coordinator)
        self._hp_coord_trial = (CoordinatorTrial(config.get("HIPRESS_COORDINATOR_TRIAL_STEPS"))
                                if options.coordinator == "auto" and world.size() > 1 else None)
        self._hp_direct = self._hp_exchanges if self._hp_coord_trial is not None else None
        self._hp_coordinated = None
        self._hp_states = StateStore(world.rank())
        # Non-finite gradients (hipress/torch/nonfinite.py): checked per gradient, states logged
        # copy-on-write, agreed on in synchronize()
        self._hp_nonfinite = options.nonfinite
        self._hp_guard = options.nonfinite != "off"
        self._hp_states.undo_log.enabled = self._hp_guard
        if self._hp_momentum is not None:
            self._hp_momentum.undo_log.enabled = self._hp_guard
        self._hp_bad: set = set()  # ids of parameters whose gradient was not finite here this step
        self._hp_skip_step = False
        # COVAP's local mode: the last step's agreement, waited for in this step (_hp_agrees_late)
        self._hp_late_agreement: Optional[Handle] = None
        # the per-step agreement's own channel where the backend has one (_hp_agree)
        self._hp_control = world.control_transport() if self._hp_guard else None
        self.last_nonfinite: Dict[str, List[int]] = {}

        def sync_for(compressor, wire=torch.float32):  # uncompressed: the backend's collectives (under dear
            # its alltoallv and allgatherv as the two phases); wire: the dtype uncompressed gradients travel in
            return make_sync(engine, self._hp_exchanges, compressor, self._hp_strategy_name, self._hp_states,
                             self._hp_average, self._hp_hierarchical, world.size(), world.local_rank() == 0,
                             wire=wire)

        self._hp_sync_for = sync_for
        self._hp_split_tensors = splits_tensors(self._hp_compressor, self._hp_strategy_name)
        # Compressed and plain gradients share the exchanges, so communication keeps one order per rank.
        self._hp_compressed = sync_for(self._hp_compressor)
        self._hp_plain = sync_for(NoneCompressor()) if options.plan is not None else self._hp_compressed
        self._hp_engine = engine
        self._hp_predivide = float(options.gradient_predivide_factor)
        self._hp_sparse_as_dense = options.sparse_as_dense
        self._hp_densified: set = set()  # ids of parameters whose sparse gradient was made dense this step
        self._hp_plan = None
        # runs of a plan's uncompressed buckets fused for the backend's allreduce; not where hipress's
        # ring sums them (under the coordinator where the backend has no allreduce beside it)
        plain = getattr(self._hp_plain.strategy, "cross", self._hp_plain.strategy)
        self._hp_fusion_bytes = options.plain_fusion_bytes if plain.name == "allreduce" else 0
        # the candidate plans by name ("model"; with a measured choice also "plain", maybe "all") and the trial
        # that measures them (hipress/torch/plan_trial.py), as made: each use fuses a copy
        self._hp_plans: Dict[str, Plan] = {}
        self._hp_trial: Optional[PlanTrial] = None
        # the profile a plan= made from the model was planned from: a checkpoint holds it, so a
        # resumed job plans from the same measurements (the compressor states belong to that plan)
        self._hp_plan_profile: Optional[Profile] = None
        self._hp_plan_option = options.plan
        if options.plan is not None:
            self._hp_plans, self._hp_trial = self._hp_make_plans(options.plan, self._hp_fusion_bytes)
            self._hp_buckets = self._hp_plan_layout(self._hp_trial.in_use if self._hp_trial is not None else "model")
        # a plan's uncompressed buckets that travel as bf16 (hipress.sync.allreduce; not where the
        # plain sync is another, as under the coordinator: CostModel.offers_bf16)
        self._hp_plain16 = (sync_for(NoneCompressor(), torch.bfloat16)
                            if self._hp_plan is not None and self._hp_plan.model.offers_bf16 else None)
        if self._hp_coord_trial is not None:
            # coordinator="auto" with nothing for the coordinator to batch, or a plan whose uncompressed
            # buckets' allreduce cannot run beside it: off, unmeasured
            model = self._hp_plans.get("model")
            if self._hp_compressor.name == "none" or (model is not None and (
                    not any(e.compress for e in model) or not self._hp_transport.concurrent_splits)):
                self._hp_coord_trial.settle("off")
        self._hp_covap = self._hp_make_covap(options.covap) if options.covap is not None else None
        self._hp_passes = options.backward_passes_per_step
        self._hp_partition_bytes = options.partition_bytes
        self._hp_counts: Dict[int, int] = {}
        self._hp_taken: set = set()  # ids of parameters whose gradient is in a bucket this step
        self._hp_handles: Dict[str, Handle] = {}
        # COVAP's local mode: the parameter averages this step started, and those of the last
        # step, which this step applies (covap.Average)
        self._hp_averaging: List["covap.Average"] = []
        self._hp_averaged: List["covap.Average"] = []
        if self._hp_covap is not None:
            world.on_quiesce(self._hp_wait_averages)
        self._hp_skip = False
        self._hp_synchronized = False
        # Timeline row 2 shows when each gradient became ready, next to the queues.
        self._hp_mark_ns = _C.now_ns()
        self._hp_timeline = engine.timeline_enabled  # set when the engine starts (HIPRESS_TIMELINE)
        if self._hp_timeline:
            engine.timeline_row(2, "backward (gradient ready)")
        # before any hook is registered: it refuses parameters no module of the model holds
        self._hp_dear = None
        if options.dear:
            trace = None
            if self._hp_timeline:  # row 3: where dear's forward and step() wait for the link
                engine.timeline_row(3, "dear (waits, updates)")
                trace = functools.partial(engine.timeline_slice, 3)
            self._hp_dear = dear.Schedule(self._hp_buckets, model, self._hp_names, self._hp_dear_update,
                                          self._hp_waiting_for, trace)
        self._hp_index_buckets()
        self._hp_trainable = tuple(p.requires_grad for _, p in named)  # the set the buckets were built for
        self._hp_hooks = {id(p): p.register_post_accumulate_grad_hook(self._hp_on_grad)
                          for _, p in named if p.requires_grad}
        self._hp_failure: Optional[str] = None  # a failed sync's error, until reset()
        self._hp_joined = False  # in join()
        self._hp_steps = 0  # synchronizations finished (successful or skipped): the same count on every rank
        self._hp_skipped = 0  # steps not taken for non-finite gradients (every rank alike but in COVAP's local
        # mode, _hp_skip_locally): the tuner skips them
        self._hp_skipped_seen = 0
        # residuals handed back (a rebuild, a plan switch, COVAP's new units, a checkpoint of another
        # layout), per parameter id, added to the next step's gradients (_hp_take); once added they
        # wait in _hp_carry_sent until that step commits (dropped) or is undone (back in the carry)
        self._hp_carry: Dict[int, torch.Tensor] = {}
        self._hp_carry_sent: Dict[int, torch.Tensor] = {}
        self._hp_uid = next(_wrapped)
        self._hp_joins = 0  # join() calls so far

    def _hp_make_tuner(self, options: Options) -> "bucket_tuner.BucketTuner":
        """bucket_bytes="tune": checks that rebuilt buckets can keep the compressor's state, then
        the tuner over [min_bytes, min(max_bytes, bytes of the trainable gradients)]."""
        comp = self._hp_compressor
        if comp.lowrank:
            raise ValueError(f"bucket_bytes='tune' needs compression 'none' or a single-round algorithm; "
                             f"{comp.name!r} is low-rank (its state is per matrix, kept across steps)")
        other = self._hp_unmovable_state()  # refused rather than lost
        if other:
            raise ValueError(f"bucket_bytes='tune' rebuilds buckets and hands error-feedback residuals back to the "
                             f"gradients; {comp.name!r} keeps other per-element state ({', '.join(other)}) that would "
                             f"be lost: use a fixed bucket_bytes with it")
        model_bytes = sum(4 * p.numel() for _, p in self._hp_named if p.requires_grad)
        return bucket_tuner.BucketTuner(model_bytes, options.bucket_tune)

    @property
    def bucket_tuner(self) -> Optional["bucket_tuner.BucketTuner"]:
        """bucket_bytes="tune": the tuner (``size``, ``done``, ``history`` of (bytes, seconds per
        step of the slowest rank), ``best``, ``summary()``); None otherwise."""
        return self._hp_tuner

    def _hp_make_plans(self, plan, fusion_bytes: int = 0,
                       prof: Optional[Profile] = None) -> Tuple[Dict[str, Plan], Optional[PlanTrial]]:
        """plan: a Plan, "auto" (profile now, collectively, unless ``prof`` is given: a checkpoint's),
        an Overrides, or a dict of Overrides' fields (as from JSON). The profile planned from is kept
        (_hp_plan_profile). fusion_bytes: what runs of uncompressed buckets are fused to, which
        the model prices them at (CostModel.plain_fusion_bytes), at most all the buckets' bytes.
        Returns the candidate plans and the trial that chooses between them (plan_trial.py): with
        Overrides.measure, where the model's plan compresses something, there are more than one
        rank, and the compressor's state can be handed from plan to plan (error-feedback
        residuals only), the model's plan, the one that compresses nothing and, where the model's
        plan leaves buckets uncompressed that no pin keeps so, the one that compresses them too;
        else the model's plan alone and no trial."""
        if isinstance(plan, Plan):
            return {"model": plan}, None
        if isinstance(plan, dict):
            fields = {f.name for f in dataclasses.fields(Overrides)}
            if set(plan) - fields:
                raise ValueError(f"plan: unknown field(s) {sorted(set(plan) - fields)}; Overrides has {sorted(fields)}")
            plan = Overrides(**plan)
        overrides = plan if isinstance(plan, Overrides) else Overrides()
        if not isinstance(plan, Overrides) and plan != "auto":
            raise ValueError(f"plan must be 'auto', a hipress.planner.Plan or Overrides, got {plan!r}")
        if self._hp_compressor.lowrank or self._hp_compressor.name == "none":
            raise ValueError(f"plan='auto' needs a single-round compressor, got {self._hp_compressor.name!r}")
        # Profiled over the world ring (its slowest link is the one that matters), by every
        # rank, so all ranks hold the same plan; N is the number of peers of the compressed sync.
        if prof is None:
            prof = profile_online(self._hp_compressor, self._hp_transport,
                                  "ps" if self._hp_choose_strategy else self._hp_strategy_name)
        self._hp_plan_profile = prof
        n_sync = len(set(world.hostnames())) if self._hp_hierarchical else world.size()
        plain = getattr(self._hp_plain.strategy, "cross", self._hp_plain.strategy)  # across hosts, if hierarchical
        plain_allreduce = plain.name == "allreduce"
        kw = dict(n=n_sync, plain_allreduce=plain_allreduce,
                  plain16=torch.bfloat16 in self._hp_transport.allreduce_dtypes,
                  plain_fusion_bytes=min(fusion_bytes, sum(4 * b.numel for b in self._hp_buckets))
                  if plain_allreduce else 0)
        sizes = [(b.name, 4 * b.numel) for b in self._hp_buckets]
        if self._hp_choose_strategy:  # allgather first: a tie goes to it (it never re-encodes)
            plans = {"model": fastest_plan(sizes, [prof.cost_model(strategy=s, **kw) for s in ("allgather", "ps")],
                                           overrides)}
            self._hp_use_strategy(plans["model"].model.strategy)
        else:
            plans = {"model": make_plan(sizes, prof.cost_model(**kw), overrides)}
        model = plans["model"].model
        if (not overrides.measure or self._hp_transport.size == 1 or self._hp_unmovable_state()
                or not any(e.compress for e in plans["model"])):
            return plans, None
        plans["plain"] = make_plan(sizes, model, dataclasses.replace(overrides, max_compress_bytes=0, force={}))
        left = {e.name: True for e in plans["model"] if not e.compress and e.reason == "model"}  # not pinned
        if left:
            plans["all"] = make_plan(sizes, model, dataclasses.replace(overrides, force={**overrides.force, **left}))
        return plans, PlanTrial(overrides.measure, candidates=[c for c in PlanTrial.CANDIDATES if c in plans])

    def _hp_use_strategy(self, name: str) -> None:
        """Compressed buckets sync with strategy ``name`` from now on (strategy "auto" under a plan:
        the planner's choice, made again from a checkpoint's profile before its states load)."""
        if name != self._hp_strategy_name:
            self._hp_strategy_name = name
            self._hp_compressed = self._hp_sync_for(self._hp_compressor)

    def _hp_plan_layout(self, name: str) -> List["_Bucket"]:
        """Puts the candidate plan ``name`` in force (a copy: fusing merges its entries) and
        returns buckets built for it, runs of its uncompressed buckets fused (fuse_uncompressed).
        Momentum correction, an aid to compression, is limited to the parameters of the buckets it
        compresses; the others keep the wrapped SGD's own momentum (the same sum, momentum being
        linear), without a velocity of hipress's, its pass per step or its undo copy."""
        self._hp_plan = copy.deepcopy(self._hp_plans[name])
        buckets = self._hp_build_buckets()
        if self._hp_fusion_bytes:
            buckets = fuse_uncompressed(buckets, self._hp_plan, self._hp_fusion_bytes)
        if self._hp_momentum is not None:
            self._hp_momentum.limit_to({id(p) for b in buckets if self._hp_plan.entry(b.name, b.numel).compress
                                        for _, p in b.params})
        return buckets

    def _hp_unmovable_state(self) -> List[str]:
        """The compressor's per-element state other than error-feedback residuals (DGC's and
        Signum's momentum): a rebuild of the buckets (bucket_bytes="tune", a plan switch) hands
        residuals back to the gradients (_hp_hand_back), and so does a checkpoint of another
        layout (_hp_load_states), but neither has a home for these."""
        return state_layout.unmovable_buffers(self._hp_compressor)

    def _hp_make_covap(self, args) -> "covap.Run":
        if self._hp_compressor.lowrank:
            raise ValueError(f"compression='covap' filters whole buckets; its inner algorithm must be single-round, "
                             f"not low-rank, got {self._hp_compressor.name!r}")
        if self._hp_plan is not None:
            raise ValueError("compression='covap' and plan= both choose what to send; use one")
        run = covap.Run({b.name: b.numel for b in self._hp_buckets}, **args)
        # wire "bf16": the local mode's averages as bf16 differences, where the backend sums bf16
        self._hp_covap_sync16 = covap.bf16_sync(self._hp_compressed) if run.refs is not None else None
        run.on_filter = self._hp_reserve_units
        self._hp_covap_reserved: Optional["covap.Filter"] = None
        if run.filter is not None:
            self._hp_reserve_units(run.filter)
        return run

    def _hp_reserve_units(self, filt: "covap.Filter") -> None:
        """A COVAP filter is made (at start, after each profile, from a checkpoint): the units
        of the last one that it gives other ranges (another interval shards otherwise) hand their
        inner compressor states' residuals back to the gradients, as a rebuild does; then every
        unit is declared."""
        filt.undo_log.enabled = self._hp_guard
        for name, t, r in covap.changed_units(self._hp_covap_reserved, filt):
            self._hp_take_to_carry(self._hp_bucket_named[name], self._hp_compressed.state_spans(f"{name}/u{t}", [r]))
        self._hp_covap_reserved = filt
        # every unit declared in unit order, so its sync's choices (PS aggregators) do not
        # depend on which units happen to be sent first
        for name, units in filt.units.items():
            for t, r in units:
                self._hp_compressed.reserve(f"{name}/u{t}", [r])

    @property
    def covap_profile(self) -> Optional["covap.Profile"]:
        """compression="covap": the profiler's figures and the interval (None before it ran)."""
        return self._hp_covap.profile if self._hp_covap is not None else None

    def covap_reprofile(self) -> None:
        """compression="covap": measure CCR again over the next steps and reset the interval."""
        if self._hp_covap is None:
            raise RuntimeError("covap_reprofile() needs compression='covap'")
        self._hp_covap.reprofile()

    # ------------------------------------------------------------------ checks
    def _hp_wrap_fields(self, options: Options) -> Dict[str, str]:
        """What every rank must agree on, readable: the parameters (as a digest: names, shapes,
        dtypes) and every choice that changes which collectives a step runs or what they carry."""
        sig = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in self._hp_named).encode()
        return {
            "parameters": f"{len(self._hp_named)} parameters, digest {zlib.crc32(sig):08x}",
            "compression": self._hp_compressor.name,
            "compression kwargs": repr(sorted(options.compression_kwargs.items())),
            "strategy": self._hp_strategy_name,
            "bucket layout": f"{len(self._hp_buckets)} buckets, digest "
                             f"{zlib.crc32(';'.join(f'{b.name}:{b.numel}' for b in self._hp_buckets).encode()):08x}",
            "partition_bytes": repr(options.partition_bytes),
            "backward_passes_per_step": repr(options.backward_passes_per_step),
            "op": options.op,
            "nonfinite": options.nonfinite,
            "local aggregation": repr(self._hp_hierarchical),
            "coordinator": repr(options.coordinator),
            "plan": type(options.plan).__name__ if not isinstance(options.plan, str) else options.plan,
            "plan measure": repr(_plan_measure(options.plan)),
            "momentum correction": repr(self._hp_momentum is not None),
            "covap": repr(sorted(options.covap.items())) if options.covap is not None else "None",
            "dear": repr(options.dear),
            "gradient_predivide_factor": repr(options.gradient_predivide_factor),
            "sparse_as_dense": repr(options.sparse_as_dense),
            # the knobs that decide sizes and steps (a clock and printing may differ per rank)
            "bucket tune": (repr(sorted((k, v) for k, v in options.bucket_tune.items() if k not in ("clock", "verbose")))
                            if options.tune else "off"),
        }

    def _hp_check_same_configuration(self, options: Options) -> None:
        """One allgather at wrap time of every rank's :meth:`_hp_wrap_fields` (a fixed-size JSON
        record), so a configuration that differs across ranks fails at once on every rank with a
        ValueError naming the ranks and fields, instead of hanging in the first step until the
        timeout (or, worse, running collectives that happen to match)."""
        tr = self._hp_transport
        if tr.size == 1:
            return
        fields = self._hp_wrap_fields(options)
        record = json.dumps({k: v[:200] for k, v in fields.items()}).encode()
        if len(record) > _WRAP_RECORD_BYTES:  # long kwargs: compare digests of the values instead
            record = json.dumps({k: f"digest {zlib.crc32(v.encode()):08x}" for k, v in fields.items()}).encode()
        mine = torch.zeros(_WRAP_RECORD_BYTES, dtype=torch.uint8)
        mine[:len(record)] = torch.frombuffer(bytearray(record), dtype=torch.uint8)
        everyone = torch.empty(_WRAP_RECORD_BYTES * tr.size, dtype=torch.uint8)
        world.quiesce()  # another optimizer's work still in flight goes first
        tr.allgather(mine, everyone)
        rows = [json.loads(bytes(everyone[r * _WRAP_RECORD_BYTES:(r + 1) * _WRAP_RECORD_BYTES].tolist())
                           .rstrip(b"\0").decode()) for r in range(tr.size)]
        diffs = []
        for r, row in enumerate(rows):
            for k in rows[0]:
                if row.get(k) != rows[0][k]:
                    diffs.append(f"rank {r} has {k} {row.get(k)}, rank 0 has {rows[0][k]}")
        if diffs:
            bad = sorted({r for r, row in enumerate(rows) if row != rows[0]})
            fields_bad = sorted({k for row in rows for k in rows[0] if row.get(k) != rows[0][k]})
            raise ValueError(
                f"hipress.DistributedOptimizer: the configuration differs across ranks: rank(s) {bad} differ from "
                f"rank 0 in {', '.join(fields_bad)} (" + "; ".join(diffs[:6]) + (" ..." if len(diffs) > 6 else "")
                + "); every rank must wrap the same model with the same options")

    # ------------------------------------------------------------------ submission
    def _hp_build_buckets(self) -> List["_Bucket"]:
        """Tensor fusion (fusion_buckets) of the parameters that need a gradient now; with Horovod's
        ``groups``, each group is one bucket and the parameters in no group are fused as usual."""
        size, own = self._hp_bucket_bytes, self._hp_own_buffers
        if self._hp_groups is None:
            return fusion_buckets(self._hp_named, self._hp_compressor, size, own, self._hp_first_bucket_bytes)
        grouped = explicit_groups(self._hp_named, self._hp_groups)
        in_group = {id(p) for g in grouped for _, p in g}
        rest = [(n, p) for n, p in self._hp_named if id(p) not in in_group]
        return [_Bucket(g, own) for g in grouped] + fusion_buckets(rest, self._hp_compressor, size, own)

    def _hp_index_buckets(self) -> None:
        """After (re)building the buckets: each parameter's bucket, and the buckets whose
        gradients are checked for NaN/Inf once per bucket, when the bucket is full, rather than
        one by one in backward (one pass and one call per bucket instead of per gradient). That
        is where nothing changes a gradient before it is in its bucket: no clipping, no momentum
        correction, and more than one rank (one rank submits no bucket). Under dear too: its
        buckets are checked where they are submitted, before their reduce-scatter. Under COVAP
        except in its local mode's filtered steps, which put no gradient in a bucket
        (_hp_checks_per_bucket); its residuals are added after the check, as after the per-gradient one."""
        self._hp_bucket_of = {id(p): b for b in self._hp_buckets for _, p in b.params}
        self._hp_bucket_named = {b.name: b for b in self._hp_buckets}
        # compared by the step's first allreduce, so that its later ones skip their check (_hp_submit)
        self._hp_layout_digest = zlib.crc32(";".join(f"{b.name}:{b.numel}" for b in self._hp_buckets).encode())
        self._hp_layout_check = "open"
        mc = self._hp_momentum
        self._hp_check_per_bucket = set() if not self._hp_guard or self._hp_transport.size == 1 else {
            b.name for b in self._hp_buckets
            if self._hp_clip_for(b) is None and (mc is None or not any(mc.corrects(p) for _, p in b.params))}
        # parameters whose final gradient is the gradient itself (nothing to clip, correct, divide
        # or check one by one): _hp_take only puts them in their bucket
        self._hp_as_is = set() if self._hp_predivide != 1.0 else {
            id(p) for b in self._hp_buckets
            if self._hp_clip_for(b) is None and (not self._hp_guard or b.name in self._hp_check_per_bucket)
            for _, p in b.params if mc is None or not mc.corrects(p)}
        # a plan's bf16 buckets of fp32 CPU gradients are cast in their copy (_Bucket.send_bf16);
        # under dear the sync casts them (hipress.sync.allreduce)
        for b in self._hp_buckets:
            b.send_bf16(self._hp_plain16 is not None and self._hp_dear is None and self._hp_transport.size > 1
                        and self._hp_route(b)[0] is self._hp_plain16 and b.fp32_cpu)
        self._hp_filled: Dict["_Bucket", int] = {}  # this step's gradients in each bucket
        self._hp_held: List["_Bucket"] = []  # full buckets of a step COVAP profiles, sent together (_hp_submit)
        self._hp_found_finite: Dict["_Bucket", int] = {}  # of those, how many its copy found finite (put)

    def _hp_clip_for(self, bucket: "_Bucket"):
        """The clip of the gradients of ``bucket``: the algorithm's clipping is an aid to its
        compression, so none for a bucket the plan leaves uncompressed."""
        if self._hp_plan is not None and self._hp_route(bucket)[0] is not self._hp_compressed:
            return None
        return self._hp_clip

    def _hp_check_bucket(self, bucket: "_Bucket") -> None:
        """The per-bucket form of the NaN/Inf check (_hp_index_buckets): a gradient that is not
        finite is recorded and sent as zeros, as the per-gradient check does."""
        sent = bucket.sent
        if nonfinite.all_finite(sent):
            return
        for (_, p), (off, n, _) in zip(bucket.params, bucket.segments):
            part = sent[off:off + n]
            if not nonfinite.all_finite(part):
                self._hp_bad.add(id(p))
                part.zero_()

    def _hp_gradients_stay_local(self) -> bool:
        """This step is a filtered step of COVAP's local mode: every gradient stays as it is, and
        none goes into a bucket (its parameters are averaged instead)."""
        return self._hp_covap is not None and self._hp_covap.local

    def _hp_checks_per_bucket(self, bucket: "_Bucket") -> bool:
        """Whether this step checks ``bucket``'s gradients in its copy (_hp_index_buckets)."""
        return bucket.name in self._hp_check_per_bucket and not self._hp_gradients_stay_local()

    def _hp_on_grad(self, p: torch.nn.Parameter):
        if self._hp_skip:
            return
        if not self._hp_counts and not self._hp_taken:  # the first gradient of a step
            self._hp_refresh_trainable()
        key = id(p)
        if self._hp_timeline:
            now = _C.now_ns()
            self._hp_engine.timeline_slice(2, f"grad.{self._hp_names[key]}", self._hp_mark_ns, now)
            self._hp_mark_ns = now
        if self._hp_covap is not None and self._hp_covap.profiling:
            self._hp_covap.grad_ready(_C.now_ns() * 1e-9)
        if key in self._hp_taken:
            raise RuntimeError(
                f"gradient of '{self._hp_names[key]}' was computed again before step(): "
                f"call step() (or synchronize()) after every {self._hp_passes} backward pass(es), "
                f"or raise backward_passes_per_step")
        self._hp_counts[key] = self._hp_counts.get(key, 0) + 1
        if self._hp_counts[key] == self._hp_passes:
            self._hp_take(p)

    def _hp_take(self, p: torch.nn.Parameter, joined: bool = False):
        """p's gradient is final for this step: put it in its bucket; submit a full bucket.
        joined (a rank in join()): zeros, sent as they are (no clipping, no momentum)."""
        key = id(p)
        if not self._hp_taken:  # a step's first final gradient
            if self._hp_dear is not None:  # the last step's updates are all done
                self._hp_dear.begin_backward()
                self._hp_commit()  # the last all-gathers' state changes belong to the last step
            if self._hp_tuner is not None:
                self._hp_tune_step()
            if self._hp_trial is not None:
                self._hp_trial_step(self._hp_trial, self._hp_use_plan)
            if self._hp_coord_trial is not None:
                self._hp_coord_trial_step()
        if self._hp_dear is not None:
            self._hp_dear.check_fresh(p)
        grad = p.grad
        bucket = self._hp_bucket_of[key]
        per_bucket = self._hp_checks_per_bucket(bucket)
        if joined:
            p.grad = torch.zeros_like(p) if grad is None or grad.is_sparse else grad.zero_()
        elif key in self._hp_as_is and (per_bucket or not self._hp_guard) and grad is not None and not grad.is_sparse:
            pass  # what final_gradient would return: the gradient itself
        else:
            if grad is not None and grad.is_sparse:
                if not self._hp_sparse_as_dense:
                    raise ValueError(f"the gradient of '{self._hp_names[key]}' is sparse (e.g. nn.Embedding(sparse=True)); "
                                     f"hipress synchronizes dense gradients: pass sparse_as_dense=True to "
                                     f"DistributedOptimizer, or use a dense embedding")
                grad = grad.to_dense()
                self._hp_densified.add(key)
            clip, corrected = self._hp_clip_for(bucket), None
            if self._hp_guard and grad is not None and not per_bucket:
                # momentum correction's native pass checks the gradient as it reads it (None where
                # that pass does not run); elsewhere the check is a pass of its own, first
                if clip is None and self._hp_momentum is not None:
                    corrected = self._hp_momentum.apply_checked(p, grad)
                if not (nonfinite.all_finite(grad) if corrected is None else corrected):
                    # never clipped, compressed or sent: zeros instead (every rank runs the same
                    # collectives); synchronize() undoes the step, and so the velocity, on every rank
                    self._hp_bad.add(key)
                    grad = torch.zeros_like(grad)
            final = grad if corrected is not None else \
                final_gradient(self._hp_names[key], p, grad, clip, self._hp_momentum)
            if final is not p.grad:  # (the setter checks shape and dtype: not when nothing changed)
                p.grad = final
            if self._hp_predivide != 1.0:  # Horovod's gradient_predivide_factor: 1/f before the sum
                p.grad.div_(self._hp_predivide)
        carry = self._hp_carry.pop(key, None)
        if carry is not None:  # a residual of a rebuilt bucket (_hp_rebuild), in the units of what is sent
            p.grad.add_(carry.to(p.grad.device).view_as(p.grad))
            self._hp_carry_sent[key] = carry
        self._hp_taken.add(key)
        if (self._hp_transport.size > 1 or self._hp_dear is not None) and not self._hp_gradients_stay_local():
            if bucket.put(p):
                self._hp_found_finite[bucket] = self._hp_found_finite.get(bucket, 0) + 1
        filled = self._hp_filled[bucket] = self._hp_filled.get(bucket, 0) + 1
        if filled == len(bucket.params):
            self._hp_submit(bucket)

    def _hp_refresh_trainable(self) -> None:
        """At the start of a step: if parameters were frozen or unfrozen since the buckets were
        built, build them again for the parameters that require gradients now (frozen ones are then
        neither synced nor given a gradient; unfrozen ones are synced like the others). Every rank
        decides alone, from its own flags; the step's agreement (_hp_agree) checks they match."""
        flags = tuple(p.requires_grad for _, p in self._hp_named)
        if flags == self._hp_trainable:
            return
        changed = [n for (n, _), a, b in zip(self._hp_named, flags, self._hp_trainable) if a != b]
        if self._hp_plan is not None or self._hp_covap is not None or self._hp_dear is not None:
            raise RuntimeError(f"hipress: requires_grad of {changed[:10]} changed after wrapping; with plan=, "
                               f"compression='covap' or strategy='dear' the buckets cannot be rebuilt: wrap the "
                               f"optimizer again")
        old = {(b.name, b.numel) for b in self._hp_buckets}
        self._hp_trainable = flags
        new = self._hp_build_buckets()
        for name, _ in old - {(b.name, b.numel) for b in new}:
            self._hp_states.discard(f"{name}/")  # a bucket that is gone: its residuals would be stale
        self._hp_set_buckets(new)

    def _hp_set_buckets(self, buckets: List["_Bucket"]) -> None:
        """The buckets every later sync uses (rebuilt at the start of a step, nothing in flight),
        with what depends on them: which bucket each parameter goes to, dear's schedule, and a
        gradient hook on every parameter that needs a gradient now."""
        self._hp_buckets = buckets
        self._hp_index_buckets()
        if self._hp_dear is not None:
            self._hp_dear.set_buckets(buckets)
        for _, p in self._hp_named:
            if p.requires_grad and id(p) not in self._hp_hooks:
                self._hp_hooks[id(p)] = p.register_post_accumulate_grad_hook(self._hp_on_grad)

    # ------------------------------------------------------------------ bucket_bytes="tune"
    def _hp_tune_step(self) -> None:
        """At a step's first final gradient (nothing of this step submitted yet; the last step's
        syncs done and, under dear, its all-gathers and updates applied): the tuner counts the last
        step, and at the end of a trial every rank gets the next size from rank 0 and rebuilds its
        buckets alike, before this gradient goes into one."""
        tuner = self._hp_tuner
        if tuner.done:
            return
        size = tuner.step_start(self._hp_last_step_skipped(), self._hp_slowest, self._hp_share,
                                self._hp_transport.rank)
        if size is not None:
            self._hp_bucket_bytes = size
            self._hp_rebuild()
            tuner.mark()

    def _hp_last_step_skipped(self) -> bool:
        """Whether the last step was skipped for non-finite gradients (agreed by every rank in it).
        Read once per step, by one online search at a time (the tuner, which Options allows with
        neither trial; plan="auto"'s trial, then coordinator="auto"'s, which waits for it)."""
        skipped = self._hp_skipped != self._hp_skipped_seen
        self._hp_skipped_seen = self._hp_skipped
        return skipped

    def _hp_slowest(self, seconds: float) -> float:
        """The largest of every rank's ``seconds`` (the ranks wait for each other: the slowest sets
        the pace). An allgather on the world transport; nothing else is in flight here."""
        return float(covap.gather_rows(self._hp_transport, torch.tensor([seconds], dtype=torch.float64)).max())

    def _hp_share(self, decision: Tuple[int, bool]) -> Tuple[int, bool]:
        """Rank 0's (size, settled) on every rank: one broadcast."""
        buf = torch.tensor([int(decision[0]), int(decision[1])], dtype=torch.int64)
        world.quiesce()
        self._hp_transport.broadcast(buf.view(torch.uint8), 0)
        return int(buf[0]), bool(buf[1])

    def _hp_rebuild(self) -> None:
        """Buckets of the current size, in place of the old ones, if the layout differs (their
        states handed back: _hp_hand_back)."""
        new = self._hp_build_buckets()
        if [(b.name, b.numel) for b in new] == [(b.name, b.numel) for b in self._hp_buckets]:
            return  # the same buckets (a size between the same two layouts): states stay as they are
        self._hp_hand_back()
        self._hp_set_buckets(new)

    def _hp_hand_back(self) -> None:
        """Before the buckets are rebuilt (another size, another plan): compressor state is per
        bucket, partition and chunk, so a new layout cannot reuse it. Its residuals are gradient
        mass not sent yet (error feedback): dropping them would lose it. Each one is handed back,
        element by element, to the parameter it stands for, and added to that parameter's next
        gradient on this rank (_hp_take): every residual, at whatever site of the sync it waited (a
        ring hop's partial sum, a PS aggregator's sum), is a part of the sum over ranks, so the sum
        of the next step carries exactly what the old states held. The carry is dropped when that
        step commits and kept if it is undone (skipped for non-finite gradients, reset()). Every
        state of the old layout goes (not only the buckets that changed), and so do PS's
        aggregator choices, so the new layout starts as a fresh job with these buckets would: what
        a job resumed from a checkpoint starts from too."""
        for b in self._hp_buckets:
            sync, bounds = self._hp_route(b)
            self._hp_take_to_carry(b, sync.state_spans(b.name, bounds))
            self._hp_states.discard(f"{b.name}/")
        self._hp_compressed.forget_layout()

    def _hp_take_to_carry(self, b: "_Bucket", spans) -> None:
        """Takes the states of bucket ``b``'s ``spans`` (state_spans) and adds their residuals to
        the carry of the parameters they stand for."""
        by_name = dict(b.params)
        for name, acc in state_layout.take_residuals(self._hp_states, spans, b.params, b.offsets).items():
            self._hp_add_carry(by_name[name], acc.view(by_name[name].shape))

    def _hp_add_carry(self, p: torch.nn.Parameter, t: torch.Tensor) -> None:
        """Adds ``t`` (p's shape; owned by the carry from now on) to what p's next gradient carries."""
        self._hp_add_carry_id(id(p), t)

    def _hp_add_carry_id(self, key: int, t: torch.Tensor) -> None:
        prev = self._hp_carry.get(key)
        self._hp_carry[key] = t if prev is None else prev + t

    # ------------------------------------------------------------------ plan="auto"'s measured choice
    @property
    def plan_trial(self) -> Optional[PlanTrial]:
        """plan="auto" measured against no compression (hipress/torch/plan_trial.py): the trial
        (``in_use``, ``done``, ``chosen``, ``seconds`` per candidate, ``summary()``); None where
        there is nothing to choose."""
        return self._hp_trial

    def _hp_trial_step(self, trial: PlanTrial, switch: Callable[[str], None]) -> None:
        """At a step's first final gradient (as _hp_tune_step): a measured choice (plan="auto"'s or
        coordinator="auto"'s) counts the last step, and where it picks the other candidate, every
        rank switches to it alike (``switch``)."""
        if trial.done:
            return
        name = trial.step_start(self._hp_last_step_skipped(), self._hp_slowest, self._hp_transport.rank)
        if name is not None:
            switch(name)
            trial.mark()

    def _hp_coord_trial_step(self) -> None:
        """coordinator="auto"'s step hook. Beside plan="auto" it waits for the plan's choice (made
        with the coordinator off), then measures "off" and "on" with the plan kept, each in a
        window of its own (hipress/torch/plan_trial.py). The uncompressed plan leaves nothing for
        the coordinator to batch (off)."""
        trial, plans = self._hp_coord_trial, self._hp_trial
        if trial.done or (plans is not None and not plans.done):
            return
        if plans is not None and plans.chosen == "plain":
            trial.settle("off")
            return
        self._hp_trial_step(trial, lambda name: self._hp_use_coordinator(name == "on"))

    @property
    def coordinator_trial(self) -> Optional[CoordinatorTrial]:
        """coordinator="auto" (hipress/torch/plan_trial.py): the trial (``in_use``: "off" or "on",
        ``done``, ``chosen``, ``seconds`` per candidate, ``summary()``); None where there is nothing
        to choose (another coordinator option, or one rank)."""
        return self._hp_coord_trial

    def _hp_use_coordinator(self, on: bool) -> None:
        """Every exchange from now on goes through the global coordinator (``on``; its executor
        started here, collectively, on the first switch) or around it. Nothing is in flight: the
        step's first gradient is not submitted yet. What the coordinator declared ahead for this
        step is voided (Exchanges.reset), on every rank alike. The syncs are made anew over the
        other exchanges; compressor states stay in the store they share, and the choices a
        strategy made on first sight (PS's aggregators) go over, so states stay where they are.
        Once the trial keeps the coordinator off, its executor stops (collectively too)."""
        if on and self._hp_coordinated is None:
            self._hp_coordinated = open_exchanges(self._hp_engine, coordinated=True, plain=self._hp_direct)
        new = self._hp_coordinated if on else self._hp_direct
        if new is not self._hp_exchanges:
            self._hp_exchanges.reset()
            layout = self._hp_compressed.layout_state()
            self._hp_exchanges = new
            self._hp_compressed = self._hp_sync_for(self._hp_compressor)
            self._hp_compressed.load_layout_state(layout)
            if self._hp_plan is None:
                self._hp_plain = self._hp_compressed
            # (a plan's uncompressed syncs stay: the direct exchanges are the coordinator's plain ones)
        if not on and self._hp_coordinated is not None and self._hp_coord_trial.done:
            coordinator.stop(self._hp_coordinated.world.executor)
            self._hp_coordinated = None

    def _hp_use_plan(self, name: str) -> None:
        """Switches to the candidate plan ``name`` (nothing in flight): the old buckets' residuals
        handed back (_hp_hand_back), momentum correction's velocities moved (_hp_move_momentum),
        and buckets built for the plan."""
        mc = self._hp_momentum
        corrected = {id(p) for _, p in self._hp_named if mc is not None and mc.corrects(p)}
        self._hp_hand_back()
        buckets = self._hp_plan_layout(name)
        if mc is not None:
            self._hp_move_momentum(corrected)
        self._hp_set_buckets(buckets)

    def _hp_move_momentum(self, corrected: set) -> None:
        """After a plan switch: a parameter momentum correction takes over starts its velocity from
        the wrapped SGD's momentum buffer (the average of what the ranks' velocities would hold, the
        same on every rank), which goes; one it lets go of gets the average over ranks of its
        velocities as that buffer (without compression the SGD's buffer is exactly that average,
        momentum being linear), gathered in chunks, the same bits on every rank."""
        mc = self._hp_momentum
        now = {id(p) for _, p in self._hp_named if mc.corrects(p)}
        for n, p in self._hp_named:
            if id(p) in now - corrected:
                buf = self.state.get(p, {}).pop("momentum_buffer", None)
                if buf is not None and n not in mc.velocity:
                    mc.velocity[n] = buf
        leaving = [(n, p, mc.velocity.pop(n)) for n, p in self._hp_named
                   if id(p) in corrected - now and n in mc.velocity]
        if not leaving:
            return
        flat = torch.cat([u.reshape(-1).float() for _, _, u in leaving])
        mean = torch.empty_like(flat)
        chunk = 1 << 22
        for s in range(0, flat.numel(), chunk):
            rows = covap.gather_rows(self._hp_transport, flat[s:s + chunk].double())
            mean[s:s + chunk] = rows.mean(dim=0).to(flat.dtype)
        off = 0
        for _, p, u in leaving:
            self.state[p]["momentum_buffer"] = mean[off:off + u.numel()].view_as(u).to(u.dtype).clone()
            off += u.numel()

    def _hp_route(self, bucket: "_Bucket"):
        """(the sync, the partitions) of a bucket: the plan's choice, or compressed."""
        if self._hp_plan is not None:
            entry = self._hp_plan.entry(bucket.name, bucket.numel)
            sync = self._hp_compressed if entry.compress else self._hp_plain16 if entry.bf16 else self._hp_plain
            return sync, entry.bounds(bucket.numel)
        return self._hp_compressed, bucket_bounds(bucket, self._hp_partition_bytes, self._hp_split_tensors,
                                                  self._hp_compressed.spread)

    def _hp_layout_kw(self, sync) -> dict:
        """The checking round of the step's next sync. The step's first one, where it is the
        backend's allreduce (or, under dear, its reduce-scatter), compares the digest of every
        bucket's name and size (agree_on), so the step's later collectives skip their round
        (sizes_agreed): one round trip less each. Where the first is another strategy's, every
        sync keeps its own checks.
        Every rank decides the same: the order of syncs and their strategies are the same."""
        plain = sync.strategy.writes_into  # the backend's allreduce
        if self._hp_layout_check == "open":
            self._hp_layout_check = "compared" if plain else "unchecked"
            return {"agree_on": self._hp_layout_digest} if plain else {}
        return {"sizes_agreed": True} if plain and self._hp_layout_check == "compared" else {}

    def _hp_submit(self, bucket: "_Bucket"):
        if self._hp_transport.size == 1:
            self._hp_handles[bucket.name] = None
            return
        if self._hp_covap is not None and self._hp_covap.profiling and self._hp_dear is None:
            # COVAP's profiler times the computation and the communication apart: a profiled step
            # sends its buckets once the last is ready (docs/covap.md, "Profiler")
            self._hp_held.append(bucket)
            if len(self._hp_held) < len(self._hp_buckets):
                return
            held, self._hp_held = self._hp_held, []
            for b in held:
                self._hp_send(b)
            return
        self._hp_send(bucket)

    def _hp_send(self, bucket: "_Bucket"):
        if self._hp_checks_per_bucket(bucket) and self._hp_found_finite.get(bucket, 0) < len(bucket.params):
            self._hp_check_bucket(bucket)
        flat = bucket.sent
        sync, bounds = self._hp_route(bucket)
        if self._hp_dear is not None:  # the all-gather waits for step() (hipress/torch/dear.py)
            self._hp_handles[bucket.name] = sync.reduce_scatter(bucket.name, flat, bounds, **self._hp_layout_kw(sync))
            return
        units = self._hp_covap.select(bucket.name, flat) if self._hp_covap is not None else None
        if units is not None and self._hp_covap.local:  # COVAP's local mode: the gradient stays as it is
            self._hp_averaging += self._hp_average_params(bucket, sync, units, self._hp_covap_sync16)
            self._hp_handles[bucket.name] = None  # the averages are waited for in the next step
            return
        # Under COVAP only where its filter sends the bucket whole as one unit (interval 1, or a
        # bucket of one unit in its step): while profiling it times the sync below instead.
        whole = units is not None and len(units) == 1 and units[0][1] == (0, flat.numel())
        into = bucket.into() if (self._hp_covap is None or whole) and sync.strategy.writes_into else None
        if into is None and bucket.wire is not None:  # put() made every gradient contiguous fp32
            raise RuntimeError(f"hipress: bucket {bucket.name} travels as bf16 but its gradients cannot take the sum")
        if into is not None:  # the backend's allreduce writes the average straight into the gradients
            name, spans = (f"{bucket.name}/u{units[0][0]}", [units[0][1]]) if whole else (bucket.name, bounds)
            self._hp_handles[bucket.name] = sync.build(name, flat, spans, into=into, **self._hp_layout_kw(sync))
            return
        if units is None:
            handles = [sync.build(bucket.name, flat, bounds, segments=bucket.segments, **self._hp_layout_kw(sync))]
            if self._hp_covap is not None:  # profiling: time it
                self._hp_covap.submitted(bucket.name, _C.now_ns() * 1e-9)
                handles[0].add_done_callback(lambda h, n=bucket.name: self._hp_covap.completed(n, _C.now_ns() * 1e-9))
        else:  # COVAP: only the selected units, each a sync (and compressor state) of its own
            handles = [sync.build(f"{bucket.name}/u{t}", flat, [r], **self._hp_layout_kw(sync)) for t, r in units]
        if bucket.in_place and len(handles) == 1:
            self._hp_handles[bucket.name] = handles[0]
        elif not bucket.in_place or handles:
            unpack = (lambda: None) if bucket.in_place else bucket.unpack
            self._hp_handles[bucket.name] = sync.ctx.compute(f"unpack.{bucket.name}", unpack, handles,
                                                             nbytes=4 * flat.numel())
        else:
            self._hp_handles[bucket.name] = None  # nothing sent: the gradient (zeros) is already in place

    def _hp_average_params(self, bucket: "_Bucket", sync, units, sync16=None) -> List["covap.Average"]:
        """COVAP's local mode (hipress/torch/covap.py, MODES): starts the average across ranks of
        the parameters of the selected ``units`` of ``bucket`` (read here, in the backward: they
        do not change before step()), each in a buffer of its own; with ``sync16``, as bf16
        differences from the units' references where they have one. The gradients, each rank's
        own, go to the wrapped optimizer as they are."""
        def by(s):
            return None if s is None else lambda *a: s.build(*a, **self._hp_layout_kw(s))
        return covap.start_averages(bucket, units, by(sync), by(sync16), self._hp_covap.refs, self._hp_transport.size)

    def _hp_wait_averages(self) -> List["covap.Average"]:
        """The last step's parameter averages (COVAP's local mode), each done, and the agreement
        queued behind them (_hp_agrees_late): nothing of this optimizer's left in flight."""
        timeout = config.get("HIPRESS_TIMEOUT_S")
        covap.wait_averages(self._hp_averaged, timeout, self._hp_waiting_for)
        late = self._hp_late_agreement
        if late is not None and not late.wait(timeout):
            raise TimeoutError(f"hipress: the last step's agreement not done within {timeout:g} s "
                               f"(HIPRESS_TIMEOUT_S); {self._hp_waiting_for()}")
        return self._hp_averaged

    def _hp_apply_averages(self, averages: List["covap.Average"]) -> None:
        """Adds each (done) average's difference to what was sent to the parameters."""
        for avg in averages:
            self._hp_bucket_named[avg.name].write_params(avg.start, avg.delta(), add=True)

    def _hp_average_all_params(self) -> None:
        """COVAP's local mode, between steps (synchronize()): the last step's averages applied,
        then every parameter averaged across ranks, so that every rank holds the same model."""
        self._hp_check_usable()
        if self._hp_transport.size == 1:
            return
        last, self._hp_averaged = self._hp_averaged, []
        self._hp_wait_params(last)
        self._hp_apply_averages(last)
        now = [a for b in self._hp_buckets
               for a in self._hp_average_params(b, self._hp_route(b)[0], [("all", (0, b.numel))])]
        self._hp_wait_params(now)
        for a in now:
            self._hp_bucket_named[a.name].write_params(a.start, a.values)

    def _hp_wait_params(self, averages: List["covap.Average"]) -> None:
        """synchronize()'s wait for parameter averages; a failure makes the optimizer unusable."""
        self._hp_handles.update({f"params.{a.name}@{a.start}/{i}": a.handle for i, a in enumerate(averages)})
        errors = self._hp_wait_all()
        self._hp_handles.clear()
        self._hp_layout_check = "open"
        if errors:
            self._hp_failure = errors[0].splitlines()[0][:300]
            raise RuntimeError("hipress: averaging the parameters failed:\n  " + "\n  ".join(errors[:3]))

    # ------------------------------------------------------------------ public API
    def synchronize(self):
        """Waits until every gradient is synchronized (submitting unused ones first).

        With ``strategy="dear"``: runs every parameter update the last ``step()`` deferred
        (waiting for its all-gather), so parameters and optimizer state are current, e.g.
        before evaluation or a checkpoint (``state_dict()`` and the model's ``state_dict()``
        do it themselves). Gradients are averaged only bucket by bucket in the next forward
        there, so calling it between backward and step() is an error.

        With ``compression="covap"`` in its local mode (the default), each rank's parameters move
        on its own gradients between averages. Called between steps (after step(), before the
        next backward), it averages every parameter across ranks, so every rank holds the same
        model: call it on every rank before evaluation or a checkpoint. (In mode "paper", and
        while the profiler runs, the ranks hold the same model already: it returns.)

        With ``nonfinite="skip"`` (default), if any rank's gradient of some parameter was NaN
        or Inf, every rank warns (:class:`NonFiniteGradientWarning`), every compressor and
        momentum state is as before this step, the gradients of those parameters are NaN
        on every rank (so a GradScaler finds inf) and the next ``step()`` does not run the
        wrapped optimizer; ``last_nonfinite`` maps each such parameter to the ranks that
        saw it (empty when none). ``nonfinite="raise"``: the same, but it raises
        :class:`NonFiniteGradientError` on every rank instead of warning. In COVAP's local mode
        with "skip", each rank's model is its own replica between averages, so only the rank(s)
        that saw the NaN or Inf skip their step (warn, NaN those gradients, no wrapped step;
        ``last_nonfinite`` names this rank); the others step on, and the averages and COVAP's
        schedule go on alike on every rank. There the ranks do not meet at every step's end.

        A failed synchronization (a peer that died, stalled past ``HIPRESS_TIMEOUT_S`` or sent a
        bad payload) raises RuntimeError naming the gradient and the peer(s); the optimizer then
        refuses to synchronize until :meth:`reset` (docs/reliability.md)."""
        if self._hp_dear is None:
            between_steps = not self._hp_handles and not self._hp_counts
            if self._hp_covap is not None and between_steps:
                if self._hp_covap.local:  # else every rank holds the same model already
                    self._hp_average_all_params()
                return
            self._hp_wait_gradients()
            return
        if self._hp_handles or self._hp_counts:
            raise RuntimeError("strategy='dear': synchronize() between backward and step(): the averaged gradients "
                               "exist only bucket by bucket in the next forward; call step() first (synchronize() "
                               "then makes the parameters current), or clip with grad_clip=")
        self._hp_dear.flush()

    def _hp_wait_gradients(self):
        """synchronize() without dear: submits unused gradients, waits for every sync, agrees on
        non-finite gradients. With dear (from step()): the same for the reduce-scatters."""
        self._hp_skip_step = False
        self._hp_check_usable()
        if not self._hp_handles and not self._hp_counts:
            raise RuntimeError("step()/synchronize() called without a backward pass since the last step")
        incomplete = {self._hp_names[k]: c for k, c in self._hp_counts.items() if c < self._hp_passes}
        if incomplete and len(incomplete) == len(self._hp_counts):
            n = next(iter(incomplete.values()))
            raise RuntimeError(f"step() after {n} of backward_passes_per_step={self._hp_passes} backward passes")
        for bucket in self._hp_buckets:  # bucket order: the same on every rank
            for _, p in bucket.params:
                if id(p) not in self._hp_taken:
                    self._hp_take(p)  # unused this step: zeros, so every rank runs the same collectives
        if self._hp_finish_step():
            return
        if self._hp_covap is not None:
            profile = self._hp_covap.finish_step(self._hp_gather)
            if profile is not None and world.rank() == 0:
                print(profile.summary(), flush=True)
        self._hp_synchronized = True

    def _hp_finish_gradients(self) -> None:
        """After the sync: f times each gradient (gradient_predivide_factor: the sync averaged
        the gradients divided by f), and densified gradients back to sparse (as Horovod does, for
        optimizers that want sparse gradients)."""
        densified, self._hp_densified = self._hp_densified, set()
        for bucket in self._hp_buckets:
            for _, p in bucket.params:
                if p.grad is None:
                    continue
                if self._hp_predivide != 1.0:
                    p.grad.mul_(self._hp_predivide)
                if id(p) in densified:
                    p.grad = p.grad.to_sparse()

    def _hp_check_usable(self) -> None:
        if self._hp_failure is not None:
            raise RuntimeError(f"hipress: an earlier gradient synchronization failed ({self._hp_failure}); call "
                               f"opt.reset() on every rank before the next step (docs/reliability.md)")

    def _hp_finish_step(self) -> bool:
        """Waits for the step's collectives, then agrees with every rank on the step (one small
        allgather: join state, trainable set, non-finite gradients). True if the step is not taken."""
        # Every gradient is taken, so the flags are final: the agreement runs now, beside the
        # step's last syncs, not after them.
        table, errors = None, []
        late = self._hp_agrees_late()
        if self._hp_guard:
            try:
                table = self._hp_agree(self._hp_bad, queued=late)
            except TransportError as e:  # on the control channel: a peer that died or stalled
                errors.append(f"the step's agreement (non-finite gradients, trainable set) failed: {e}")
        if self._hp_late_agreement is not None:
            self._hp_handles[_LAST_AGREEMENT], self._hp_late_agreement = self._hp_late_agreement, None
        if late and not self._hp_joined:  # waited for in the next step (a rank in join() waits now:
            # its loop's steps must not end before every rank's has begun)
            self._hp_late_agreement, table = self._hp_handles.pop(_AGREEMENT), None
        bad = self._hp_bad
        if self._hp_dear is None:  # the step's exchanges are all submitted (dear's all-gathers: next forward)
            self._hp_exchanges.step_submitted()
        # the last step's parameter averages (COVAP's local mode) are due now
        due, self._hp_averaged, self._hp_averaging = self._hp_averaged, self._hp_averaging, []
        self._hp_handles.update({f"params.{a.name}@{a.start}": a.handle for a in due if a.handle is not None})
        errors = self._hp_wait_all() + errors
        self._hp_counts.clear()
        self._hp_taken.clear()
        self._hp_filled.clear()
        self._hp_found_finite.clear()
        self._hp_bad = set()
        if errors:
            # keep the handles (reset() waits them out) and the undo logs (reset() undoes the step)
            self._hp_failure = errors[0].splitlines()[0][:300]
            shown = errors[:3] + ([f"... and {len(errors) - 3} more gradient(s)"] if len(errors) > 3 else [])
            raise RuntimeError("hipress gradient synchronization failed:\n  " + "\n  ".join(shown))
        self._hp_handles.clear()
        self._hp_layout_check = "open"
        self._hp_finish_gradients()
        self._hp_steps += 1
        # they belong to the last step, which was kept: applied even if this one is not
        self._hp_apply_averages(due)
        if not self._hp_guard:  # nothing is undone: the step is kept
            self._hp_carry_committed()
            return False
        if table is not None:
            self._hp_check_same_trainable(table)
        if late:
            self._hp_skip_locally(bad)
            return False
        skipped = self._hp_decide_nonfinite(table[:, _AGREE_HEADER:])
        if skipped:  # this step's averages are dropped with it (their syncs still run out)
            self._hp_averaged = []
        return skipped

    def _hp_agrees_late(self) -> bool:
        """COVAP's local mode with nonfinite="skip": each rank's parameters move on its own gradients
        between averages, so a rank with a non-finite gradient skips its step alone
        (_hp_skip_locally) and the ranks need not meet at every step's end: the step's agreement
        is waited for in the next step, with the averages this step starts, and a rank runs on
        while a slower one finishes its backward. (Its table is not read there: COVAP fixes the
        trainable set at wrap, _hp_refresh_trainable. It orders join()'s steps, whose rank waits
        for it at once.)"""
        return self._hp_nonfinite == "skip" and self._hp_gradients_stay_local() and self._hp_transport.size > 1

    def _hp_agree(self, bad: set, queued: bool = False) -> torch.Tensor:
        """Every rank's row: [4 bytes of the trainable set's digest, one byte per parameter (not
        finite here this step)], gathered into the returned table (ranks x row) by one allgather of
        a few bytes per step (not with nonfinite="off"). Its size is fixed by the parameters, which
        the ranks compared at wrap, so it has no checking round.

        Where the backend has a control channel (world.control_transport()), this thread runs it
        there at once, while the comm queue's thread still moves the step's last buckets: it adds
        nothing to the step's tail. Elsewhere it is queued on the comm queue behind those buckets
        (its handle among theirs: the table is complete once they are all done); there always
        with ``queued`` (its handle is waited for later: _hp_agrees_late)."""
        mine = torch.zeros(_AGREE_HEADER + len(self._hp_named), dtype=torch.uint8)
        mine[:_AGREE_HEADER] = torch.tensor(list(zlib.crc32(bytes(self._hp_trainable)).to_bytes(4, "little")),
                                            dtype=torch.uint8)
        if bad:
            mine[_AGREE_HEADER:] = torch.tensor([id(p) in bad for _, p in self._hp_named], dtype=torch.uint8)
        n = self._hp_transport.size
        if n == 1:
            return mine.view(1, -1)
        table = torch.empty(n * mine.numel(), dtype=torch.uint8)
        if self._hp_control is not None and not queued:
            self._hp_control.allgather(mine, table, sizes_agreed=True)
        else:
            self._hp_handles[_AGREEMENT] = self._hp_exchanges.world.gather_rows(_AGREEMENT, mine, table)
        return table.view(n, mine.numel())

    def _hp_check_same_trainable(self, table: torch.Tensor) -> None:
        digests = table[:, :_AGREE_HEADER]
        differ = [r for r in range(table.shape[0]) if not torch.equal(digests[r], digests[0])]
        if differ:
            frozen = [n for (n, _), t in zip(self._hp_named, self._hp_trainable) if not t]
            self._hp_failure = "the ranks train different sets of parameters"
            raise RuntimeError(f"hipress: rank(s) {differ} train a different set of parameters (requires_grad) than "
                               f"rank 0; every rank must freeze and unfreeze the same parameters before the same "
                               f"step. This rank has frozen: {frozen[:10]}")

    def _hp_wait_all(self) -> List[str]:
        """Waits for every submitted handle, all within one HIPRESS_TIMEOUT_S from now; returns
        the errors. A timeout names the peer(s) this rank was waiting for; any failure also names
        the peers that did not fail too (:func:`hipress.comm.world.silent_peers`: the stalled or
        dead ones, or a peer that went on)."""
        deadline = config.get("HIPRESS_TIMEOUT_S")
        end = time.monotonic() + deadline
        errors = []
        for name, h in self._hp_handles.items():
            if h is None:
                continue
            if not h.wait(max(0.0, end - time.monotonic())):
                errors.append(f"'{name}' not synchronized within {deadline:g} s (HIPRESS_TIMEOUT_S); "
                              f"{self._hp_waiting_for()}")
                continue
            err = h.exception(0)
            if err is not None:
                errors.append(str(err))
        if errors:
            silent = world.silent_peers(window_s=2 * deadline)
            if silent:
                errors[0] += f"; rank(s) {silent} report no failure of their own (stalled, dead or still running)"
            elif silent == []:
                errors[0] += "; every other rank failed too"
        return errors

    def _hp_waiting_for(self) -> str:
        return waiting_words(self._hp_exchanges.comm_thread_world)

    def _hp_commit(self) -> None:
        self._hp_carry_committed()
        self._hp_states.commit()
        if self._hp_momentum is not None:
            self._hp_momentum.commit()
        if self._hp_covap is not None and self._hp_covap.filter is not None:
            self._hp_covap.filter.undo_log.commit()

    def _hp_decide_nonfinite(self, table: torch.Tensor) -> bool:
        """From every rank's byte per parameter (which were not finite on that rank): if any
        rank had one, undo this step's state changes, NaN the gradients of those parameters,
        then warn and mark the step skipped, or raise. True if the step is not taken. Every
        rank reaches the same decision from the same table."""
        hit = table.any(0).nonzero().view(-1).tolist()
        if not hit:
            self.last_nonfinite = {}
            self._hp_commit()
            return False
        self._hp_undo()
        self._hp_skipped += 1
        where = {}
        for i in hit:
            name, p = self._hp_named[i]
            where[name] = table[:, i].nonzero().view(-1).tolist()
            if p.grad is not None:
                p.grad.fill_(float("nan"))
        self.last_nonfinite = where
        if self._hp_joined:  # a rank in join() has no step to skip: the states are restored, that is all
            return True
        if self._hp_nonfinite == "raise":
            raise NonFiniteGradientError(nonfinite.describe(where, "step not taken"), where)
        warnings.warn(nonfinite.describe(where, "step skipped on every rank"), NonFiniteGradientWarning,
                      stacklevel=4)
        self._hp_skip_step = self._hp_synchronized = True
        return True

    def _hp_skip_locally(self, bad: set) -> None:
        """COVAP's local mode (_hp_agrees_late): this rank's non-finite gradients skip this rank's
        step only. Nothing of hipress's is undone: the filter's schedule and the averages started
        in this step (of the parameters before it, finite) are every rank's, and go on as on the
        other ranks."""
        self._hp_commit()
        hit = [(name, p) for name, p in self._hp_named if id(p) in bad]
        where = self.last_nonfinite = {name: [self._hp_transport.rank] for name, _ in hit}
        if not hit:
            return
        self._hp_skipped += 1
        for _, p in hit:
            if p.grad is not None:
                p.grad.fill_(float("nan"))
        if self._hp_joined:
            return
        warnings.warn(nonfinite.describe(where, "step skipped on this rank (COVAP's local mode: the other ranks step "
                                                "on, each on its own gradients, as between averages)", restored=False),
                      NonFiniteGradientWarning, stacklevel=4)
        self._hp_skip_step = True

    def _hp_carry_committed(self) -> None:
        """The step that added the carry to its gradients is kept: the carry is in its sums now."""
        self._hp_carry_sent = {}

    def _hp_undo(self) -> None:
        # the step is dropped: its gradients (and the carry in them) were not taken
        for key, t in self._hp_carry_sent.items():
            self._hp_add_carry_id(key, t)
        self._hp_carry_sent = {}
        self._hp_states.undo()
        if self._hp_momentum is not None:
            self._hp_momentum.undo()
        if self._hp_covap is not None and self._hp_covap.filter is not None:
            self._hp_covap.filter.undo()

    def _hp_gather(self, v: torch.Tensor) -> torch.Tensor:
        """Every rank's float64 vector v, one row per rank (nothing else is in flight here)."""
        return covap.gather_rows(self._hp_transport, v)

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside: step() does not synchronize (call synchronize() yourself first)."""
        self._hp_skip = True
        try:
            yield
        finally:
            self._hp_skip = False

    def join(self) -> int:
        """This rank has no more data (uneven inputs): until every rank has joined, it takes part
        in the other ranks' gradient synchronizations with zero gradients (its optimizer does not
        step), so ``op=Average`` still divides by the full number of ranks. Returns, on every rank,
        the rank whose join() completed the set (the last to join). Every rank calls it once out of
        data (each epoch, say); the optimizer is usable again afterwards.

        The working ranks need not know in advance and pay nothing: they run their steps as
        always. Only joined ranks coordinate, through the rendezvous store (torch transport): the
        rank that joins last records there the step at which every rank has joined; each joined
        rank, after each zero step, looks whether that was the last one. That rank runs one zero
        step too, so every rank stops after the same step. ``hipress.join()`` serves the
        Horovod-style collectives (hipress.torch.collectives), not this optimizer."""
        self._hp_check_usable()
        if self._hp_dear is not None:
            raise RuntimeError("join() is not supported with strategy='dear' (its updates wait for the next forward)")
        if self._hp_tuner is not None and not self._hp_tuner.done:
            raise RuntimeError("join() while bucket_bytes='tune' is still tuning: the working ranks measure steps and "
                               "agree on sizes that a joined rank would not take part in; join after the tuner has "
                               "settled (opt.bucket_tuner.done)")
        if self._hp_trial is not None and not self._hp_trial.done:
            raise RuntimeError("join() while plan='auto' still measures its candidate plans: the working ranks "
                               "measure steps and switch plans, which a joined rank would not take part in; join "
                               "after the choice is made (opt.plan_trial.done)")
        if self._hp_coord_trial is not None and not self._hp_coord_trial.done:
            raise RuntimeError("join() while coordinator='auto' (compression='auto''s default) still measures the "
                               "coordinator on and off: the working ranks switch exchanges, which a joined rank would "
                               "not take part in; join after the choice is made (opt.coordinator_trial.done), or pass "
                               "coordinator=False")
        if self._hp_handles or self._hp_taken or self._hp_counts:
            raise RuntimeError("join() called while gradients are being synchronized; call step() or "
                               "synchronize() first")
        self._hp_joins += 1
        tr = self._hp_transport
        if tr.size == 1:
            return 0
        store = getattr(tr, "store", None)
        if store is None:
            raise RuntimeError(f"DistributedOptimizer.join() needs a rendezvous store (the torch transport); the "
                               f"{tr.name} transport has none")
        if self._hp_covap is not None and not self._hp_guard:
            raise RuntimeError("join() with compression='covap' needs nonfinite='skip' or 'raise' (a COVAP step may "
                               "send nothing; the per-step agreement then orders the joined ranks' steps)")
        key = f"hipress/join/opt{self._hp_uid}/{self._hp_joins}"
        if store.add(f"{key}/count", 1) == tr.size:  # the last to join: every rank stops after this step
            store.set(f"{key}/final", f"{self._hp_steps}:{tr.rank}")
        self._hp_joined = True
        try:
            while True:
                self._hp_refresh_trainable()
                step = self._hp_steps
                for bucket in self._hp_buckets:
                    for _, p in bucket.params:
                        self._hp_take(p, joined=True)
                self._hp_finish_step()
                if self._hp_covap is not None:
                    self._hp_covap.finish_step(self._hp_gather)
                # The last rank wrote final before its zero step, and this rank's step could not end
                # before every rank's had begun: if final is that step, it is there now.
                if store.check([f"{key}/final"]):
                    final_step, last = map(int, store.get(f"{key}/final").decode().split(":"))
                    if final_step == step:
                        return last
        finally:
            self._hp_joined = False
            self._hp_synchronized = False
            for _, p in self._hp_named:
                p.grad = None

    def reset(self) -> None:
        """After a failed synchronization (RuntimeError from step()/synchronize()), makes the
        optimizer usable again: waits for the tasks still running (at most HIPRESS_TIMEOUT_S),
        drops the failed step (its gradients are left as they are; its compressor and momentum
        state changes are undone when ``nonfinite`` is not "off"), and opens fresh connections to
        the peers. Collective: every rank calls it (those that failed and those that did not), and
        it returns once all have. Also fine to call when nothing failed (drops the current step)."""
        if self._hp_dear is not None:
            raise RuntimeError("hipress reset(): not supported with strategy='dear'; wrap the optimizer again")
        deadline = config.get("HIPRESS_TIMEOUT_S")
        engine = self._hp_engine
        # a no-op on each queue runs once whatever is running there now has finished
        fences = [engine.submit("reset.fence", lambda: None, queue=q) for q in ("comm", "compute")]
        end = time.monotonic() + deadline
        for h in [*fences, self._hp_late_agreement, *self._hp_handles.values()]:
            if h is None:
                continue
            if not h.wait(max(0.0, end - time.monotonic())):
                raise RuntimeError(f"hipress reset(): task '{h.name}' still runs after {deadline:g} s "
                                   f"(HIPRESS_TIMEOUT_S); {self._hp_waiting_for()}")
        self._hp_handles.clear()
        self._hp_averaging, self._hp_averaged = [], []
        self._hp_late_agreement = None
        self._hp_layout_check = "open"
        self._hp_counts.clear()
        self._hp_taken.clear()
        self._hp_filled.clear()
        self._hp_held = []
        self._hp_found_finite.clear()
        self._hp_bad = set()
        self._hp_undo()
        self._hp_skip_step = self._hp_synchronized = False
        # the failed step's time is no measurement
        for search in (self._hp_tuner, self._hp_trial, self._hp_coord_trial):
            if search is not None:
                search.restart_window()
        # the exchanges in use, and under coordinator="auto" the other set too (it may switch back)
        exchange_sets = {id(e): e for e in (self._hp_exchanges, self._hp_direct, self._hp_coordinated)
                         if e is not None}.values()
        for ex in exchange_sets:
            ex.reset()
        if self._hp_transport.size > 1:
            world.reconnect()
            for ex in exchange_sets:  # (the coordinated ones: a new executor, collectively)
                ex.rebind(world.transport(), world.local_transport(), world.cross_transport())
            self._hp_transport = world.transport()
            self._hp_control = world.control_transport() if self._hp_guard else None
        self._hp_failure = None

    def step(self, closure=None):
        if self._hp_dear is not None:
            return self._hp_dear_step(closure)
        if self._hp_skip:
            if not self._hp_synchronized:
                raise RuntimeError("step() inside skip_synchronize() needs an explicit synchronize() first")
        else:
            self.synchronize()
        self._hp_check_usable()
        self._hp_synchronized = False
        if self._hp_skip_step:  # a rank's gradient was not finite (see synchronize()): not taken
            self._hp_skip_step = False
            out = None
        else:
            with self._hp_momentum.plain_step() if self._hp_momentum is not None else contextlib.nullcontext():
                out = super(self.__class__, self).step(closure)
        self._hp_mark_ns = _C.now_ns()
        if self._hp_covap is not None and self._hp_covap.profiling:
            self._hp_covap.step_end(self._hp_mark_ns * 1e-9)
        return out

    def _hp_dear_step(self, closure):
        """step() of strategy="dear": waits for this step's reduce-scatters (and agrees on
        non-finite gradients), queues every bucket's all-gather in forward order and defers the
        update to the bucket's first use (hipress/torch/dear.py). Returns None."""
        if closure is not None:
            raise ValueError("strategy='dear' defers the update to the next forward, so step() takes no closure")
        if self._hp_skip:
            raise RuntimeError("strategy='dear' has no synchronize()-then-step() form: call step() without "
                               "skip_synchronize()")
        # the all-gathers' sizes follow from the layout this step's reduce-scatters compared
        agreed = self._hp_layout_check == "compared"
        t0 = _C.now_ns() if self._hp_timeline else 0
        self._hp_wait_gradients()
        if self._hp_timeline:
            self._hp_engine.timeline_slice(3, "step.wait.reduce_scatters", t0, _C.now_ns())
        self._hp_synchronized = False
        if self._hp_skip_step:  # a rank's gradient was not finite: nothing gathered, nothing updated
            self._hp_skip_step = False
            return None
        hyper = dear.hyperparameters(self.param_groups)
        for bucket in self._hp_dear.forward_order:
            handle = None
            if self._hp_transport.size > 1:
                sync, bounds = self._hp_route(bucket)
                check = {"sizes_agreed": True} if agreed and sync.strategy.writes_into else {}
                handle = sync.all_gather(bucket.name, bucket.flat, bounds, **check)
            self._hp_dear.defer(bucket, handle, hyper)
        self._hp_mark_ns = _C.now_ns()
        return None

    def _hp_dear_update(self, bucket: "_Bucket", hyper: List[dict]) -> None:
        """The wrapped optimizer's step on ``bucket``'s parameters alone, with their averaged
        gradient and the settings of the step() that deferred it: every other parameter's
        gradient is None meanwhile (torch optimizers skip those; per-parameter state such as
        Adam's step count advances once per step), and every gradient is restored after."""
        saved = [(p, p.grad) for g in self.param_groups for p in g["params"]]
        try:
            for p, _ in saved:
                p.grad = None
            for (_, p), off in zip(bucket.params, bucket.offsets):
                g = bucket.flat[off:off + p.numel()].view(p.shape)
                p.grad = g if (p.dtype == g.dtype and p.device == g.device) else g.to(p.device, p.dtype)
            with dear.using_hyperparameters(self.param_groups, hyper), \
                    (self._hp_momentum.plain_step() if self._hp_momentum is not None else contextlib.nullcontext()):
                super(self.__class__, self).step()
        finally:
            for p, g in saved:
                p.grad = g

    def zero_grad(self, set_to_none: bool = True):
        if (self._hp_handles or self._hp_taken) and self._hp_failure is None:
            raise RuntimeError("zero_grad() called while gradients are being synchronized; call step() "
                               "or synchronize() first")
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        if self._hp_dear is not None:
            self._hp_dear.flush()  # the state of the last step() taken
        sd = super(self.__class__, self).state_dict()
        states = self._hp_states.state_dict()
        sd["hipress"] = {"compressor_state": states}
        owners = self._hp_state_owners() if states else None
        if owners is not None:  # what each state's residual stands for, and among how many ranks (_hp_load_states)
            sd["hipress"]["state_owners"] = {k: owners[k] for k in states if k in owners}
            sd["hipress"]["state_ranks"] = self._hp_transport.size
        layout = self._hp_compressed.layout_state()
        if layout:  # the choices made on first sight (PS's aggregators), which the states follow
            sd["hipress"]["sync_layout"] = layout
        if self._hp_momentum is not None:
            sd["hipress"]["velocity"] = self._hp_momentum.state_dict()
        if self._hp_covap is not None:
            # the local mode's averages the next step applies: what they add to the parameters
            # (first: applying one sets its unit's reference, which the run's state holds)
            averages = covap.averages_state(self._hp_wait_averages())
            sd["hipress"]["covap"] = dict(self._hp_covap.state_dict(), averages=averages)
        if self._hp_carry:  # residuals handed back (rebuild, plan switch, another layout's checkpoint), not sent
            sd["hipress"]["carry"] = {self._hp_names[k]: v.clone() for k, v in self._hp_carry.items()}
        if self._hp_tuner is not None:  # the layout the compressor states belong to, and where the search is
            sd["hipress"]["bucket_tune"] = {"tuner": self._hp_tuner.state_dict()}
        if self._hp_trial is not None:  # the plan the compressor states belong to, and where the trial is
            sd["hipress"]["plan_trial"] = {"trial": self._hp_trial.state_dict()}
        if self._hp_coord_trial is not None:  # where the trial is, so a resumed job does not measure again
            sd["hipress"]["coordinator_trial"] = self._hp_coord_trial.state_dict()
        if self._hp_plan_profile is not None:
            sd["hipress"]["plan_profile"] = self._hp_plan_profile.to_dict()
        return sd

    def _hp_state_owners(self) -> Optional[Dict[str, List[List]]]:
        """Every compressor-state key of the current layout, with the parameter pieces its
        per-element buffers (a residual) stand for: [name, offset in the parameter, offset in the
        buffer, elements] (state_spans: the elements of the bucket each key's buffers cover).
        None where a strategy does not list its keys (the low-rank one: its states are per matrix)."""
        owners = {}
        for b in self._hp_buckets:
            sync, bounds = self._hp_route(b)
            try:
                spans = sync.state_spans(b.name, bounds)
            except NotImplementedError:
                return None
            owners.update(state_layout.owners_of(spans, b.params, b.offsets))
        if self._hp_covap is not None:  # COVAP: each unit's sync has states of its own
            for name, t, r in self._hp_covap.unit_layouts():
                b = self._hp_bucket_named[name]
                owners.update(state_layout.owners_of(self._hp_compressed.state_spans(f"{name}/u{t}", [r]),
                                                     b.params, b.offsets))
        return owners

    def _hp_load_states(self, hp: dict) -> None:
        """load_state_dict(): the compressor states, where they belong to this optimizer's layout.
        Saved with another one (another number of ranks: ring chunks and PS's choice of aggregators
        follow it; other buckets), each error-feedback residual goes, element by element, to the
        parameter it stands for, and into this rank's next gradient (the carry, as a rebuild hands
        back); the states start afresh, as a job of this layout does. State that is not a residual
        (DGC's momentum) has no such home: a ValueError says so."""
        saved, owners = hp["compressor_state"], hp.get("state_owners")
        mine = self._hp_state_owners() if owners is not None else None
        if mine is None or state_layout.same_layout(saved, owners, hp.get("state_ranks"), mine,
                                                    self._hp_transport.size):
            self._hp_states.load_state_dict(saved)
            self._hp_compressed.load_layout_state(hp.get("sync_layout", {}))
            return
        by_name = dict(self._hp_named)
        carry = state_layout.residuals_by_parameter(saved, owners, {n: p.numel() for n, p in by_name.items()},
                                                    self._hp_unmovable_state())
        self._hp_states.load_state_dict({})
        self._hp_compressed.forget_layout()
        for name, acc in carry.items():
            self._hp_add_carry(by_name[name], acc.view(by_name[name].shape))
        warnings.warn(state_layout.moved_warning(len(carry)))

    def _hp_load_plan_profile(self, hp: dict) -> None:
        """load_state_dict(), a plan made from the model: where the checkpoint's profile is of the
        same kind (world size, strategy, device, algorithm) but measured other figures than this
        optimizer's (a profile taken anew at start-up, the link timed again), the plans are made
        again from the checkpoint's, with this optimizer's plan= pins: a resumed job runs the plans
        the saved compressor states belong to, and its trial goes on between the same candidates."""
        saved = hp.get("plan_profile")
        mine = self._hp_plan_profile
        if saved is None or mine is None or saved == mine.to_dict():
            return
        prof = Profile.from_dict(saved, source="the checkpoint's plan_profile", accept_older=True)
        if prof.key != mine.key:
            return  # another kind of job (e.g. another world size): its own profile plans it
        self._hp_plans, self._hp_trial = self._hp_make_plans(self._hp_plan_option, self._hp_fusion_bytes, prof)
        self._hp_compressed.forget_layout()
        self._hp_set_buckets(self._hp_plan_layout(self._hp_trial.in_use if self._hp_trial is not None else "model"))

    def _hp_load_trial(self, hp: dict) -> None:
        """load_state_dict(), plan="auto" measured: the trial's state, and the candidate plan in
        force when the checkpoint was saved, with its buckets (the compressor states and velocities
        loaded next belong to them; this optimizer's own are replaced, so nothing is handed over).
        A checkpoint of a plan without a trial ran the model's plan."""
        saved = hp.get("plan_trial")
        if self._hp_trial is None:
            carry = _saved_carry(hp)
            if saved is not None and (carry or saved["trial"]["in_use"] != "model"):
                raise ValueError(f"the checkpoint was saved with plan='auto' measuring its candidates, "
                                 f"{saved['trial']['in_use']!r} plan in force"
                                 f"{' with residuals not yet sent' if carry else ''}; this optimizer has no "
                                 f"such choice (plan= a Plan, measure=0, or nothing compressed): resume with the "
                                 f"plan= it was saved with")
            return
        if saved is None:  # saved with the model's plan alone (measure=0): it goes on with it
            self._hp_trial.settle("model")
        else:
            self._hp_trial.load_state_dict(saved["trial"])
        self._hp_compressed.forget_layout()
        self._hp_set_buckets(self._hp_plan_layout(self._hp_trial.in_use))

    def _hp_load_tuning(self, hp: dict) -> None:
        """load_state_dict(), bucket_bytes="tune": the tuner's state, and the buckets of the size in
        force when the checkpoint was saved (the compressor states loaded next belong to them; this
        optimizer's own states are replaced, so nothing is carried)."""
        saved = hp.get("bucket_tune")
        if self._hp_tuner is None:
            carry = _saved_carry(hp)
            if saved is not None and _holds_buffers(hp["compressor_state"]) and (
                    carry or saved["tuner"]["size"] != self._hp_bucket_bytes or self._hp_first_bucket_bytes):
                raise ValueError(f"the checkpoint was saved with bucket_bytes='tune' at {saved['tuner']['size']} bytes"
                                 f"{' with residuals not yet sent' if carry else ''}; its compressor states "
                                 f"belong to those buckets: resume with bucket_bytes='tune' (or bucket_bytes="
                                 f"{saved['tuner']['size']} once nothing waits to be sent)")
            return
        if saved is None:
            if _holds_buffers(hp["compressor_state"]):
                raise ValueError("the checkpoint was saved without bucket_bytes='tune': its compressor states belong "
                                 "to buckets of another size; resume with the bucket_bytes it was saved with")
            return
        self._hp_tuner.load_state_dict(saved["tuner"])
        self._hp_bucket_bytes = self._hp_tuner.size
        self._hp_compressed.forget_layout()
        self._hp_set_buckets(self._hp_build_buckets())

    def _hp_load_carry(self, hp: dict) -> None:
        """load_state_dict(): the residuals handed back and not sent yet, by parameter (this
        optimizer's own carry is replaced); added to the next step's gradients."""
        carry = _saved_carry(hp)
        by_name = dict(self._hp_named)
        unknown = sorted(set(carry) - set(by_name))
        if unknown:
            raise ValueError(f"the checkpoint's carry names parameters this optimizer lacks: {unknown[:10]}")
        self._hp_carry = {id(by_name[n]): v.clone() for n, v in carry.items()}
        self._hp_carry_sent = {}

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        hp = state_dict.pop("hipress", None)
        if self._hp_dear is not None:
            self._hp_dear.flush()  # pending updates belong to the state being replaced
        super(self.__class__, self).load_state_dict(state_dict)
        if hp is not None:
            if self._hp_covap is not None and "covap" in hp:  # first: its filter's units are part of the layout
                self._hp_covap.load_state_dict(hp["covap"])
                saved = hp["covap"].get("averages", [])
                unknown = sorted({a["bucket"] for a in saved} - set(self._hp_bucket_named))
                if unknown:
                    raise ValueError(f"the checkpoint's COVAP averages name buckets this optimizer lacks: {unknown[:5]}")
                self._hp_averaged = covap.averages_from_state(saved)
            self._hp_load_tuning(hp)
            self._hp_load_plan_profile(hp)
            self._hp_load_trial(hp)
            if self._hp_coord_trial is not None and "coordinator_trial" in hp:
                # where the saved job's trial was (every rank loads the same point): its exchanges in force
                self._hp_coord_trial.load_state_dict(hp["coordinator_trial"])
                self._hp_use_coordinator(self._hp_coord_trial.in_use == "on")
            self._hp_load_carry(hp)
            self._hp_load_states(hp)  # (adds to the carry where the states do not fit this layout)
            if self._hp_momentum is not None:
                self._hp_momentum.load_state_dict(hp.get("velocity", {}))


def _plan_measure(plan) -> Optional[int]:
    """Overrides.measure of a plan= option (None: no plan, or a Plan used as is)."""
    if isinstance(plan, Overrides):
        return plan.measure
    if isinstance(plan, dict):
        return plan.get("measure", Overrides.measure)
    return Overrides.measure if plan == "auto" else None


def _saved_carry(hp: dict) -> dict:
    """A checkpoint's carry, by parameter name (held inside "bucket_tune" or "plan_trial" by
    checkpoints written before it had an entry of its own)."""
    if "carry" in hp:
        return hp["carry"]
    return next((hp[k]["carry"] for k in ("bucket_tune", "plan_trial") if "carry" in hp.get(k, {})), {})


def _holds_buffers(states: dict) -> bool:
    """Whether saved compressor states hold any per-element buffer (a residual); uncompressed
    ring syncs save states without any."""
    return any(st.get("buffers") for st in states.values())


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters=None, compression="none",
                         strategy: str = "auto", backward_passes_per_step: int = 1, op: str = Average,
                         partition_bytes: Optional[int] = 64 << 20, local_aggregation="auto", plan=None,
                         coordinator=None, bucket_bytes="auto",
                         grad_clip="auto", momentum_correction="auto", nonfinite: str = "skip",
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups=None,
                         sparse_as_dense: bool = False, model: Optional[torch.nn.Module] = None,
                         bucket_tune: Optional[dict] = None, **compression_kwargs):
    """Wraps ``optimizer`` so that step() uses gradients averaged over all ranks.

    compression: an algorithm name of ``hipress.compression`` ("none", "onebit", "tbq",
    "terngrad", "dgc", "graddrop", "powersgd", or a registered user one) or a
    Compressor instance; extra keyword arguments configure it.
    strategy: "ring", "ps", "allgather", "dear" or "auto" (default: the fastest the algorithm's
    accuracy allows; see hipress.sync.factory and docs/convergence.md). "dear" (paper 001,
    docs/dear.md; needs ``model=``): each bucket's ring reduce-scatter runs in backward, step()
    queues the all-gathers and returns, and each bucket's parameters are updated by this
    optimizer just before their first use in the next forward (forward pre-hooks on ``model``'s
    modules); synchronize() and state_dict() first apply what is pending. partition_bytes: gradients larger than this are
    split into partitions that pipeline independently (None: never); under PS without a plan, a bucket of at least
    4 MiB per rank is also split into one partition per rank, so every rank aggregates a share of it.
    local_aggregation: "auto" (default) reduces uncompressed among ranks of one host and
    compresses only across hosts, when there are several hosts with several ranks each;
    True/False force it on/off.
    plan: selective compression and partitioning (paper §3.3). "auto" profiles encode,
    decode and the link once (cached; see hipress.planner) and then, per gradient,
    compresses only where the cost model says it pays and picks the partition count, and
    sends the rest as fp32 or, where the backend sums bf16 and it pays, bf16 (docs/planner.md);
    a hipress.planner.Overrides (or a dict of its fields) pins thresholds on top of "auto";
    a Plan is used as is. Where the model's plan compresses something, the first steps measure
    it against the plan that compresses nothing (Overrides.measure steps each, 10 by default; 0:
    no measuring) and the faster is kept (hipress/torch/plan_trial.py, ``opt.plan_trial``).
    compression="auto" means TernGrad with plan="auto".
    compression="covap": COVAP's filter (paper 004; hipress/torch/covap.py, docs/covap.md): each
    step syncs only the buckets (or shards of large ones) whose index t has (t + step) % I == 0.
    mode="local" (default): every rank applies its own gradient every step and the selected
    units' parameters are averaged across ranks (call ``opt.synchronize()`` between steps on
    every rank to average them all, before evaluation or a checkpoint), sent as fp32 parameters
    (wire="fp32", default) or as bf16 differences from the last average (wire="bf16"); mode="paper": the rest
    waits in a residual (the paper's Algorithm 1), with ef_init=0.5, ascend_steps=50,
    ascend_range=0.1 (the residual's coefficient schedule) and inner="none" (the algorithm that
    compresses what is sent, with its own keywords). Both: interval ("auto": ceil(CCR),
    profiled over the first profile_steps=5 steps after one warm-up, at most max_interval, 8
    in mode "local" and 4 in mode "paper"; or an int), shard=True. ``opt.covap_profile`` holds
    the profile; ``opt.covap_reprofile()`` measures again.
    bucket_bytes: tensor fusion: gradients smaller than this share buffers, synced (and
    planned, compressed, partitioned) as one, until an exchange of the buffer sends this
    many bytes (None or 0: every gradient alone). "auto" (default): 25 MiB where every bucket
    goes through the backend's allreduce uncompressed (compression="none", no plan, COVAP,
    dear or coordinator), 4 MiB for a single-round compressor, plan or not (not beside COVAP or
    dear, nor for a quantizer on the ring: its partitions span tensors under one scale), else
    1 MiB (auto_bucket_bytes). Multi-round compressors such as PowerSGD
    send only factors, so more gradients share a buffer; each matrix is compressed whole.
    "tune": the size is searched while training by Bayesian optimisation (paper 001 §IV-B,
    DeAR; hipress/torch/bucket_tuner.py, docs/dear.md; needs optuna): each trial applies a size on
    every rank, lets ``warmup`` steps pass and measures ``window`` steps; its objective is the
    slowest rank's mean step time. Trial 0 is 25 MiB (clamped to the range), the others are
    proposed by optuna's GPSampler (log expected improvement over log2 bytes); after ``trials``
    trials the best measured size is kept for good and rank 0 prints it once. Rank 0 decides and
    broadcasts; every rank rebuilds its buckets at the same step (the first final gradient of a
    step; under dear, after the last step's updates), and the residuals of error-feedback
    compressors are added to the next step's gradients, so none is lost. With strategy ring, ps,
    allgather or dear, and compression "none" or a single-round algorithm whose state is a residual
    only (not DGC or Signum: their momentum has no place to go; not low-rank ones); not with
    plan=, groups= or compression="covap" (ValueError). ``opt.bucket_tuner`` shows the search;
    ``state_dict()`` carries it, so a resumed job goes on as the uninterrupted one would.
    bucket_tune: the tuner's knobs as a dict (bucket_bytes="tune" only): trials=20, window=10,
    warmup=1, min_bytes=1 MiB, max_bytes=256 MiB (capped at the bytes of the trainable
    gradients), start_bytes=25 MiB, startup_trials=3 (random trials before the GP proposes),
    seed=0, clock=None (a callable giving seconds; default time.perf_counter), verbose=True.
    grad_clip: clipping of each gradient before it is compressed (hipress.torch.clipping):
    "auto" (default) clips nothing (what measured best, docs/convergence.md cause 15); "paper"
    applies what the algorithm's paper prescribes (TernGrad: 2.5 sigma per layer) and nothing
    for the others; None turns it off; a callable (name, grad) is yours.
    momentum_correction: with a torch.optim.SGD with momentum, each rank applies the
    momentum (and weight decay) to its own gradient before compression and the SGD steps
    without them (hipress.torch.momentum; DGC's momentum correction, for every algorithm).
    "auto" (default): on for single-round compressors (not "none", not PowerSGD).
    coordinator: True batches compressed gradients' communication through the global coordinator
    (hipress.comm.coordinator; uncompressed buckets go beside it, through the backend's allreduce);
    "auto" measures it off, then on, for HIPRESS_COORDINATOR_TRIAL_STEPS steps each once training
    starts (after plan="auto"'s choice, with the plan kept) and keeps the faster, "on" only where
    it wins by more than 3% (``opt.coordinator_trial``; hipress/torch/plan_trial.py); None reads HIPRESS_COORDINATOR, and
    where that is unset: "auto" with compression="auto", else off.
    nonfinite: what a NaN or Inf in some rank's gradient does (hipress.torch.nonfinite). Each
    gradient is checked before clipping, momentum correction and compression (one sum per
    gradient), and every compressor/momentum state is copied on first change in a step.
    "skip" (default): every rank warns (hipress.torch.nonfinite.NonFiniteGradientWarning,
    naming the parameters and ranks), every state is restored, those parameters' gradients
    are NaN on every rank, and step() does not run the wrapped optimizer: the step is as if
    its batch had not been taken, on every rank; with a GradScaler (Horovod's pattern:
    synchronize(); scaler.unscale_(opt); with opt.skip_synchronize(): scaler.step(opt)) every
    rank finds inf and lowers its scale alike. "raise": the states are restored and
    synchronize()/step() raise NonFiniteGradientError on every rank. "off": no check, no
    copies (a non-finite value then corrupts compressor state for good).
    op: Average (default) or Sum of the gradients; Adasum (Horovod's, hipress/torch/adasum.py):
    each rank steps the wrapped optimizer on its own gradients and step() combines the ranks'
    parameter updates adaptively (a power of 2 ranks; nothing sent in backward; compression "none"
    or "fp16", the updates' dtype on the wire).
    gradient_predivide_factor, num_groups, groups, sparse_as_dense: Horovod's, same names and
    meaning (docs/horovod.md). gradient_predivide_factor=f (op=Average only): each gradient is
    divided by f before the sync and multiplied by f after it (f / size of the sum). groups=n
    (num_groups=n is its deprecated name): the trainable parameters, in the optimizer's order,
    cut into n runs, each synchronized as one bucket; groups=[[p, ...], ...]: each list one
    bucket, the parameters in none fused as usual (bucket_bytes). sparse_as_dense=True: a sparse
    gradient (nn.Embedding(sparse=True)) is made dense, synchronized, and made sparse again;
    without it a sparse gradient raises ValueError.

    Every rank must wrap with the same configuration: wrapping compares it across ranks and
    raises ValueError on every rank naming the differing ranks and fields. After a failed step
    (RuntimeError naming the peers), ``opt.reset()`` on every rank makes it usable again;
    ``opt.join()`` lets a rank out of data serve the others' steps (docs/reliability.md).
    Returns the same optimizer object, whose class is now a subclass of its old class.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if hasattr(optimizer, "_hipress_setup"):
        raise ValueError("this optimizer is already wrapped by hipress.DistributedOptimizer")
    if strategy == "dear":
        if not isinstance(model, torch.nn.Module):
            raise ValueError("strategy='dear' needs model= (the torch.nn.Module whose parameters the optimizer "
                             "updates): each bucket is updated in a forward pre-hook of the modules that hold it")
        if named_parameters is None:
            named_parameters = model.named_parameters()
    elif model is not None:
        raise ValueError(f"model= is used by strategy='dear' only, not by strategy={strategy!r}")
    named = _resolve_named_parameters(optimizer, named_parameters)
    if op == Adasum:  # updates combined in step(), nothing synchronized in backward (hipress/torch/adasum.py)
        fixed = {"strategy": (strategy, "auto"), "plan": (plan, None),
                 "gradient_predivide_factor": (gradient_predivide_factor, 1.0), "groups": (groups, None),
                 "num_groups": (num_groups, 0), "sparse_as_dense": (sparse_as_dense, False),
                 "grad_clip": (grad_clip, "auto"), "momentum_correction": (momentum_correction, "auto"),
                 "local_aggregation": (local_aggregation, "auto")}
        changed = sorted(k for k, (given, default) in fixed.items() if given is not default and given != default)
        if bucket_bytes == "tune" or bucket_tune is not None:  # nothing is fused: there is no bucket to tune
            changed.append("bucket_bytes='tune'")
        if compression not in ("none", "fp16"):
            changed.insert(0, f"compression={compression!r}")
        if changed or compression_kwargs:
            raise ValueError(f"op=hipress.Adasum combines each rank's optimizer update in step() and sends nothing "
                             f"during backward; it takes none of {changed + sorted(compression_kwargs)} "
                             f"(only compression 'none' or 'fp16', backward_passes_per_step and nonfinite)")
        return adasum.wrap(optimizer, named, nonfinite, fp16=compression == "fp16")
    base = optimizer.__class__
    cls = type(base.__name__, (base,), {k: v for k, v in _HipressOptimizer.__dict__.items()
                                        if not k.startswith("__")} | {"__module__": base.__module__})
    options = Options(compression, compression_kwargs, strategy, backward_passes_per_step, op, partition_bytes,
                      local_aggregation, plan, coordinator, bucket_bytes, grad_clip, momentum_correction,
                      nonfinite=nonfinite, gradient_predivide_factor=gradient_predivide_factor,
                      groups=_horovod_groups(num_groups, groups), sparse_as_dense=bool(sparse_as_dense),
                      bucket_tune=bucket_tune)
    optimizer.__class__ = cls
    try:
        optimizer._hipress_setup(named, options, model)
    except Exception:
        optimizer.__class__ = base
        raise
    return optimizer


def _horovod_groups(num_groups, groups):
    """Horovod's deprecated ``num_groups`` is ``groups`` given as a count."""
    if not num_groups:
        return groups
    warnings.warn("DistributedOptimizer's num_groups is Horovod's deprecated name of groups; pass groups=",
                  DeprecationWarning, stacklevel=3)
    if groups is not None:
        raise ValueError(f"pass groups or num_groups, not both (num_groups={num_groups!r}, groups given)")
    return num_groups
