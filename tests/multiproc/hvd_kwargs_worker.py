"""One rank of the tests of DistributedOptimizer's Horovod keyword arguments
(gradient_predivide_factor, groups/num_groups, sparse_as_dense), launched by
test_optimizer_hvd_kwargs.py.

    python hvd_kwargs_worker.py OUT_DIR

Every gradient is chosen so that its average over ranks is exact in fp32 (small integers
times powers of two), so the test can compare with exact expected values. Saves this rank's
synchronized gradients, bucket layouts and error messages to OUT_DIR/rank{r}.pt.
"""
import sys
import warnings

import torch
import torch.nn as nn

import hipress


class Five(nn.Module):
    """Five parameters; the loss sum(p_i * x_i) makes each gradient exactly x_i."""

    def __init__(self):
        super().__init__()
        self.p = nn.ParameterList([nn.Parameter(torch.zeros(k + 2)) for k in range(5)])

    def loss(self, rank, step):
        return sum((p * local_input(i, p.numel(), rank, step)).sum() for i, p in enumerate(self.p))


def local_input(i, n, rank, step):
    """Parameter i's gradient on this rank at this step: small integers."""
    return torch.arange(n, dtype=torch.float32) * (rank + 1) + 3 * i - step * rank


def synced_grads(model, opt, rank, steps=2):
    """The synchronized gradients of each step (lr 0: the parameters do not move)."""
    out = []
    for step in range(steps):
        opt.zero_grad()
        model.loss(rank, step).backward()
        opt.synchronize()
        out.append([p.grad.clone() for p in model.p])
        with opt.skip_synchronize():
            opt.step()
    return out


def wrapped(model, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    return hipress.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **kw)


def layout(opt):
    return [[name for name, _ in b.params] for b in opt._hp_buckets]


def main():
    out_dir = sys.argv[1]
    hipress.init()
    rank = hipress.rank()
    res = {"size": hipress.size()}

    # gradient_predivide_factor: the same averages as without it
    for f in (1.0, 2.5, 4.0):
        model = Five()
        res[f"predivide {f}"] = synced_grads(model, wrapped(model, gradient_predivide_factor=f), rank)

    # groups: a count, lists, and the deprecated num_groups
    model = Five()
    opt = wrapped(model, groups=2)
    res["groups 2"] = (layout(opt), synced_grads(model, opt, rank))
    model = Five()
    p = list(model.p)
    opt = wrapped(model, groups=[[p[3], p[0]], [p[4]]])
    res["groups lists"] = (layout(opt), synced_grads(model, opt, rank))
    model = Five()
    opt = wrapped(model, num_groups=3, bucket_bytes=0)
    res["num_groups 3"] = (layout(opt), synced_grads(model, opt, rank))

    # sparse_as_dense: rank r looks up rows r, r + 1 and r again
    emb = nn.Embedding(6, 2, sparse=True)
    opt = hipress.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.5), sparse_as_dense=True,
                                       named_parameters=emb.named_parameters())
    before = emb.weight.detach().clone()
    opt.zero_grad()
    emb(torch.tensor([rank, rank + 1, rank])).mul(torch.tensor([[1.0, 2.0]])).sum().backward()
    opt.synchronize()
    res["sparse grad is sparse"] = emb.weight.grad.is_sparse
    res["sparse grad"] = emb.weight.grad.to_dense().clone()
    with opt.skip_synchronize():
        opt.step()
    res["sparse step"] = before - emb.weight.detach()

    # without sparse_as_dense: a clear error, on every rank, nothing sent
    emb = nn.Embedding(6, 2, sparse=True)
    opt = hipress.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.5),
                                       named_parameters=emb.named_parameters())
    try:
        emb(torch.tensor([rank])).sum().backward()
        res["sparse error"] = None
    except ValueError as e:
        res["sparse error"] = str(e)
    res["adasum"] = adasum_cases(rank)
    torch.save(res, f"{out_dir}/rank{rank}.pt")


def adasum_cases(rank):
    """op=Adasum: the parameters after each of 3 Adam steps (a power of 2 ranks), a step where
    rank 1's gradient is NaN, and, with 3 ranks, the error of every rank."""
    model = Five()
    try:
        opt = hipress.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.1),
                                           named_parameters=model.named_parameters(), op=hipress.Adasum)
    except NotImplementedError as e:
        return {"error": str(e)}
    out = {"params": []}
    for step in range(3):
        opt.zero_grad()
        model.loss(rank, step).backward()
        opt.step()
        out["params"].append([p.detach().clone() for p in model.p])
    opt.zero_grad()
    model.loss(rank, 3).backward()
    if rank == 1:
        model.p[2].grad[0] = float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    out["after nan"] = [p.detach().clone() for p in model.p]
    out["nan warnings"] = [str(w.message) for w in caught]
    out["last_nonfinite"] = opt.last_nonfinite
    return out


if __name__ == "__main__":
    main()
