"""Horovod's collective API in the ``hipress`` namespace (``import hipress as hvd``).

    import hipress as hvd
    hvd.init()
    avg = hvd.allreduce(torch.tensor([loss]), name="avg_loss")           # Average by default
    rows = hvd.allgather(t)                                              # first dimensions may differ
    out, got = hvd.alltoall(t, splits=[2, 0, 1])                         # uneven splits
    part = hvd.reducescatter(t, op=hvd.Sum)
    ps = hvd.add_process_set([0, 2]); hvd.allreduce(t, process_set=ps)
    last = hvd.join()

Semantics follow Horovod 0.28's ``horovod.torch`` (argument names, defaults, return values,
autograd), built on hipress's byte transport (:mod:`hipress.comm.transport`):

* Every collective first all-gathers a small JSON description of each rank's call (operation,
  dtypes, shapes, reduction op, scale factors, root, splits, argument errors). Every rank checks
  the same descriptions, so a mismatch (shapes, dtypes, roots, ops, one rank calling a different
  collective) or a bad argument on one rank raises on *every* rank, naming the ranks, before a
  byte of data moves; the transport stays usable. The rank whose arguments were bad raises
  ``ValueError``; the others raise :class:`HorovodInternalError`.
* Reductions are deterministic and every rank gets bit-identical results: float32 Sum and
  Average use the backend's own allreduce where it has one (gloo, NCCL, MPI:
  ``Transport.allreduce``; its order of addition); every other reduction is reduced by one rank
  per element, in rank order (reduce-scatter over ``alltoallv``, then ``allgatherv``). Scale factors are applied as Horovod does: ``prescale_factor`` to each rank's input,
  ``postscale_factor`` (divided by the set size for Average) to the result, computed in double
  precision and cast back (integers truncate toward zero, so Average of integer tensors is
  ``trunc(sum / n)``).
* Asynchronous calls (``*_async``) run eagerly: the handle returned is already complete
  (``poll`` is True); a mismatch error is kept and raised by ``synchronize`` as in Horovod,
  argument errors raise at the call. This keeps one thread on the transport at a time.
* The collectives run on a private transport split off the world transport on first use, so
  they never interleave with the DistributedOptimizer's traffic.
* Every wait is bounded by ``HIPRESS_TIMEOUT_S`` (a rank that never arrives raises, never hangs);
  this includes a rank waiting in :func:`join`.

Not here: MPI-communicator process sets (``ProcessSet(comm)``), ``init(process_sets=...)``
(add them with :func:`add_process_set` after :func:`hipress.init`), sparse allreduce,
CUDA-aware transfers (CUDA tensors go through host memory). See docs/horovod.md.
"""
from __future__ import annotations

import contextlib
import io
import itertools
import json
import os
import threading
import time
import warnings
from typing import Dict, List, Optional, Sequence

import torch

from hipress.comm import world
from hipress.comm.transport.base import TransportError
from hipress.torch.compression import Compression

__all__ = [
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "HorovodInternalError",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async", "allgather_object",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async",
    "synchronize", "poll", "barrier", "join", "start_timeline", "stop_timeline",
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built",
    "ddl_built", "ccl_built", "cuda_built", "rocm_built", "sycl_built", "is_homogeneous",
]

# ---------------------------------------------------------------------------- reduction ops
# The values of Average and Sum are hipress's (hipress.Average, hipress.Sum of the optimizer).
Average = "average"
Sum = "sum"
Adasum = "adasum"
Min = "min"
Max = "max"
Product = "product"
_OPS = (Average, Sum, Adasum, Min, Max, Product)
# horovod.torch's constants are ints; accepted too, so hvd.Sum from a Horovod import works.
_HOROVOD_OP_CODES = {0: Average, 1: Sum, 2: Adasum, 3: Min, 4: Max, 5: Product}


class HorovodInternalError(RuntimeError):
    """A collective failed on this rank because of the other ranks (mismatched shapes, dtypes,
    roots or operations, another rank's bad arguments, a peer that died or timed out)."""


def _norm_op(op) -> str:
    if isinstance(op, bool):
        raise ValueError(f"op must be hipress.Average, Sum, Min, Max, Product or Adasum, got {op!r}")
    if isinstance(op, int) and op in _HOROVOD_OP_CODES:
        return _HOROVOD_OP_CODES[op]
    if isinstance(op, str) and op.lower() in _OPS:
        return op.lower()
    raise ValueError(f"op must be hipress.Average, Sum, Min, Max, Product or Adasum, got {op!r}")


def _resolve_op(op, average) -> str:
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average if op is None else _norm_op(op)


# ---------------------------------------------------------------------------- process sets
class ProcessSet:
    """A set of ranks that run collectives together (``process_set=`` of every collective).

    ``ProcessSet([0, 2])`` describes one; :func:`add_process_set` (called by every rank, in the
    same order) registers it and sets ``process_set_id``. Roots (``broadcast``'s ``root_rank``)
    stay global ranks, as in Horovod."""

    process_set_id = None
    ranks = None
    mpi_comm = None

    def __init__(self, ranks_or_comm):
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            raise ValueError("hipress process sets take a list of ranks (MPI communicators are not "
                             "supported)") from None
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError("ProcessSet should be initialized with a list of process ranks")
        self.ranks = ranks

    def _invalidate(self):
        self.process_set_id = None

    def size(self) -> Optional[int]:
        """Number of ranks, or None if not registered."""
        if self.process_set_id is None:
            return None
        return len(_set_ranks(self))

    def rank(self) -> Optional[int]:
        """This process's position in the set (None if not registered; ValueError if not a member)."""
        if self.process_set_id is None:
            return None
        ranks = _set_ranks(self)
        if world.rank() not in ranks:
            raise ValueError("Process is not part of provided process set.")
        return ranks.index(world.rank())

    def included(self) -> Optional[bool]:
        """Whether this process belongs to the set (None if it has no ranks yet)."""
        if self.process_set_id == 0:
            return True
        if self.ranks is None:
            return None
        return world.rank() in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm=None)"

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def _set_ranks(ps: ProcessSet) -> List[int]:
    if ps.process_set_id == 0:
        return list(range(world.size()))
    return list(ps.ranks)


