"""GRACE's API as a porting layer (``hipress.grace``; docs/grace.md "Porting a GRACE compressor").

A compressor written for GRACE (Xu et al., ICDCS 2021; its torch API) runs on hipress with its
logic unchanged::

    import hipress
    from hipress import grace

    class TopK(grace.Compressor):            # was: from grace_dl.torch import Compressor
        def compress(self, tensor, name): ...        # -> (tensors, ctx)
        def decompress(self, tensors, ctx): ...      # -> tensor

    opt = hipress.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=grace.wrap(TopK(), memory=grace.ResidualMemory(),
                                                              communicator="allgather"))

``wrap`` returns a hipress :class:`hipress.compression.Compressor` that hipress's allgather
strategy (hipress/sync/allgather.py) syncs. Per gradient partition (one per tensor unless a
tensor exceeds the optimizer's ``partition_bytes``), on every rank:

1. ``memory.compensate``, ``compressor.compress``, ``memory.update`` (GRACE's ``send_step``);
   the tensors and ctx are written into one hipress payload (a self-describing byte format,
   below: nothing is pickled, so a peer's payload cannot run code);
2. every rank's payload goes to every rank (one allgather per bucket);
3. the communicator's reduction, on each rank alike, over the ranks' payloads in rank order:

   * ``"allgather"`` and ``"broadcast"`` (GRACE's Allgather and Broadcast, the same reduction):
     each rank's tensors are decompressed with that rank's ctx, ``compressor.aggregate`` of the
     list, divided by the number of ranks if ``compressor.average``;
   * ``"allreduce"``: the ranks' compressed tensors summed elementwise (divided by the number of
     ranks first if ``compressor.average``, as GRACE's allreduce averages them), then
     ``decompress`` once. The compressed tensors must be summable: the same count and shapes on
     every rank and the same ctx (ValueError otherwise).

Differences from GRACE: the tensor a compressor sees is the flat fp32 partition (GRACE: the
gradient in its shape and dtype); ``name`` is the partition's state key (``"<bucket>/p<i>/worker"``,
the bucket named after its first parameter), not the parameter's name; decompress runs with the sender's ctx, carried in the payload
(GRACE decompresses every rank's tensors with the receiver's own ctx, the same for every
compressor whose ctx is a shape or dtype). A memory's state lives in the user's object, so it is
not in hipress's checkpoints (``state_dict``) and not rolled back when a step with non-finite
gradients is skipped.
"""
from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from typing import Any, List, Optional, Sequence, Tuple

import torch

from hipress.compression.base import Compressor as _HipressCompressor
from hipress.compression.base import CompressorState, check_payload, flat_f32

COMMUNICATORS = ("allreduce", "allgather", "broadcast")


# ------------------------------------------------------------------ GRACE's classes


class Compressor(ABC):
    """GRACE's compressor: ``compress(tensor, name) -> (tensors, ctx)``,
    ``decompress(tensors, ctx) -> tensor``, ``aggregate(tensors)`` (default: their sum).
    ``average``: the communicator divides the aggregate by the number of ranks.
    ``tensors_size_are_same``: every rank's compressed tensors have the same sizes (GRACE's
    allgather uses it to skip a size exchange; hipress's payloads carry their sizes, so it is
    informational here)."""

    def __init__(self, average: bool = True, tensors_size_are_same: bool = True):
        self.average = average
        self.tensors_size_are_same = tensors_size_are_same

    @abstractmethod
    def compress(self, tensor: torch.Tensor, name: str) -> Tuple[Sequence[torch.Tensor], Any]:
        """The compressed tensors and the context decompress needs."""

    @abstractmethod
    def decompress(self, tensors: Sequence[torch.Tensor], ctx: Any) -> torch.Tensor:
        """The tensor the compressed tensors stand for."""

    def aggregate(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return sum(tensors)


class Memory(ABC):
    """GRACE's memory: ``compensate(tensor, name)`` before compression, ``update(...)`` after."""

    @abstractmethod
    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """The tensor to compress (the gradient with what memory carries added)."""

    def update(self, tensor: torch.Tensor, name: str, compressor: Compressor, tensor_compressed, ctx) -> None:
        """Called with the compensated tensor and its compressed form."""


class NoneMemory(Memory):
    def compensate(self, tensor, name):
        return tensor


class ResidualMemory(Memory):
    """Error feedback: compensate = beta * residual + gamma * tensor; the residual is what the
    compressed form misses (tensor - decompress(compressed))."""

    def __init__(self, beta: float = 1.0, gamma: float = 1.0):
        self.residuals = {}
        self.beta, self.gamma = beta, gamma

    def compensate(self, tensor, name):
        residual = self.residuals.get(name)
        return tensor if residual is None else self.beta * residual + self.gamma * tensor

    def update(self, tensor, name, compressor, tensor_compressed, ctx):
        self.residuals[name] = tensor - compressor.decompress(tensor_compressed, ctx)


# ------------------------------------------------------------------ payload format
# "HPGR", version, then the compressed tensors as a list value and the ctx as a value. A value is
# a one-byte tag and its body: N None, T / F bool, I int64, D float64, S utf-8 string, Y dtype,
# Z torch.Size, U tuple, L list (count u32 + values), X tensor (dtype, ndim, dims u64, raw bytes).

_MAGIC = b"HPGR"
_VERSION = 1
_MAX_DEPTH = 32
_MAX_NDIM = 16
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
           torch.int32, torch.int64, torch.bool]
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}
_CTX_TYPES = "None, bool, int, float, str, torch.dtype, torch.Size, tuples, lists and CPU-copyable tensors"


