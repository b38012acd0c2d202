"""strategy="dear": the ring's two phases one iteration apart (paper 001, DeAR; docs/dear.md).

In backward, a fused bucket's ring reduce-scatter starts as soon as its gradients are final
(the optimizer's usual hooks). ``step()`` waits for the reduce-scatters only, then queues the
bucket's all-gathers, in forward order, behind them, and defers the parameter update: the
all-gathers run while the program goes on into the next iteration's forward. A forward
pre-hook on each module that owns parameters of a bucket waits for that bucket's all-gather
and runs the user's own optimizer on that bucket's parameters alone, just before their first
use. ``synchronize()``, ``state_dict()`` (optimizer and model) and ``load_state_dict()`` first
apply every update still pending, so parameters are current whenever they are read.

This module holds the schedule (what is pending, which module releases which bucket, the
optimizer hyperparameters each deferred update runs with); the optimizer supplies the
update itself and the syncs.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional, Sequence

import torch

from hipress import _C, config


def hyperparameters(groups: Sequence[dict]) -> List[dict]:
    """A copy of every param group's settings but its parameters (lr, betas, weight decay...),
    taken when step() is called. A deferred update runs with these, so a scheduler stepping
    right after step() changes the next iteration's lr, as it does without deferral, and every
    bucket of one iteration sees the same lr. Tensors (a capturable lr) are cloned because
    schedulers change them in place."""
    return [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in g.items() if k != "params"} for g in groups]


@contextlib.contextmanager
def using_hyperparameters(groups: Sequence[dict], snapshot: Sequence[dict]):
    """Inside: each group's settings are the snapshot's; afterwards what they were."""
    if len(groups) != len(snapshot):
        raise RuntimeError(f"strategy='dear': the optimizer has {len(groups)} param groups, but had {len(snapshot)} "
                           f"at the step() whose update is pending; call synchronize() before add_param_group()")
    saved = [{k: g[k] for k in s if k in g} for g, s in zip(groups, snapshot)]
    try:
        for g, s in zip(groups, snapshot):
            g.update(s)
        yield
    finally:
        for g, s in zip(groups, saved):
            g.update(s)


def owning_modules(model: torch.nn.Module, params: Sequence[torch.nn.Parameter],
                   names: Dict[int, str]) -> Dict[torch.nn.Module, List[int]]:
    """For every module of ``model`` that holds some of ``params`` itself (not through a
    submodule): the ids of those parameters. A parameter shared by several modules (tied
    weights) is listed under each, so whichever runs first releases it. Raises ValueError
    naming the parameters no module of ``model`` holds (no hook could update them in time)."""
    wanted = {id(p) for p in params}
    owners: Dict[torch.nn.Module, List[int]] = {}
    seen = set()
    for module in model.modules():
        mine = [id(p) for p in module.parameters(recurse=False) if id(p) in wanted]
        if mine:
            owners[module] = mine
            seen.update(mine)
    missing = [names[id(p)] for p in params if id(p) not in seen]
    if missing:
        raise ValueError(f"strategy='dear': parameter(s) {missing[:10]} of the optimizer belong to no module of model=; "
                         f"their update would have no forward hook to run in; pass the model that owns them")
    return owners


class _Pending:
    __slots__ = ("bucket", "handle", "hyper")

    def __init__(self, bucket, handle, hyper):
        self.bucket, self.handle, self.hyper = bucket, handle, hyper


class Schedule:
    """Which bucket updates are pending and the hooks that run them in time.

    ``buckets``: the optimizer's fusion buckets (objects with ``name`` and ``params``, a
    list of (name, parameter)); ``update(bucket, hyper)`` applies one bucket's reduced
    gradient with the optimizer settings ``hyper``; ``waiting_for()`` says, in words, whom this
    rank waits for (a timeout's message). ``trace(name, start_ns, end_ns)``, where given (the
    engine's timeline is on), records each wait for an all-gather and each update, so a step's
    timeline shows where the forward stood still."""

    def __init__(self, buckets: Sequence, model: torch.nn.Module, names: Dict[int, str],
                 update: Callable[[object, List[dict]], None], waiting_for: Callable[[], str],
                 trace: Optional[Callable[[str, int, int], None]] = None):
        self._update = update
        self._waiting_for = waiting_for
        self._trace = trace
        self._names = names
        self._model = model
        self._pending: Dict[str, _Pending] = {}
        self._stale: set = set()  # ids of parameters whose update was still pending when backward began
        self._hooks: list = []
        self.set_buckets(buckets)
        # model.state_dict() / load_state_dict() see (or replace) current parameters
        self._model_hooks = [model.register_state_dict_pre_hook(lambda *args: self.flush()),
                             model.register_load_state_dict_pre_hook(lambda *args: self.flush())]

    def set_buckets(self, buckets: Sequence) -> None:
        """Schedules ``buckets`` from now on (the optimizer rebuilt them: bucket_bytes="tune"); the
        forward pre-hooks are registered again for them. Only with nothing pending: the pending
        updates belong to the old buckets."""
        if self._pending:
            raise RuntimeError(f"strategy='dear': buckets rebuilt while updates of {list(self._pending)[:5]} are "
                               f"pending; flush() first")
        # Forward order: buckets are filled in reverse parameter order (backward's), so the
        # first bucket a forward needs is the last one. Every rank queues the all-gathers in
        # this order, fixed with the buckets, so their messages match whatever the model does.
        self.forward_order = list(reversed(buckets))
        params = [p for b in buckets for _, p in b.params]
        bucket_of = {id(p): b.name for b in buckets for _, p in b.params}
        releases: Dict[torch.nn.Module, List[str]] = {}
        for module, ids in owning_modules(self._model, params, self._names).items():
            releases[module] = list(dict.fromkeys(bucket_of[i] for i in ids))
        for h in self._hooks:
            h.remove()
        self._releases = releases
        self._hooks = [m.register_forward_pre_hook(self._before_forward) for m in self._releases]

    @property
    def pending(self) -> List[str]:
        """Names of the buckets whose update has not run yet, in the order they were deferred."""
        return list(self._pending)

    def defer(self, bucket, handle, hyper: List[dict]) -> None:
        """``bucket``'s update waits for ``handle`` (its all-gather; None: nothing to wait for)."""
        if bucket.name in self._pending:
            raise RuntimeError(f"strategy='dear': bucket '{bucket.name}' deferred twice without its update running")
        self._pending[bucket.name] = _Pending(bucket, handle, hyper)

    def _before_forward(self, module, args) -> None:
        if self._pending:
            for name in self._releases[module]:
                if name in self._pending:
                    self._apply(name)

    def flush(self) -> None:
        """Runs every pending update (waiting for its all-gather), in the order deferred."""
        for name in list(self._pending):
            if name in self._pending:
                self._apply(name)

    def _apply(self, name: str) -> None:
        item = self._pending.pop(name)
        h = item.handle
        t0 = _C.now_ns() if self._trace else 0
        if h is not None:
            deadline = config.get("HIPRESS_TIMEOUT_S")
            if not h.wait(deadline):
                raise RuntimeError(f"strategy='dear': all-gather of '{name}' not done within {deadline:g} s "
                                   f"(HIPRESS_TIMEOUT_S); {self._waiting_for()}")
            err = h.exception(0)
            if err is not None:
                raise RuntimeError(f"strategy='dear': all-gather of '{name}' failed: {err}")
        if self._trace:
            t1 = _C.now_ns()
            self._trace(f"wait.allgather.{name}", t0, t1)
        self._update(item.bucket, item.hyper)
        if self._trace:
            self._trace(f"update.{name}", t1, _C.now_ns())

    def begin_backward(self) -> None:
        """The first gradient of a step is final: every update still pending belongs to a bucket
        no module released in the forward that produced this gradient. Runs them now (their
        buffers are about to be reused); their parameters must not get a gradient in this step
        (:meth:`check_fresh`), since the forward would have used them before their update."""
        self._stale = {id(p) for item in self._pending.values() for _, p in item.bucket.params}
        self.flush()

    def check_fresh(self, p: torch.nn.Parameter) -> None:
        """Raises if ``p`` has a gradient although the forward used it before its update."""
        if id(p) in self._stale and p.grad is not None:
            raise RuntimeError(
                f"strategy='dear': parameter '{self._names[id(p)]}' got a gradient, but its module's forward "
                f"pre-hook did not run before it was used, so the forward used it before its update; every "
                f"parameter must be used through a module that holds it (call modules, not module.forward), "
                f"or use strategy='ring'")

    def end_backward(self) -> None:
        self._stale = set()


def speedup_bound(workers: int, t_ff: float, t_bp: float, t_rs: float, t_ag: float) -> float:
    """Paper 001's eq. 6: the most any schedule that overlaps the reduce-scatter with backward
    and the all-gather with forward can speed ``workers`` up over one worker, from per-step
    times of forward (t_ff), backward (t_bp), reduce-scatter (t_rs) and all-gather (t_ag):
    P (t_ff + t_bp) / (t_ff + t_bp + t_rs + t_ag - min(t_rs, t_bp) - min(t_ag, t_ff))."""
    if workers < 1 or min(t_ff, t_bp, t_rs, t_ag) < 0 or t_ff + t_bp <= 0:
        raise ValueError(f"speedup_bound needs workers >= 1, non-negative times and t_ff + t_bp > 0; got "
                         f"{workers}, {t_ff}, {t_bp}, {t_rs}, {t_ag}")
    compute = t_ff + t_bp
    return workers * compute / (compute + t_rs + t_ag - min(t_rs, t_bp) - min(t_ag, t_ff))
