"""Reference simulator of compressed data-parallel training: N workers in one process,
pure torch + the algorithms' numpy references (hipress/compression/reference.py), with
allgather semantics. It is the figure the convergence bench sets beside hipress's own run
(``python -m hipress.bench.convergence``; ``--reference-only`` runs only this).

Per step, with the same task, model initialisation, shards, batch order, optimizer and
hyper-parameters as hipress's ranks (hipress/bench/tasks.py):

  1. every worker computes its gradient on its own batch (one model: under allgather
     semantics every rank holds bit-identical parameters, so one copy stands for all);
  2. each worker's gradient is treated as ``hipress.DistributedOptimizer``'s defaults treat
     it, per parameter, before compression: clipped if asked (``grad_clip``,
     hipress/torch/clipping.py; the default clips nothing), then turned into the worker's own
     velocity (``momentum_correction="auto"``, hipress/torch/momentum.py: single-round
     algorithms with a momentum SGD, which then steps without momentum);
  3. the gradients are fused into the buckets and partitions hipress syncs with the
     allgather strategy (``fusion_buckets``, ``splits_tensors`` and ``bucket_bounds`` of
     hipress/torch/optimizer.py with the optimizer's default ``bucket_bytes`` and
     ``partition_bytes``): quantizers get a payload per tensor; a sparsifier's top-k and a
     bucket's PowerSGD matrices are per bucket as hipress has them;
  4. single-round algorithms: each worker's partition goes through the reference encode
     and decode with that worker's own state (error-feedback residual when the compressor
     hipress builds has one, DGC's momentum and accumulation, the RNG counter of TernGrad
     and GradDrop, started where hipress's StateStore starts it: independent per worker);
     the decoded payloads of all workers are summed in rank order and divided by N:
     nothing is re-encoded (the allgather strategy, hipress/sync/allgather.py);
     PowerSGD: the reference's two rounds per matrix (round0 on every worker, P summed over
     workers, round1 with the sum, Q summed, finish), divided by N (hipress/sync/lowrank.py);
  5. the mean goes into ``.grad`` and the torch optimizer steps (without momentum where
     momentum correction applied it).

The algorithm and its parameters are the ones hipress would use: read from the compressor
``hipress.compression.get(algo, **kwargs)`` builds (its parameters, whether it is wrapped in
error feedback, beta and gamma), never copied here. Its encode, decode and state never run
(only its byte count sizes PowerSGD's buckets, as in hipress): no native kernel (hipress._C)
and no engine computes any of the simulator's numbers. A ported
GRACE compressor (``algo``: a callable rank -> ``hipress.grace.wrap(...)``, each worker its own
compressor and memory) runs its own torch code with GRACE's communicator semantics
(``Reference._grace``). A
compressor or parameter the references do not implement raises :class:`Unsupported` with
the reason (the bench prints it as n/a) instead of being approximated.

The ``strategy`` of hipress's run does not apply here: ring and PS re-encode merged partial
sums, which the allgather semantics leave out on purpose (the difference between the two
columns of the bench is then the effect of hipress's strategy plus any implementation bug).
"""
from __future__ import annotations

import contextlib
import inspect
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from hipress import compression
from hipress.bench import tasks
from hipress.compression import reference as ref
from hipress.compression.error_feedback import ErrorFeedback
from hipress.compression.grace_api import Ported
from hipress.sync.base import partition_shape, rng_stream_start
from hipress.sync.lowrank import matrix_shape, sent_raw
from hipress.torch import clipping, momentum
from hipress.torch.optimizer import (DistributedOptimizer, auto_bucket_bytes, bucket_bounds, final_gradient,
                                     fusion_buckets, splits_tensors)

# hipress's defaults, read from the optimizer's signature so that a change there changes both runs
_DEFAULTS = {k: v.default for k, v in inspect.signature(DistributedOptimizer).parameters.items()
             if k in ("bucket_bytes", "partition_bytes", "grad_clip", "momentum_correction")}


class Unsupported(Exception):
    """No pure reference for this algorithm or parameter: the reason is the message."""


