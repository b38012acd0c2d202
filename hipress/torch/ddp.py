"""A DDP communication hook: hipress's algorithms and strategies under ``DistributedDataParallel``.

    import hipress.ddp
    dist.init_process_group("gloo")                      # torchrun, Accelerate, Lightning, Ray Train...
    model = DistributedDataParallel(model)
    state = hipress.ddp.HookState(compression="terngrad", named_parameters=model.named_parameters())
    model.register_comm_hook(state, hipress.ddp.hook)    # or hipress.ddp.fp16_wrapper(hipress.ddp.hook)

DDP fuses gradients into buckets and, instead of its allreduce, calls ``hook(state, bucket)``
once per bucket and step; the hook returns a ``torch.futures.Future`` whose value is the
bucket's averaged gradient. Here a DDP bucket is a hipress bucket: its gradients, in
hipress's canonical order (reverse parameter order, as ``DistributedOptimizer`` fuses them),
are handed to the same sync (``hipress.sync.make_sync``: the algorithm, the strategy,
partitions, per-tensor payloads for quantizers, whole matrices for PowerSGD) and the future
completes when the engine's last task of that sync does. Errors of the sync become the
future's exception, so ``backward()`` raises; a sync that does not finish within
``HIPRESS_TIMEOUT_S`` fails the future with a ``TimeoutError``.

What the optimizer does and the hook does too: the clipping (``grad_clip="paper"``:
TernGrad's 2.5 sigma per tensor; ``"auto"`` clips nothing), compressor state per rank (``state.state_dict()``),
averaging, and momentum correction, but not by itself: a hook cannot change the optimizer's
step, so the user moves SGD's momentum into the hook (``momentum_correction=0.9`` and an SGD
with ``momentum=0``; the optimizer's ``"auto"`` applies it to single-round algorithms).
``compression="covap"`` filters DDP's buckets (hipress.torch.covap.StreamRun: the filter
starts once DDP's buckets stop changing). Not here: ``plan=`` (it needs every bucket before
the first step; DDP makes its buckets itself).

hipress's own traffic runs over a private gloo group (:func:`init`), not over DDP's process
group: the engine's communication thread and DDP's collectives (the unused-parameter map of
``find_unused_parameters``/``static_graph``, bucket rebuilds, buffer broadcasts) would
otherwise interleave on one gloo group in different orders on different ranks.
See docs/ddp.md.
"""
import heapq
import itertools
import threading
import time
import warnings
import zlib
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from hipress import compression as _compression
from hipress import config
from hipress.comm import world
from hipress.comm.exchange import open_exchanges, waiting_words
from hipress.engine import get_engine
from hipress.sync import StateStore, make_sync, resolve_strategy, use_local_aggregation
from hipress.torch import clipping, covap, momentum, state_layout
from hipress.torch.optimizer import Average, Sum, _Bucket, bucket_bounds, splits_tensors

__all__ = ["HookState", "hook", "comm_hook", "register", "fp16_wrapper", "bf16_wrapper", "init"]

_generation = itertools.count()


# ---------------------------------------------------------------------------- world
def init(timeout_s: Optional[float] = None) -> None:
    """hipress's world for a DDP job: when torch.distributed is up, a private gloo group of the
    same ranks over torch.distributed's default store (so hipress's traffic never shares a gloo
    group with DDP's collectives), else, or when ``HIPRESS_TRANSPORT`` names another backend
    (mpi, horovod, ...), ``hipress.init()``. Idempotent; collective. The hook calls it on its
    first bucket; call it yourself to choose when the connections are made."""
    if world.is_initialized():
        return
    requested = (config.get("HIPRESS_TRANSPORT") or "").lower()
    if not (dist.is_available() and dist.is_initialized()) or requested not in ("", "torch"):
        world.init(timeout_s=timeout_s)  # hipress's own connections (HIPRESS_TRANSPORT=mpi, ...)
        return
    timeout = config.get("HIPRESS_TIMEOUT_S") if timeout_s is None else float(timeout_s)
    prefix = f"hipress/ddp{next(_generation)}"  # every rank counts its inits the same way
    world.init_private_gloo(dist.distributed_c10d._get_default_store(), prefix, dist.get_rank(),
                            dist.get_world_size(), timeout)


def private_world(framework: str, init_call: str):
    """hipress's world for a framework that uses torch.distributed's default group itself (DDP,
    FSDP): init(), then checks that the world is a private group on a transport that moves CPU
    payloads. Returns the world transport."""
    init()
    if _shares_default_group():
        raise RuntimeError(
            f"hipress's world uses torch.distributed's default group, which {framework} uses too: their "
            f"collectives could interleave on one gloo group and deadlock. Call {init_call} "
            f"instead of hipress.init() (a private gloo group of the same ranks)")
    transport = world.transport()
    device = getattr(transport, "device", None)
    if device is not None and torch.device(device).type != "cpu":
        raise ValueError(f"the {transport.name} transport moves {torch.device(device).type} buffers only, "
                         f"but hipress's payloads are CPU tensors; use HIPRESS_TRANSPORT=torch or mpi")
    return transport


