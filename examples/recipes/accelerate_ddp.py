"""Hugging Face Accelerate with hipress's DDP comm hook (docs/ddp.md, "Recipes").

    torchrun --nproc_per_node 2 examples/recipes/accelerate_ddp.py --compression tbq

A plain Accelerate training loop; the hipress lines are marked "# hipress". Accelerate's own
``DistributedDataParallelKwargs(comm_hook=...)`` takes only its enum of torch's hooks, so the
hook is registered on the model ``prepare`` returns (a DDP when there are several processes).
"""
import argparse
import hashlib

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.nn.parallel import DistributedDataParallel as DDP

import hipress.ddp  # hipress
from hipress.bench.models import DigitsCNN, digits_data  # a small CNN; sklearn's digits, shuffled by seed


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16, help="per process")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--compression", default="tbq")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=42)
    a = p.parse_args()

    torch.manual_seed(a.seed)
    torch.set_num_threads(1)
    accelerator = Accelerator(cpu=True)
    (xtr, ytr), (xte, yte) = digits_data(a.seed)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xtr, ytr), batch_size=a.batch_size,
                                         shuffle=True, generator=torch.Generator().manual_seed(a.seed))
    model = DigitsCNN()
    # hipress: momentum correction moves SGD's momentum into the hook (applied before compression)
    corrected = a.compression not in ("none", "powersgd") and a.momentum > 0
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.0 if corrected else a.momentum)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    state = None
    if isinstance(model, DDP):  # hipress
        state = hipress.ddp.register(model, a.compression, momentum_correction=a.momentum if corrected else None)

    for epoch in range(a.epochs):
        for x, y in loader:
            opt.zero_grad()
            accelerator.backward(F.cross_entropy(model(x), y))
            opt.step()
    net = accelerator.unwrap_model(model)
    net.eval()
    with torch.no_grad():
        acc = (net(xte).argmax(1) == yte).float().mean().item()
    digest = hashlib.sha256(b"".join(q.detach().numpy().tobytes() for q in net.parameters())).hexdigest()[:16]
    synced = state.buckets_synced if state is not None else 0
    print(f"rank {accelerator.process_index}/{accelerator.num_processes} done: test accuracy {acc:.4f} "
          f"buckets synced by hipress {synced} params sha256 {digest}", flush=True)
    hipress.shutdown()  # hipress


if __name__ == "__main__":
    main()