# ------------------------------------------------------------------ single-round references
# name -> (parameters the reference takes, parameters its result does not depend on,
#          make(params, numel, rng counter) -> (encode(x) -> payload, decode(payload, n) -> x)).
# encode is a closure over one worker's state of one partition.


def _none(p, n, counter):
    return (lambda x: x), (lambda payload, n: payload)


def _onebit(p, n, counter):
    row = int(p.get("row", 0))  # the state's row length (OneBit.row_length of the partition's shape)
    return (lambda x: ref.onebit_encode(x, row)), ref.onebit_decode


def _tbq(p, n, counter):
    return (lambda x: ref.tbq_encode(x, p["threshold"], p["relative"])), ref.tbq_decode


def _terngrad(p, n, counter):
    st = [counter]

    def encode(x):  # the native kernel draws n numbers per encode, so the counter moves by n
        out = ref.terngrad_encode(x, int(p["bitwidth"]), int(p["seed"]), st[0])
        st[0] += n
        return out
    return encode, ref.terngrad_decode


def _graddrop(p, n, counter):
    return ref.GradDropReference(n, p["ratio"], p["sample_ratio"], int(p["warmup_steps"]), int(p["seed"]),
                                 counter, int(p["summands"])).encode, ref.sparse_decode


def _dgc(p, n, counter):
    return ref.DGCReference(n, p["ratio"], p["momentum"], int(p["warmup_steps"]), int(p["summands"])).encode, \
        ref.sparse_decode


def _counted(encode_at, advance):
    """encode(x) at the worker's RNG counter, which then moves as the native kernel's does."""
    def make(p, n, counter):
        st = [counter]

        def encode(x):
            out = encode_at(p, x, st[0])
            st[0] += advance(p, n)
            return out
        return encode
    return make


def _stream(encode_at):
    """A stochastic reference whose kernel draws one number per element per encode."""
    return _counted(encode_at, lambda p, n: n)


def _signsgd(p, n, counter):
    return (lambda x: ref.signsgd_encode(x, p["scale"])), ref.sign_decode


def _signum(p, n, counter):
    return ref.SignumReference(n, p["momentum"], p["scale"]).encode, ref.sign_decode


def _efsignsgd(p, n, counter):
    return ref.efsignsgd_encode, ref.sign_decode


def _qsgd(p, n, counter):
    enc = _stream(lambda p, x, c: ref.qsgd_encode(x, int(p["quantum_num"]), int(p["seed"]), c))(p, n, counter)
    return enc, ref.qsgd_decode


def _natural(p, n, counter):
    return _stream(lambda p, x, c: ref.natural_encode(x, int(p["seed"]), c))(p, n, counter), ref.natural_decode


def _terngrad_grace(p, n, counter):
    enc = _stream(lambda p, x, c: ref.terngrad_grace_encode(x, p["clip"], int(p["seed"]), c))(p, n, counter)
    return enc, ref.terngrad_grace_decode


def _u8bit(p, n, counter):
    return ref.u8bit_encode, ref.u8bit_decode


def _half(algo):
    def make(p, n, counter):
        return (lambda x: ref.half_encode(x, algo)), ref.half_decode
    return make

_randomk_enc = _counted(lambda p, x, c: ref.randomk_encode(x, p["ratio"], int(p["seed"]), c),
                        lambda p, n: ref.randomk_counter_advance(n, p["ratio"]))
_adaq_enc = _counted(lambda p, x, c: ref.adaq_encode(x, p["ratio"], int(p["seed"]), c),
                     lambda p, n: ref.adaq_counter_advance(n))
_sketch_enc = _counted(lambda p, x, c: ref.sketch_encode(x, int(p["quantiles"]), int(p["sample"]), int(p["seed"]), c),
                       lambda p, n: ref.sketch_counter_advance(n, int(p["sample"])))


def _randomk(p, n, counter):
    return _randomk_enc(p, n, counter), ref.sparse_decode


def _topk(p, n, counter):
    return (lambda x: ref.topk_encode(x, p["ratio"])), ref.sparse_decode


def _threshold(p, n, counter):
    return (lambda x: ref.threshold_encode(x, p["threshold"])), ref.sparse_decode


def _adaq(p, n, counter):
    return _adaq_enc(p, n, counter), ref.adaq_decode


