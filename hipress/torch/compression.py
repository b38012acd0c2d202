"""``hipress.Compression``: Horovod's ``hvd.Compression`` shape, plus every hipress algorithm.

    hvd.allreduce(t, compression=hvd.Compression.fp16)
    hvd.DistributedOptimizer(opt, named_parameters=..., compression=hvd.Compression.tbq)

Each entry has Horovod's interface, ``compress(tensor) -> (tensor, ctx)`` and
``decompress(tensor, ctx) -> tensor``, and *is* the algorithm's name (a ``str`` subclass:
``Compression.tbq == "tbq"``), so ``DistributedOptimizer``, which takes algorithm names, accepts
every entry whose name hipress's registry knows (``none`` and the hipress algorithms; ``fp16``
is not a hipress algorithm).

* ``Compression.none``: the tensor unchanged.
* ``Compression.fp16``: floating point tensors travel as float16 and come back in their dtype
  (others unchanged), as in Horovod.
* ``Compression.<algorithm>`` (``onebit``, ``tbq``, ``terngrad``, ``dgc``, ``graddrop``, and any
  name registered with :func:`hipress.compression.register`): in the collectives
  (``allreduce``/``grouped_allreduce``/``reducescatter``), ``compress`` encodes the tensor with the
  algorithm and decodes it again on this rank (no error feedback, no state), so the reduction
  sees exactly the values the algorithm would deliver, but the bytes on the wire are the dense
  tensor's. Compressed communication proper is DistributedOptimizer's
  (``compression="tbq"``). Multi-round algorithms (``powersgd``) raise ``NotImplementedError`` there.
"""
from __future__ import annotations

import torch

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor", "AlgorithmCompressor"]


class Compressor(str):
    """Horovod's compressor interface; the value of the string is the algorithm's name."""

    def __new__(cls, name: str):
        return super().__new__(cls, name)

    def compress(self, tensor):
        """Returns ``(compressed tensor, context for decompress)``."""
        return tensor, None

    def decompress(self, tensor, ctx):
        return tensor

    def __repr__(self) -> str:
        return f"hipress.Compression.{str(self)}"


class NoneCompressor(Compressor):
    """No compression (the default)."""


class FP16Compressor(Compressor):
    """Floating point tensors as float16 on the wire, back to their dtype after."""

    def compress(self, tensor):
        if tensor.dtype.is_floating_point:
            return tensor.type(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    def decompress(self, tensor, ctx):
        if ctx is not None and ctx.is_floating_point:
            return tensor.type(ctx)
        return tensor


class AlgorithmCompressor(Compressor):
    """A hipress algorithm: encode and decode on this rank (see the module docstring)."""

    def _compressor(self):
        from hipress import compression as hc
        from hipress.compression import registry

        name = str(self)
        # error feedback needs a residual per tensor, which a stateless collective does not keep
        comp = hc.get(name, error_feedback=False) if registry._DEFAULT_EF.get(name) else hc.get(name)
        if comp.lowrank:
            raise NotImplementedError(f"Compression.{name} is a low-rank algorithm; it runs only "
                                      "inside hipress.DistributedOptimizer(compression=...)")
        return comp

    def compress(self, tensor):
        if not tensor.dtype.is_floating_point or tensor.numel() == 0:
            return tensor, None
        comp = self._compressor()
        g = tensor.detach().to("cpu", torch.float32).contiguous().reshape(-1)
        payload = comp.encode(g, None)
        out = torch.zeros_like(g)
        comp.decode_add(payload, out)
        out = out.reshape(tensor.shape).to(tensor.device, tensor.dtype)
        if tensor.requires_grad:  # straight-through: the gradient passes as if unchanged
            out = tensor + (out - tensor).detach()
        return out, None


class _CompressionMeta(type):
    def __getattr__(cls, name):
        if name.startswith("_"):
            raise AttributeError(name)
        from hipress import compression as hc

        if name.lower() in hc.available():
            c = AlgorithmCompressor(name.lower())
            setattr(cls, name, c)
            return c
        raise AttributeError(f"hipress.Compression has no algorithm {name!r}; available: none, fp16, "
                             f"{', '.join(a for a in hc.available() if a != 'none')}")

    def __dir__(cls):
        from hipress import compression as hc

        return sorted(set(type.__dir__(cls)) | set(hc.available()) | {"fp16"})


class Compression(metaclass=_CompressionMeta):
    """Compression used around allreduce (Horovod's ``hvd.Compression``), and hipress's
    algorithms by name (``Compression.tbq``; any registered name resolves on first access)."""

    none = NoneCompressor("none")
    fp16 = FP16Compressor("fp16")
    onebit = AlgorithmCompressor("onebit")
    tbq = AlgorithmCompressor("tbq")
    terngrad = AlgorithmCompressor("terngrad")
    dgc = AlgorithmCompressor("dgc")
    graddrop = AlgorithmCompressor("graddrop")
    powersgd = AlgorithmCompressor("powersgd")
