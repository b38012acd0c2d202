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
from hipress.compression.native import (BF16, BUILTIN_IDS, DGC, FP16, QSGD, TBQ, Adaq, DGCGrace, EFSignSGD, GradDrop,
                                        Inceptionn,
                                        NativeCompressor, Natural, OneBit, PayloadError, PowerSGD, PowerSGDGrace,
                                        RandomK, SignSGD, Signum, Sketch, TernGrad, TernGradGrace, Threshold, TopK,
                                        U8bit)
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


#: Without ``out`` or ``numel``, :func:`decompress` allocates at most
#: ``max(DECOMPRESS_MIN_NUMEL, DECOMPRESS_NUMEL_PER_BYTE * len(payload))`` elements unless
#: ``max_numel`` says otherwise (see its docstring).
DECOMPRESS_MIN_NUMEL = 1 << 16
DECOMPRESS_NUMEL_PER_BYTE = 1024

# Bit widths of the packed body: tbq, terngrad; GRACE's quantizers (docs/grace.md): signsgd, signum,
# efsignsgd (sign bits), qsgd, natural, u8bit (8-bit codes), terngrad_grace (2-bit), fp16, bf16 (16-bit values)
_DENSE_BITS = {2: (2,), 3: (1, 2, 4, 8), 7: (1,), 8: (1,), 9: (1,), 10: (8,), 11: (8,), 12: (2,), 13: (8,),
               14: (16,), 15: (16,)}
# fp32 header words (scales, thresholds, norms) per built-in; GRACE's sparsifiers (docs/grace.md):
# randomk, topk, threshold (v), adaq (two means), dgc_grace (threshold), sketch, powersgd_grace
_FLOAT_WORDS = {1: 0, 2: 1, 3: 3, 4: 1, 5: 1, 6: 0, 7: 1, 8: 1, 9: 1, 10: 2, 11: 0, 12: 1, 13: 1, 14: 0, 15: 0,
                20: 0, 21: 0, 22: 1, 23: 2, 24: 1, 25: 0, 26: 0, 27: 0}
_SPARSE_PAIRS = (4, 5, 20, 21, 22, 24)  # count (uint32 index, fp32 value) pairs
_NAMES = {24: "dgc_grace", 26: "powersgd_grace"}  # payload names that are not the class name in lower case


def _algo_name(algo: int) -> str:
    """The registered name of a built-in (TernGradGrace: terngrad_grace)."""
    cls = BUILTIN_IDS[algo]
    return _NAMES.get(algo) or getattr(cls, "algorithm", None) or cls.__name__.lower()


def _header_bytes(p: torch.Tensor) -> torch.Tensor:
    """The payload's first HEADER_BYTES (fewer if shorter) as a CPU uint8 tensor."""
    h = p[:HEADER_BYTES]
    return h.cpu().contiguous() if h.device.type != "cpu" else h.contiguous()


def _check_layout(algo: int, bits: int, kind: int, count: int, numel: int, body: int, words) -> None:
    """The body size each built-in's decoder expects for the header's fields (the layouts of
    hipress/dsl/specs/*.cll as the generated decoders read them); PayloadError otherwise."""
    name = _algo_name(algo)

    def bad(msg):
        raise PayloadError(f"{name} payload: {msg}")

    for w in range(_FLOAT_WORDS[algo]):
        if (words[w] & 0x7F800000) == 0x7F800000:
            bad(f"field {w + 1} (float) is inf or NaN")
    if algo in _DENSE_BITS:
        if bits not in _DENSE_BITS[algo]:
            bad(f"bit width {bits}, expected one of {_DENSE_BITS[algo]}")
        if count != 0 or kind != 0:
            bad(f"unexpected count {count} / kind {kind}")
        expected = (numel * bits + 7) // 8
    elif algo == 1:  # onebit: sign bits, then one fp32 scale per row; count = the row length
        if bits != 1 or kind != 0:
            bad(f"unexpected bit width {bits} / kind {kind}")
        if (count == 0 or count > numel) if numel else count != 0:
            bad(f"row length {count} for {numel} elements")
        expected = (numel + 7) // 8 + (4 * ((numel + count - 1) // count) if numel else 0)
    elif algo in _SPARSE_PAIRS:  # DGC, GradDrop, GRACE's sparsifiers: count (uint32 index, fp32 value) pairs
        if bits != 0 or kind != 0:
            bad(f"unexpected bit width {bits} / kind {kind}")
        if count > numel:
            bad(f"{count} entries for {numel} elements")
        expected = 8 * count
    elif algo == 23:  # adaq: count uint32 indices, then count sign bits (packed)
        if bits != 1 or kind != 0:
            bad(f"unexpected bit width {bits} / kind {kind}")
        if count > numel:
            bad(f"{count} entries for {numel} elements")
        expected = 4 * count + (count + 7) // 8
    elif algo == 25:  # sketch: count fp32 bucket means, then numel uint8 codes
        if bits != 8 or kind != 0:
            bad(f"unexpected bit width {bits} / kind {kind}")
        if not 1 <= count <= 256:
            bad(f"{count} buckets, expected 1..256")
        expected = 4 * count + numel
    elif algo == 27:  # inceptionn: 2-bit tags, then n32 fp32, n16 16-bit and n8 8-bit values (words 0-2), bound word 3
        n32, n16, n8, eb = words
        if bits != 2 or kind != 0 or count != 0:
            bad(f"unexpected bit width {bits} / kind {kind} / count {count}")
        if not 1 <= eb <= 126:
            bad(f"exponent bound {eb} not in [1, 126]")
        if n32 + n16 + n8 > numel:
            bad(f"{n32 + n16 + n8} values for {numel} elements")
        expected = (numel + 3) // 4 + 4 * n32 + 2 * n16 + n8
    else:  # PowerSGD (6, 26): rows x cols matrix of rank count; kind 0: P^ and Q, 1: P, 2: Q
        rows, cols = words[0], words[1]
        if bits != 0 or kind not in (0, 1, 2):
            bad(f"unexpected bit width {bits} / kind {kind}")
        if rows * cols != numel or count > min(rows, cols):
            bad(f"inconsistent shape {rows} x {cols} rank {count} for {numel} elements")
        expected = 4 * count * ((rows + cols) if kind == 0 else (rows if kind == 1 else cols))
    if body != expected:
        bad(f"body has {body} bytes, {numel} elements need {expected}")