def _dgc_grace(p, n, counter):
    return ref.DGCGraceReference(n, p["ratio"], p["momentum"], int(p["seed"]), counter).encode, ref.sparse_decode


def _sketch(p, n, counter):
    return _sketch_enc(p, n, counter), ref.sketch_decode


def _inceptionn(p, n, counter):
    return (lambda x: ref.inceptionn_encode(x, p["error_bound"])), ref.inceptionn_decode


SINGLE_ROUND = {
    "none": (set(), set(), _none),
    "onebit": (set(), set(), _onebit),
    "tbq": ({"threshold", "relative"}, set(), _tbq),
    "terngrad": ({"bitwidth", "seed"}, set(), _terngrad),
    # the native kernel samples a threshold, then selects the exact top-k: the sample cannot change the result
    "dgc": ({"ratio", "momentum", "warmup_steps", "summands"}, {"sample_ratio", "seed"}, _dgc),
    "graddrop": ({"ratio", "sample_ratio", "warmup_steps", "summands", "seed"}, set(), _graddrop),
    # GRACE's quantizers (docs/grace.md)
    "signsgd": ({"scale"}, set(), _signsgd),
    "signum": ({"momentum", "scale"}, set(), _signum),
    "efsignsgd": (set(), set(), _efsignsgd),
    "qsgd": ({"quantum_num", "seed"}, set(), _qsgd),
    "natural": ({"seed"}, set(), _natural),
    "terngrad_grace": ({"clip", "seed"}, set(), _terngrad_grace),
    "u8bit": (set(), set(), _u8bit),
    "fp16": (set(), set(), _half("fp16")),
    "bf16": (set(), set(), _half("bf16")),
    # GRACE's sparsifiers and hybrids (docs/grace.md)
    "randomk": ({"ratio", "seed"}, set(), _randomk),
    "topk": ({"ratio"}, {"sample_ratio", "seed"}, _topk),  # the sample only speeds the exact selection up
    "threshold": ({"threshold"}, set(), _threshold),
    "adaq": ({"ratio", "seed"}, set(), _adaq),
    "dgc_grace": ({"ratio", "momentum", "seed"}, set(), _dgc_grace),
    "sketch": ({"quantiles", "sample", "seed"}, set(), _sketch),
    "inceptionn": ({"error_bound"}, set(), _inceptionn),
}
POWERSGD_PARAMS = {"rank", "seed", "error_feedback"}


def _check_params(name: str, params: Dict[str, float], takes: set, ignores: set) -> None:
    unknown = sorted(set(params) - takes - ignores)
    missing = sorted(takes - set(params))
    if unknown:
        raise Unsupported(f"the {name} reference has no parameter {', '.join(unknown)}")
    if missing:
        raise Unsupported(f"hipress's {name} compressor no longer has parameter {', '.join(missing)} "
                          f"that the reference needs")


class _Worker:
    """One worker's compressor for one partition: ``decoded = worker(g)``, its state kept."""

    def __init__(self, encode, decode, n: int, ef: Optional[Tuple[float, float]]):
        self.encode, self.decode, self.n, self.ef = encode, decode, n, ef
        self.residual = np.zeros(n, np.float32) if ef else None

    def __call__(self, g: np.ndarray) -> np.ndarray:
        if self.ef is None:
            return self.decode(self.encode(g), self.n)
        payload, self.residual = ref.error_feedback_step(self.encode, self.decode, g, self.residual, *self.ef)
        return self.decode(payload, self.n)


# ------------------------------------------------------------------ the simulator