class _State:
    """The private transport and the registered process sets of one world (one init)."""

    def __init__(self, base):
        self.base = base
        self.tr = base.split(0, key=base.rank)   # collective over the world: every rank is here
        self.sets: Dict[int, tuple] = {0: (global_process_set, self.tr)}
        self.next_id = 1


_state: Optional[_State] = None
_lock = threading.RLock()


def _get_state() -> _State:
    global _state
    world.init()  # hipress's convention (broadcast_parameters does the same): idempotent, collective
    with _lock:
        base = world.transport()
        if _state is None or _state.base is not base:
            for pid, (ps, _) in list((_state.sets if _state else {}).items()):
                if pid:
                    ps._invalidate()
            _state = _State(base)
            global_process_set.ranks = list(range(world.size()))
            world.on_shutdown(_forget)
        return _state


def _forget() -> None:
    global _state
    with _lock:
        if _state is not None:
            for pid, (ps, _) in _state.sets.items():
                if pid:
                    ps._invalidate()
        _state = None


def _set_transport(process_set):
    """(state, process set, its transport) for an operation; ValueError if unusable here."""
    world.quiesce()  # nothing of hipress's still in flight beside this operation (nor _get_state's first round)
    st = _get_state()
    ps = global_process_set if process_set is None else process_set
    if not isinstance(ps, ProcessSet):
        raise ValueError(f"process_set must be a hipress.ProcessSet, got {type(ps).__name__}")
    entry = st.sets.get(ps.process_set_id) if ps.process_set_id is not None else None
    if entry is None or entry[0] is not ps:
        raise ValueError(f"{ps} has not been registered: call hipress.add_process_set() on every rank first")
    if entry[1] is None:
        raise ValueError("Process is not part of provided process set.")
    return st, ps, entry[1]