def known_world_size() -> Optional[int]:
    """The number of ranks, where hipress's world or torch.distributed is up already (a state
    loaded before the first collective decides with it whether its checkpoint fits); else None."""
    if world.is_initialized():
        return world.size()
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else None


def _shares_default_group() -> bool:
    """Whether hipress's world transport is torch.distributed's default group (``hipress.init()``
    called after ``init_process_group``), which DDP uses too."""
    if not (dist.is_available() and dist.is_initialized() and world.is_initialized()):
        return False
    return getattr(world.transport(), "pg", None) is dist.distributed_c10d._get_default_group()


# ---------------------------------------------------------------------------- buckets
class _Layout:
    """One DDP bucket layout (a set of parameters in DDP's order) as a hipress bucket."""

    __slots__ = ("bucket", "ddp_offsets", "canon_offsets", "numels", "bounds", "identity")

    def __init__(self, bucket: _Bucket, ddp_offsets, canon_offsets, numels, bounds):
        self.bucket = bucket
        self.ddp_offsets = ddp_offsets      # where each parameter's gradient lies in DDP's buffer
        self.canon_offsets = canon_offsets  # and in the hipress bucket (canonical order)
        self.numels = numels
        self.bounds = bounds
        self.identity = ddp_offsets == canon_offsets  # DDP's buffer is already in canonical order

    @property
    def name(self) -> str:
        return self.bucket.name


class _Pending:
    __slots__ = ("fut", "name", "done", "deadline", "timeout")

    def __init__(self, fut, name):
        self.fut, self.name, self.done, self.deadline, self.timeout = fut, name, False, None, None