class Reference:
    """Reduces N workers' gradients the way hipress would, with the pure references.

    ``named``: the model's (name, parameter) list, in the optimizer's order. ``optimizer``:
    the local torch optimizer (momentum correction reads its momentum; None: no momentum
    correction). ``reduce(grads)`` takes ``grads[r][j]``, worker r's gradient of parameter j
    (None: unused this step), treats them in place (clipping, momentum correction) and
    returns the averaged gradient per parameter; ``apply(grads)`` writes it into ``.grad``;
    the optimizer then steps inside ``plain_step()``.
    """

    def __init__(self, named: Sequence[Tuple[str, torch.nn.Parameter]], size: int, algo: str,
                 kwargs: Optional[dict] = None, optimizer: Optional[torch.optim.Optimizer] = None, *,
                 bucket_bytes=_DEFAULTS["bucket_bytes"], partition_bytes=_DEFAULTS["partition_bytes"],
                 grad_clip=_DEFAULTS["grad_clip"], momentum_correction=_DEFAULTS["momentum_correction"]):
        if algo == "auto":  # DistributedOptimizer: TernGrad where the planner says it pays, the rest plain
            raise Unsupported("compression='auto' is chosen per gradient by the planner, which the simulator "
                              "does not model")
        self.ported = None
        if callable(algo) and not isinstance(algo, str):  # rank -> a ported GRACE compressor (hipress.grace.wrap)
            self.ported = [algo(r) for r in range(size)]
            if not all(isinstance(c, Ported) for c in self.ported):
                raise TypeError("algo: a callable must return hipress.grace.wrap(...) for each rank")
            comp = self.ported[0]
        else:
            try:
                comp = compression.get(algo, **(kwargs or {}))
            except (TypeError, ValueError) as e:
                raise Unsupported(str(e)) from None
        ef = (comp.beta, comp.gamma) if isinstance(comp, ErrorFeedback) else None
        inner = comp.inner if ef else comp
        self.algo, self.name, self.ef, self.inner = algo, inner.name, ef, inner
        self.params = dict(getattr(inner, "params", {}))
        if self.ported is not None:
            self.semantics = f"grace {comp.communicator}"
        elif comp.lowrank:
            if self.name not in ("powersgd", "powersgd_grace", "acpsgd"):
                raise Unsupported(f"no pure reference for the multi-round compressor {self.name!r}")
            if self.name == "powersgd_grace":  # GRACE's: fresh Q every step, error feedback always
                self.params.setdefault("error_feedback", 1.0)
            _check_params(self.name, self.params, POWERSGD_PARAMS, set())
            self.semantics = "lowrank"
        else:
            if self.name not in SINGLE_ROUND:
                raise Unsupported(f"no pure reference for the compressor {self.name!r}")
            takes, ignores, self._make = SINGLE_ROUND[self.name]
            _check_params(self.name, self.params, takes, ignores)
            self.semantics = "allgather"
        self.named = list(named)
        self.size = size
        self.clip: Optional[Callable] = clipping.resolve(grad_clip, comp.name)
        names = {id(p): n for n, p in self.named}
        use_mc = optimizer is not None and momentum.resolve(momentum_correction, optimizer, comp)
        velocity = not momentum.in_compressor(comp)  # signum keeps its own momentum
        self.momentum = ([momentum.MomentumCorrection(optimizer, names, velocity=velocity) for _ in range(size)]
                         if use_mc else None)
        first = None
        if bucket_bytes == "auto":  # the optimizer's rule (no plan, COVAP, dear or coordinator here)
            bucket_bytes, first = auto_bucket_bytes(comp)
        self.buckets = fusion_buckets(self.named, comp, bucket_bytes, first_bucket_bytes=first)
        self.split_tensors = splits_tensors(comp, "allgather")
        self.partition_bytes = partition_bytes
        self._index = {id(p): j for j, (_, p) in enumerate(self.named)}
        self._states: Dict[str, list] = {}  # hipress's state key -> one state per worker

    def _flat(self, bucket, grads_r) -> np.ndarray:
        return torch.cat([grads_r[self._index[id(p)]].detach().float().reshape(-1)
                          for _, p in bucket.params]).numpy()

    def _allgather(self, bucket, flats: List[np.ndarray]) -> np.ndarray:
        out = np.empty(bucket.numel, np.float32)
        for i, (s, e) in enumerate(bucket_bounds(bucket, self.partition_bytes, self.split_tensors)):
            if e <= s:
                continue
            key = f"{bucket.name}/p{i}/worker"  # the allgather strategy's state key
            if key not in self._states:
                params = self.params
                if hasattr(self.inner, "row_length"):  # onebit: per-row scales of the partition's shape
                    params = {**params, "row": self.inner.row_length(e - s, partition_shape(bucket.segments, s, e))}
                self._states[key] = [_Worker(*self._make(params, e - s, rng_stream_start(  # as StateStore
                                             0 if self.inner.shared_rng else r, key)), e - s,
                                             self.ef) for r in range(self.size)]
            acc = np.zeros(e - s, np.float32)
            for r, worker in enumerate(self._states[key]):  # rank order, as every rank adds them
                acc += worker(flats[r][s:e])
            out[s:e] = acc
        return out

    def _grace(self, bucket, flats: List[np.ndarray]) -> np.ndarray:
        """GRACE's send and receive steps with each worker's own compressor and memory, written
        from GRACE's communicators (not from hipress/compression/grace_api.py): allgather and
        broadcast decompress every worker's tensors and aggregate them; allreduce sums the
        compressed tensors (averaged first when the compressor averages) and decompresses once.
        The result is worker 0's (the others decompress the same tensors)."""
        out = np.empty(bucket.numel, np.float32)
        size, c0 = self.size, self.ported[0].compressor
        for i, (s, e) in enumerate(bucket_bounds(bucket, self.partition_bytes, self.split_tensors)):
            if e <= s:
                continue
            name = f"{bucket.name}/p{i}/worker"  # the allgather strategy's state key: the memory's name
            sent = []
            for r, port in enumerate(self.ported):
                t = port.memory.compensate(torch.from_numpy(flats[r][s:e].copy()), name)
                tensors, ctx = port.compressor.compress(t, name)
                port.memory.update(t, name, port.compressor, tensors, ctx)
                sent.append((list(tensors), ctx))
            if self.ported[0].communicator == "allreduce":
                summed = [t.clone() for t in sent[0][0]]
                for tensors, _ in sent[1:]:
                    for acc, t in zip(summed, tensors):
                        acc += t
                if c0.average:
                    summed = [t / size for t in summed]
                result = c0.decompress(summed, sent[0][1])
            else:
                result = c0.aggregate([c0.decompress(tensors, ctx) for tensors, ctx in sent])
                if c0.average:
                    result = result / size
            out[s:e] = result.reshape(-1).to(torch.float32).numpy()
        return out

    def _lowrank(self, bucket, flats: List[np.ndarray]) -> np.ndarray:
        out = np.empty(bucket.numel, np.float32)
        segments = [sg for sg in bucket.segments if sg[1] > 0]
        for i, (off, numel, shape) in enumerate(segments):
            if sent_raw(self.inner, numel, shape):  # summed as it is (hipress.sync.lowrank)
                out[off:off + numel] = sum_in_rank_order(f[off:off + numel] for f in flats)
                continue
            key = f"{bucket.name}/lowrank" + ("" if len(segments) == 1 else f"/{i}")  # the low-rank strategy's
            if key not in self._states and self.name == "acpsgd":
                rows, cols = matrix_shape(shape, numel)
                self._states[key] = [ref.ACPSGDReference(rows, cols, int(self.params["rank"]), int(self.params["seed"]),
                                                         bool(self.params["error_feedback"]))
                                     for _ in range(self.size)]
            elif key not in self._states:
                rows, cols = matrix_shape(shape, numel)
                self._states[key] = [ref.PowerSGDReference(rows, cols, int(self.params["rank"]),
                                                           int(self.params["seed"]),
                                                           bool(self.params["error_feedback"]),
                                                           fresh_q=self.name == "powersgd_grace")
                                     for _ in range(self.size)]
            workers = self._states[key]
            if self.name == "acpsgd":  # one factor per step
                total = sum_in_rank_order(w.local(f[off:off + numel]) for w, f in zip(workers, flats))
                out[off:off + numel] = [w.finish(total) for w in workers][0]
                continue
            p_sum = sum_in_rank_order(w.round0(f[off:off + numel]) for w, f in zip(workers, flats))
            q_sum = sum_in_rank_order(w.round1(p_sum) for w in workers)
            decoded = [w.finish(q_sum) for w in workers]  # the same on every worker: the same sums
            out[off:off + numel] = decoded[0]
        return out

    def reduce(self, grads: Sequence[Sequence[Optional[torch.Tensor]]]) -> List[torch.Tensor]:
        if len(grads) != self.size:
            raise ValueError(f"expected the gradients of {self.size} workers, got {len(grads)}")
        grads = [list(g) for g in grads]
        for r, g in enumerate(grads):  # what DistributedOptimizer does to a final gradient, in its order
            mc = self.momentum[r] if self.momentum is not None else None
            for j, (name, p) in enumerate(self.named):
                g[j] = final_gradient(name, p, g[j], self.clip, mc)
        mean: List[Optional[torch.Tensor]] = [None] * len(self.named)
        for bucket in self.buckets:
            flats = [self._flat(bucket, g) for g in grads]
            if self.ported is not None:  # averaged (or not) as the GRACE compressor says
                out = self._grace(bucket, flats)
            else:
                out = self._lowrank(bucket, flats) if self.semantics == "lowrank" else self._allgather(bucket, flats)
                out /= np.float32(self.size)
            for (_, p), off in zip(bucket.params, bucket.offsets):
                mean[self._index[id(p)]] = torch.from_numpy(out[off:off + p.numel()].copy()).view_as(p)
        return mean

    def apply(self, grads) -> None:
        for (_, p), g in zip(self.named, self.reduce(grads)):
            if g is not None:
                p.grad = g

    def plain_step(self):
        """The context the optimizer steps in: without momentum where momentum correction applied it."""
        return self.momentum[0].plain_step() if self.momentum is not None else contextlib.nullcontext()


