"""The identity "compressor": fp32 bytes as they are (rate 1, no header).

Used for compression="none" so that uncompressed synchronization runs through the
same strategies. encode() returns a zero-copy uint8 view of its input: the payload
aliases the gradient until the gradient is next written, which the strategies
respect (a chunk is never written while its payload is in flight).
"""
from __future__ import annotations

from typing import Optional

import torch

from hipress.compression.base import Compressor, CompressorState, flat_f32


class NoneCompressor(Compressor):
    name = "none"
    category = "none"
    rate = 1.0
    aggregatable = True
    rounds = 1
    reencode_safe = True  # lossless

    def max_encoded_bytes(self, numel: int, shape=None) -> int:
        return 4 * numel

    def encoded_bytes(self, numel: int, shape=None) -> Optional[int]:
        return 4 * numel

    def _merged_compressor(self) -> Compressor:
        return self  # lossless: nothing to carry over

    def encode(self, grad: torch.Tensor, state: Optional[CompressorState] = None,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
        g = flat_f32(grad)
        if out is None:
            return g.view(torch.uint8)
        out = out[:4 * g.numel()]
        out.view(torch.float32).copy_(g)
        return out

    def _values(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        if payload.dtype != torch.uint8 or payload.numel() != 4 * numel:
            raise ValueError(f"'none' payload has {payload.numel()} bytes, expected {4 * numel} for {numel} floats")
        return payload.view(torch.float32)

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        out.copy_(self._values(payload, out.numel()).view_as(out))
        return out

    def decode_add(self, payload: torch.Tensor, acc: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        acc.add_(self._values(payload, acc.numel()).view_as(acc), alpha=alpha)
        return acc

    def combine(self, a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        out = a.clone() if out is None else out
        torch.add(a.view(torch.float32), b.view(torch.float32), out=out.view(torch.float32))
        return out
