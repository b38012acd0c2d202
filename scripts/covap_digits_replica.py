"""COVAP on the convergence bench's digits task, in one process (docs/covap.md, "Accuracy").

    python scripts/covap_digits_replica.py '[{"interval": 2}, {"interval": 2, "send": "unscaled"}]'

COVAP is linear and every rank selects the same units, so the filter applied to the average of
the workers' gradients is the distributed run (hipress's 4-rank run at interval 2, seed 42,
gives the same 89.2 as this replica). Each config (JSON keys: interval, lr, momentum, ef_init,
send, seeds, workers, epochs, batch) trains tasks.build("digits") for 10 epochs of 4 workers of
batch 32 (110 steps) with SGD, the filter over the optimizer's 1 MiB buckets in front of it,
and prints the final test accuracy per seed and their mean.

send: "paper" (default, covap.Filter: residual = coeff * residual + gradient every step, the
paper's Algorithm 1 with its scheduler) or "unscaled" (the authors' published reducer: the
coefficient scales the residual on steps where the unit is kept; a selected unit sends its
gradient plus the residual as it is).
"""
import json
import sys

import torch

from hipress.bench import tasks
from hipress.compression.none import NoneCompressor
from hipress.torch import covap
from hipress.torch.optimizer import fusion_buckets


def unscaled_send(filt: covap.Filter, name: str, flat: torch.Tensor) -> None:
    res = filt.residual.setdefault(name, torch.zeros(flat.numel()))
    coeff = filt.coefficient
    for t, (s, e) in filt.units[name]:
        if covap.selected(t, filt.step, filt.interval):
            flat[s:e].add_(res[s:e])
            res[s:e].zero_()
        else:
            res[s:e].mul_(coeff).add_(flat[s:e])
            flat[s:e].zero_()


def accuracy(seed, interval=2, lr=0.05, momentum=0.9, ef_init=covap.EF_INIT, send="paper", workers=4,
             epochs=10, batch=32):
    task = tasks.build("digits", seed, batch)
    named = list(task.model.named_parameters())
    opt = torch.optim.SGD(task.model.parameters(), lr=lr, momentum=momentum)
    buckets = fusion_buckets(named, NoneCompressor(), 1 << 20)
    filt = covap.Filter({b.name: b.numel for b in buckets}, interval, ef_init=ef_init)

    def step(epoch, i):
        grads = []
        for r in range(workers):
            x, y = task.batch(r, workers, epoch, i)
            task.model.zero_grad(set_to_none=True)
            loss = task.loss(task.model(x), y)
            loss.backward()
            grads.append({n: p.grad.clone() for n, p in named})
            first = loss.item() if r == 0 else first
        for b in buckets:
            flat = torch.cat([sum(g[n] for g in grads).reshape(-1) / workers for n, _ in b.params])
            if send == "paper":
                filt.apply(b.name, flat)
            elif send == "unscaled":
                unscaled_send(filt, b.name, flat)
            else:
                raise ValueError(f"send must be 'paper' or 'unscaled', got {send!r}")
            for (n, p), off in zip(b.params, b.offsets):
                p.grad = flat[off:off + p.numel()].view_as(p).clone()
        filt.advance()
        opt.step()
        return first

    return tasks.train(task, workers, epochs, epochs, step)[-1]["test_accuracy"]


def main(configs):
    torch.set_num_threads(1)
    for cfg in configs:
        cfg = dict(cfg)
        seeds = cfg.pop("seeds", [42, 1, 2])
        accs = [accuracy(s, **cfg) for s in seeds]
        print(json.dumps(cfg), " ".join(f"{a:.1f}" for a in accs), f"mean {sum(accs) / len(accs):.1f}", flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]) if len(sys.argv) > 1 else [{"interval": 1}, {"interval": 2}])
