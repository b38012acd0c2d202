"""FSDP2's reduce-scatter done by hipress: any hipress algorithm under ``fully_shard``.

    import hipress.fsdp
    dist.init_process_group("gloo")
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    state = hipress.fsdp.register(model, compression="terngrad")   # every FSDPModule of model

FSDP2 (``torch.distributed.fsdp.fully_shard``) reduces each module's gradients with one
reduce-scatter per backward: every rank copies its unsharded gradients into one flat buffer of N
equal rows (row r: the part of every parameter that rank r keeps, each parameter padded on dim 0 to
a multiple of N), calls ``comm(output_tensor=, input_tensor=, group=, op=)`` and then takes
``output_tensor`` (one row, the sum or average over ranks) as its sharded gradients.
``FSDPModule.set_custom_reduce_scatter`` swaps that call for an object; :class:`ReduceScatter` is
such an object. It runs hipress's ring reduce-scatter (:func:`hipress.sync.ring.reduce_scatter`:
each of the N-1 hops encodes a chunk, sends it to the next rank, decodes and adds what the previous
rank sent), with rank r owning row r, so FSDP gets back exactly what it asked for. With
``compression="none"`` it is an exact reduce-scatter (only the order of the additions differs from
gloo's).

FSDP's contract, and what is done with it:

* ``op``: ``AVG`` divides the decoded sum by N, ``SUM`` leaves it, ``PREMUL_SUM(f)`` multiplies it
  by f (FSDP uses it for ``set_gradient_divide_factor``). The division comes after the
  decode-and-add, as in every hipress strategy: compressed bytes are never scaled. For fp16
  reductions FSDP itself divides before and after (op ``SUM``), so nothing is done twice.
* dtypes: the buffers are in FSDP's reduce dtype (``MixedPrecisionPolicy(reduce_dtype=)``); the
  compressors work in fp32, so other dtypes (and device buffers) are copied to an fp32 CPU buffer
  and the owned row copied back into ``output_tensor``. fp32 CPU input is reduced in place (FSDP
  does not read its reduce-scatter input again).
* the call is synchronous: it returns when ``output_tensor`` holds the result (FSDP does not ask
  for ``async_op``; if asked, a completed ``Work`` is returned). A sync that does not finish within
  ``HIPRESS_TIMEOUT_S`` raises ``TimeoutError`` out of ``backward()``.

Compressor state (error-feedback residuals, RNG counters) is kept per FSDP module, per partition
and per chunk of the ring, on each rank, across steps (:meth:`FsdpState.state_dict` for a
checkpoint). Like the DDP hook, hipress talks over a private gloo group of the same ranks
(:func:`hipress.ddp.init`), never over FSDP's process group, whose all-gathers may be in flight.
Only single-round algorithms: a ring reduce-scatter re-encodes partial sums, which PowerSGD's
low-rank rounds do not allow. See docs/fsdp.md.
"""
from __future__ import annotations

import math
import threading
import warnings
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import ReduceOp

from hipress import compression as _compression
from hipress import config
from hipress.comm import world
from hipress.comm.exchange import open_exchanges, waiting_words
from hipress.compression.base import is_f32_flat
from hipress.engine import get_engine
from hipress.planner.plan import chunk_bounds
from hipress.sync import StateStore
from hipress.sync.base import SyncContext
from hipress.sync.ring import reduce_scatter as ring_reduce_scatter
from hipress.torch import clipping
from hipress.torch.ddp import init, known_world_size, private_world

try:  # the interface FSDP2 takes (torch >= 2.8); a private module, so imported with care
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _FsdpReduceScatter
except ImportError:  # pragma: no cover - older torch
    _FsdpReduceScatter = object

__all__ = ["FsdpState", "ReduceScatter", "register", "init"]


def _scale_of(op, n: int) -> Optional[float]:
    """The factor FSDP's reduce op asks for on the sum (None: the sum itself)."""
    kind = getattr(op, "op", op)  # PREMUL_SUM(f) is a ReduceOp holding its kind; AVG, SUM are the kind
    if kind == ReduceOp.SUM:
        return None
    if kind == ReduceOp.AVG:
        return 1.0 / n
    if kind == ReduceOp.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        if not isinstance(factor, (int, float)):
            raise ValueError(f"hipress.fsdp: PREMUL_SUM needs a Python scalar factor, got {factor!r}")
        return float(factor)
    raise ValueError(f"hipress.fsdp: reduce op {op!r} is not supported (FSDP asks for SUM, AVG or PREMUL_SUM)")