class HookState:
    """The state of hipress's DDP hook: the algorithm and its options, and once the first bucket
    arrived, the sync and every rank's compressor state.

    compression, compression_kwargs, strategy, op, partition_bytes, local_aggregation,
    coordinator (True or False; not "auto") and grad_clip mean what they mean for
    ``hipress.DistributedOptimizer``.
    named_parameters: ``model.named_parameters()`` (of the model or of the DDP wrapper, the same
    on every rank): names the buckets (compressor state keys, as the optimizer names them) and
    orders each bucket's gradients as the optimizer fuses them (reverse parameter order). Without
    it, parameters are named ``param.<i>`` in the order DDP's first step shows them to the hook.
    momentum_correction: None (default: off), SGD's momentum factor, or a dict of SGD's
    ``momentum``, ``dampening``, ``weight_decay``, ``nesterov``: each rank applies them to its own
    gradient before compression (hipress.torch.momentum, DGC's momentum correction), and the SGD
    given to DDP must then run with momentum 0 (and weight decay 0 if given here). Velocities are
    in :meth:`state_dict`.
    timeout_s: how long a bucket may take (default ``HIPRESS_TIMEOUT_S``).
    Nothing connects or allocates until the first bucket, so a state may be made before
    ``init_process_group`` (Lightning's ``DDPStrategy(ddp_comm_state=...)``).
    """

    def __init__(self, compression="none", strategy: str = "auto", *, named_parameters=None, op: str = Average,
                 partition_bytes: Optional[int] = 64 << 20, local_aggregation="auto",
                 coordinator: Optional[bool] = None, grad_clip="auto", momentum_correction=None,
                 timeout_s: Optional[float] = None, **compression_kwargs):
        if compression == "auto":
            raise ValueError("compression='auto' needs hipress.DistributedOptimizer (a plan over every bucket "
                             "before the first step); the DDP hook takes an algorithm name, 'covap' or a Compressor")
        self._args = (compression, strategy, dict(op=op, partition_bytes=partition_bytes,
                                                  local_aggregation=local_aggregation, coordinator=coordinator,
                                                  grad_clip=grad_clip, momentum_correction=momentum_correction,
                                                  timeout_s=timeout_s, **compression_kwargs))
        if op not in (Average, Sum):
            raise ValueError(f"op must be hipress.Average or hipress.Sum, got {op!r}")
        self.covap: Optional[covap.StreamRun] = None
        if compression == "covap":  # COVAP's filter around the inner algorithm (hipress/torch/covap.py)
            mine, compression, compression_kwargs = covap.split_options(compression_kwargs)
            self.covap = covap.StreamRun(mine)
        self.compressor = (_compression.get(compression, **compression_kwargs) if isinstance(compression, str)
                           else compression)
        if self.covap is not None and self.compressor.lowrank:
            raise ValueError(f"compression='covap' filters whole buckets; its inner algorithm must be single-round, "
                             f"not low-rank, got {self.compressor.name!r}")
        self.strategy = resolve_strategy(strategy, self.compressor)
        self.average = op == Average
        self.partition_bytes = partition_bytes
        self.local_aggregation = local_aggregation
        if coordinator not in (None, True, False) or not isinstance(coordinator, (bool, type(None))):
            raise ValueError(f"coordinator must be True, False or None (HIPRESS_COORDINATOR), got {coordinator!r}; "
                             f"'auto' (measured on and off) is hipress.DistributedOptimizer's")
        self.coordinator = bool(config.get("HIPRESS_COORDINATOR")) if coordinator is None else coordinator
        self.clip = clipping.resolve(grad_clip, self.compressor.name)
        self.timeout_s = timeout_s
        self._order: Dict[int, int] = {}
        self._names: Dict[int, str] = {}
        params = []
        if named_parameters is not None:
            for i, (n, p) in enumerate(named_parameters):
                self._order[id(p)] = i
                self._names[id(p)] = n
                params.append(p)
        self._named_given = named_parameters is not None
        self._numels = {self._names[id(p)]: p.numel() for p in params}  # checks a checkpoint's carry
        self._covap_reserved = None  # the COVAP filter whose units the sync has declared
        # COVAP's local mode: each bucket's parameter averages of the last step, applied by its next hook
        self._covap_averages: Dict[str, List[covap.Average]] = {}
        if self.covap is not None:
            world.on_quiesce(self._covap_wait_all)
        self._grad_hooks = []
        if self.covap is not None and self.covap.args.get("interval", "auto") == "auto":
            # the profiler's T_comp runs from the first to the last gradient of a backward (without
            # named_parameters, from the first to the last bucket)
            self._grad_hooks = [p.register_post_accumulate_grad_hook(self._covap_grad)
                                for p in params if p.requires_grad]
        group = _momentum_group(momentum_correction)
        self.momentum = _HookMomentum(group, self._names) if group is not None else None
        self._lock = threading.Lock()
        self._held: List[tuple] = []  # buckets not sent yet: a step COVAP profiles sends them together (submit)
        self._sync = None
        self._sync16 = None
        self._states: Optional[StateStore] = None
        self._loaded: Optional[dict] = None  # a state_dict's compressor part, loaded with the first bucket
        # residuals of a checkpoint of another number of ranks, by parameter name (flat), not sent yet
        self._carry: Dict[str, torch.Tensor] = {}
        self._layouts: Dict[Tuple[int, ...], _Layout] = {}
        self._name_owner: Dict[str, frozenset] = {}
        self._size = None
        # watchdog of in-flight buckets (started with the first one)
        self._cv = threading.Condition()
        self._heap: List[Tuple[float, int, _Pending]] = []
        self._seq = itertools.count()
        self._watchdog: Optional[threading.Thread] = None
        self.buckets_synced = 0

    # ------------------------------------------------------------------ setup
    def _setup(self) -> None:
        private_world("DDP", "hipress.ddp.init()")
        self._size = world.size()
        engine = get_engine()
        exchanges = open_exchanges(engine, coordinated=self.coordinator)
        self._world_exchange = exchanges.comm_thread_world  # a timeout names the peers it waits for
        self._states = StateStore(world.rank())
        hierarchical = use_local_aggregation(self.local_aggregation, world.hostnames())
        self.hierarchical = hierarchical
        self._split_tensors = splits_tensors(self.compressor, self.strategy)
        self._sync = make_sync(engine, exchanges, self.compressor, self.strategy, self._states, self.average,
                               hierarchical, world.size(), world.local_rank() == 0)
        if self._loaded is not None:
            self._load_fitting(self._fitting_states(self._loaded, world.size()))
            self._loaded = None
        # COVAP's local mode with wire "bf16": its averages as bf16 differences, where the backend sums bf16
        self._sync16 = covap.bf16_sync(self._sync) if self.covap is not None else None

    def _layout(self, bucket) -> _Layout:
        params = bucket.parameters()
        key = tuple(id(p) for p in params)
        lay = self._layouts.get(key)
        if lay is not None:
            return lay
        for p in params:  # without named_parameters: named in the order DDP's first step shows them
            if id(p) not in self._order:
                if self._named_given:
                    raise ValueError("a parameter of a DDP bucket is not in the named_parameters given to "
                                     "hipress.ddp.HookState; pass the DDP model's (or its module's) parameters")
                self._order[id(p)] = i = len(self._order)
                self._names[id(p)] = f"param.{i}"
        ddp_offsets, off = [], 0
        for p in params:
            ddp_offsets.append(off)
            off += p.numel()
        canon = sorted(range(len(params)), key=lambda j: -self._order[id(params[j])])  # reverse parameter order
        hb = _Bucket([(self._names[id(params[j])], params[j]) for j in canon])
        name = hb.name
        members = frozenset(key)
        # DDP rebuilt its buckets (once, after its first step): a bucket sharing parameters with
        # this one but not all of them is gone; its states are dropped, not checkpointed (a
        # resumed job would otherwise replay old residuals). Names are never reused for another
        # set of parameters (a resumed job starts from the first step's buckets again).
        for other, other_members in self._name_owner.items():
            if other_members != members and other_members & members:
                self._states.discard(other + "/")
        owner = self._name_owner.setdefault(name, members)
        if owner != members:  # another set of parameters had this name: keep states apart
            digest = zlib.crc32(";".join(n for n, _ in hb.params).encode())
            name = f"{name}#{digest:08x}"
            self._name_owner.setdefault(name, members)
        hb.name = name
        canon_offsets = [0] * len(params)
        for j, o in zip(canon, hb.offsets):
            canon_offsets[j] = o
        lay = _Layout(hb, ddp_offsets, canon_offsets, [p.numel() for p in params],
                      bucket_bounds(hb, self.partition_bytes, self._split_tensors, self._sync.spread))
        if lay.identity:
            hb.flat = None  # synced in DDP's buffer (when it is fp32)
        self._layouts[key] = lay
        return lay

    # ------------------------------------------------------------------ the hook
    def submit(self, bucket) -> torch.futures.Future:
        """``hook(self, bucket)``: starts the sync of one DDP bucket; returns its future."""
        with self._lock:
            if self._sync is None:
                self._setup()
            lay = self._layout(bucket)
        buf = bucket.buffer()
        total = sum(lay.numels)
        if buf.numel() != total:
            raise RuntimeError(f"DDP bucket {bucket.index()} holds {buf.numel()} elements, its parameters "
                               f"{total}: padded or sparse buckets are not supported")
        on_cpu = buf.device.type == "cpu"
        in_place = on_cpu and lay.identity and buf.dtype == torch.float32 and buf.is_contiguous()
        if in_place:
            flat = buf.view(-1)
        else:
            if lay.bucket.flat is None:
                lay.bucket.flat = torch.empty(total, dtype=torch.float32)
            flat = lay.bucket.flat
            # a device buffer (CUDA) comes over in one copy, in stream order: hipress's payloads
            # are CPU tensors (untested here: no GPU)
            src = buf if on_cpu else buf.detach().to("cpu", torch.float32)
            for d, c, n in zip(lay.ddp_offsets, lay.canon_offsets, lay.numels):
                flat[c:c + n].copy_(src[d:d + n])
        if self.clip is not None or self.momentum is not None:  # as the optimizer's final_gradient
            for (name, p), (o, n, _) in zip(lay.bucket.params, lay.bucket.segments):
                g = flat[o:o + n].view(p.shape)
                if self.clip is not None:
                    self.clip(name, g)
                if self.momentum is not None:
                    self.momentum.apply(p, g)
        if self._carry:
            self._add_carry(lay, flat)
        fut = torch.futures.Future()
        self.buckets_synced += 1
        if self._size == 1:
            self._unpack(lay, flat, buf, in_place)
            fut.set_result(buf)
            return fut
        last = bucket.is_last()
        self._held.append((lay, flat, buf, in_place, fut))
        if self.covap is not None:
            self._covap_begin(time.perf_counter())  # at a step's first bucket: closes a profiled step before it
            if self.covap.profiling and not last:
                # COVAP's profiler times the computation and the communication apart: a profiled step
                # sends its buckets once the last is ready (docs/covap.md, "Profiler"), as the optimizer
                return fut
        todo, self._held = self._held, []
        for args in todo:
            self._launch(*args, last=last and args[0] is lay)
        return fut

    def _launch(self, lay: _Layout, flat: torch.Tensor, buf: torch.Tensor, in_place: bool,
                fut: torch.futures.Future, last: bool) -> None:
        """The sync of one bucket (``flat``, its fp32 copy, or DDP's ``buf`` itself ``in_place``),
        completing ``fut`` with ``buf`` holding the average."""
        pending = _Pending(fut, lay.name)
        if self.covap is None:
            handles = [self._sync.build(lay.name, flat, lay.bounds, segments=lay.bucket.segments)]
        else:
            handles = self._covap_build(lay, flat, last)
        if not handles:  # COVAP sent nothing of this bucket: its gradient (zeros) is final
            self._unpack(lay, flat, buf, in_place)
            fut.set_result(buf)
            return
        if in_place and len(handles) == 1:
            handle = handles[0]
        else:
            unpack = (lambda: None) if in_place else (lambda: self._unpack(lay, flat, buf, False))
            handle = self._sync.ctx.compute(f"unpack.ddp.{lay.name}", unpack, handles, nbytes=4 * flat.numel())
        self._watch(pending)
        handle.add_done_callback(lambda h: self._finish(pending, h, buf))

    # ------------------------------------------------------------------ COVAP
    def _covap_build(self, lay: _Layout, flat: torch.Tensor, last: bool) -> list:
        """The syncs of one bucket under COVAP: the whole bucket (before the filter starts, and
        timed while profiling), or its selected units, each a sync (and compressor state) of its
        own as in the optimizer; none when no unit of it is selected."""
        cv = self.covap
        now = time.perf_counter()
        self._covap_apply(lay, self._covap_averages.pop(lay.name, []))  # the local mode's, of the last step
        units = cv.select(lay.name, flat, now)
        filt = cv.run.filter if cv.run is not None else None
        if filt is not None and filt is not self._covap_reserved:
            # units the new filter gives other ranges (another interval shards otherwise) hand their
            # inner states' residuals to the next gradients, as the optimizer does
            lays = {lay.name: lay for lay in self._layouts.values()}
            for name, t, r in covap.changed_units(self._covap_reserved, filt):
                b = lays[name].bucket
                spans = self._sync.state_spans(f"{name}/u{t}", [r])
                self._add_to_carry(state_layout.take_residuals(self._states, spans, b.params, b.offsets))
            # every unit declared in unit order, so the sync's choices (PS aggregators) do not
            # depend on which units happen to be sent first
            for name, declared in filt.units.items():
                for t, r in declared:
                    self._sync.reserve(f"{name}/u{t}", [r])
            self._covap_reserved = filt
        if units is None:
            handles = [self._sync.build(lay.name, flat, lay.bounds, segments=lay.bucket.segments)]
            if cv.profiling:
                cv.submitted(lay.name, now)
                handles[0].add_done_callback(lambda h, n=lay.name: cv.completed(n, time.perf_counter()))
        elif cv.run.local:  # the gradient stays this rank's own; the selected units' parameters are averaged
            self._covap_averages[lay.name] = self._covap_average_params(lay, units, self._sync16)
            handles = []  # waited for in the next step
        else:
            handles = [self._sync.build(f"{lay.name}/u{t}", flat, [r]) for t, r in units]
        if last:
            cv.end_step()
        return handles

    def _covap_average_params(self, lay: _Layout, units, sync16=None) -> List[covap.Average]:
        """COVAP's local mode (hipress/torch/covap.py, MODES): starts the average across ranks of
        the selected units' parameters (with ``sync16``, as bf16 differences from the units'
        references where they have one). The bucket's next hook (the next step's backward) applies
        it: DDP hands out a bucket when every gradient of its parameters is final, so the rest of
        the backward does not read them, and the optimizer's step comes after every bucket's future."""
        refs = self.covap.run.refs
        return covap.start_averages(lay.bucket, units, self._sync.build, None if refs is None or sync16 is None
                                    else sync16.build, refs, self._size)

    def _covap_wait(self, averages: List[covap.Average]) -> None:
        timeout = config.get("HIPRESS_TIMEOUT_S") if self.timeout_s is None else float(self.timeout_s)
        covap.wait_averages(averages, timeout, lambda: waiting_words(self._world_exchange))

    def _covap_wait_all(self) -> None:
        self._covap_wait([a for avgs in self._covap_averages.values() for a in avgs])

    def _covap_apply(self, lay: _Layout, averages: List[covap.Average]) -> None:
        """Adds each average's difference to what was sent to the bucket's parameters."""
        self._covap_wait(averages)
        for a in averages:
            lay.bucket.write_params(a.start, a.delta(), add=True)

    def _covap_begin(self, now: float) -> None:
        profile = self.covap.begin(now, lambda v: covap.gather_rows(world.transport(), v))
        if profile is not None and world.rank() == 0:
            print(profile.summary(), flush=True)

    def _covap_grad(self, p) -> None:
        """A gradient hook (interval="auto"): times the backward while profiling."""
        if self._sync is None or self._size == 1:
            return
        now = time.perf_counter()
        self._covap_begin(now)
        self.covap.grad_ready(now)

    @property
    def covap_profile(self) -> Optional[covap.Profile]:
        """compression="covap": the profiler's figures and the interval (None before it ran)."""
        return None if self.covap is None or self.covap.run is None else self.covap.run.profile

    def covap_reprofile(self) -> None:
        """compression="covap": measure CCR again over the next steps and reset the interval."""
        if self.covap is None:
            raise RuntimeError("covap_reprofile() needs compression='covap'")
        if self.covap.run is not None:  # else the first profile has not started yet
            self.covap.run.reprofile()

    def synchronize(self) -> None:
        """``compression="covap"`` in its local mode: each rank's parameters move on its own
        gradients between averages. This averages every parameter of the hook's buckets across
        ranks now, so every rank holds the same model: call it on every rank between steps,
        before evaluation or a checkpoint. Nothing to do otherwise."""
        run = self.covap.run if self.covap is not None else None
        if run is None or not run.local or self._size == 1:
            return
        lays = {lay.name: lay for lay in self._layouts.values()}
        for name in run.sizes:  # the last step's averages first
            self._covap_apply(lays[name], self._covap_averages.pop(name, []))
        now = [(lays[name], a) for name in run.sizes
               for a in self._covap_average_params(lays[name], [("all", (0, lays[name].bucket.numel))])]
        self._covap_wait([a for _, a in now])
        for lay, a in now:
            lay.bucket.write_params(a.start, a.values)

    @staticmethod
    def _unpack(lay: _Layout, flat: torch.Tensor, buf: torch.Tensor, in_place: bool) -> None:
        if in_place:
            return
        dst = buf if buf.device.type == "cpu" else torch.empty(buf.numel(), dtype=torch.float32)
        for d, c, n in zip(lay.ddp_offsets, lay.canon_offsets, lay.numels):
            dst[d:d + n].copy_(flat[c:c + n])
        if dst is not buf:
            buf.copy_(dst)  # one copy back to the device

    def _finish(self, pending: _Pending, h, buf) -> None:
        err = h.exception(0)
        with self._cv:
            if pending.done:
                return
            pending.done = True
            self._cv.notify()  # the watchdog drops it
        if err is None:
            pending.fut.set_result(buf)
        else:
            pending.fut.set_exception(RuntimeError(
                f"hipress gradient synchronization of DDP bucket '{pending.name}' failed: {err}"))

    # ------------------------------------------------------------------ timeouts
    def _watch(self, pending: _Pending) -> None:
        timeout = config.get("HIPRESS_TIMEOUT_S") if self.timeout_s is None else float(self.timeout_s)
        pending.timeout = timeout
        pending.deadline = time.monotonic() + timeout
        with self._cv:
            heapq.heappush(self._heap, (pending.deadline, next(self._seq), pending))
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch_loop, name="hipress-ddp-watchdog", daemon=True)
                self._watchdog.start()
            self._cv.notify()

    def _watch_loop(self) -> None:
        while True:
            expired = []
            with self._cv:
                while self._heap and self._heap[0][2].done:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cv.wait(30.0)
                    if not self._heap:  # idle: the next bucket starts another
                        self._watchdog = None
                        return
                    continue
                deadline, _, pending = self._heap[0]
                now = time.monotonic()
                if now < deadline:
                    self._cv.wait(deadline - now)
                    continue
                heapq.heappop(self._heap)
                pending.done = True
                expired.append(pending)
            for p in expired:
                p.fut.set_exception(TimeoutError(
                    f"hipress: DDP bucket '{p.name}' not synchronized within {p.timeout:g} s (HIPRESS_TIMEOUT_S or "
                    f"HookState(timeout_s=)); {waiting_words(self._world_exchange)}"))

    # ------------------------------------------------------------------ checkpoints
    def _add_carry(self, lay: _Layout, flat: torch.Tensor) -> None:
        """Adds the residuals handed to this bucket's parameters (a checkpoint of another number
        of ranks) to their gradients, in the units of what is sent, once."""
        for (name, p), (o, n, _) in zip(lay.bucket.params, lay.bucket.segments):
            carry = self._carry.pop(name, None)
            if carry is None:
                continue
            if carry.numel() != n:
                raise ValueError(f"the checkpoint's compressor states hold {carry.numel()} residual elements for "
                                 f"{name!r}, which has {n}: a checkpoint of another model or other parameter names")
            flat[o:o + n] += carry

    def _add_to_carry(self, carry: Dict[str, torch.Tensor]) -> None:
        for name, acc in carry.items():
            prev = self._carry.get(name)
            self._carry[name] = acc if prev is None else prev + acc

    def _owners(self) -> Optional[dict]:
        """What each state key's residual stands for (hipress/torch/state_layout.py), over every
        layout this hook has seen and COVAP's units; None where the strategy does not list its
        keys (low-rank)."""
        owners = {}
        lays = {lay.name: lay for lay in self._layouts.values()}
        units = self.covap.run.unit_layouts() if self.covap is not None and self.covap.run is not None else []
        try:
            for lay in lays.values():
                spans = self._sync.state_spans(lay.name, lay.bounds)
                owners.update(state_layout.owners_of(spans, lay.bucket.params, lay.bucket.offsets))
            for name, t, r in units:
                b = lays[name].bucket
                owners.update(state_layout.owners_of(self._sync.state_spans(f"{name}/u{t}", [r]), b.params, b.offsets))
        except NotImplementedError:
            return None
        return owners

    def _fitting_states(self, saved: dict, size: int) -> dict:
        """What of a state_dict a job of ``size`` ranks can load (the compressor states and the
        sync's first-sight choices, for :meth:`_load_fitting`). Saved on another number of ranks
        (ring chunks and PS's choice of aggregators follow it), each residual goes to the
        parameter it stands for and into this rank's next gradient of it, and the states start
        afresh (none are returned), as the optimizer does; state that is not a residual (DGC's
        momentum) has no such home: a ValueError says so."""
        states, owners, ranks = saved["compressor_state"], saved.get("state_owners"), saved.get("state_ranks")
        if owners is None or ranks == size:
            return {k: saved[k] for k in ("compressor_state", "sync_layout") if k in saved}
        numels = self._numels if self._named_given else None
        carry = state_layout.residuals_by_parameter(states, owners, numels,
                                                    state_layout.unmovable_buffers(self.compressor))
        self._add_to_carry(carry)
        if carry:
            warnings.warn(state_layout.moved_warning(len(carry)))
        return {"compressor_state": {}}

    def _load_fitting(self, sd: dict) -> None:
        """Loads what :meth:`_fitting_states` returned, once the sync exists."""
        self._states.load_state_dict(sd["compressor_state"])
        self._sync.load_layout_state(sd.get("sync_layout", {}))

    def state_dict(self) -> dict:
        """This rank's compressor state (error-feedback residuals, RNG counters, PowerSGD's Q), for
        a checkpoint: save it per rank, beside the model and the optimizer. With what each
        residual stands for (``state_owners``) and among how many ranks, so that a job of another
        number of ranks can resume from it."""
        if self._states is None:  # nothing ran since a load: the loaded state as it came
            out = {k: v for k, v in (self._loaded or {"compressor_state": {}}).items()}
            out["compressor_state"] = dict(out["compressor_state"])
        else:
            out = {"compressor_state": self._states.state_dict()}
            owners = self._owners() if out["compressor_state"] else None
            if owners is not None:
                out["state_owners"] = {k: owners[k] for k in out["compressor_state"] if k in owners}
                out["state_ranks"] = self._size
            layout = self._sync.layout_state()
            if layout:  # the choices made on first sight (PS's aggregators), which the states follow
                out["sync_layout"] = layout
        if self._carry:
            out["carry"] = {name: t.clone() for name, t in self._carry.items()}
        if self.momentum is not None:
            out["velocity"] = self.momentum.state_dict()
        if self.covap is not None:
            self._covap_wait_all()
            # first: applying an average sets its unit's reference, which the run's state holds
            averages = covap.averages_state([a for avgs in self._covap_averages.values() for a in avgs])
            out["covap"] = dict(self.covap.state_dict(), averages=averages)
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores :meth:`state_dict` (before or after the first bucket)."""
        sd = {k: state_dict[k] for k in ("compressor_state", "state_owners", "state_ranks", "sync_layout")
              if k in state_dict}
        sd["compressor_state"] = dict(sd["compressor_state"])
        self._carry = {name: t.clone() for name, t in state_dict.get("carry", {}).items()}
        size = known_world_size()
        if size is not None:  # the number of ranks is known: another one's states are moved (or refused) now
            sd = self._fitting_states(sd, size)
        if self.momentum is not None:
            self.momentum.load_state_dict(state_dict.get("velocity", {}))
        if self.covap is not None:
            if "covap" not in state_dict:
                raise ValueError("this HookState has compression='covap', but the state dict has no COVAP state")
            self.covap.load_state_dict(state_dict["covap"])
            self._covap_averages = {}
            for a in covap.averages_from_state(state_dict["covap"].get("averages", [])):
                self._covap_averages.setdefault(a.name, []).append(a)
        with self._lock:
            if self._states is None:
                self._loaded = sd
            else:
                self._load_fitting(sd)

    def __getstate__(self):
        """Pickling (Lightning's ddp_spawn pickles the strategy, and this state with it) keeps the
        options and the compressor state; parameter names given by object identity do not survive
        it, so the copy names parameters in the order DDP shows them (as without named_parameters)."""
        if self._sync is not None or self._heap:
            raise RuntimeError("a hipress.ddp.HookState can be pickled only before its first bucket")
        return {"args": self._args, "loaded": self._loaded, "carry": self._carry}

    def __setstate__(self, st):
        compression, strategy, kw = st["args"]
        self.__init__(compression, strategy, **kw)
        self._loaded = st["loaded"]
        self._carry = st.get("carry", {})

    def __repr__(self) -> str:
        strategy = "lowrank" if self.compressor.lowrank else self.strategy
        return (f"HookState(compression={self.compressor.name!r}, strategy={strategy!r}, "
                f"buckets synced={self.buckets_synced})")


def _momentum_group(mc) -> Optional[dict]:
    """momentum_correction=: None/False (off), a momentum factor, or a dict of SGD's momentum,
    dampening, weight_decay and nesterov -> the settings momentum correction applies."""
    if mc is None or mc is False:
        return None
    if isinstance(mc, bool) or not isinstance(mc, (int, float, dict)):
        raise ValueError(f"momentum_correction must be None, a momentum factor or a dict of SGD's momentum, "
                         f"dampening, weight_decay and nesterov, got {mc!r}")
    d = {"momentum": float(mc)} if not isinstance(mc, dict) else dict(mc)
    unknown = sorted(set(d) - {"momentum", "dampening", "weight_decay", "nesterov"})
    if unknown:
        raise ValueError(f"momentum_correction: unknown setting(s) {unknown}")
    group = {"momentum": float(d.get("momentum", 0.0)), "dampening": float(d.get("dampening", 0.0)),
             "weight_decay": float(d.get("weight_decay", 0.0)), "nesterov": bool(d.get("nesterov", False))}
    if not group["momentum"] and not group["weight_decay"]:
        raise ValueError("momentum_correction: momentum and weight_decay are both 0 (nothing to apply)")
    return group


class _HookMomentum(momentum.MomentumCorrection):
    """hipress.torch.momentum's correction with the settings given to the hook (the SGD given to
    DDP runs with momentum 0 and weight decay 0: the hook cannot change its step)."""

    def __init__(self, group: dict, names: Dict[int, str]):
        super().__init__(None, names)
        self._fixed = self._current = group
        self._no_decay = dict(group, weight_decay=0.0)

    def _group(self, p) -> dict:
        return self._current

    def apply(self, p, grad) -> None:
        if not self._fixed["weight_decay"] or p.device == grad.device:
            return super().apply(p, grad)
        # a device parameter, its gradient staged on the CPU: the decay term comes over first
        grad.add_(p.detach().to(grad.device), alpha=self._fixed["weight_decay"])
        self._current = self._no_decay
        try:
            super().apply(p, grad)
        finally:
            self._current = self._fixed


def hook(state, bucket):
    """The DDP communication hook: ``model.register_comm_hook(state, hipress.ddp.hook)`` with a
    :class:`HookState`. Returns a future of the bucket's averaged gradient."""
    return state.submit(bucket)


