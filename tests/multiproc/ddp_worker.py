"""One rank: trains the same model 50 steps with hipress (no compression) and with
torch DistributedDataParallel, from the same start, and saves both final models."""
import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import hipress


def main():
    out_dir, strategy, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo")  # the user's own group: hipress shares it
    hipress.init()
    rank = hipress.rank()
    torch.manual_seed(0)
    model_h = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))
    model_d = copy.deepcopy(model_h)
    opt_h = hipress.DistributedOptimizer(torch.optim.SGD(model_h.parameters(), lr=0.05, momentum=0.9),
                                         named_parameters=model_h.named_parameters(), strategy=strategy)
    ddp = nn.parallel.DistributedDataParallel(model_d)
    opt_d = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x, y = torch.randn(32, 20, generator=g), torch.randint(0, 5, (32,), generator=g)
        for m, o in ((model_h, opt_h), (ddp, opt_d)):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
    torch.save({"hipress": model_h.state_dict(), "ddp": model_d.state_dict()}, os.path.join(out_dir, f"rank{rank}.pt"))
    hipress.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
