"""One rank of the DistributedOptimizer tests (launched by test_optimizer.py).

    python optim_worker.py OUT_DIR CONFIGS_JSON

For every config {compression, strategy, kwargs, passes} it builds the same small
model with uneven layers (a 1-element bias, a zero-size parameter, an unused
parameter), feeds rank-specific data, records this rank's local gradients and the
synchronized ones, and saves everything to OUT_DIR/rank{r}.pt for the test to check.
"""
import json
import os
import sys

import torch
import torch.nn as nn

import hipress
from hipress.torch import clipping
from worker_common import device

DEVICE = device()


class Uneven(nn.Module):
    def __init__(self, big_numel: int = 2000):
        super().__init__()
        self.a = nn.Linear(7, 13)
        self.b = nn.Linear(13, 1)  # 13 weights and a single-element bias
        self.empty = nn.Parameter(torch.empty(0))
        self.unused = nn.Parameter(torch.ones(3))  # never gets a gradient
        self.big = nn.Parameter(torch.randn(big_numel) * 0.01)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x))).squeeze(1) + (self.big[:7] * x).sum(1) + self.empty.sum()


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 7, generator=g).to(DEVICE), torch.randn(16, generator=g).to(DEVICE)


def local_grads(model, rank, step, passes):
    model.zero_grad(set_to_none=True)
    for k in range(passes):
        x, y = batch(rank, step * passes + k)
        ((model(x) - y) ** 2).mean().backward()
    return {n: (p.grad.cpu().clone() if p.grad is not None else torch.zeros_like(p, device="cpu"))
            for n, p in model.named_parameters()}


def main():
    out_dir, configs = sys.argv[1], json.loads(sys.argv[2])
    hipress.init()
    rank = hipress.rank()
    results = []
    for cfg in configs:
        torch.manual_seed(0)
        model = Uneven(cfg.get("big_numel", 2000)).to(DEVICE)
        ref_model = Uneven(cfg.get("big_numel", 2000)).to(DEVICE)
        ref_model.load_state_dict(model.state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: parameters stay, gradients are compared
        plan = None
        if "plan_force" in cfg:
            from hipress.planner import Overrides
            plan = Overrides(force={k: tuple(v) if isinstance(v, list) else v for k, v in cfg["plan_force"].items()},
                             bf16=cfg.get("plan_bf16"), measure=cfg.get("plan_measure", Overrides.measure))
        opt = hipress.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                           compression=cfg["compression"], strategy=cfg["strategy"],
                                           backward_passes_per_step=cfg.get("passes", 1),
                                           partition_bytes=cfg.get("partition_bytes", 64 << 20),
                                           local_aggregation=cfg.get("local_aggregation", "auto"), plan=plan,
                                           coordinator=cfg.get("coordinator", False),
                                           bucket_bytes=cfg.get("bucket_bytes", 4 << 20),
                                           **cfg.get("kwargs", {}))
        steps = []
        for step in range(cfg.get("steps", 1)):
            local = local_grads(ref_model, rank, step, cfg.get("passes", 1))
            clip = clipping.resolve("auto", cfg["compression"])  # what the optimizer applies by default
            if clip is not None:
                for n, g in local.items():
                    clip(n, g)
            opt.zero_grad(set_to_none=True)
            for k in range(cfg.get("passes", 1)):
                x, y = batch(rank, step * cfg.get("passes", 1) + k)
                ((model(x) - y) ** 2).mean().backward()
            opt.synchronize()
            synced = {n: p.grad.cpu().clone() for n, p in model.named_parameters()}
            with opt.skip_synchronize():
                opt.step()
            steps.append({"local": local, "synced": synced})
        # PS aggregators (with local aggregation: those of the cross-host strategy)
        owners = {k: v for sync in (opt._hp_plain, opt._hp_compressed)
                  for k, v in getattr(getattr(sync.strategy, "cross", sync.strategy), "_owner", {}).items()}
        buckets = []
        for b in opt._hp_buckets:
            sync, bounds = opt._hp_route(b)
            buckets.append({"name": b.name, "params": [n for n, _ in b.params], "bounds": bounds,
                            "compressed": sync is opt._hp_compressed, "strategy": sync.strategy.name,
                            "wire": str(getattr(sync.strategy, "wire", torch.float32)),
                            "sent": str(b.sent.dtype)})  # the buffer put() fills: bf16 if cast in the copy
        results.append({"config": cfg, "steps": steps, "owners": owners, "buckets": buckets,
                        "hierarchical": opt._hp_hierarchical,
                        "coordinated": type(opt._hp_compressed.ctx.exchange).__name__ == "CoordinatedExchange",
                        "predicted": None if opt._hp_exchanges.predictor is None
                        else dict(opt._hp_exchanges.predictor.stats)})
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    hipress.shutdown()


if __name__ == "__main__":
    main()
