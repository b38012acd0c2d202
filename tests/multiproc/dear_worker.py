"""One rank of the strategy="dear" tests (launched by test_dear_ranks.py).

    python dear_worker.py OUT_DIR CONFIGS_JSON

For every config {strategy, compression, optimizer, scheduler, steps, save_at} it trains the
same small model on rank-specific data and records the parameters every forward used (read
after the forward, so with "dear" they are the ones its pre-hooks had just updated) and,
after the last step and synchronize(), the final parameters, and how many checking rounds
(the transport's ``_meta_gather``, on any thread) each step's window held. With "save_at": k it also calls
synchronize() after step k, records the parameters, saves model, optimizer and scheduler
state, and then resumes a fresh model and optimizer from that checkpoint for the remaining
steps, recording what the resumed run's forwards used. Saves OUT_DIR/rank{r}.pt.
"""
import io
import json
import os
import sys

import torch
import torch.nn as nn

import hipress
from hipress.comm.transport.base import Transport

ROUNDS = [0]  # checking rounds so far (every transport of this process)
_meta_gather = Transport._meta_gather


def _counted(self, op, values):
    ROUNDS[0] += 1
    return _meta_gather(self, op, values)


Transport._meta_gather = _counted


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 40)    # 240 weights: a bucket of its own at bucket_bytes=512
        self.b = nn.Linear(40, 5)
        self.c = nn.Linear(5, 1)
        self.unused = nn.Linear(2, 2)  # never called: zero gradients, updated only by flushes

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))).squeeze(1)


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 6, generator=g), torch.randn(8, generator=g)


def make(cfg):
    torch.manual_seed(0)
    model = Net()
    first = list(model.a.parameters()) + list(model.unused.parameters())
    second = list(model.b.parameters()) + list(model.c.parameters())
    if cfg["optimizer"] == "sgd":
        opt = torch.optim.SGD([{"params": first}, {"params": second, "lr": 0.05, "weight_decay": 0.0}],
                              lr=0.1, momentum=0.9, weight_decay=1e-3)
    else:
        opt = torch.optim.AdamW([{"params": first}, {"params": second, "lr": 0.003, "weight_decay": 0.0}],
                                lr=0.01, weight_decay=0.05)
    kw = {"model": model} if cfg["strategy"] == "dear" else {"named_parameters": model.named_parameters()}
    opt = hipress.DistributedOptimizer(opt, compression=cfg.get("compression", "none"), strategy=cfg["strategy"],
                                       bucket_bytes=512, partition_bytes=cfg.get("partition_bytes", 64 << 20),
                                       **kw, **cfg.get("kwargs", {}))
    if cfg["scheduler"] == "step":
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
    return model, opt, sched


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(model, opt, sched, rank, first, last, used, on_step=None, rounds_at=None):
    """Steps first..last-1; used[t] = the parameters forward t ran with; rounds_at[t] = the checking
    rounds so far when forward t started."""
    for step in range(first, last):
        if rounds_at is not None:
            rounds_at[step] = ROUNDS[0]
        x, y = batch(rank, step)
        opt.zero_grad(set_to_none=True)
        loss = ((model(x) - y) ** 2).mean()
        used[step] = params(model)
        loss.backward()
        opt.step()
        sched.step()
        if on_step is not None:
            on_step(step)


def main():
    out_dir, configs = sys.argv[1], json.loads(sys.argv[2])
    hipress.init()
    rank = hipress.rank()
    results = []
    for cfg in configs:
        model, opt, sched = make(cfg)
        used, res = {}, {"config": cfg}
        checkpoint = {}

        def save(step):
            if step != cfg.get("save_at"):
                return
            opt.synchronize()
            res["after_synchronize"] = params(model)
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
            checkpoint["bytes"] = buf.getvalue()

        rounds_at = {}
        train(model, opt, sched, rank, 0, cfg["steps"], used, save, rounds_at)
        # from forward t to forward t+1 (with dear: step t's reduce-scatters, step t-1's all-gathers)
        rounds = {t: rounds_at[t + 1] - rounds_at[t] for t in range(cfg["steps"] - 1)}
        if cfg["strategy"] == "dear":  # ring's parameters are current after step()
            opt.synchronize()
        res["used"], res["final"], res["rounds"] = used, params(model), rounds
        if "bytes" in checkpoint:
            saved = torch.load(io.BytesIO(checkpoint["bytes"]), weights_only=False)
            res["saved_model"] = {n: t.clone() for n, t in saved["model"].items()}
            model2, opt2, sched2 = make(cfg)
            model2.load_state_dict(saved["model"])
            opt2.load_state_dict(saved["opt"])
            sched2.load_state_dict(saved["sched"])
            resumed = {}
            train(model2, opt2, sched2, rank, cfg["save_at"] + 1, cfg["steps"], resumed)
            opt2.synchronize()
            res["resumed_used"], res["resumed_final"] = resumed, params(model2)
        results.append(res)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    hipress.shutdown()


if __name__ == "__main__":
    main()
