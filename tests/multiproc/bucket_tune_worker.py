"""One rank of the bucket_bytes="tune" tests (launched by test_bucket_tune.py), and of plan="auto"'s
measured choice (test_plan_trial_ranks.py).

    python bucket_tune_worker.py OUT_DIR CONFIGS_JSON

For every config it trains the same small model on rank-specific batches with
hipress.DistributedOptimizer, either with a fixed ``bucket_bytes`` or with ``bucket_bytes="tune"``
and the config's ``tune`` knobs. ``clock``: "fake" gives the tuner a clock that the loop moves
after each step() by a synthetic step time of the bucket size in force, times (1 + rank / 4), so
the measurements (and the slowest rank, the last) are known in advance and a resumed job sees
the same ones; "real" leaves the tuner's own clock. ``nan_at``: steps whose loss is NaN on rank 0
(every rank then skips the step). ``save_at``: after that step, a checkpoint (model and optimizer
state_dict) is taken and a fresh model and optimizer loaded from it train the remaining steps.
``plan`` (Overrides' fields) instead of a tuned or fixed size: the trial gets the fake clock, moved
by ``plan_seconds`` of the candidate plan in force; ``load_into``: plan= options of fresh optimizers
the checkpoint is loaded into (recorded: the error, or the trial's state and the plan in force);
``links``: {"saved": s, "resumed": s}, the link's seconds per byte the planner's profile says when
the job that saves starts and when the resumed one does (which buckets each compresses recorded).
``hidden``: the width of the model's hidden layer (40).

Recorded per step (after step()): the size in force and the bucket layout, the raw gradients
(this rank's, before hipress sees them) and whether the step was skipped, the carry added to them,
the plan in force and the SGD's momentum buffers; at the end, after
synchronize(): the parameters, the tuner's history, the optimizer's hipress state (compressor
states and carry) and the layout with each bucket's partitions. Saves OUT_DIR/rank{r}.pt.
"""
import contextlib
import dataclasses
import io
import json
import math
import os
import sys
import warnings

import torch
import torch.nn as nn

import hipress
from hipress.planner import Overrides
from hipress.planner.cost_model import AffineCurve
from hipress.torch import optimizer
from hipress.torch.nonfinite import NonFiniteGradientWarning


class Net(nn.Module):
    def __init__(self, hidden=40):
        super().__init__()
        self.a = nn.Linear(6, hidden)
        self.b = nn.Linear(hidden, 5)
        self.c = nn.Linear(5, 1)
        self.unused = nn.Linear(2, 2)  # zero gradients every step

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))).squeeze(1)


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, generator=g)


def synthetic_seconds(size):
    """A step time with its best at 2**8 bytes in the model's range [16, 1988] bytes, in whole
    2**-20 s: the clocks' sums and differences are then exact, so a resumed job, whose clock starts
    elsewhere, measures the very same numbers."""
    return round((1.0 + 0.1 * (math.log2(size) - 8.0) ** 2) * 2 ** 20) / 2 ** 20


@contextlib.contextmanager
def measured_link(send_s_per_byte):
    """While it lasts, the planner's profile as measured but with the link's time per byte replaced:
    what timing the link again may find (plan="auto" profiles at start-up, a resumed job anew)."""
    real = optimizer.profile_online

    def profile(*args, **kw):
        prof = real(*args, **kw)
        link = AffineCurve(1e-4, send_s_per_byte)
        # the allreduce priced from that link too (the measured one is loopback's)
        return dataclasses.replace(prof, send=link, send_one=link if prof.send_one is not None else None,
                                   allreduce=None)
    optimizer.profile_online = profile
    try:
        yield
    finally:
        optimizer.profile_online = real


def make(cfg, rank, clock, link=None):
    """link: seconds per byte of the link the planner's profile says (``measured_link``)."""
    with measured_link(link) if link is not None else contextlib.nullcontext():
        return _make(cfg, rank, clock)


def _make(cfg, rank, clock):
    torch.manual_seed(0)
    model = Net(cfg.get("hidden", 40))
    if cfg.get("momentum", True):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:  # plain SGD: p_T = p_0 - lr * (sum of the averaged gradients), for the conservation check
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kw = {"model": model} if cfg["strategy"] == "dear" else {"named_parameters": model.named_parameters()}
    if "plan" in cfg:  # plan="auto"'s measured choice (test_plan_trial_ranks.py) instead of tuning
        kw["plan"] = Overrides(**cfg["plan"])
    elif "fixed" in cfg:
        kw["bucket_bytes"] = cfg["fixed"]
    else:
        knobs = dict(cfg["tune"])
        if cfg.get("clock", "fake") == "fake":
            knobs["clock"] = lambda: clock[0]
        kw.update(bucket_bytes="tune", bucket_tune=knobs)
    opt = hipress.DistributedOptimizer(opt, compression=cfg.get("compression", "none"), strategy=cfg["strategy"],
                                       partition_bytes=cfg.get("partition_bytes", 64 << 20),
                                       **kw, **cfg.get("kwargs", {}))
    if opt.plan_trial is not None:
        opt.plan_trial.clock = lambda: clock[0]
    return model, opt


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def compressed(opt):
    """Whether the plan in force compresses each bucket (None without a plan)."""
    return None if opt._hp_plan is None else [opt._hp_plan.entry(b.name, b.numel).compress for b in opt._hp_buckets]


def layout(opt):
    return [(b.name, b.numel) for b in opt._hp_buckets]