class FsdpState:
    """What every :class:`ReduceScatter` of a model shares: the algorithm, the sync's context and
    every rank's compressor state.

    compression: an algorithm name (with its keyword arguments) or a Compressor, single-round.
    partition_bytes: the ring runs on column partitions of FSDP's buffer of at most this many bytes
    (over all N rows), each its own chain of hops, so encoding one overlaps sending another.
    grad_clip: as for ``hipress.DistributedOptimizer`` ("paper": TernGrad's 2.5 sigma per
    parameter; "auto": none), applied to each parameter's whole unsharded gradient on each rank before
    compression. timeout_s: how long one reduce-scatter may take (default ``HIPRESS_TIMEOUT_S``).
    Nothing connects or allocates until the first reduce-scatter.
    """

    def __init__(self, compression="none", *, partition_bytes: Optional[int] = 64 << 20, grad_clip="auto",
                 timeout_s: Optional[float] = None, **compression_kwargs):
        if compression in ("auto", "covap"):
            raise ValueError(f"compression={compression!r} needs hipress.DistributedOptimizer; "
                             f"hipress.fsdp takes an algorithm name or a Compressor")
        self.compressor = (_compression.get(compression, **compression_kwargs) if isinstance(compression, str)
                           else compression)
        if self.compressor.lowrank:
            raise ValueError(f"hipress.fsdp: {self.compressor.name} is a low-rank algorithm (whole matrices); a "
                             f"ring reduce-scatter re-encodes partial sums, which it cannot; use a quantizer "
                             f"or sparsifier (onebit, tbq, terngrad, dgc, ...) or 'none'")
        if partition_bytes is not None and partition_bytes < 0:
            raise ValueError(f"partition_bytes must be >= 0 or None, got {partition_bytes}")
        self.partition_bytes = partition_bytes
        self.clip = clipping.resolve(grad_clip, self.compressor.name)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._ctx: Optional[SyncContext] = None
        self._states: Optional[StateStore] = None
        self._loaded: Optional[dict] = None
        self.reduce_scatters = 0

    # ------------------------------------------------------------------ setup
    def _setup(self) -> None:
        private_world("FSDP", "hipress.fsdp.init()")
        engine = get_engine()
        self._states = StateStore(world.rank())
        if self._loaded is not None:
            self._states.load_state_dict(_fitting(self._loaded, world.size()))
            self._loaded = None
        self._ctx = SyncContext(engine, open_exchanges(engine).world, self.compressor, self._states)

    def _column_bounds(self, n: int, m: int) -> List[Tuple[int, int]]:
        k = max(1, math.ceil(4 * n * m / self.partition_bytes)) if self.partition_bytes else 1
        return chunk_bounds(m, max(1, min(k, m)))

    # ------------------------------------------------------------------ the reduce-scatter
    def reduce_scatter(self, key: str, output: torch.Tensor, input: torch.Tensor, group, op,
                       layout: Optional[List[Tuple[str, int, int]]] = None) -> None:
        """``output`` (this rank's row) := op over ranks of ``input`` (N rows, one per rank).
        ``key`` names the compressor states (one per FSDP module); ``layout``: (name, padded
        shard numel, numel) per parameter, for clipping."""
        n = group.size() if group is not None else 1
        m = output.numel()
        if input.numel() != n * m:
            raise ValueError(f"hipress.fsdp: reduce-scatter input has {input.numel()} elements, expected "
                             f"{n} ranks x {m} output elements")
        if not (input.is_floating_point() and output.is_floating_point()):
            raise ValueError(f"hipress.fsdp: floating-point buffers expected, got {input.dtype} -> {output.dtype}")
        if not output.is_contiguous():
            raise ValueError("hipress.fsdp: the reduce-scatter output must be contiguous")
        scale = _scale_of(op, n)
        with self._lock:
            if self._ctx is None:
                self._setup()
        ranks = dist.get_process_group_ranks(group) if group is not None else [0]
        if n > 1 and (n != world.size() or ranks != list(range(world.size()))):
            raise ValueError(f"hipress.fsdp reduces over all ranks of the job ({world.size()}), but FSDP's "
                             f"reduce-scatter group holds ranks {ranks}: HSDP and 2-D meshes are not supported")
        in_place = is_f32_flat(input)
        rows = (input if in_place else input.detach().to("cpu", torch.float32)).reshape(n, m)
        if self.clip is not None:
            self._clip(rows, layout)
        self.reduce_scatters += 1
        if n > 1:
            ctx = self._ctx
            name = f"{key}@{m}"  # a module's buffer changes size when some of its parameters get no gradient
            finals = [ring_reduce_scatter(ctx, f"{name}/p{i}", [rows[c, a:b] for c in range(n)], owned_offset=0)
                      for i, (a, b) in enumerate(self._column_bounds(n, m)) if b > a]
            done = ctx.compute(f"done.fsdp.{name}", lambda: None, finals)
            timeout = config.get("HIPRESS_TIMEOUT_S") if self.timeout_s is None else float(self.timeout_s)
            if not done.wait(timeout):
                raise TimeoutError(f"hipress: FSDP reduce-scatter of '{key}' not done within {timeout:g} s "
                                   f"(HIPRESS_TIMEOUT_S or FsdpState(timeout_s=)); {waiting_words(self._ctx.exchange)}")
            err = done.exception(0)
            if err is not None:
                raise RuntimeError(f"hipress FSDP reduce-scatter of '{key}' failed: {err}")
        own = rows[group.rank() if group is not None else 0]
        if scale is not None:
            own.mul_(scale)
        output.copy_(own.view(output.shape))

    def _clip(self, rows: torch.Tensor, layout) -> None:
        """The algorithm's clipping of each parameter's whole gradient (this rank's, before
        compression), as the optimizer clips it; the padding stays zero."""
        n, m = rows.shape
        if layout is None or sum(p for _, p, _ in layout) != m:
            raise RuntimeError(f"hipress.fsdp: {self.compressor.name}'s clipping needs each parameter's place in "
                               f"FSDP's buffer, which is not known here (a module whose parameters did not all get "
                               f"gradients, or a ReduceScatter made without its module); pass grad_clip=None")
        a = 0
        for name, padded, numel in layout:
            region = rows[:, a:a + padded]
            whole = region.contiguous().view(-1)  # a copy: the parameter, padded, in dim-0 order
            grad = whole[:numel]
            self.clip(name, grad)
            region.copy_(whole.view(n, padded))
            a += padded

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """This rank's compressor state, for a checkpoint (save it per rank), and the number of
        ranks it belongs to."""
        if self._states is None:
            return dict(self._loaded or {"compressor_state": {}})
        return {"compressor_state": self._states.state_dict(), "state_ranks": world.size()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores :meth:`state_dict` (before or after the first reduce-scatter). A state saved on
        another number of ranks is dropped, with a warning (see :func:`_fitting`)."""
        sd = {"compressor_state": dict(state_dict["compressor_state"])}
        if "state_ranks" in state_dict:
            sd["state_ranks"] = state_dict["state_ranks"]
        size = known_world_size()
        if size is not None:
            sd = {"compressor_state": _fitting(sd, size), "state_ranks": size}
        with self._lock:
            if self._states is None:
                self._loaded = sd
            else:
                self._states.load_state_dict(sd["compressor_state"])

    def __repr__(self) -> str:
        return f"FsdpState(compression={self.compressor.name!r}, reduce_scatters={self.reduce_scatters})"


def _fitting(saved: dict, size: int) -> dict:
    """The compressor states of a state_dict that a job of ``size`` ranks can use. FSDP's rows,
    and the ring chunks over them, follow the number of ranks, so a residual saved on another
    number stands for other elements (where a row keeps its size, its key even matches): such
    states are dropped, with a warning, and start afresh. (DistributedOptimizer and the DDP hook
    hand theirs to the parameters instead; FSDP's rows interleave the parameters' shards.)"""
    ranks = saved.get("state_ranks")
    if ranks is None or ranks == size or not saved["compressor_state"]:
        return saved["compressor_state"]
    warnings.warn(f"hipress.fsdp: the checkpoint's compressor states were saved with {ranks} ranks, this job has "
                  f"{size}: FSDP's rows differ, so the states ({len(saved['compressor_state'])}) start afresh and "
                  f"their error-feedback residuals are dropped")
    return {}


class ReduceScatter(_FsdpReduceScatter):
    """FSDP2's reduce-scatter by hipress, for ``fsdp_module.set_custom_reduce_scatter(...)``.

    state: the :class:`FsdpState` of the model (shared by its modules); name: the module's name
    (its compressor states' key; unique per module); module: the FSDPModule, whose parameters
    tell where each parameter lies in FSDP's buffer (needed by clipping only)."""

    def __init__(self, state: FsdpState, name: str, module=None):
        if _FsdpReduceScatter is object:
            raise RuntimeError("hipress.fsdp needs torch's FSDP2 custom reduce-scatter interface (torch >= 2.8)")
        self.state = state
        self.name = name
        self.module = module

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def _layout(self) -> Optional[List[Tuple[str, int, int]]]:
        if self.module is None:
            return None
        out = []
        for group in self.module._get_fsdp_state()._fsdp_param_groups:
            for p in group.fsdp_params:
                out.append((f"{self.name}.{p._module_info.param_name}", p.padded_sharded_param_size.numel(),
                            p._orig_size.numel()))
        return out

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op,
                 async_op: bool = False):
        self.state.reduce_scatter(self.name, output_tensor, input_tensor, group, op,
                                  self._layout() if self.state.clip is not None else None)
        if not async_op:
            return None
        fut = torch.futures.Future()
        fut.set_result([output_tensor])
        return torch._C._distributed_c10d._create_work_from_future(fut)


def register(model: torch.nn.Module, compression="none", **kwargs) -> FsdpState:
    """Sets a hipress :class:`ReduceScatter` on every FSDPModule of ``model`` (``fully_shard``
    applied to it or to its submodules), named by its place in the model. ``kwargs``: those of
    :class:`FsdpState` and the algorithm's. Returns the state (checkpoint it)."""
    from torch.distributed.fsdp import FSDPModule

    state = FsdpState(compression, **kwargs)
    found = 0
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(ReduceScatter(state, name or "root", module))
            found += 1
    if not found:
        raise ValueError("hipress.fsdp.register: the model has no FSDPModule; apply "
                         "torch.distributed.fsdp.fully_shard to it (and its layers) first")
    return state
