"""CompLL: gradient compression for hipress (HiPress §4).

    from hipress import compression
    c = compression.get("tbq", threshold=0.01)       # ErrorFeedback(TBQ) by default
    st = c.new_state(g.numel(), g.shape)
    payload = c.encode(g, st)                          # uint8 tensor, self-describing
    c.decode_add(payload, acc)                         # acc += decoded

    payload = compression.compress(g, "terngrad", bitwidth=4)   # plain functions
    dense = compression.decompress(payload)                     # algorithm read from the header

The Compressor contract (single and multi-round) is documented in
hipress/compression/base.py.
"""
from __future__ import annotations

from typing import Optional

import torch

from hipress import _C, config
from hipress.compression.base import CATEGORIES, Compressor, CompressorState
from hipress.compression.error_feedback import ErrorFeedback
from hipress.compression.native import (BUILTIN_IDS, DGC, TBQ, GradDrop, NativeCompressor, OneBit, PayloadError,
                                        PowerSGD, TernGrad)
from hipress.compression.none import NoneCompressor
from hipress.compression.registry import available, get, register

HEADER_BYTES = _C.compress_header_bytes

# The C++ pool reads HIPRESS_COMPRESS_THREADS itself on first use (csrc/compress/thread_pool.cc,
# same meaning); parsed here as well so that a value that is not an integer fails now, naming
# the variable, instead of being read as the default.
config.get("HIPRESS_COMPRESS_THREADS")


def set_num_threads(n: int) -> None:
    """Threads used by the native kernels (default: ``HIPRESS_COMPRESS_THREADS``, else 1; <= 0: all cores).
    Results are bit-identical for any thread count."""
    _C.compress_set_num_threads(int(n))


def num_threads() -> int:
    return _C.compress_num_threads()


def compress(grad: torch.Tensor, name: str = "tbq", state: Optional[CompressorState] = None, **params) -> torch.Tensor:
    """One-shot encode with a freshly configured compressor (no distributed setup needed)."""
    return get(name, **params).encode(grad, state)


def payload_info(payload: torch.Tensor) -> dict:
    """Header fields of a payload (validated): algo id/name, numel, body bytes, bits, kind, count."""
    import struct
    p = payload.contiguous().view(-1)
    if p.dtype != torch.uint8 or p.numel() < HEADER_BYTES:
        raise PayloadError("payload truncated or not uint8")
    raw = bytes(p[:HEADER_BYTES].tolist())
    magic, algo, ver, bits, kind, _check, count, numel, body = struct.unpack("<IBBBBIIQQ", raw[:32])
    if magic != _C.compress_magic:
        raise PayloadError("not a hipress compressed payload")
    cls = BUILTIN_IDS.get(algo)
    return {"algo": algo, "name": cls.__name__.lower() if cls else None, "version": ver, "bits": bits, "kind": kind,
            "count": count, "numel": numel, "body_bytes": body}


def decompress(payload: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Decode a payload of any built-in algorithm (the header says which) into a new fp32 tensor or ``out``."""
    info = payload_info(payload)
    cls = BUILTIN_IDS.get(info["algo"])
    if cls is None:
        raise PayloadError(f"payload made by an unknown algorithm id {info['algo']}")
    if out is None:
        out = torch.empty(info["numel"], dtype=torch.float32)
    return cls().decode(payload, out)


__all__ = ["CATEGORIES", "Compressor", "CompressorState", "ErrorFeedback", "NativeCompressor", "PayloadError",
           "OneBit", "TBQ", "TernGrad", "DGC", "GradDrop", "PowerSGD", "available", "get", "register",
           "compress", "decompress", "payload_info", "set_num_threads", "num_threads", "HEADER_BYTES",
           "NoneCompressor"]
