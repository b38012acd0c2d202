"""Horovod's own data parallelism as a baseline for hipress's benchmarks.

    from horovod_ext.baseline import horovod_optimizer, init_horovod, broadcast_initial_state

    hvd = init_horovod()                                    # hvd.init() once; returns horovod.torch
    opt = horovod_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                            compression="none")             # or "fp16"
    broadcast_initial_state(model, opt)                     # same start on every rank
    loss.backward(); opt.step()                             # Horovod allreduce-averages the gradients

``compression="none"`` is Horovod's plain allreduce (``hvd.Compression.none``);
``compression="fp16"`` casts each gradient to float16 before the allreduce and back after
(``hvd.Compression.fp16``): the sum itself is computed in float16. Names accepted:
``none``/``horovod``, ``fp16``/``horovod-fp16`` (see :data:`BASELINES`).

Run under ``horovodrun -np N`` (or ``mpirun`` with Horovod built with MPI). Horovod must
be installed (``bash scripts/install_horovod.sh``); :func:`available` says whether it is.
"""
from __future__ import annotations

import itertools
import time
from typing import Optional

import torch

__all__ = ["BASELINES", "available", "init_horovod", "horovod_optimizer", "broadcast_initial_state"]

#: baseline configuration name -> Horovod compression name
BASELINES = {"horovod": "none", "horovod-fp16": "fp16"}


def available() -> bool:
    from horovod_ext import available as _available

    return _available()


def init_horovod():
    """``hvd.init()`` once (with dynamic process sets, so hipress's Horovod transport can
    share the job) and return the ``horovod.torch`` module."""
    import horovod.torch as hvd

    if not hvd.is_initialized():
        hvd.init(process_sets="dynamic")
    return hvd


def _compressor(hvd, compression: str):
    name = BASELINES.get(compression, compression)
    table = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}
    if name not in table:
        raise ValueError(f"Horovod baseline compression must be one of {sorted(table) + sorted(BASELINES)}, "
                         f"got {compression!r}")
    return table[name]


def horovod_optimizer(optimizer, model=None, compression: str = "none", named_parameters=None,
                      backward_passes_per_step: int = 1, op: Optional[str] = "average", **kwargs):
    """Wrap ``optimizer`` in ``hvd.DistributedOptimizer``.

    ``model`` (or ``named_parameters``) names the gradients for Horovod; ``compression`` is
    ``"none"`` or ``"fp16"`` (or ``"horovod"`` / ``"horovod-fp16"``); ``op`` is ``"average"``
    or ``"sum"``; other keyword arguments go to ``hvd.DistributedOptimizer`` unchanged.
    Initializes Horovod if needed."""
    hvd = init_horovod()
    if named_parameters is None and model is not None:
        named_parameters = model.named_parameters()
    ops = {"average": hvd.Average, "sum": hvd.Sum}
    if op not in ops:
        raise ValueError(f"op must be 'average' or 'sum', got {op!r}")
    return hvd.DistributedOptimizer(optimizer, named_parameters=named_parameters,
                                    compression=_compressor(hvd, compression),
                                    backward_passes_per_step=backward_passes_per_step, op=ops[op], **kwargs)


_barriers = itertools.count()


def _sleeping_barrier(hvd) -> None:
    """Waits for every rank, sleeping between polls. Horovod's own waits spin (sched_yield):
    with more ranks than cores the ranks already waiting starve one still busy (a lazy
    torch import took 31 s instead of 2 s under three spinning ranks on 2 cores, and
    Horovod's gloo controller then timed out)."""
    h = hvd.allgather_async(torch.zeros(1), name=f"hipress.baseline.barrier.{next(_barriers)}")
    while not hvd.poll(h):
        time.sleep(1e-3)
    hvd.synchronize(h)


def broadcast_initial_state(model, optimizer=None, root_rank: int = 0) -> None:
    """Rank ``root_rank``'s parameters (and optimizer state) on every rank."""
    hvd = init_horovod()
    _sleeping_barrier(hvd)  # the broadcasts below then wait (spinning) only briefly
    hvd.broadcast_parameters(model.state_dict(), root_rank=root_rank)
    if optimizer is not None:
        hvd.broadcast_optimizer_state(optimizer, root_rank=root_rank)
