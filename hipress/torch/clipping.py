"""Gradient clipping before compression: the training aid some algorithms' papers prescribe.

    hipress.DistributedOptimizer(opt, ..., compression="terngrad")                 # grad_clip="auto": none
    hipress.DistributedOptimizer(opt, ..., grad_clip="paper")                      # the paper's (TernGrad: 2.5 sigma)
    hipress.DistributedOptimizer(opt, ..., grad_clip=hipress.clipping.sigma(3.0))  # your own
    hipress.DistributedOptimizer(opt, ..., grad_clip=None)                         # off

A clip is a callable ``clip(name, grad)`` that changes ``grad`` in place. The optimizer calls
it on every parameter's final gradient of a step, on every rank, before the gradient is fused
and compressed. ``"paper"`` is what the algorithm's paper prescribes (:data:`PAPER`), and no
clipping for the others. ``"auto"`` (the default) is what measured best: no clipping. TernGrad's
2.5 sigma, which its paper prescribes for gradients averaged before momentum, lost accuracy on
every task of the convergence benchmark under hipress's momentum correction and per-tensor
scales (docs/convergence.md, cause 15).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

Clip = Callable[[str, torch.Tensor], None]


def sigma(c: float) -> Clip:
    """Layer-wise clipping to [-c sigma, c sigma], sigma the gradient's standard deviation
    (TernGrad, Wen et al. 2017, §3.3: c = 2.5 keeps almost every element of a normal
    gradient and bounds the range the ternary levels must span)."""
    if not c > 0:
        raise ValueError(f"sigma clipping needs c > 0, got {c}")

    def clip(name: str, grad: torch.Tensor) -> None:
        if grad.numel() > 1:
            bound = c * float(grad.float().std())
            grad.clamp_(-bound, bound)

    clip.__name__ = clip.__qualname__ = f"sigma({c:g})"
    return clip


#: the clipping each algorithm's paper prescribes (algorithm name -> clip)
PAPER = {"terngrad": sigma(2.5)}


def resolve(grad_clip, algorithm: str) -> Optional[Clip]:
    """The clip to use: ``"paper"`` -> the paper's for ``algorithm`` (or none), ``"auto"`` and
    None -> none, a callable -> itself."""
    if grad_clip == "paper":
        return PAPER.get(algorithm)
    if grad_clip == "auto":
        return None
    if grad_clip is None or callable(grad_clip):
        return grad_clip
    raise ValueError(f"grad_clip must be 'auto', 'paper', None or a callable (name, grad), got {grad_clip!r}")