def add_process_set(process_set) -> ProcessSet:
    """Registers a process set (a :class:`ProcessSet` or a list of ranks) and returns it.

    Collective over all ranks, which must pass the same ranks in the same order of calls; a
    disagreement raises ``ValueError`` on every rank. Adding a set with the ranks of one that is
    registered already (the global set included) raises ``ValueError``."""
    st = _get_state()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    n = world.size()
    err = None
    if ps.process_set_id is not None:
        err = f"{ps} is registered already"
    elif not ps.ranks or len(set(ps.ranks)) != len(ps.ranks) or any(not 0 <= r < n for r in ps.ranks):
        err = f"process set ranks {ps.ranks} must be distinct ranks in [0, {n})"
    metas = _exchange(st.tr, {"op": "add_process_set", "ranks": ps.ranks, "err": err})
    if err:
        raise ValueError(err)
    bad = [i for i, m in enumerate(metas) if m.get("op") != "add_process_set" or m.get("err")]
    if bad:
        raise ValueError(f"add_process_set: rank(s) {bad} did not add a valid process set at this point "
                         "(see their errors)")
    groups = _group_values([(i, m["ranks"]) for i, m in enumerate(metas)])
    if len(groups) > 1:
        raise ValueError("add_process_set: ranks disagree on the set: " + _describe(groups))
    for pid, (other, _) in st.sets.items():
        if _set_ranks(other) == ps.ranks:
            raise ValueError(f"Attempted to add a duplicate process set: {ps}")
    sub = st.tr.subgroup(ps.ranks)
    ps.process_set_id = st.next_id
    st.next_id += 1
    st.sets[ps.process_set_id] = (ps, sub)
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregisters a process set (call it on every rank); False for the global set or one that is
    not registered. The set object becomes invalid."""
    if not isinstance(process_set, ProcessSet) or process_set.process_set_id in (None, 0):
        return False
    with _lock:
        st = _state
        if st is None:
            return False
        entry = st.sets.get(process_set.process_set_id)
        if entry is None or entry[0] is not process_set:
            return False
        del st.sets[process_set.process_set_id]
    if entry[1] is not None:
        try:
            entry[1].close()
        except Exception:  # noqa: BLE001 - best effort
            pass
    process_set._invalidate()
    return True


# ---------------------------------------------------------------------------- metadata round
_BLOCK = 504  # bytes of JSON that fit the first round (plus an 8-byte length)


def _exchange(tr, d: dict) -> List[dict]:
    """All-gathers one JSON-able dict from every rank of ``tr`` (index = rank in ``tr``)."""
    raw = json.dumps(d, separators=(",", ":")).encode()
    n = tr.size
    if n == 1:
        return [json.loads(raw)]
    block = torch.zeros(_BLOCK + 8, dtype=torch.uint8)
    block[:8] = torch.tensor([len(raw)], dtype=torch.int64).view(torch.uint8)
    if len(raw) <= _BLOCK:
        block[8:8 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    allb = torch.empty(n * (_BLOCK + 8), dtype=torch.uint8)
    _call(tr.allgather, block, allb)
    rows = allb.view(n, _BLOCK + 8)
    lengths = [int(rows[i, :8].clone().view(torch.int64)[0]) for i in range(n)]
    if max(lengths) <= _BLOCK:
        return [json.loads(bytes(rows[i, 8:8 + lengths[i]].tolist())) for i in range(n)]
    full = torch.empty(sum(lengths), dtype=torch.uint8)
    _call(tr.allgatherv, torch.frombuffer(bytearray(raw), dtype=torch.uint8), full, lengths)
    out, off = [], 0
    for L in lengths:
        out.append(json.loads(bytes(full[off:off + L].tolist())))
        off += L
    return out


def _call(fn, *args):
    """A transport call; its failures become HorovodInternalError (as Horovod's do)."""
    try:
        return fn(*args)
    except TransportError as e:
        raise HorovodInternalError(str(e)) from e


def _group_values(pairs):
    """[(rank, value)] -> [(value, [ranks])] in order of first appearance."""
    groups: list = []
    for r, v in pairs:
        for g in groups:
            if g[0] == v:
                g[1].append(r)
                break
        else:
            groups.append((v, [r]))
    return groups


def _describe(groups) -> str:
    return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {v}" for v, rs in groups)


# ---------------------------------------------------------------------------- tensors <-> bytes
_DTYPES = {str(d): d for d in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                               torch.bfloat16, torch.float32, torch.float64, torch.bool)}


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype)


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def _from_bytes(b: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    if b.numel() == 0:
        return torch.empty(shape, dtype=dtype)
    return b.view(dtype).reshape(shape)


def _tensor_err(t, kind: str, reduce: bool = False) -> Optional[str]:
    """Why ``t`` cannot take part in ``kind`` on this rank (None: it can)."""
    if not isinstance(t, torch.Tensor):
        return f"{kind} takes torch tensors, got {type(t).__name__}"
    if str(t.dtype) not in _DTYPES or (reduce and t.dtype == torch.bool):
        return f"Tensor type {t.type()} is not supported by {kind}."
    return None


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ---------------------------------------------------------------------------- agreement
_JOIN_OK = ("allreduce", "allgather", "broadcast", "barrier")


class _Round:
    """What every rank of a set called at one collective, checked the same way everywhere."""

    def __init__(self, kind: str, metas: List[dict], members: List[int]):
        self.metas, self.members = metas, members
        self.joined = [i for i, m in enumerate(metas) if m["op"] == "join"]
        self.active = [i for i, m in enumerate(metas) if m["op"] != "join"]
        self.kind = kind
        self.error: Optional[str] = None
        self.plan: Optional[dict] = None
        if not self.active:
            return
        g = [self.members[i] for i in range(len(metas))]  # set rank -> world rank
        kinds = _group_values([(g[i], metas[i]["op"]) for i in self.active])
        if len(kinds) > 1:
            self.error = "Mismatched collective operations: " + _describe(kinds)
            return
        self.kind = kinds[0][0]
        errs = [g[i] for i in self.active if metas[i].get("err")]
        if errs:
            self.error = (f"{self.kind}: rank(s) {errs} passed invalid arguments: "
                          + "; ".join(f"rank {g[i]}: {metas[i]['err']}" for i in self.active if metas[i].get("err")))
            return
        if self.joined and self.kind not in _JOIN_OK:
            self.error = (f"{self.kind} is not supported while rank(s) {[g[i] for i in self.joined]} "
                          "have joined (hipress.join)")
            return
        self.error = self._check(g)
        if self.error is None:
            self.plan = metas[self.active[0]]

    def _check(self, g) -> Optional[str]:
        act = [(g[i], self.metas[i]) for i in self.active]
        kind = self.kind

        def same(key, what, f=lambda m, k: m.get(k)):
            groups = _group_values([(r, f(m, key)) for r, m in act])
            if len(groups) > 1:
                return f"Mismatched {kind} {what}: " + _describe(groups)
            return None

        checks = [("count", "numbers of tensors", lambda m, k: len(m.get("t", [])))]
        if kind == "broadcast":
            checks.append(("root", "root ranks", None))
        if kind in ("allreduce", "reducescatter"):
            checks += [("rop", "reduction ops", None), ("pre", "prescale factors", None),
                       ("post", "postscale factors", None)]
        for key, what, f in checks:
            e = same(key, what, f) if f else same(key, what)
            if e:
                return e
        count = len(act[0][1].get("t", []))
        for j in range(count):
            suffix = f" (tensor {j} of the group)" if count > 1 else ""
            e = same(j, "data types" + suffix, lambda m, k: m["t"][k][0])
            if e:
                return e
            if kind in ("allgather", "alltoall"):
                e = same(j, "tensor ranks" + suffix, lambda m, k: len(m["t"][k][1]))
                if e:
                    return e
                e = same(j, "tensor shapes beyond the first dimension" + suffix, lambda m, k: m["t"][k][1][1:])
            else:
                e = same(j, "tensor shapes" + suffix, lambda m, k: m["t"][k][1])
            if e:
                return e
        if kind == "broadcast":
            root = act[0][1]["root"]
            if root not in g:
                return f"broadcast root rank {root} is not in the process set {g}"
            if g.index(root) in self.joined:
                return f"broadcast root rank {root} has joined (hipress.join)"
        if kind == "alltoall":
            n = len(g)
            bad = [r for r, m in act if len(m["splits"]) != n]
            if bad:
                return f"alltoall splits of rank(s) {bad} do not have {n} entries"
        return None


def _round(kind: str, tr, members: List[int], meta: dict) -> _Round:
    """One metadata round for an active call; raises on every rank if the ranks disagree."""
    meta = dict(meta, op=kind)
    if meta.get("name") is not None:
        meta["name"] = str(meta["name"])
    metas = _exchange(tr, meta)
    rd = _Round(kind, metas, members)
    if rd.error is not None:
        if meta.get("err"):
            raise ValueError(meta["err"])
        raise HorovodInternalError(rd.error)
    return rd


def _traced(kind: str):
    """Records the whole operation on the timeline (its ``name`` argument, else ``kind``)."""
    def wrap(fn):
        import functools
        import inspect

        pos = list(inspect.signature(fn).parameters).index("name")

        @functools.wraps(fn)
        def run(*args, **kw):
            if _timeline is None:
                return fn(*args, **kw)
            with _trace(kind, kw.get("name", args[pos] if len(args) > pos else None)):
                return fn(*args, **kw)
        return run
    return wrap


# ---------------------------------------------------------------------------- element-wise work
def _scale(t: torch.Tensor, f: float) -> torch.Tensor:
    """``t * f`` as Horovod scales: in double precision, cast back (integers truncate)."""
    if f == 1.0:
        return t
    if t.dtype == torch.float64:
        return t * f
    return (t.double() * f).to(t.dtype)


def _combine(parts: torch.Tensor, rop: str) -> torch.Tensor:
    """Reduces ``parts[0], parts[1], ...`` in rank order (the same order on every rank)."""
    acc = parts[0].clone()
    for p in parts[1:]:
        if rop in (Sum, Average):
            acc += p
        elif rop == Min:
            acc = torch.minimum(acc, p)
        elif rop == Max:
            acc = torch.maximum(acc, p)
        elif rop == Product:
            acc *= p
        else:  # pragma: no cover - validated before
            raise ValueError(rop)
    return acc


def _post_factor(rop: str, post: float, n: int) -> float:
    return post / n if rop == Average else post


def _bounds(total: int, n: int, unit: int = 1, first_heavy: bool = False) -> List[int]:
    """Split ``total`` items into n contiguous chunks; offsets (n + 1) times ``unit``."""
    if first_heavy:  # reducescatter: the first total % n ranks get one more row (Horovod's split)
        q, r = divmod(total, n)
        sizes = [q + (1 if i < r else 0) for i in range(n)]
    else:
        sizes = [total * (i + 1) // n - total * i // n for i in range(n)]
    out = [0]
    for s in sizes:
        out.append(out[-1] + s * unit)
    return out


def _reduce_scatter_flat(tr, flat: torch.Tensor, bounds: List[int], rop: str, post: float) -> torch.Tensor:
    """This rank's chunk ``[bounds[me], bounds[me+1])`` of the reduction of every rank's ``flat``."""
    n, me = tr.size, tr.rank
    esz = flat.element_size()
    m = bounds[me + 1] - bounds[me]
    if n == 1:
        return _scale(flat[bounds[0]:bounds[1]].clone(), _post_factor(rop, post, 1))
    send_counts = [(bounds[i + 1] - bounds[i]) * esz for i in range(n)]
    recv = torch.empty(n * m * esz, dtype=torch.uint8)
    if flat.numel():
        _call(tr.alltoallv, _as_bytes(flat), send_counts, recv, [m * esz] * n)
    parts = _from_bytes(recv, flat.dtype, (n, m))
    return _scale(_combine(parts, rop), _post_factor(rop, post, n))


def _allreduce_flat(tr, flat: torch.Tensor, rop: str, post: float) -> torch.Tensor:
    n, N = tr.size, flat.numel()
    if N == 0:
        return flat.clone()
    if rop in (Sum, Average) and flat.dtype == torch.float32 and n > 1 and tr.has_allreduce:
        # the backend's own collective (gloo/NCCL allreduce, MPI_Iallreduce): its algorithm and
        # its order of addition, the same bits on every rank (Transport.allreduce)
        out = flat.clone()
        _call(tr.allreduce, out)
        return _scale(out, _post_factor(rop, post, n))
    b = _bounds(N, n)
    mine = _reduce_scatter_flat(tr, flat, b, rop, post)
    if n == 1:
        return mine
    esz = flat.element_size()
    out = torch.empty(N, dtype=flat.dtype)
    _call(tr.allgatherv, _as_bytes(mine), _as_bytes(out), [(b[i + 1] - b[i]) * esz for i in range(n)])
    return out


def _adasum_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    dot = float(torch.dot(a, b))
    an, bn = float(torch.dot(a, a)), float(torch.dot(b, b))
    ac = 1.0 - dot / an * 0.5 if an >= 1e-8 else 1.0
    bc = 1.0 - dot / bn * 0.5 if bn >= 1e-8 else 1.0
    return ac * a + bc * b


def _adasum_flat(tr, flat: torch.Tensor, post: float) -> torch.Tensor:
    """Adasum over the ranks: pairs (0,1), (2,3), ... then pairs of those results (a binary
    tree, as Horovod's recursive doubling combines them), in double precision."""
    n, N = tr.size, flat.numel()
    if N == 0:
        return flat.clone()
    if n == 1:
        return _scale(flat.clone(), post)
    allb = torch.empty(n * N * flat.element_size(), dtype=torch.uint8)
    _call(tr.allgather, _as_bytes(flat), allb)
    vecs = list(_from_bytes(allb, flat.dtype, (n, N)).double())
    while len(vecs) > 1:
        vecs = [_adasum_pair(vecs[i], vecs[i + 1]) for i in range(0, len(vecs), 2)]
    return _scale(vecs[0].to(flat.dtype), post)


# ---------------------------------------------------------------------------- allreduce
@_traced("allreduce")
def _allreduce_impl(tensors: Sequence[torch.Tensor], rop: str, pre: float, post: float, process_set,
                    name: Optional[str], kind: str = "allreduce") -> List[torch.Tensor]:
    st, ps, tr = _set_transport(process_set)
    err = None
    for t in tensors:
        err = err or _tensor_err(t, kind, reduce=True)
    if err is None and rop == Adasum:
        if ps.process_set_id != 0:
            raise NotImplementedError("Adasum does not support non-global process sets yet.")
        if tr.size & (tr.size - 1):
            raise NotImplementedError("Running Adasum with non-power of 2 ranks is not supported yet.")
        if any(not t.dtype.is_floating_point for t in tensors):
            err = "Adasum takes floating point tensors"
    meta = {"name": name, "err": err, "rop": rop, "pre": float(pre), "post": float(post),
            "t": [] if err else [[_dtype_name(t), list(t.shape)] for t in tensors],
            "count": len(tensors)}
    rd = _round("allreduce", tr, _set_ranks(ps), meta)
    hosts = [_host(t) for t in tensors]
    return [r.to(t.device) for r, t in zip(_allreduce_data(tr, rd.plan, hosts), tensors)]


def _allreduce_data(tr, plan: dict, hosts: Optional[List[torch.Tensor]]) -> List[torch.Tensor]:
    """The data phase of an agreed allreduce; ``hosts`` None: this rank has joined (zeros)."""
    specs = [(_DTYPES[d], tuple(s)) for d, s in plan["t"]]
    if hosts is None:
        hosts = [torch.zeros(s, dtype=d) for d, s in specs]
    rop, pre, post = plan["rop"], plan["pre"], plan["post"]
    hosts = [_scale(h, pre) for h in hosts]
    out: List[Optional[torch.Tensor]] = [None] * len(hosts)
    if rop == Adasum:  # per tensor: the dot products are the tensor's own
        for j, h in enumerate(hosts):
            out[j] = _adasum_flat(tr, h.reshape(-1), post).reshape(specs[j][1])
        return out
    by_dtype: Dict[torch.dtype, List[int]] = {}
    for j, (d, _) in enumerate(specs):
        by_dtype.setdefault(d, []).append(j)
    for d, idx in by_dtype.items():  # one reduction per dtype (in order of first appearance)
        flat = torch.cat([hosts[j].reshape(-1) for j in idx]) if len(idx) > 1 else hosts[idx[0]].reshape(-1)
        red = _allreduce_flat(tr, flat, rop, post)
        off = 0
        for j in idx:
            k = _numel(specs[j][1])
            out[j] = red[off:off + k].reshape(specs[j][1])
            if len(idx) > 1:
                out[j] = out[j].clone()
            off += k
    return out


class _AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, rop, pre, post, process_set, name):
        ctx.args = (rop, pre, post, process_set)
        return _allreduce_impl([tensor], rop, pre, post, process_set, name)[0]

    @staticmethod
    def backward(ctx, grad):
        rop, pre, post, ps = ctx.args
        g = allreduce(grad, op=rop, prescale_factor=pre, postscale_factor=post, process_set=ps)
        return g, None, None, None, None, None


class _GroupedAllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rop, pre, post, process_set, name, *tensors):
        ctx.args = (rop, pre, post, process_set)
        return tuple(_allreduce_impl(list(tensors), rop, pre, post, process_set, name))

    @staticmethod
    def backward(ctx, *grads):
        rop, pre, post, ps = ctx.args
        gs = grouped_allreduce(list(grads), op=rop, prescale_factor=pre, postscale_factor=post, process_set=ps)
        return (None, None, None, None, None, *gs)


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """Reduces ``tensor`` over the ranks of ``process_set`` (default op: Average) and returns the
    result; ``tensor`` is not modified. Differentiable: the gradient is the allreduce of the
    output's gradient with the same op and factors (Horovod's definition).

    ``compression``: ``hipress.Compression.none`` (default), ``.fp16`` or a hipress algorithm,
    applied around the reduction (compress, reduce, decompress)."""
    rop = _resolve_op(op, average)
    compressed, ctx = compression.compress(tensor)
    out = _AllreduceFn.apply(compressed, rop, float(prescale_factor), float(postscale_factor), process_set, name)
    return compression.decompress(out, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    """In-place :func:`allreduce`: ``tensor`` receives the result and is returned."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set) -> int:
    """:func:`allreduce` returning a handle for :func:`synchronize` / :func:`poll` (not differentiable)."""
    rop = _resolve_op(op, average)
    return _submit(lambda: _allreduce_impl([tensor], rop, float(prescale_factor), float(postscale_factor),
                                           process_set, name)[0])


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set) -> int:
    rop = _resolve_op(op, average)

    def run():
        r = _allreduce_impl([tensor], rop, float(prescale_factor), float(postscale_factor), process_set, name)[0]
        return _assign(tensor, r)
    return _submit(run)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set):
    """:func:`allreduce` of a list of tensors in one operation; returns a list."""
    rop = _resolve_op(op, average)
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedAllreduceFn.apply(rop, float(prescale_factor), float(postscale_factor), process_set, name,
                                     *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0, process_set=global_process_set) -> int:
    rop = _resolve_op(op, average)
    tensors = list(tensors)
    return _submit(lambda: _allreduce_impl(tensors, rop, float(prescale_factor), float(postscale_factor),
                                           process_set, name))


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> int:
    rop = _resolve_op(op, average)
    tensors = list(tensors)

    def run():
        rs = _allreduce_impl(tensors, rop, float(prescale_factor), float(postscale_factor), process_set, name)
        return [_assign(t, r) for t, r in zip(tensors, rs)]
    return _submit(run)


def _assign(t: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        t.copy_(r)
    return t


# ---------------------------------------------------------------------------- allgather
@_traced("allgather")
def _allgather_impl(tensors: Sequence[torch.Tensor], process_set, name) -> tuple:
    """(outputs, rows[tensor][set rank])."""
    st, ps, tr = _set_transport(process_set)
    err = None
    for t in tensors:
        err = err or _tensor_err(t, "allgather")
        if err is None and t.dim() == 0:
            err = "allgather does not support scalar inputs (give it at least one dimension)"
    meta = {"name": name, "err": err, "count": len(tensors),
            "t": [] if err else [[_dtype_name(t), list(t.shape)] for t in tensors]}
    rd = _round("allgather", tr, _set_ranks(ps), meta)
    outs, rows = _allgather_data(tr, rd, [_host(t) for t in tensors])
    return [o.to(t.device) for o, t in zip(outs, tensors)], rows


def _allgather_data(tr, rd: _Round, hosts: Optional[List[torch.Tensor]]):
    plan, n = rd.plan, tr.size
    specs = [(_DTYPES[d], tuple(s[1:])) for d, s in plan["t"]]
    if hosts is None:
        hosts = [torch.zeros((0,) + rest, dtype=d) for d, rest in specs]
    rows = [[(rd.metas[i]["t"][j][1][0] if i in rd.active else 0) for i in range(n)] for j in range(len(specs))]
    rowbytes = [_numel(rest) * torch.empty(0, dtype=d).element_size() for d, rest in specs]
    per_rank = [sum(rows[j][i] * rowbytes[j] for j in range(len(specs))) for i in range(n)]
    send = torch.cat([_as_bytes(h) for h in hosts]) if hosts else torch.empty(0, dtype=torch.uint8)
    recv = torch.empty(sum(per_rank), dtype=torch.uint8)
    if sum(per_rank):
        if n == 1:
            recv.copy_(send)
        else:
            _call(tr.allgatherv, send, recv, per_rank)
    offs = [0]
    for c in per_rank:
        offs.append(offs[-1] + c)
    outs = []
    for j, (d, rest) in enumerate(specs):
        pieces = []
        for i in range(n):
            start = offs[i] + sum(rows[k][i] * rowbytes[k] for k in range(j))
            pieces.append(recv[start:start + rows[j][i] * rowbytes[j]])
        b = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)
        outs.append(_from_bytes(b.contiguous(), d, (sum(rows[j]),) + rest))
    return outs, rows


class _AllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, process_set, name):
        outs, rows = _allgather_impl([tensor], process_set, name)
        ctx.process_set, ctx.rows = process_set, rows[0]
        return outs[0]

    @staticmethod
    def backward(ctx, grad):
        g = allreduce(grad, op=Average, process_set=ctx.process_set)
        me = _my_set_rank(ctx.process_set)
        off = sum(ctx.rows[:me])
        return g.narrow(0, off, ctx.rows[me]), None, None


class _GroupedAllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, process_set, name, *tensors):
        outs, rows = _allgather_impl(list(tensors), process_set, name)
        ctx.process_set, ctx.rows = process_set, rows
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        gs = grouped_allreduce(list(grads), op=Average, process_set=ctx.process_set)
        me = _my_set_rank(ctx.process_set)
        return (None, None, *[g.narrow(0, sum(r[:me]), r[me]) for g, r in zip(gs, ctx.rows)])


def _my_set_rank(process_set) -> int:
    ps = global_process_set if process_set is None else process_set
    return _set_ranks(ps).index(world.rank())


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenates every rank's ``tensor`` along the first dimension (which may differ between
    ranks; the other dimensions and the dtype must agree). Differentiable: the gradient is this
    rank's rows of the averaged output gradient."""
    return _AllgatherFn.apply(tensor, process_set, name)


def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    return _submit(lambda: _allgather_impl([tensor], process_set, name)[0][0])


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """:func:`allgather` of a list of tensors in one operation; returns a list."""
    return list(_GroupedAllgatherFn.apply(process_set, name, *tensors))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    tensors = list(tensors)
    return _submit(lambda: _allgather_impl(tensors, process_set, name)[0])


# ---------------------------------------------------------------------------- objects
def _dumps(obj) -> bytes:
    try:
        import cloudpickle as pickler
    except ImportError:  # pragma: no cover - cloudpickle ships with most stacks
        import pickle as pickler
    b = io.BytesIO()
    pickler.dump(obj, b)
    return b.getvalue()


def _loads(b: bytes):
    import pickle

    return pickle.loads(b)  # noqa: S301 - trusted peers only, as in Horovod


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """Every rank's ``obj`` (pickled; trusted peers only), as a list in set rank order."""
    raw = _dumps(obj)
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    outs, rows = _allgather_impl([t], process_set, name or type(obj).__name__)
    data, sizes = outs[0], rows[0]
    res, off = [], 0
    for s in sizes:
        res.append(_loads(data[off:off + s].numpy().tobytes()))
        off += s
    return res


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """``root_rank``'s ``obj`` (pickled; trusted peers only) on every rank of the set."""
    _, ps, _ = _set_transport(process_set)
    me = world.rank()
    if me == root_rank:
        raw = _dumps(obj)
        sz = torch.tensor([len(raw)], dtype=torch.int64)
    else:
        sz = torch.zeros(1, dtype=torch.int64)
    name = name or type(obj).__name__
    broadcast_(sz, root_rank, name + ".sz", process_set)
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if me == root_rank and raw else \
        torch.empty(int(sz[0]), dtype=torch.uint8)
    broadcast_(t, root_rank, name + ".t", process_set)
    return obj if me == root_rank else _loads(t.numpy().tobytes())


# ---------------------------------------------------------------------------- broadcast
@_traced("broadcast")
def _broadcast_impl(tensor: torch.Tensor, root_rank: int, process_set, name) -> torch.Tensor:
    st, ps, tr = _set_transport(process_set)
    members = _set_ranks(ps)
    err = _tensor_err(tensor, "broadcast")
    if err is None and (isinstance(root_rank, bool) or not isinstance(root_rank, int) or root_rank not in members):
        err = f"broadcast received invalid root rank {root_rank!r} for provided process set ({members})"
    meta = {"name": name, "err": err, "count": 1, "root": root_rank if err is None else -1,
            "t": [] if err else [[_dtype_name(tensor), list(tensor.shape)]]}
    rd = _round("broadcast", tr, members, meta)
    return _broadcast_data(tr, rd, members, _host(tensor).clone()).to(tensor.device)


def _broadcast_data(tr, rd: _Round, members, host: Optional[torch.Tensor]) -> torch.Tensor:
    d, shape = rd.plan["t"][0]
    if host is None:
        host = torch.empty(shape, dtype=_DTYPES[d])
    if host.numel() and tr.size > 1:
        _call(tr.broadcast, _as_bytes(host), members.index(rd.plan["root"]))
    return host


class _BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, process_set, name):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return _broadcast_impl(tensor, root_rank, process_set, name)

    @staticmethod
    def backward(ctx, grad):
        g = allreduce(grad, op=Average, process_set=ctx.process_set)
        if world.rank() != ctx.root_rank:
            g = g * 0
        return g, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """``root_rank``'s ``tensor`` (a global rank, member of the set) on every rank; ``tensor`` is
    not modified. Differentiable: the root gets the averaged output gradient, the others zeros."""
    return _BroadcastFn.apply(tensor, root_rank, process_set, name)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """In-place :func:`broadcast`: ``tensor`` receives the root's values and is returned."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    return _submit(lambda: _broadcast_impl(tensor, root_rank, process_set, name))


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    return _submit(lambda: _assign(tensor, _broadcast_impl(tensor, root_rank, process_set, name)))


# ---------------------------------------------------------------------------- alltoall
@_traced("alltoall")
def _alltoall_impl(tensor: torch.Tensor, splits, process_set, name):
    """(output, received splits as int32)."""
    st, ps, tr = _set_transport(process_set)
    n = tr.size
    err = _tensor_err(tensor, "alltoall")
    sp: List[int] = []
    if err is None and tensor.dim() == 0:
        err = "alltoall does not support scalar inputs (give it at least one dimension)"
    if err is None:
        if splits is None:
            if tensor.shape[0] % n:
                err = ("splits not provided, but first dimension of tensor is not an even multiple of the "
                       "number of workers.")
            else:
                sp = [tensor.shape[0] // n] * n
        else:
            try:
                sp = [int(x) for x in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
            except (TypeError, ValueError):
                err = f"alltoall splits must be integers, got {splits!r}"
            if err is None and (len(sp) != n or any(x < 0 for x in sp)):
                err = f"alltoall splits {sp} must have {n} non-negative entries (one per rank of the set)"
            elif err is None and sum(sp) > tensor.shape[0]:
                err = f"alltoall splits {sp} sum to more than the first dimension {tensor.shape[0]}"
    meta = {"name": name, "err": err, "count": 1, "splits": sp if err is None else [],
            "t": [] if err else [[_dtype_name(tensor), list(tensor.shape)]]}
    rd = _round("alltoall", tr, _set_ranks(ps), meta)
    host = _host(tensor)
    d, shape = rd.plan["t"][0]
    rest = tuple(shape[1:])
    rowbytes = _numel(rest) * host.element_size()
    me = tr.rank
    recv_rows = [rd.metas[i]["splits"][me] for i in range(n)]
    send_counts = [s * rowbytes for s in sp]
    recv = torch.empty(sum(recv_rows) * rowbytes, dtype=torch.uint8)
    send = _as_bytes(host)
    if n == 1:
        recv.copy_(send[:recv.numel()])
    elif any(sum(m["splits"]) for m in rd.metas) and rowbytes:  # every rank decides alike
        _call(tr.alltoallv, send, send_counts, recv, [r * rowbytes for r in recv_rows])
    out = _from_bytes(recv, host.dtype, (sum(recv_rows),) + rest).to(tensor.device)
    return out, torch.tensor(recv_rows, dtype=torch.int32)


class _AlltoallFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, process_set, name):
        out, got = _alltoall_impl(tensor, splits, process_set, name)
        ctx.process_set, ctx.recvsplits = process_set, got
        if splits is None:
            return out
        ctx.mark_non_differentiable(got)
        return out, got

    @staticmethod
    def backward(ctx, grad, *unused):
        g, _ = alltoall(grad, splits=ctx.recvsplits, process_set=ctx.process_set)
        return g, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Sends ``splits[j]`` rows (first dimension) of ``tensor`` to rank j of the set and returns the
    rows received, in rank order. ``splits`` None: equal parts (the first dimension must divide
    by the set size) and only the output is returned; with ``splits``: ``(output,
    received_splits)``. Differentiable: the gradient is the alltoall of the output gradient
    with the received splits."""
    return _AlltoallFn.apply(tensor, splits, process_set, name)


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    return _submit(lambda: _alltoall_impl(tensor, splits, process_set, name))


