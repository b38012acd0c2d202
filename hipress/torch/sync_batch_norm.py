"""``hipress.SyncBatchNorm``: batch normalization over the batch of every rank (Horovod's
``hvd.SyncBatchNorm``), on CPU as well as on GPU.

In training (or without running statistics) the mean and variance are those of the whole
global batch: the ranks all-gather their per-channel element counts, sums and sums of squares
(in double precision, reduced in rank order, so every rank normalizes with the same numbers)
and, in the backward pass, all-reduce the per-channel sums of the gradient and of the gradient
times the centred input. The result equals ``torch.nn.BatchNorm*`` applied to the ranks'
batches concatenated, for the input gradient too; the weight and bias gradients are this rank's
share (their sum over the ranks is the single-process gradient, which the DistributedOptimizer's
averaging turns into the mean, as in Horovod). Running statistics are updated with the global
mean and the unbiased global variance. Evaluation with running statistics is local.

Every rank must call forward (and backward) together, as for any collective; a rank may bring
an empty batch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from hipress.comm import world

__all__ = ["SyncBatchNorm"]


class SyncBatchNorm(_BatchNorm):
    """Synchronous batch normalization over N-dimensional input ``(N, C, ...)``.

    Arguments as ``torch.nn.BatchNorm*d``: num_features, eps=1e-5, momentum=0.1 (None: cumulative
    average), affine=True, track_running_stats=True."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input):
        self._check_input_dim(input)
        factor = 0.0
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            factor = (1.0 / float(self.num_batches_tracked)) if self.momentum is None else self.momentum
        if not self.training and self.track_running_stats:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0,
                                self.eps)
        world.init()
        if world.size() == 1:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, True, factor,
                                self.eps)
        running = self.training and self.track_running_stats
        return _SyncBatchNormFn.apply(input, self.weight, self.bias, self.running_mean if running else None,
                                      self.running_var if running else None, self.eps, factor)


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    """(N, C, ...) -> (C, N * ...)."""
    return x.transpose(0, 1).reshape(x.shape[1], -1)


def _shape(c: int, x: torch.Tensor):
    return (1, c) + (1,) * (x.dim() - 2)


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, momentum):
        from hipress.torch.collectives import allgather, allreduce

        x = input.contiguous()
        c = x.shape[1]
        xc = _channels_last(x).double()
        local = torch.cat([torch.tensor([float(xc.shape[1])], dtype=torch.float64), xc.sum(1), (xc * xc).sum(1)])
        stats = allgather(local.unsqueeze(0).to("cpu"), name="sync_batch_norm.stats")  # (size, 1 + 2C)
        total = stats[0].clone()
        for row in stats[1:]:  # rank order: the same sums on every rank
            total += row
        count = total[0].item()
        if count <= 1 and running_mean is not None:
            raise ValueError(f"Expected more than 1 value per channel when training, got input size {tuple(x.shape)} "
                             "over all ranks")
        mean = total[1:1 + c] / count
        var = (total[1 + c:] / count - mean * mean).clamp_min(0.0)
        invstd = 1.0 / torch.sqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean), alpha=momentum)
                unbiased = var * (count / (count - 1))
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var), alpha=momentum)
        shp = _shape(c, x)
        mean_t, invstd_t = mean.to(x.dtype).to(x.device), invstd.to(x.dtype).to(x.device)
        xhat = (x - mean_t.view(shp)) * invstd_t.view(shp)
        out = xhat
        if weight is not None:
            out = out * weight.view(shp)
        if bias is not None:
            out = out + bias.view(shp)
        ctx.save_for_backward(x, weight, mean_t, invstd_t)
        ctx.count = count
        ctx.has_bias = bias is not None
        ctx.allreduce = allreduce
        return out

    @staticmethod
    def backward(ctx, grad_output):
        from hipress.torch.collectives import Sum

        x, weight, mean, invstd = ctx.saved_tensors
        c = x.shape[1]
        shp = _shape(c, x)
        g = grad_output.contiguous()
        xmu = x - mean.view(shp)
        gc, xmuc = _channels_last(g), _channels_last(xmu)
        sum_dy = gc.sum(1)
        sum_dy_xmu = (gc * xmuc).sum(1)
        grad_weight = (sum_dy_xmu * invstd) if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_dy if ctx.has_bias and ctx.needs_input_grad[2] else None
        grad_input = None
        if ctx.needs_input_grad[0]:
            both = torch.cat([sum_dy, sum_dy_xmu]).double().cpu()
            both = ctx.allreduce(both, op=Sum, name="sync_batch_norm.grad_stats")
            mean_dy = (both[:c] / ctx.count).to(x.dtype).to(x.device)
            mean_dy_xmu = (both[c:] / ctx.count).to(x.dtype).to(x.device)
            scale = invstd if weight is None else invstd * weight
            grad_input = (g - mean_dy.view(shp) - xmu * (invstd * invstd * mean_dy_xmu).view(shp)) * scale.view(shp)
        return grad_input, grad_weight, grad_bias, None, None, None, None