def train(cfg, model, opt, rank, first, last, clock, rec, after_step=None):
    named = list(model.named_parameters())
    for step in range(first, last):
        x, y = batch(rank, step)
        opt.zero_grad(set_to_none=True)
        loss = ((model(x) - y) ** 2).mean()
        if rank == 0 and step in cfg.get("nan_at", ()):
            loss = loss * float("nan")
        # this rank's own gradients, before hipress's hooks see them (unused module: zeros)
        grads = torch.autograd.grad(loss, [p for _, p in named], retain_graph=True, allow_unused=True)
        rec["grads"][step] = {n: (torch.zeros_like(p) if g is None else g.detach().clone())
                              for (n, p), g in zip(named, grads)}
        loss.backward()
        # residuals a plan switch at this step's start handed back (added to this step's gradients)
        # (once added to a gradient, a carry waits in _hp_carry_sent until the step commits)
        rec["carry"][step] = {opt._hp_names[k]: v.clone() for k, v in {**opt._hp_carry, **opt._hp_carry_sent}.items()}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", NonFiniteGradientWarning)
            opt.step()
        rec["skipped"][step] = any(issubclass(w.category, NonFiniteGradientWarning) for w in caught)
        tuner = opt.bucket_tuner
        rec["size"][step] = tuner.size if tuner is not None else None
        rec["layout"][step] = layout(opt)
        rec["params"][step] = params(model)  # with dear: the parameters before the deferred update
        trial = opt.plan_trial
        rec["plan"][step] = trial.in_use if trial is not None else None
        rec["momentum_buffer"][step] = {n: opt.state[p]["momentum_buffer"].clone() for n, p in named
                                        if "momentum_buffer" in opt.state.get(p, {})}
        seconds = cfg["plan_seconds"][rec["plan"][step]] if rec["plan"][step] is not None else \
            synthetic_seconds(rec["size"][step] or 512)
        clock[0] += seconds * (1 + rank / 4)
        if after_step is not None:
            after_step(step)


def hipress_state(opt, cfg):
    if cfg["strategy"] == "dear":  # the last update (other strategies have nothing pending after step())
        opt.synchronize()
    return opt.state_dict()["hipress"]


def main():
    out_dir, configs = sys.argv[1], json.loads(sys.argv[2])
    hipress.init()
    rank = hipress.rank()
    results = []
    for cfg in configs:
        clock = [100.0 * (rank + 1)]  # only differences count: each rank's clock starts elsewhere
        model, opt = make(cfg, rank, clock, cfg.get("links", {}).get("saved"))
        rec = {"config": cfg, "grads": {}, "skipped": {}, "size": {}, "layout": {}, "params": {}, "carry": {},
               "plan": {}, "momentum_buffer": {}}
        saved = {}

        def save(step):
            if step == cfg.get("save_at"):
                buf = io.BytesIO()
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
                saved["bytes"] = buf.getvalue()
                saved["clock"] = clock[0]
            if step in cfg.get("state_at", ()):  # the optimizer's hipress state between two steps
                rec.setdefault("state_at", {})[step] = opt.state_dict()["hipress"]

        rec["initial"] = params(model)
        train(cfg, model, opt, rank, 0, cfg["steps"], clock, rec, save)
        rec["state"] = hipress_state(opt, cfg)
        rec["final"] = params(model)
        if opt.bucket_tuner is not None:
            rec["history"] = list(opt.bucket_tuner.history)
            rec["done"] = opt.bucket_tuner.done
        if opt.plan_trial is not None:
            rec["trial"] = {"seconds": dict(opt.plan_trial.seconds), "chosen": opt.plan_trial.chosen}
        rec["strategy"] = opt._hp_strategy_name
        rec["buckets"] = [{"name": b.name, "params": [(n, p.numel()) for n, p in b.params],
                           "offsets": list(b.offsets), "bounds": opt._hp_route(b)[1]} for b in opt._hp_buckets]
        if "bytes" in saved and "load_into" in cfg:  # the checkpoint loaded by optimizers of other plan= options
            ck = torch.load(io.BytesIO(saved["bytes"]), weights_only=False)
            rec["loaded"] = []
            for plan in cfg["load_into"]:
                model2, opt2 = make(dict(cfg, plan=plan), rank, [0.0])
                try:
                    opt2.load_state_dict(ck["opt"])
                except ValueError as e:
                    rec["loaded"].append({"error": str(e)})
                    continue
                trial = opt2.plan_trial
                rec["loaded"].append({"error": None, "trial": None if trial is None else (trial.in_use, trial.done),
                                      "compressed": compressed(opt2)})
        elif "bytes" in saved:
            ck = torch.load(io.BytesIO(saved["bytes"]), weights_only=False)
            clock2 = [12345.0 + rank]  # a new process's clock: elsewhere again
            model2, opt2 = make(cfg, rank, clock2, cfg.get("links", {}).get("resumed"))
            compressed_before, strategy_before = compressed(opt2), opt2._hp_strategy_name
            model2.load_state_dict(ck["model"])
            opt2.load_state_dict(ck["opt"])
            res = {"grads": {}, "skipped": {}, "size": {}, "layout": {}, "params": {}, "carry": {}, "plan": {},
                   "momentum_buffer": {}}
            train(cfg, model2, opt2, rank, cfg["save_at"] + 1, cfg["steps"], clock2, res)
            hipress_state(opt2, cfg)
            res["final"] = params(model2)
            res["compressed"] = {"before_load": compressed_before, "after": compressed(opt2)}
            res["strategy"] = {"before_load": strategy_before, "after": opt2._hp_strategy_name}
            res["history"] = list(opt2.bucket_tuner.history) if opt2.bucket_tuner is not None else None
            rec["resumed"] = res
        results.append(rec)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    hipress.shutdown()


if __name__ == "__main__":
    main()