def payload_info(payload: torch.Tensor) -> dict:
    """Header fields of a payload, validated before anything is allocated: magic, format
    version, header check, a payload exactly header + body long (no trailing bytes), and for
    the built-in algorithms the body size their decoder expects for the element count and
    count the header announces, finite fp32 scales and thresholds, known bit width and kind.
    Ids 7..63 not in ``BUILTIN_IDS`` are rejected; ids >= 64 (user algorithms, hipress.compll)
    get the generic checks only (their decoders check the rest against the output's size). Raises :class:`PayloadError` (a ``ValueError``) for any malformed payload.

    Returns algo id/name, version, bits, kind, count, numel, body_bytes."""
    if not isinstance(payload, torch.Tensor):
        raise TypeError(f"a payload is a uint8 torch.Tensor, got {type(payload).__name__}")
    p = payload.reshape(-1)
    if p.dtype != torch.uint8:
        raise PayloadError(f"a payload is a uint8 tensor, got {p.dtype}")
    h = _header_bytes(p)
    algo, ver, bits, kind, count, numel, body, words = _C.compress_read_header(h.data_ptr(), p.numel())
    cls = BUILTIN_IDS.get(algo)
    if algo in _FLOAT_WORDS:  # the built-ins of hipress/dsl/specs (a compressor added to BUILTIN_IDS
        _check_layout(algo, bits, kind, count, numel, body, words)  # later gets the generic checks)
    elif cls is None and algo < _FIRST_USER_ALGO:
        raise PayloadError(f"payload made by an unknown algorithm id {algo}")
    return {"algo": algo, "name": _algo_name(algo) if cls else None, "version": ver, "bits": bits, "kind": kind,
            "count": count, "numel": numel, "body_bytes": body}


_FIRST_USER_ALGO = 64  # csrc/compress/format.h kFirstUserAlgo


def decompress(payload: torch.Tensor, out: Optional[torch.Tensor] = None, *, numel: Optional[int] = None,
               max_numel: Optional[int] = None) -> torch.Tensor:
    """Decode a payload of any built-in algorithm (the header says which) into ``out`` or a new
    fp32 tensor. The payload is validated (:func:`payload_info`) before anything is allocated,
    and a payload is never trusted for how much to allocate:

    * ``out`` given: the header's element count must equal ``out.numel()``.
    * ``numel`` given (the count the caller expects): the header's must equal it.
    * otherwise the header's count must be at most ``max_numel``, by default
      ``max(DECOMPRESS_MIN_NUMEL, DECOMPRESS_NUMEL_PER_BYTE * len(payload))`` (65536 elements,
      or 1024 elements, 4 KiB of fp32, per payload byte). Quantised payloads (onebit, TBQ,
      TernGrad, GRACE's quantizers) always fit it: their body has at least one bit per element. Sparse (DGC,
      GradDrop) and low-rank (PowerSGD) payloads do not bound their element count (a 56-byte
      DGC payload may announce 2^63 elements); the default admits DGC/GradDrop down to a
      density of about 1/8192 and PowerSGD matrices up to 8192 * rank rows and columns. Pass
      ``numel`` or ``max_numel`` when decoding sparser or larger payloads.

    Every violation raises :class:`PayloadError` (a ``ValueError``) before allocating."""
    info = payload_info(payload)
    cls = BUILTIN_IDS.get(info["algo"])
    if cls is None:
        raise PayloadError(f"payload made by algorithm id {info['algo']}, not a built-in: decode it with its "
                           "compressor (hipress.compression.get(name).decode)")
    n = info["numel"]
    if numel is not None and int(numel) != n:
        raise PayloadError(f"payload holds {n} elements, the caller expects {int(numel)}")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if out.numel() != n:
            raise PayloadError(f"payload holds {n} elements, out has {out.numel()}")
    elif numel is None:
        cap = max(DECOMPRESS_MIN_NUMEL, DECOMPRESS_NUMEL_PER_BYTE * payload.numel()) if max_numel is None \
            else int(max_numel)
        if n > cap:
            raise PayloadError(f"payload announces {n} elements, more than max_numel = {cap} "
                               f"(pass numel= or max_numel= to decode larger payloads)")
    if out is None:
        out = torch.empty(n, dtype=torch.float32)
    return cls().decode(payload, out)


__all__ = ["CATEGORIES", "Compressor", "CompressorState", "ErrorFeedback", "NativeCompressor", "PayloadError",
           "OneBit", "TBQ", "TernGrad", "DGC", "GradDrop", "PowerSGD", "SignSGD", "Signum", "EFSignSGD", "QSGD",
           "Natural", "TernGradGrace", "U8bit", "FP16", "BF16", "RandomK", "TopK", "Threshold", "Adaq", "DGCGrace",
           "Sketch", "PowerSGDGrace", "Inceptionn", "available", "get", "register",
           "compress", "decompress", "payload_info", "set_num_threads", "num_threads", "HEADER_BYTES",
           "DECOMPRESS_MIN_NUMEL", "DECOMPRESS_NUMEL_PER_BYTE",
           "NoneCompressor"]