# ---------------------------------------------------------------------------- reducescatter
@_traced("reducescatter")
def _reducescatter_impl(tensors: Sequence[torch.Tensor], rop: str, pre: float, post: float, process_set,
                        name) -> List[torch.Tensor]:
    st, ps, tr = _set_transport(process_set)
    err = None
    for t in tensors:
        err = err or _tensor_err(t, "reducescatter", reduce=True)
        if err is None and t.dim() == 0:
            err = "Reducescatter does not support scalar inputs"
    if err is None and rop not in (Average, Sum):
        err = "Reducescatter currently only supports Average and Sum."
    meta = {"name": name, "err": err, "rop": rop, "pre": float(pre), "post": float(post), "count": len(tensors),
            "t": [] if err else [[_dtype_name(t), list(t.shape)] for t in tensors]}
    try:
        _round("reducescatter", tr, _set_ranks(ps), meta)
    except ValueError as e:
        if rop not in (Average, Sum):  # Horovod raises this one as an internal error
            raise HorovodInternalError(str(e)) from None
        raise
    outs = []
    for t in tensors:
        h = _scale(_host(t), pre)
        rest = tuple(h.shape[1:])
        b = _bounds(h.shape[0], tr.size, _numel(rest), first_heavy=True)
        mine = _reduce_scatter_flat(tr, h.reshape(-1), b, rop, post)
        outs.append(mine.reshape((-1,) + rest).to(t.device))
    return outs


