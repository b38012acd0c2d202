"""One rank of the checkpoint/resume test (launched by test_resume.py).

    python resume_worker.py OUT_DIR PHASE CONFIGS_JSON K M

For every config {compression, strategy, kwargs} it trains the same small model with momentum SGD
through hipress.DistributedOptimizer on rank-specific batches (batch i depends only on the
rank and i, so a resumed job sees exactly the batches an uninterrupted one would).

PHASE "first" (one launch): job A trains K+M steps uninterrupted and records its final
parameters; job B trains K steps and saves model.state_dict() and optimizer.state_dict() to
its own file per rank (the supported pattern: compressor state is per rank). The processes
then exit, so nothing of B survives in memory.
PHASE "resume" (a fresh launch): job C loads B's files and trains M more; so does job D,
which loads everything but the optimizer state's "hipress" entry (the compressor state), to
show that state is what a bit-identical resume depends on.
Results go to OUT_DIR/{PHASE}-rank{r}.pt, checkpoints to OUT_DIR/ckpt-{config}-rank{r}.pt.
"""
import json
import os
import sys

import torch
import torch.nn as nn

import hipress


def make_model():
    torch.manual_seed(0)
    # Two weight matrices (PowerSGD compresses matrices) and biases. The first weight has
    # 8192 elements, two partitions of 4096: enough that GradDrop's threshold comes from a
    # random sample (1024 of 4096), so its RNG counter has to survive the checkpoint too.
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 4))


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(32, 64, generator=g), torch.randn(32, 4, generator=g)


def make_optimizer(model, cfg):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)  # momentum: optimizer state matters too
    # bucket_bytes=0 and 16 KiB partitions: every parameter is its own gradient, the large
    # one split in two, so there are several states (and PS aggregators on both ranks).
    return hipress.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                        compression=cfg["compression"], strategy=cfg["strategy"],
                                        bucket_bytes=0, partition_bytes=16 << 10, **cfg["kwargs"])


def train(model, opt, rank, first, last):
    for step in range(first, last):
        x, y = batch(rank, step)
        opt.zero_grad(set_to_none=True)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def resume(ckpt, cfg, rank, k, m, keep_hipress=True, broadcast=False):
    """Job C from this rank's checkpoint: M more steps; the final parameters."""
    # Loaded afresh each time: torch's Optimizer.load_state_dict keeps the loaded momentum
    # tensors (no copy), so a resume changes them in place.
    saved = torch.load(ckpt, weights_only=False)
    model = make_model()
    model.load_state_dict(saved["model"])
    opt = make_optimizer(model, cfg)
    opt.load_state_dict({key: v for key, v in saved["optimizer"].items() if keep_hipress or key != "hipress"})
    if broadcast:  # Horovod's pattern after loading; every rank keeps its own hipress state
        hipress.broadcast_optimizer_state(opt, root_rank=0)
    train(model, opt, rank, k, k + m)
    return params(model)


def main():
    out_dir, phase, configs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    k, m = int(sys.argv[4]), int(sys.argv[5])
    hipress.init()
    rank = hipress.rank()
    results = []
    for i, cfg in enumerate(configs):
        ckpt = os.path.join(out_dir, f"ckpt-{i}-rank{rank}.pt")
        if phase == "first":
            model = make_model()
            train(model, make_optimizer(model, cfg), rank, 0, k + m)
            uninterrupted = params(model)
            model = make_model()
            opt = make_optimizer(model, cfg)
            train(model, opt, rank, 0, k)
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, ckpt)
            results.append({"config": cfg, "uninterrupted": uninterrupted})
        else:
            results.append({"config": cfg, "resumed": resume(ckpt, cfg, rank, k, m),
                            "without_compressor_state": resume(ckpt, cfg, rank, k, m, keep_hipress=False),
                            "resumed_then_broadcast": resume(ckpt, cfg, rank, k, m, broadcast=True)})
    torch.save(results, os.path.join(out_dir, f"{phase}-rank{rank}.pt"))
    hipress.shutdown()


if __name__ == "__main__":
    main()