def sum_in_rank_order(arrays) -> np.ndarray:
    it = iter(arrays)
    acc = np.array(next(it), dtype=np.float32)
    for a in it:
        acc += a
    return acc


class Simulation:
    """``size`` workers training ``task`` with ``algo``: ``step(epoch, i)`` is one optimizer
    step of all of them (each worker's batch i of the epoch); returns worker 0's loss, the
    figure hipress's run reports. Raises :class:`Unsupported` when there is no reference."""

    def __init__(self, task: tasks.Task, size: int, algo: str, kwargs: Optional[dict] = None, *, lr: float,
                 bucket_bytes=_DEFAULTS["bucket_bytes"]):
        self.task, self.size = task, size
        self.named = list(task.model.named_parameters())
        self.optimizer = tasks.optimizer(task.model, lr)
        self.reference = Reference(self.named, size, algo, kwargs, self.optimizer, bucket_bytes=bucket_bytes)

    def step(self, epoch: int, i: int) -> float:
        grads, losses = [], []
        for r in range(self.size):
            x, y = self.task.batch(r, self.size, epoch, i)
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.task.loss(self.task.model(x), y)
            loss.backward()
            grads.append([p.grad for _, p in self.named])
            losses.append(float(loss.detach()))
        self.reference.apply(grads)
        with self.reference.plain_step():
            self.optimizer.step()
        return losses[0]