def comm_hook(compression="none", strategy: str = "auto", **kwargs):
    """``(state, hook)`` for ``model.register_comm_hook(*hipress.ddp.comm_hook("tbq"))`` and for
    frameworks that take the two (Lightning's ``ddp_comm_state``/``ddp_comm_hook``)."""
    return HookState(compression, strategy, **kwargs), hook


def register(model: torch.nn.parallel.DistributedDataParallel, compression="none", strategy: str = "auto",
             wrapper=None, **kwargs) -> HookState:
    """Registers hipress's hook on a DDP model, its parameters naming the buckets; ``wrapper``:
    :func:`fp16_wrapper` or :func:`bf16_wrapper` (or torch's). Returns the state (checkpoint it)."""
    kwargs.setdefault("named_parameters", model.named_parameters())
    state = HookState(compression, strategy, **kwargs)
    model.register_comm_hook(state, wrapper(hook) if wrapper is not None else hook)
    return state


# ---------------------------------------------------------------------------- fp16 / bf16
def _cast_wrapper(dtype, label):
    def wrap(inner):
        def wrapped(state, bucket):
            bucket.set_buffer(bucket.buffer().to(dtype))
            fut = inner(state, bucket)

            def cast_back(f):
                out = bucket.buffer()
                out.copy_(f.value())
                return out

            return fut.then(cast_back)

        wrapped.__name__ = wrapped.__qualname__ = f"hipress_{label}_wrapper_hook"
        wrapped.__doc__ = f"{inner.__name__} on gradients cast to {dtype}"
        return wrapped

    wrap.__name__ = wrap.__qualname__ = f"{label}_wrapper"
    wrap.__doc__ = (f"Like torch's {label}_compress_wrapper: the bucket is cast to {dtype} before the hook and "
                    f"the result cast back by DDP. With hipress's hook this rounds gradients to {dtype} before "
                    f"compression (the compressors work in fp32: what travels is the algorithm's payload). "
                    f"Works on CPU (torch's bf16 wrapper refuses to run without CUDA and NCCL).")
    return wrap


fp16_wrapper = _cast_wrapper(torch.float16, "fp16")
bf16_wrapper = _cast_wrapper(torch.bfloat16, "bf16")
