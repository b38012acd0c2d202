"""The identity "compressor": fp32 bytes as they are (rate 1).

Used for compression="none" so that uncompressed synchronization runs through the
same strategies. encode() returns a zero-copy uint8 view of its input: the payload
aliases the gradient until the gradient is next written, which the strategies
respect (a chunk is never written while its payload is in flight).
"""
from __future__ import annotations

import torch


class _NoState:
    __slots__ = ()

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        if sd:
            raise ValueError("the 'none' compressor has no state to load")


class NoneCompressor:
    name = "none"
    category = "none"
    rate = 1.0
    aggregatable = True
    rounds = 1

    def max_encoded_bytes(self, numel: int) -> int:
        return 4 * numel

    def new_state(self, numel: int, shape=None) -> _NoState:
        return _NoState()

    def encode(self, grad: torch.Tensor, state=None, out: torch.Tensor = None) -> torch.Tensor:
        g = grad.detach().reshape(-1)
        if g.dtype != torch.float32:
            g = g.float()
        g = g.contiguous()
        if out is None:
            return g.view(torch.uint8)
        out = out[:4 * g.numel()]
        out.view(torch.float32).copy_(g)
        return out

    def _values(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        if payload.numel() != 4 * numel:
            raise ValueError(f"'none' payload has {payload.numel()} bytes, expected {4 * numel} for {numel} floats")
        return payload.view(torch.float32)

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        out.copy_(self._values(payload, out.numel()).view_as(out))
        return out

    def decode_add(self, payload: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        acc.add_(self._values(payload, acc.numel()).view_as(acc))
        return acc
