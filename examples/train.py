"""Data-parallel training of a small CNN on scikit-learn's digits (offline data).

Runs unchanged under any launcher:
    python -m hipress.launch -np 4 python examples/train.py     # built-in, local processes
    torchrun --nproc_per_node 4 examples/train.py
    mpirun -np 4 python examples/train.py
    horovodrun -np 4 python examples/train.py

The three hipress lines are marked "# hipress".
"""
import argparse
import hashlib
import time

import torch
import torch.nn.functional as F

import hipress  # hipress
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
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (applied before compression: momentum correction)")
    p.add_argument("--seed", type=int, default=42)
    a = p.parse_args()

    hipress.init()  # hipress
    rank, size = hipress.rank(), hipress.size()
    torch.manual_seed(a.seed)
    torch.set_num_threads(1)
    (xtr, ytr), (xte, yte) = digits_data(a.seed)
    xtr, ytr = xtr[rank::size], ytr[rank::size]  # this rank's shard

    model = DigitsCNN()
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=a.momentum)
    opt = hipress.DistributedOptimizer(opt, named_parameters=model.named_parameters(),  # hipress
                                       compression=a.compression, strategy=a.strategy)
    hipress.broadcast_parameters(model.state_dict(), root_rank=0)
    hipress.broadcast_optimizer_state(opt, root_rank=0)

    steps = len(ytr) // a.batch_size
    t0 = time.perf_counter()
    for epoch in range(a.epochs):
        g = torch.Generator().manual_seed(a.seed + epoch)
        order = torch.randperm(len(ytr), generator=g)
        total = 0.0
        for s in range(steps):
            idx = order[s * a.batch_size:(s + 1) * a.batch_size]
            opt.zero_grad()
            loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
            loss.backward()
            opt.step()
            total += loss.item()
        if rank == 0:
            print(f"epoch {epoch + 1}/{a.epochs}  loss {total / steps:.4f}  test accuracy "
                  f"{accuracy(model, xte, yte):.4f}  ({time.perf_counter() - t0:.1f} s)", flush=True)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]
    print(f"rank {rank}/{size} done: test accuracy {accuracy(model, xte, yte):.4f} "
          f"compression={a.compression} strategy={a.strategy} params sha256 {digest}", flush=True)
    hipress.shutdown()


if __name__ == "__main__":
    main()
