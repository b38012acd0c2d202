"""Compressed backward sends of activation gradients with lazy error propagation (Optimus-CC §5).

The sender compresses the activation gradient of a micro-batch with any hipress compressor
(low-rank "powersgd" by default); the receiver decodes it. With lazy error propagation the
sender keeps what compression lost (sent value minus decoded value) and adds it to the next
micro-batch's gradient before compressing that one, so within a step the sum of what was
received plus the error still kept equals the sum of the uncompressed gradients: the weight
gradients, accumulated over every micro-batch before the update, lose nothing for good but
the last error. The error is dropped at the end of the step (the paper keeps it within an
iteration), see :meth:`BackwardCompressor.end_step`.

Low-rank ("powersgd") keeps its factor Q from one send to the next (PowerSGD's warm start: one
power iteration per send then tracks the gradients' dominant subspace instead of starting from a
random one each time), with its own error feedback off: the lazy error is the only error memory.
Other compressors encode statelessly. Each gradient is compressed as a matrix of (elements / last dimension) rows and last-dimension
columns: for a transformer's (batch, sequence, hidden) activations that is one row per token,
the shape a low-rank approximation suits.
"""
from __future__ import annotations

from typing import Optional

import torch

from hipress import compression

#: bytes in front of each payload on the wire: its length (payloads may be shorter than the bound)
LENGTH_BYTES = 8


def matrix_shape(shape) -> tuple:
    """The 2-D view a gradient of ``shape`` is compressed as."""
    shape = tuple(int(d) for d in shape)
    if len(shape) == 0:
        return (1, 1)
    cols = shape[-1] if shape[-1] > 0 else 1
    numel = 1
    for d in shape:
        numel *= d
    return (numel // cols, cols)


class BackwardCompressor:
    """One stage's compressor for the activation gradients it sends backward.

    compression: a hipress compressor name or instance; kwargs configure it (``rank=`` for
    "powersgd"). No compressor keeps a residual of its own: the error is carried here, lazily,
    when ``lazy_error`` is true. "powersgd" keeps its warm-started Q per gradient shape."""

    def __init__(self, compression_name="powersgd", lazy_error: bool = True, **kwargs):
        if compression_name == "powersgd":
            if "error_feedback" in kwargs:
                raise ValueError("backward compression carries its own (lazy) error: powersgd's error_feedback "
                                 "is always off here; use lazy_error=")
            self.compressor = compression.PowerSGD(error_feedback=False, **kwargs)
        else:
            self.compressor = compression.get(compression_name, **kwargs)
        self.warm_start = compression_name == "powersgd"
        self.states: dict = {}  # matrix shape -> the low-rank compressor's state (its Q)
        self.lazy_error = bool(lazy_error)
        self.error: Optional[torch.Tensor] = None  # what the last compressed send lost, not yet sent

    def max_wire_bytes(self, shape) -> int:
        m = matrix_shape(shape)
        return LENGTH_BYTES + int(self.compressor.max_encoded_bytes(m[0] * m[1], m))

    def encode(self, grad: torch.Tensor) -> tuple:
        """(wire buffer of max_wire_bytes(grad.shape) bytes, the decoded gradient the receiver
        will get). Adds the carried error first, and keeps the new one."""
        if not grad.is_floating_point():
            raise ValueError(f"activation gradients must be floating point to be compressed, got {grad.dtype}")
        x = grad.detach().to(torch.float32)
        if self.lazy_error and self.error is not None:
            if self.error.shape != x.shape:
                raise ValueError(f"lazy error propagation needs every micro-batch's activation gradient to have one "
                                 f"shape; the kept error has {tuple(self.error.shape)}, this one {tuple(x.shape)}")
            x = x + self.error
        m = matrix_shape(x.shape)
        wire = torch.zeros(self.max_wire_bytes(x.shape), dtype=torch.uint8)
        state = None
        if self.warm_start:
            state = self.states.get(m)
            if state is None:
                state = self.states[m] = self.compressor.new_state(m[0] * m[1], m)
        payload = self.compressor.encode(x.reshape(m), state, out=wire[LENGTH_BYTES:])
        wire[:LENGTH_BYTES].view(torch.int64)[0] = payload.numel()
        decoded = self.decode(wire, x.shape)
        if self.lazy_error:
            self.error = x - decoded
        return wire, decoded.to(grad.dtype)

    def decode(self, wire: torch.Tensor, shape) -> torch.Tensor:
        """The fp32 gradient of ``shape`` a wire buffer from :meth:`encode` carries."""
        n = int(wire[:LENGTH_BYTES].view(torch.int64)[0])
        if not 0 < n <= wire.numel() - LENGTH_BYTES:
            raise ValueError(f"compressed activation gradient: payload length {n} does not fit the "
                             f"{wire.numel() - LENGTH_BYTES}-byte buffer")
        m = matrix_shape(shape)
        out = torch.empty(m[0] * m[1], dtype=torch.float32)
        self.compressor.decode(wire[LENGTH_BYTES:LENGTH_BYTES + n], out)
        return out.view(tuple(shape))

    def state_dict(self) -> dict:
        """The warm-started states (PowerSGD's Q per matrix shape), for a checkpoint taken
        between steps (the lazy error ends with each step)."""
        return {"states": [[list(shape), st.state_dict()] for shape, st in self.states.items()]}

    def load_state_dict(self, sd: dict) -> None:
        self.states = {}
        for shape, st_sd in sd["states"]:
            m = tuple(shape)
            st = self.states[m] = self.compressor.new_state(m[0] * m[1], m)
            st.load_state_dict(st_sd)
        self.error = None

    def end_step(self) -> Optional[torch.Tensor]:
        """Ends the step: returns the error still kept (None if nothing was compressed) and forgets it."""
        kept, self.error = self.error, None
        return kept
