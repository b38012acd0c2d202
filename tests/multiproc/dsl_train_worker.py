"""One rank of the DSL training test: loads a user spec with hipress.compll, trains a few steps.

    python dsl_train_worker.py SPEC OUT_DIR STEPS [NAME]

NAME: register the spec under this name (a shipped spec such as powersgd clashes with the built-in
of the same name); with SPEC "builtin", NAME is a built-in compressor, trained the same way.
"""
import os
import sys

import torch
import torch.nn as nn

import hipress
from hipress import compll


def main():
    spec, out_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    hipress.init()
    rank = hipress.rank()
    name = sys.argv[4] if len(sys.argv) > 4 else None
    if spec == "builtin":
        algo = name
    else:
        algo = compll.load(spec, name=name).spec.name  # compiled once (cache by hash), registered in this process
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt = hipress.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=algo)
    g = torch.Generator().manual_seed(100 + rank)
    w = torch.randn(10, 1, generator=torch.Generator().manual_seed(5))
    losses = []
    for _ in range(steps):
        x = torch.randn(64, 10, generator=g)
        y = x @ w
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    torch.save({"losses": losses, "params": [p.detach().clone() for p in model.parameters()]},
               os.path.join(out_dir, f"rank{rank}.pt"))
    hipress.shutdown()


if __name__ == "__main__":
    main()
