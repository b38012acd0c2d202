"""examples/train.py as a torch DistributedDataParallel script with hipress's comm hook.

    torchrun --nproc_per_node 4 examples/train_ddp.py --compression terngrad
    python -m hipress.launch -np 4 python examples/train_ddp.py

A plain DDP script; the hipress lines are marked "# hipress" (docs/ddp.md). With momentum
correction (single-round algorithms, as hipress.DistributedOptimizer's "auto" does), the
momentum moves from the SGD into the hook.
"""
import argparse
import hashlib
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import hipress.ddp  # hipress
from hipress.bench.models import DigitsCNN, digits_data  # a small CNN; sklearn's digits, shuffled by seed


def accuracy(model, x, y):
    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    model.train()
    return acc


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--compression", default="none")
    p.add_argument("--strategy", default="auto")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=42)
    a = p.parse_args()

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(a.seed)
    torch.set_num_threads(1)
    (xtr, ytr), (xte, yte) = digits_data(a.seed)
    xtr, ytr = xtr[rank::size], ytr[rank::size]  # this rank's shard

    model = DigitsCNN()
    ddp = DDP(model)
    corrected = a.compression not in ("none", "powersgd") and a.momentum > 0  # hipress: momentum correction
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.0 if corrected else a.momentum)
    state = hipress.ddp.HookState(a.compression, a.strategy, named_parameters=model.named_parameters(),  # hipress
                                  momentum_correction=a.momentum if corrected else None)
    ddp.register_comm_hook(state, hipress.ddp.hook)  # hipress

    steps = len(ytr) // a.batch_size
    t0 = time.perf_counter()
    for epoch in range(a.epochs):
        g = torch.Generator().manual_seed(a.seed + epoch)
        order = torch.randperm(len(ytr), generator=g)
        total = 0.0
        for s in range(steps):
            idx = order[s * a.batch_size:(s + 1) * a.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(ddp(xtr[idx]), ytr[idx])
            loss.backward()
            opt.step()
            total += loss.item()
        if rank == 0:
            print(f"epoch {epoch + 1}/{a.epochs}  loss {total / steps:.4f}  test accuracy "
                  f"{accuracy(model, xte, yte):.4f}  ({time.perf_counter() - t0:.1f} s)", flush=True)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]
    print(f"rank {rank}/{size} done: test accuracy {accuracy(model, xte, yte):.4f} "
          f"compression={a.compression} strategy={a.strategy} params sha256 {digest}", flush=True)
    hipress.shutdown()  # hipress
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
