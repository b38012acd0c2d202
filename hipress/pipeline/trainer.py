"""Pipeline x data-parallel training of an nn.Sequential (see hipress/pipeline/__init__.py)."""
from __future__ import annotations

import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from hipress import config
from hipress.comm import world
from hipress.pipeline import schedule, tied as tied_sync
from hipress.pipeline.compressed_backward import BackwardCompressor
from hipress.pipeline.layout import Layout, compressed_stage_set, split_stage, tied_names_of_stage
from hipress.torch.functions import broadcast_parameters
from hipress.torch.optimizer import DistributedOptimizer

# p2p tags: activations forward, their gradients backward, the one-off copy of tied parameters
_TAG_FORWARD, _TAG_BACKWARD, _TAG_TIE = 1, 2, 3
_HEADER = 8  # int64s of a shape header: ndim, dtype code, up to 6 dimensions
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
_joined: Optional[tuple] = None  # (layout, stage) whose data-parallel group is hipress's world here


class Pipeline:
    """One rank's part of a pp x dp job: its stage of ``model``, the 1F1B schedule, and the
    synchronization of the stage's gradients over its data-parallel group through hipress.

    model: the whole torch.nn.Sequential, built alike on every rank (same seed); this rank keeps
    its stage's layers (``balance``: layers per stage, else as even as possible).
    make_optimizer: params -> torch.optim.Optimizer for the stage's parameters (called once
    for the parameters hipress synchronizes, once for the tied ones).
    loss_fn(output, target): the mean loss of a micro-batch (the last stage calls it).
    micro_batches: M, the micro-batches each replica's batch is cut into (equal sizes).
    tied: [(first-stage parameter name, last-stage parameter name), ...], names as in ``model``
    (e.g. ("embed.weight", "head.weight")): one parameter kept as two copies whose gradients are
    summed (and averaged over replicas) each step. fuse_embedding: that sync as one all-reduce
    over the 2D ranks holding a copy instead of a data-parallel all-reduce and a pair sum
    (Optimus-CC §6; hipress/pipeline/tied.py).
    backward_compression: None (off), or a hipress compressor name (e.g. "powersgd", with
    backward_compression_kwargs={"rank": r}) for the activation gradients sent backward;
    lazy_error: carry each send's compression error to the next micro-batch's;
    epilogue_only: compress only the sends of the 1F1B epilogue (schedule.in_epilogue).
    backward_compression_warmup: steps whose backward sends all go uncompressed before
    backward_compression starts (the paper's warm-up of uncompressed iterations, §9.1; 10% of a
    300-step run took the example's CB cost from +6.2% to +1.7% perplexity, docs/pipeline.md).
    compress_stages: the stages whose data-parallel gradients are compressed with
    dp_compression (+ dp_compression_kwargs): None (none), k (the first k) or a list.
    Other keywords go to hipress.DistributedOptimizer (strategy=, bucket_bytes=, ...).

    torch.distributed must be initialized over the pp*dp ranks (gloo on CPU); hipress's world
    becomes this stage's data-parallel group (a private gloo group, one per stage).
    """

    def __init__(self, model: nn.Sequential, make_optimizer: Callable[[List[nn.Parameter]], torch.optim.Optimizer],
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *, pp: int, dp: int,
                 micro_batches: int, balance: Optional[Sequence[int]] = None,
                 tied: Iterable[Tuple[str, str]] = (), fuse_embedding: bool = False,
                 backward_compression=None, backward_compression_kwargs: Optional[dict] = None,
                 lazy_error: bool = True, epilogue_only: bool = True, backward_compression_warmup: int = 0,
                 compress_stages=None, dp_compression="powersgd", dp_compression_kwargs: Optional[dict] = None,
                 **hipress_kwargs):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("hipress.pipeline needs torch.distributed initialized over all pp*dp ranks "
                               "(torch.distributed.init_process_group('gloo'))")
        self.layout = Layout(pp, dp)
        if dist.get_world_size() != self.layout.size:
            raise ValueError(f"pp={pp} x dp={dp} needs {self.layout.size} ranks, torch.distributed has "
                             f"{dist.get_world_size()}")
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches must be a positive int, got {micro_batches!r}")
        self.rank = dist.get_rank()
        self.stage = self.layout.stage_of(self.rank)
        self.replica = self.layout.replica_of(self.rank)
        self.micro_batches = micro_batches
        self.first, self.last = self.stage == 0, self.stage == pp - 1
        self.module = split_stage(model, self.stage, pp, balance)
        self.loss_fn = loss_fn
        self.fuse_embedding = bool(fuse_embedding)
        self.epilogue_only = bool(epilogue_only)
        w = backward_compression_warmup
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(f"backward_compression_warmup must be an int >= 0 (steps), got {w!r}")
        self.backward_compression_warmup = w
        self.steps_done = 0  # steps finished, the same count on every rank (both ends of a send ask it)
        self.compressed_stages = compressed_stage_set(compress_stages, pp)
        self.tied_names = tied_names_of_stage(model, list(tied), self.stage, pp, balance)
        self._join_dp_world()

        params = dict(self.module.named_parameters())
        tied_here = [params[n] for n in self.tied_names]
        synced = [(n, p) for n, p in params.items() if n not in self.tied_names]
        self._copy_tied_from_first_stage(tied_here)
        broadcast_parameters(self.module.state_dict(), root_rank=0)  # replica 0's values on every replica
        compress = self.stage in self.compressed_stages
        self.optimizer = (DistributedOptimizer(make_optimizer([p for _, p in synced]), named_parameters=synced,
                                               compression=dp_compression if compress else "none",
                                               backward_passes_per_step=micro_batches, **hipress_kwargs,
                                               **((dp_compression_kwargs or {}) if compress else {}))
                          if synced else None)
        self.tied_params = tied_here
        self.tied_optimizer = make_optimizer(tied_here) if tied_here else None
        # every stage but the first encodes what it sends, every stage but the last decodes
        self.backward_compressor = (BackwardCompressor(backward_compression, lazy_error,
                                                       **(backward_compression_kwargs or {}))
                                    if backward_compression is not None and pp > 1 else None)
        self.kept_error: Optional[torch.Tensor] = None  # the lazy error left at the end of the last step
        self.compressed_sends = 0  # backward sends compressed so far (this rank)
        self.tied_sync_groups: List[List[int]] = []  # the all-reduce groups of the last tied sync
        # seconds spent, summed over steps: the 1F1B schedule (sends waited for), the tied sync,
        # and the optimizer steps (their wait for hipress's data-parallel sync included)
        self.timings = {"schedule_s": 0.0, "tied_sync_s": 0.0, "update_s": 0.0}

    # ------------------------------------------------------------------ setup
    def _join_dp_world(self) -> None:
        """hipress's world = this stage's data-parallel group (made once per process)."""
        global _joined
        group = (self.layout, self.stage)
        if world.is_initialized():
            if _joined != group:
                raise RuntimeError(f"hipress is already initialized (rank {world.rank()} of {world.size()}) with "
                                   f"another world; a Pipeline needs hipress's world to be its stage's data-parallel "
                                   f"group: one pipeline layout per process, built before any hipress.init()")
            return
        world.init_private_gloo(dist.distributed_c10d._get_default_store(), f"hipress/pipeline/stage{self.stage}",
                                self.replica, self.layout.dp, config.get("HIPRESS_TIMEOUT_S"))
        _joined = group

    def _copy_tied_from_first_stage(self, tied_here: List[nn.Parameter]) -> None:
        """The last stage's copies start as the first stage's values."""
        if not tied_here:
            return
        peer = (self.layout.rank(self.layout.pp - 1, self.replica) if self.first
                else self.layout.rank(0, self.replica))
        for p in tied_here:
            if self.first:
                dist.send(p.detach().contiguous(), peer, tag=_TAG_TIE)
            else:
                buf = torch.empty_like(p.detach())
                dist.recv(buf, peer, tag=_TAG_TIE)
                with torch.no_grad():
                    p.copy_(buf)

    # ------------------------------------------------------------------ p2p
    def _next(self) -> int:
        return self.layout.rank(self.stage + 1, self.replica)

    def _prev(self) -> int:
        return self.layout.rank(self.stage - 1, self.replica)

    def _send_activation(self, y: torch.Tensor, with_header: bool, pending: list) -> None:
        if not isinstance(y, torch.Tensor) or y.dtype not in _DTYPES:
            raise ValueError(f"stage {self.stage} must output one floating-point tensor to send to the next stage, "
                             f"got {type(y).__name__ if not isinstance(y, torch.Tensor) else y.dtype}")
        if y.dim() > _HEADER - 2:
            raise ValueError(f"stage {self.stage}'s output has {y.dim()} dimensions; at most {_HEADER - 2} are supported")
        y = y.detach().contiguous()
        if with_header:
            header = torch.zeros(_HEADER, dtype=torch.int64)
            header[0], header[1] = y.dim(), _DTYPES.index(y.dtype)
            header[2:2 + y.dim()] = torch.tensor(y.shape, dtype=torch.int64)
            pending.append((dist.isend(header, self._next(), tag=_TAG_FORWARD), header))
        pending.append((dist.isend(y, self._next(), tag=_TAG_FORWARD), y))

    def _recv_activation(self, with_header: bool) -> torch.Tensor:
        if with_header:
            header = torch.empty(_HEADER, dtype=torch.int64)
            dist.recv(header, self._prev(), tag=_TAG_FORWARD)
            ndim = int(header[0])
            self._in_shape, self._in_dtype = tuple(int(d) for d in header[2:2 + ndim]), _DTYPES[int(header[1])]
        x = torch.empty(self._in_shape, dtype=self._in_dtype)
        dist.recv(x, self._prev(), tag=_TAG_FORWARD)
        return x

    def _compress_backward(self, sender: int, micro_batch: int) -> bool:
        """Whether stage ``sender``'s backward send of ``micro_batch`` is compressed (both ends ask)."""
        return (self.backward_compressor is not None and self.steps_done >= self.backward_compression_warmup
                and (not self.epilogue_only or schedule.in_epilogue(sender, self.layout.pp, self.micro_batches,
                                                                    micro_batch)))

    def _send_grad(self, g: torch.Tensor, micro_batch: int, pending: list) -> None:
        g = g.detach().contiguous()
        if self._compress_backward(self.stage, micro_batch):
            g, _ = self.backward_compressor.encode(g)
            self.compressed_sends += 1
        pending.append((dist.isend(g, self._prev(), tag=_TAG_BACKWARD), g))

    def _recv_grad(self, like: torch.Tensor, micro_batch: int) -> torch.Tensor:
        if self._compress_backward(self.stage + 1, micro_batch):
            wire = torch.empty(self.backward_compressor.max_wire_bytes(like.shape), dtype=torch.uint8)
            dist.recv(wire, self._next(), tag=_TAG_BACKWARD)
            return self.backward_compressor.decode(wire, like.shape).to(like.dtype)
        g = torch.empty_like(like)
        dist.recv(g, self._next(), tag=_TAG_BACKWARD)
        return g

    # ------------------------------------------------------------------ training
    def _micro(self, batch: Optional[torch.Tensor], what: str) -> List[Optional[torch.Tensor]]:
        if batch is None:
            return [None] * self.micro_batches
        if batch.shape[0] % self.micro_batches:
            raise ValueError(f"the {what} batch of {batch.shape[0]} examples does not split into "
                             f"micro_batches={self.micro_batches} equal parts")
        return list(batch.chunk(self.micro_batches))

    def step(self, inputs: Optional[torch.Tensor], targets: Optional[torch.Tensor]) -> Optional[float]:
        """One training step on this replica's batch (every stage of the replica passes the same
        batch; the first stage uses ``inputs``, the last ``targets``; others may pass None).
        Returns the batch's mean loss on the last stage, None on the others."""
        if self.first and inputs is None:
            raise ValueError("the first stage needs the inputs")
        if self.last and targets is None:
            raise ValueError("the last stage needs the targets")
        xs = self._micro(inputs if self.first else None, "input")
        ts = self._micro(targets if self.last else None, "target")
        self.module.train()
        for opt in (self.optimizer, self.tied_optimizer):
            if opt is not None:
                opt.zero_grad(set_to_none=True)
        pending: list = []
        t0 = time.perf_counter()
        saved: Dict[int, tuple] = {}
        losses = []
        m = self.micro_batches
        try:
            for op, i in schedule.one_f_one_b(self.stage, self.layout.pp, m):
                if op == "F":
                    x = xs[i] if self.first else self._recv_activation(i == 0).requires_grad_()
                    y = self.module(x)
                    if self.last:
                        loss = self.loss_fn(y, ts[i])
                        losses.append(loss.detach())
                        saved[i] = (x, loss / m)
                    else:
                        self._send_activation(y, i == 0, pending)
                        saved[i] = (x, y)
                else:
                    x, y = saved.pop(i)
                    if self.last:
                        y.backward()
                    else:
                        torch.autograd.backward(y, self._recv_grad(y, i))
                    if not self.first:
                        self._send_grad(x.grad if x.grad is not None else torch.zeros_like(x), i, pending)
            for work, _ in pending:
                work.wait()
        finally:
            if self.backward_compressor is not None:
                self.kept_error = self.backward_compressor.end_step()
        t1 = time.perf_counter()
        self.timings["schedule_s"] += t1 - t0
        if self.tied_params:
            for p in self.tied_params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self.tied_sync_groups = tied_sync.sync_tied_gradients([p.grad for p in self.tied_params], self.layout, self.stage,
                                          self.replica, self.fuse_embedding)
            t2 = time.perf_counter()
            self.timings["tied_sync_s"] += t2 - t1
            t1 = t2
            self.tied_optimizer.step()
        if self.optimizer is not None:
            self.optimizer.step()
        self.timings["update_s"] += time.perf_counter() - t1
        self.steps_done += 1
        return float(torch.stack(losses).mean()) if self.last else None

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """This rank's part of a checkpoint, taken between steps: its stage's parameters, both
        optimizers (hipress's data-parallel state inside), the backward compressor's warm-started
        states and the step count (the warm-up of backward compression counts it). Save it per
        rank; every rank of the job loads its own with :meth:`load_state_dict`."""
        return {"stage": self.stage, "replica": self.replica, "layout": [self.layout.pp, self.layout.dp],
                "module": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                "tied_optimizer": self.tied_optimizer.state_dict() if self.tied_optimizer is not None else None,
                "backward_compressor": (self.backward_compressor.state_dict()
                                        if self.backward_compressor is not None else None),
                "steps_done": self.steps_done, "compressed_sends": self.compressed_sends}

    def load_state_dict(self, sd: dict) -> None:
        """Restores :meth:`state_dict` of the same rank's part (same pp x dp layout)."""
        if sd["layout"] != [self.layout.pp, self.layout.dp] or sd["stage"] != self.stage:
            raise ValueError(f"the checkpoint is of stage {sd['stage']} of a pp x dp = {sd['layout'][0]} x "
                             f"{sd['layout'][1]} pipeline; this rank is stage {self.stage} of {self.layout.pp} x "
                             f"{self.layout.dp}: load each rank's own checkpoint into the same layout")
        self.module.load_state_dict(sd["module"])
        for opt, saved, what in ((self.optimizer, sd["optimizer"], "optimizer"),
                                 (self.tied_optimizer, sd["tied_optimizer"], "tied_optimizer")):
            if (opt is None) != (saved is None):
                raise ValueError(f"the checkpoint's {what} does not match this stage's (other tied parameters?)")
            if opt is not None:
                opt.load_state_dict(saved)
        if (self.backward_compressor is None) != (sd["backward_compressor"] is None):
            raise ValueError("the checkpoint was saved with backward_compression "
                             f"{'off' if sd['backward_compressor'] is None else 'on'}; this pipeline has it "
                             f"{'off' if self.backward_compressor is None else 'on'}")
        if self.backward_compressor is not None:
            self.backward_compressor.load_state_dict(sd["backward_compressor"])
        self.steps_done, self.compressed_sends = int(sd["steps_done"]), int(sd["compressed_sends"])

    @torch.no_grad()
    def evaluate(self, inputs: Optional[torch.Tensor], targets: Optional[torch.Tensor]) -> float:
        """The mean loss of every replica's (inputs, targets), forward only; collective over all
        ranks, returned on every rank."""
        self.module.eval()
        xs = self._micro(inputs if self.first else None, "input")
        ts = self._micro(targets if self.last else None, "target")
        pending: list = []
        total = torch.zeros(2, dtype=torch.float64)
        for i in range(self.micro_batches):
            y = self.module(xs[i] if self.first else self._recv_activation(i == 0))
            if self.last:
                total[0] += float(self.loss_fn(y, ts[i]))
                total[1] += 1
            else:
                self._send_activation(y, i == 0, pending)
        for work, _ in pending:
            work.wait()
        self.module.train()
        dist.all_reduce(total)
        return float(total[0] / total[1])