class _ReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, rop, pre, post, process_set, name):
        ctx.args = (rop, pre, post, process_set)
        return _reducescatter_impl([tensor], rop, pre, post, process_set, name)[0]

    @staticmethod
    def backward(ctx, grad):
        rop, pre, post, ps = ctx.args
        g = grad * _rs_grad_scale(rop, pre, post, ps)
        return allgather(g, process_set=ps), None, None, None, None, None


class _GroupedReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rop, pre, post, process_set, name, *tensors):
        ctx.args = (rop, pre, post, process_set)
        return tuple(_reducescatter_impl(list(tensors), rop, pre, post, process_set, name))

    @staticmethod
    def backward(ctx, *grads):
        rop, pre, post, ps = ctx.args
        f = _rs_grad_scale(rop, pre, post, ps)
        return (None, None, None, None, None, *grouped_allgather([g * f for g in grads], process_set=ps))


def _rs_grad_scale(rop, pre, post, ps) -> float:
    """Horovod's reducescatter gradient: allgather of the output gradient times the set size
    (Sum only) and both scale factors."""
    f = float(len(_set_ranks(global_process_set if ps is None else ps))) if rop == Sum else 1.0
    return f * pre * post


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduces ``tensor`` (same shape on every rank; ``op`` Average or Sum, as in Horovod) and
    returns this rank's part of the result along the first dimension: the first ``d % n`` ranks of the set get ``d // n + 1`` rows,
    the others ``d // n``. Differentiable (Horovod's definition: the allgather of the output
    gradient, times the set size for Sum, times the scale factors)."""
    rop = _norm_op(op)
    compressed, ctx = compression.compress(tensor)
    out = _ReducescatterFn.apply(compressed, rop, float(prescale_factor), float(postscale_factor), process_set, name)
    return compression.decompress(out, ctx)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0) -> int:
    rop = _norm_op(op)
    return _submit(lambda: _reducescatter_impl([tensor], rop, float(prescale_factor), float(postscale_factor),
                                               process_set, name)[0])


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                          prescale_factor=1.0, postscale_factor=1.0):
    rop = _norm_op(op)
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedReducescatterFn.apply(rop, float(prescale_factor), float(postscale_factor), process_set, name,
                                         *[p[0] for p in pairs])
    return [compression.decompress(o, p[1]) for o, p in zip(outs, pairs)]


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> int:
    rop = _norm_op(op)
    tensors = list(tensors)
    return _submit(lambda: _reducescatter_impl(tensors, rop, float(prescale_factor), float(postscale_factor),
                                               process_set, name))


# ---------------------------------------------------------------------------- handles
_handles: Dict[int, tuple] = {}
_handle_ids = itertools.count(1)


def _submit(fn) -> int:
    """Runs ``fn`` now; a failure caused by the other ranks is kept for :func:`synchronize`
    (argument errors raise here, as Horovod's do)."""
    h = next(_handle_ids)
    try:
        _handles[h] = (True, fn())
    except HorovodInternalError as e:
        _handles[h] = (False, e)
    return h


def poll(handle) -> bool:
    """Whether the operation of ``handle`` has completed (always True: hipress runs them eagerly)."""
    return True


def synchronize(handle):
    """The result of the operation of ``handle`` (None for an unknown handle); raises the
    operation's HorovodInternalError if it failed."""
    if handle not in _handles:
        return None
    ok, v = _handles.pop(handle)
    if not ok:
        raise v
    return v


# ---------------------------------------------------------------------------- barrier, join
def barrier(process_set=global_process_set) -> None:
    """Returns once every rank of the set has called it."""
    st, ps, tr = _set_transport(process_set)
    with _trace("barrier", None):
        _round("barrier", tr, _set_ranks(ps), {"name": None, "err": None, "count": 0})


def join(device=-1) -> int:
    """This rank has no more data: until every rank has joined, it takes part in the allreduce,
    allgather, broadcast and barrier calls of the ranks still working (on the global set),
    contributing zeros to allreduces (so Average still divides by the full size, and Min,
    Max and Product see zeros, as in Horovod) and no rows to allgathers. Returns the rank that
    joined last (the highest such rank if several joined in the same round).

    Horovod 0.28 serves only allreduce during a join; allgather, broadcast and barrier are
    hipress's additions. alltoall and reducescatter raise on the working ranks while a rank has
    joined (as in Horovod); a collective on a smaller process set that includes a joined rank
    waits for it until ``HIPRESS_TIMEOUT_S``. ``device`` is accepted for compatibility (zeros are
    made on the CPU)."""
    st, ps, tr = _set_transport(global_process_set)
    members = _set_ranks(ps)
    first = True
    while True:
        with _trace("join", None):
            metas = _exchange(tr, {"op": "join", "first": first})
        first = False
        rd = _Round("join", metas, members)
        if not rd.active:
            newly = [members[i] for i, m in enumerate(metas) if m.get("first")]
            return max(newly)
        if rd.error is not None:
            continue  # the working ranks raise; this rank waits for their next call
        if rd.kind == "allreduce":
            _allreduce_data(tr, rd.plan, None)
        elif rd.kind == "allgather":
            _allgather_data(tr, rd, None)
        elif rd.kind == "broadcast":
            _broadcast_data(tr, rd, members, None)
        # barrier: the metadata round was all of it


# ---------------------------------------------------------------------------- timeline
_timeline: Optional[dict] = None


def start_timeline(file_path, mark_cycles=False) -> None:
    """Records this process's collectives (one Chrome-trace event each, from the call to its result;
    in :func:`join`, one per round served)
    until :func:`stop_timeline`, which writes them to ``file_path`` on rank 0 (as Horovod writes
    one file). ``mark_cycles`` is accepted and ignored."""
    global _timeline
    if not world.is_initialized():
        raise ValueError("hipress has not been initialized; use hipress.init().")
    _timeline = {"path": os.fspath(file_path), "events": [], "t0": time.perf_counter()}


def stop_timeline() -> None:
    global _timeline
    if not world.is_initialized():
        raise ValueError("hipress has not been initialized; use hipress.init().")
    tl, _timeline = _timeline, None
    if tl is None or world.rank() != 0:
        return
    with open(tl["path"], "w") as f:
        json.dump({"traceEvents": tl["events"], "displayTimeUnit": "ms"}, f)


@contextlib.contextmanager
def _trace(kind: str, name: Optional[str]):
    tl = _timeline
    if tl is None:
        yield
        return
    t = time.perf_counter()
    try:
        yield
    finally:
        tl["events"].append({"name": name or kind, "cat": kind, "ph": "X", "pid": world.rank(), "tid": 0,
                             "ts": (t - tl["t0"]) * 1e6, "dur": (time.perf_counter() - t) * 1e6})


# ---------------------------------------------------------------------------- build queries
def _core():
    try:
        from hipress import _C

        return _C
    except ImportError:
        return None


def mpi_built() -> bool:
    """hipress's native core was compiled with MPI (the ``mpi`` transport)."""
    return bool(getattr(_core(), "with_mpi", False))


def gloo_built() -> bool:
    """torch.distributed with gloo is available (the ``torch`` transport)."""
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_gloo_available())