def run(task_name: str, size: int, algo: str, kwargs: Optional[dict] = None, *, epochs: int, batch: int,
        lr: float, seed: int, seq: int = 64, eval_every: int = 1, bucket_bytes=_DEFAULTS["bucket_bytes"]) -> dict:
    """Trains ``task_name`` as ``size`` simulated workers; the result has the fields of a
    hipress run's result (algo, points, steps_per_epoch) and ``semantics``, or ``na`` (the
    reason) when there is no reference."""
    task = tasks.build(task_name, seed, batch, seq)
    try:
        sim = Simulation(task, size, algo, kwargs, lr=lr, bucket_bytes=bucket_bytes)
    except Unsupported as e:
        return {"algo": algo, "na": str(e)}
    # One thread, as each of hipress's ranks runs (convergence.worker): torch's kernels then sum
    # in the same order, so a step computes the same gradients as the ranks do. With other
    # thread counts the last bits differ and chaotic runs part ways after a few epochs
    # (digits, TernGrad: 93.3% at one thread, 86.9% at two; hipress's allgather run: 93.3%).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    try:
        points = tasks.train(task, size, epochs, eval_every, sim.step)
    finally:
        torch.set_num_threads(threads)
    return {"algo": algo, "points": points, "steps_per_epoch": task.steps_per_epoch(size),
            "semantics": sim.reference.semantics, "buckets": len(sim.reference.buckets),
            "wall_s": time.perf_counter() - t0}
