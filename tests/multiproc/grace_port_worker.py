"""One rank of the GRACE porting test (test_grace_port.py): GRACE-style compressors written here in
torch, against hipress.grace's base classes, train the digits task through
hipress.DistributedOptimizer. The test runs the same compressors in the reference simulator.

    python grace_port_worker.py CASE OUT_DIR STEPS
"""
import os
import sys
import zlib

import torch

from hipress import grace

SEED, BATCH, LR = 42, 32, 0.05


class TopK(grace.Compressor):
    """GRACE's top-k in torch: the k largest magnitudes and their indices; ctx (numel, shape)."""

    def __init__(self, ratio=0.05):
        super().__init__()
        self.ratio = ratio

    def compress(self, tensor, name):
        k = max(1, int(tensor.numel() * self.ratio))
        _, idx = torch.topk(tensor.abs(), k, sorted=False)
        return [tensor[idx], idx], (tensor.numel(), tensor.size())

    def decompress(self, tensors, ctx):
        values, idx = tensors
        numel, shape = ctx
        out = torch.zeros(numel, dtype=values.dtype)
        out.scatter_(0, idx, values)
        return out.view(shape)


class QSGDLike(grace.Compressor):
    """QSGD with s levels: |x| / ||x|| * s rounded stochastically, int8 levels with signs, the norm.
    Its random numbers come from (seed, tensor name, call count), so they do not depend on the
    order in which tensors are compressed."""

    def __init__(self, levels=16, seed=0):
        super().__init__()
        self.levels, self.seed, self.calls = levels, seed, {}

    def compress(self, tensor, name):
        k = self.calls.get(name, 0)
        self.calls[name] = k + 1
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 1_000_003 + 7919 * k + self.seed)
        norm = tensor.norm()
        scaled = tensor.abs() / norm * self.levels if norm > 0 else torch.zeros_like(tensor)
        low = scaled.floor()
        q = low + (torch.rand(tensor.shape, generator=gen) < scaled - low).to(tensor.dtype)
        return [(q * tensor.sign()).to(torch.int8), norm.reshape(1)], None

    def decompress(self, tensors, ctx):
        q, norm = tensors
        return q.to(torch.float32) * (norm / self.levels)


class Grid(grace.Compressor):
    """Rounding to a fixed grid (multiples of step), sent as the float grid indices: the compressed
    tensors are summable and the ctx is the same on every rank, the case of the allreduce communicator."""

    def __init__(self, step=2.0 ** -10):
        super().__init__()
        self.step = step

    def compress(self, tensor, name):
        return [torch.round(tensor / self.step)], tensor.dtype

    def decompress(self, tensors, ctx):
        return (tensors[0] * self.step).to(ctx)


# case -> rank -> the ported compressor (the reference simulator builds one per worker the same way)
CASES = {
    "topk-residual-allgather": lambda rank: grace.wrap(TopK(0.05), memory=grace.ResidualMemory(),
                                                       communicator="allgather"),
    "qsgd-none-broadcast": lambda rank: grace.wrap(QSGDLike(16, seed=100 + rank), communicator="broadcast"),
    "grid-none-allreduce": lambda rank: grace.wrap(Grid(), communicator="allreduce"),
}


def main():
    import hipress
    from hipress.bench import tasks

    case, out_dir, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.set_num_threads(1)  # as the simulator: the same summation order in torch's kernels
    hipress.init()
    rank, size = hipress.rank(), hipress.size()
    task = tasks.build("digits", SEED, BATCH)
    model = task.model
    opt = hipress.DistributedOptimizer(tasks.optimizer(model, LR), named_parameters=model.named_parameters(),
                                       compression=CASES[case](rank))
    hipress.broadcast_parameters(model.state_dict(), root_rank=0)
    losses = []
    for i in range(steps):
        x, y = task.batch(rank, size, 1, i)
        opt.zero_grad()
        loss = task.loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    torch.save({"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}},
               os.path.join(out_dir, f"rank{rank}.pt"))
    hipress.shutdown()


if __name__ == "__main__":
    main()