def nccl_built() -> int:
    """The NCCL version code torch.distributed was built with (0: none), as Horovod returns it."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()):
        return 0
    try:
        v = torch.cuda.nccl.version()
        return v[0] * 10000 + v[1] * 100 + v[2] if isinstance(v, tuple) else int(v)
    except Exception:  # noqa: BLE001
        return 1


def _transport_name() -> str:
    return world.transport().name if world.is_initialized() else ""


def mpi_enabled() -> bool:
    """The world transport moves data over MPI (hipress's own, or Horovod's under ``--mpi``)."""
    name = _transport_name()
    return name == "mpi" or name.endswith("/mpi")


def gloo_enabled() -> bool:
    """The world transport moves data over gloo (torch.distributed, or Horovod's under ``--gloo``)."""
    return _transport_name().endswith("/gloo")


def mpi_threads_supported() -> bool:
    """hipress's MPI transport requires MPI_THREAD_SERIALIZED or better (True when MPI is in use)."""
    if not mpi_enabled():
        raise ValueError("MPI is not enabled (the world transport is not MPI)")
    return True


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def sycl_built() -> bool:
    return False


def cuda_built() -> bool:
    """hipress's native core was compiled with CUDA kernels."""
    return bool(getattr(_core(), "with_cuda", False))


def rocm_built() -> bool:
    return bool(getattr(torch.version, "hip", None)) and cuda_built()


def is_homogeneous() -> bool:
    """Every host runs the same number of ranks."""
    world.init()
    names = world.hostnames()
    return len({names.count(h) for h in set(names)}) == 1