def _write(value, out: List[bytes], depth: int = 0) -> None:
    if depth > _MAX_DEPTH:
        raise TypeError(f"a GRACE ctx nested deeper than {_MAX_DEPTH} levels cannot be sent")
    if value is None:
        out.append(b"N")
    elif value is True or value is False:
        out.append(b"T" if value else b"F")
    elif isinstance(value, int):
        out.append(b"I" + struct.pack("<q", value))
    elif isinstance(value, float):
        out.append(b"D" + struct.pack("<d", value))
    elif isinstance(value, str):
        raw = value.encode()
        out.append(b"S" + struct.pack("<I", len(raw)) + raw)
    elif isinstance(value, torch.dtype):
        if value not in _DTYPE_CODE:
            raise TypeError(f"dtype {value} cannot be sent in a GRACE payload")
        out.append(b"Y" + bytes([_DTYPE_CODE[value]]))
    elif isinstance(value, torch.Size):
        out.append(b"Z" + struct.pack("<I", len(value)) + b"".join(struct.pack("<q", int(d)) for d in value))
    elif isinstance(value, (tuple, list)):
        out.append((b"U" if isinstance(value, tuple) else b"L") + struct.pack("<I", len(value)))
        for v in value:
            _write(v, out, depth + 1)
    elif isinstance(value, torch.Tensor):
        if value.dtype not in _DTYPE_CODE:
            raise TypeError(f"a tensor of {value.dtype} cannot be sent in a GRACE payload")
        if value.dim() > _MAX_NDIM:
            raise TypeError(f"a tensor of {value.dim()} dimensions cannot be sent (at most {_MAX_NDIM})")
        t = value.detach().cpu().contiguous()
        out.append(b"X" + bytes([_DTYPE_CODE[t.dtype], t.dim()]) + b"".join(struct.pack("<Q", d) for d in t.shape))
        out.append(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    else:
        raise TypeError(f"a GRACE compressor's tensors and ctx must be built from {_CTX_TYPES}; "
                        f"got a {type(value).__name__}")


class _Reader:
    def __init__(self, buf: bytes):
        self.buf, self.off = buf, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.off + n > len(self.buf):
            raise ValueError(f"GRACE payload truncated: {n} bytes needed at offset {self.off} of {len(self.buf)}")
        b = self.buf[self.off:self.off + n]
        self.off += n
        return b

    def unpack(self, fmt: str):
        s = struct.Struct(fmt)
        return s.unpack(self.take(s.size))

    def value(self, depth: int = 0):
        if depth > _MAX_DEPTH:
            raise ValueError("GRACE payload nests values too deeply")
        tag = self.take(1)
        if tag == b"N":
            return None
        if tag in (b"T", b"F"):
            return tag == b"T"
        if tag == b"I":
            return self.unpack("<q")[0]
        if tag == b"D":
            return self.unpack("<d")[0]
        if tag == b"S":
            try:
                return self.take(self.unpack("<I")[0]).decode()
            except UnicodeDecodeError:
                raise ValueError("GRACE payload: a string is not valid utf-8") from None
        if tag == b"Y":
            return self.dtype()
        if tag == b"Z":
            (k,) = self.unpack("<I")
            if k > _MAX_NDIM:
                self.too_many(k)
            return torch.Size(self.unpack(f"<{k}q"))
        if tag in (b"U", b"L"):
            (k,) = self.unpack("<I")
            if k > len(self.buf) - self.off:  # every value takes a byte at least
                raise ValueError(f"GRACE payload: {k} items announced, {len(self.buf) - self.off} bytes left")
            items = [self.value(depth + 1) for _ in range(k)]
            return tuple(items) if tag == b"U" else items
        if tag == b"X":
            return self.tensor()
        raise ValueError(f"GRACE payload: unknown value tag {tag!r} at offset {self.off - 1}")

    def too_many(self, k):
        raise ValueError(f"GRACE payload: a shape of {k} dimensions (at most {_MAX_NDIM})")

    def dtype(self) -> torch.dtype:
        (code,) = self.take(1)
        if code >= len(_DTYPES):
            raise ValueError(f"GRACE payload: unknown dtype code {code}")
        return _DTYPES[code]

    def tensor(self) -> torch.Tensor:
        dtype = self.dtype()
        (ndim,) = self.take(1)
        if ndim > _MAX_NDIM:
            self.too_many(ndim)
        shape = self.unpack(f"<{ndim}Q")
        numel = 1
        for d in shape:
            numel *= d
        itemsize = torch.empty(0, dtype=dtype).element_size()
        if numel * itemsize > len(self.buf) - self.off:  # checked before anything is allocated
            raise ValueError(f"GRACE payload truncated: a tensor of shape {tuple(shape)} needs {numel * itemsize} "
                             f"bytes, {len(self.buf) - self.off} left")
        raw = bytearray(self.take(numel * itemsize))
        t = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        if dtype == torch.bool and bool((t > 1).any()):
            raise ValueError("GRACE payload: a bool tensor holds bytes other than 0 and 1")
        return t.view(dtype).reshape(shape)


def encode_payload(tensors: Sequence[torch.Tensor], ctx) -> torch.Tensor:
    """A GRACE compressor's (tensors, ctx) as one uint8 payload."""
    if not isinstance(tensors, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError(f"compress must return (tensors, ctx) with tensors a list or tuple of tensors, "
                        f"got {type(tensors).__name__}")
    out = [_MAGIC, bytes([_VERSION])]
    _write(list(tensors), out)
    _write(ctx, out)
    raw = b"".join(out)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def decode_payload(payload: torch.Tensor) -> Tuple[List[torch.Tensor], Any]:
    """Inverse of :func:`encode_payload`; a malformed payload raises ValueError."""
    p = check_payload(payload)
    r = _Reader(p.numpy().tobytes())
    if r.take(4) != _MAGIC:
        raise ValueError("not a GRACE payload of hipress.grace (bad magic)")
    (ver,) = r.take(1)
    if ver != _VERSION:
        raise ValueError(f"GRACE payload version {ver}, this build reads {_VERSION}")
    tensors = r.value()
    if not isinstance(tensors, list) or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError("GRACE payload: the compressed tensors are not a list of tensors")
    ctx = r.value()
    if r.off != len(r.buf):
        raise ValueError(f"GRACE payload has {len(r.buf) - r.off} trailing bytes")
    return tensors, ctx


def _ctx_bytes(ctx) -> bytes:
    return encode_payload([], ctx).numpy().tobytes()


# ------------------------------------------------------------------ the adapter


class Ported(_HipressCompressor):
    """A GRACE compressor, memory and communicator as a hipress compressor (see the module
    docstring). Made by :func:`wrap`."""

    # "quantization": each tensor of a fused bucket gets payloads of its own (splits_tensors), as
    # GRACE compresses each gradient alone
    category = "quantization"
    rate = 1.0  # unknown until compress has run
    aggregatable = False
    rounds = 1
    fixed_strategy = "allgather"  # the communicators' reductions run at its aggregation step

    def __init__(self, compressor: Compressor, memory: Optional[Memory] = None, communicator: str = "allgather"):
        for what, obj, methods in (("compressor", compressor, ("compress", "decompress", "aggregate")),
                                   ("memory", memory, ("compensate", "update"))):
            if obj is None and what == "memory":
                continue
            missing = [m for m in methods if not callable(getattr(obj, m, None))]
            if missing:
                raise TypeError(f"the GRACE {what} {type(obj).__name__} has no {', '.join(missing)}")
        if communicator not in COMMUNICATORS:
            raise ValueError(f"communicator must be one of {COMMUNICATORS}, got {communicator!r}")
        self.compressor = compressor
        self.memory = memory if memory is not None else NoneMemory()
        self.communicator = communicator
        self.name = f"grace.{type(compressor).__name__}"
        self._states = 0

    @property
    def average(self) -> bool:
        return bool(getattr(self.compressor, "average", True))

    def _merged_compressor(self):
        return self  # never re-encoded: allgather only

    def max_encoded_bytes(self, numel: int, shape=None) -> int:
        raise NotImplementedError("a GRACE compressor's payload size is known only after compress")

    def new_state(self, numel: int, shape=None) -> CompressorState:
        st = CompressorState(self.name, numel, shape)
        st.key = f"{self.name}/{self._states}"  # a StateStore replaces it with its key (the partition's)
        self._states += 1
        return st

    def encode(self, grad, state=None, out=None):
        tensor = flat_f32(grad).clone()  # the user's code may keep or modify it
        if state is None:  # a pure function of grad: no memory
            tensors, ctx = self.compressor.compress(tensor, f"{self.name}/stateless")
        else:
            if not isinstance(state, CompressorState) or state.key is None:
                raise TypeError("state must come from this compressor's new_state")
            name = state.key  # GRACE's tensor name: the memory keys its residual by it
            tensor = self.memory.compensate(tensor, name)
            tensors, ctx = self.compressor.compress(tensor, name)
            self.memory.update(tensor, name, self.compressor, tensors, ctx)
        payload = encode_payload(tensors, ctx)
        if out is None:
            return payload
        if out.dtype != torch.uint8 or out.numel() < payload.numel():
            raise ValueError(f"out has {out.numel()} bytes, the payload {payload.numel()}")
        out.view(-1)[:payload.numel()].copy_(payload)
        return out.view(-1)[:payload.numel()]

    def _decompressed(self, tensors, ctx, numel: int) -> torch.Tensor:
        t = self.compressor.decompress(tensors, ctx)
        if not isinstance(t, torch.Tensor) or t.numel() != numel:
            raise ValueError(f"{self.name}.decompress returned {getattr(t, 'numel', lambda: '?')()} elements, "
                             f"expected {numel}")
        return t.reshape(-1)

    def decode(self, payload, out):
        tensors, ctx = decode_payload(payload)
        out.view(-1).copy_(self._decompressed(tensors, ctx, out.numel()))
        return out

    def aggregate_payloads(self, payloads: Sequence[torch.Tensor], out: torch.Tensor, average: bool) -> torch.Tensor:
        """The communicator's reduction of every rank's payload (rank order) into out."""
        n = len(payloads)
        decoded = [decode_payload(p) for p in payloads]
        divide = average and self.average
        if self.communicator == "allreduce":
            (first, ctx), others = decoded[0], decoded[1:]
            summed = [t.clone() for t in first]
            for src, (tensors, c) in enumerate(others, 1):
                if len(tensors) != len(summed) or any(a.shape != b.shape for a, b in zip(tensors, summed)):
                    raise ValueError(f"communicator 'allreduce': rank {src}'s compressed tensors "
                                     f"{[tuple(t.shape) for t in tensors]} differ from rank 0's "
                                     f"{[tuple(t.shape) for t in summed]}; use 'allgather'")
                if _ctx_bytes(c) != _ctx_bytes(ctx):
                    raise ValueError(f"communicator 'allreduce': rank {src}'s ctx differs from rank 0's, so the sum "
                                     "of the compressed tensors has no one decompression; use 'allgather'")
                for acc, t in zip(summed, tensors):
                    acc += t
            if divide:
                for t in summed:
                    if not t.is_floating_point():
                        raise ValueError("communicator 'allreduce' with compressor.average averages the compressed "
                                         f"tensors: they must be floating point, got {t.dtype}")
                summed = [t / n for t in summed]
            result = self._decompressed(summed, ctx, out.numel())
        else:  # allgather, broadcast
            result = self.compressor.aggregate([self._decompressed(t, c, out.numel()) for t, c in decoded])
            result = result.reshape(-1)
            if divide:
                result = result / n
        out.view(-1).copy_(result)
        return out

    def __repr__(self):
        return (f"hipress.grace.wrap({type(self.compressor).__name__}, memory={type(self.memory).__name__}, "
                f"communicator={self.communicator!r})")


def wrap(compressor: Compressor, memory: Optional[Memory] = None, communicator: str = "allgather") -> Ported:
    """A GRACE compressor (and memory, default none; communicator "allreduce", "allgather" or
    "broadcast") as a hipress compressor for ``hipress.DistributedOptimizer(compression=...)``."""
    return Ported(compressor, memory, communicator)


__all__ = ["COMMUNICATORS", "Compressor", "Memory", "NoneMemory", "ResidualMemory", "Ported", "wrap",
           "encode_payload", "decode_payload"]
