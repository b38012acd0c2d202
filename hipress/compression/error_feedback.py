"""Error feedback as a decorator around any single-round compressor (GRACE eq. 4).

    residual <- beta * residual + gamma * grad          (compensate)
    payload   = inner.encode(residual)
    residual <- residual - inner.decode(payload)        (update)

For native compressors the three steps run fused in C++ (csrc/compress/
compressor.h ErrorFeedback); for user compressors written in Python they run
with torch ops. The residual is the state buffer "residual" (added after the
inner compressor's own buffers). Invariant (up to fp32 rounding of one
subtraction): beta*old_residual + gamma*grad == decode(payload) + new_residual.
"""
from __future__ import annotations

from typing import Optional

import torch

from hipress import _C
from hipress.compression.base import Compressor, CompressorState, check_residual_in, flat_f32
from hipress.compression.native import NativeCompressor


class ErrorFeedback(Compressor):
    takes_residual_in = True

    def __init__(self, inner: Compressor, beta: float = 1.0, gamma: float = 1.0):
        if not isinstance(inner, Compressor):
            raise TypeError("ErrorFeedback wraps a hipress.compression.Compressor")
        if inner.lowrank:
            raise ValueError(f"{inner.name} is low-rank and keeps its own error feedback")
        self.inner = inner
        self.beta, self.gamma = float(beta), float(gamma)
        self.name = inner.name
        self.category, self.rate = inner.category, inner.rate
        self.aggregatable, self.rounds, self.shared_rng = inner.aggregatable, inner.rounds, inner.shared_rng
        self._native = (_C.compress_error_feedback(inner._c, self.beta, self.gamma)
                        if isinstance(inner, NativeCompressor) else None)

    def _merged_compressor(self) -> Compressor:
        return self  # the residual is already the error feedback of a re-encode

    def for_sum_of(self, contributions: int) -> Compressor:
        inner = self.inner.for_sum_of(contributions)
        if inner is self.inner:
            return self
        made = self.__dict__.setdefault("_for_sum_of", {})
        if contributions not in made:
            made[contributions] = ErrorFeedback(inner, self.beta, self.gamma)
        return made[contributions]

    @property
    def reencode_safe(self) -> bool:
        return self.inner.reencode_safe

    def max_encoded_bytes(self, numel: int, shape=None) -> int:
        return self.inner.max_encoded_bytes(numel, shape)

    def encoded_bytes(self, numel: int, shape=None) -> Optional[int]:
        return self.inner.encoded_bytes(numel, shape)

    def new_state(self, numel: int, shape=None) -> CompressorState:
        st = self.inner.new_state(numel, shape)
        st.add_buffer("residual", numel)
        st.algorithm = f"ef({st.algorithm})"
        return st

    def encode(self, grad, state: Optional[CompressorState] = None, out=None,
               residual_in: Optional[torch.Tensor] = None):
        """residual_in: the residual before this encode, when it is not the state's buffer (which
        then only receives the new residual; Compressor.takes_residual_in)."""
        if state is None:
            check_residual_in(residual_in, None, "residual")
            return self.inner.encode(grad, None, out)
        if "residual" not in state.buffers:
            raise ValueError("state has no residual: make it with this ErrorFeedback's new_state")
        res = state.buffers["residual"]
        check_residual_in(residual_in, state, "residual")
        if self._native is not None:
            return self.inner._encode_with(self._native, grad, state, out, residual_in)
        g = flat_f32(grad)
        if g.numel() != res.numel():
            raise ValueError(f"state was made for {res.numel()} elements, the gradient has {g.numel()}")
        old = res if residual_in is None else residual_in.view(-1)
        if self.beta == 1.0 and self.gamma == 1.0:
            torch.add(old, g, out=res)
        else:
            torch.mul(old, self.beta, out=res).add_(g * self.gamma)
        payload = self.inner.encode(res, state, out)
        self.inner.decode_add(payload, res, alpha=-1.0)
        return payload

    def decode(self, payload, out):
        return self.inner.decode(payload, out)

    def decode_divided(self, payload, out, divisor: int):
        return self.inner.decode_divided(payload, out, divisor)

    def decode_add(self, payload, acc, alpha: float = 1.0):
        return self.inner.decode_add(payload, acc, alpha)

    def __repr__(self):
        return f"ErrorFeedback({self.inner!r}, beta={self.beta:g}, gamma={self.gamma:g})"
