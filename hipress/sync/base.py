"""Shared pieces of the CaSync strategies (paper 000 §3.1, §5).

A strategy turns one gradient partition into a task graph of the five primitives
(encode, decode, merge on the compute queue; send/recv on the comm queue). It never
moves bytes itself: comm tasks call the transport, compute tasks call the compressor.

Cross-rank order. Transports match messages in call order, and each rank has a
single comm thread, so every rank must issue its communication in the same order or
two ranks can wait on each other forever. Which compute task finishes first is a
matter of timing, so ready order is not enough: :class:`CommChain` makes every comm
task depend on the previous one submitted, so comm runs in submission order, which
is the same on every rank because gradients are submitted in the same order (hooks
fire in the model's backward order; the optimizer submits missing ones in parameter
order). The global coordinator (later) replaces this chain with a planned order.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hipress.engine import Engine, Handle

_LEN = struct.Struct("<q")


def chunk_bounds(n: int, parts: int) -> List[Tuple[int, int]]:
    """Splits range(n) into `parts` contiguous (start, end) ranges differing by at most
    one element (the first n % parts get the extra one); some are empty when n < parts."""
    if parts <= 0:
        raise ValueError(f"parts must be positive, got {parts}")
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def frame(payloads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenates payloads as [int64 length][bytes] records (one uint8 tensor)."""
    total = sum(8 + p.numel() for p in payloads)
    out = torch.empty(total, dtype=torch.uint8)
    off = 0
    for p in payloads:
        out[off:off + 8] = torch.frombuffer(bytearray(_LEN.pack(p.numel())), dtype=torch.uint8)
        off += 8
        out[off:off + p.numel()] = p
        off += p.numel()
    return out


def unframe(buf: torch.Tensor, expected: int) -> List[torch.Tensor]:
    """Inverse of :func:`frame`; checks the record count and bounds (views, no copies)."""
    out, off, n = [], 0, buf.numel()
    raw = buf.numpy()
    for i in range(expected):
        if off + 8 > n:
            raise ValueError(f"framed buffer truncated: record {i} of {expected} starts past its end ({n} bytes)")
        (length,) = _LEN.unpack_from(raw, off)
        off += 8
        if length < 0 or off + length > n:
            raise ValueError(f"framed buffer corrupt: record {i} claims {length} bytes, {n - off} left")
        out.append(buf[off:off + length])
        off += length
    if off != n:
        raise ValueError(f"framed buffer has {n - off} trailing bytes after {expected} records")
    return out


class CommChain:
    """Orders comm tasks by submission (see module docstring)."""

    def __init__(self):
        self.last: Optional[Handle] = None

    def deps(self, extra: Sequence[Handle]) -> List[Handle]:
        return list(extra) + ([self.last] if self.last is not None else [])

    def push(self, h: Handle) -> Handle:
        self.last = h
        return h


class StateStore:
    """Per-(tensor, partition, role) compressor state, created on first use.

    Keys are strings, so ``state_dict()`` is a plain dict a checkpoint can hold.
    """

    def __init__(self):
        self._states: Dict[str, object] = {}
        self._pending: Dict[str, dict] = {}

    def get(self, key: str, compressor, numel: int, shape=None):
        st = self._states.get(key)
        if st is None:
            st = compressor.new_state(numel, shape)
            if key in self._pending:
                st.load_state_dict(self._pending.pop(key))
            self._states[key] = st
        return st

    def state_dict(self) -> dict:
        out = {k: v.state_dict() for k, v in self._states.items()}
        out.update(self._pending)  # restored but not used yet: keep it
        return out

    def load_state_dict(self, sd: dict) -> None:
        self._states.clear()
        self._pending = dict(sd)


def direct_exchange(transport, payloads: Dict[int, torch.Tensor], recv_from, bulk: bool) -> Dict[int, torch.Tensor]:
    """Moves payloads now, over the transport; receivers learn the sizes from the transport
    (payload sizes vary with the gradient for sparsifiers).

    bulk=False: exactly one destination and one source (a ring step): one sendrecv_alloc.
    bulk=True: one alltoallv_alloc (zero bytes to and from every peer not named). Every
    rank of the transport must make the same kind of call at the same point.
    """
    n = transport.size
    if not bulk:
        (dst, payload), = payloads.items()
        (src,) = recv_from
        return {src: transport.sendrecv_alloc(payload, dst, src)}
    segs = [payloads[j].reshape(-1) if j in payloads else torch.empty(0, dtype=torch.uint8) for j in range(n)]
    send_counts = [x.numel() for x in segs]
    recv, recv_counts = transport.alltoallv_alloc(torch.cat(segs), send_counts)
    out, off = {}, 0
    for j, c in enumerate(recv_counts):
        if j in recv_from:
            out[j] = recv[off:off + c]
        off += c
    return out


@dataclass
class SyncContext:
    """What a strategy needs to emit tasks for one gradient.

    executor: a coordinator executor (hipress.coordinator); when set, exchanges are
    deferred tasks batched by the global coordinator, and comm needs no chain.
    """

    engine: Engine
    transport: object  # hipress.transport.base.Transport
    compressor: object  # hipress.compression Compressor
    states: StateStore
    chain: CommChain = field(default_factory=CommChain)
    executor: object = None
    # Compute tasks of partitions up to this many bytes run in batches (see compute()).
    batch_compute_bytes: int = field(default_factory=lambda: int(os.environ.get("HIPRESS_BATCH_COMPUTE_BYTES",
                                                                                 256 << 10)))
    _occurrence: Dict[str, int] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def size(self) -> int:
        return self.transport.size

    def compute(self, name: str, fn: Callable[[], object], deps: Sequence[Handle] = (), nbytes: int = -1) -> Handle:
        """A compute task. Given the bytes it works on, small ones (<= batch_compute_bytes)
        of the same primitive batch with those queued right behind them: batch
        compression (paper §3.2), one hand-off and one completion pass for many small
        gradients."""
        batch = None
        if 0 <= nbytes <= self.batch_compute_bytes:
            batch = name.split(".", 1)[0]
        return self.engine.submit(name, fn, queue="compute", deps=deps, batch=batch)

    def comm(self, name: str, fn: Callable[[], object], deps: Sequence[Handle] = ()) -> Handle:
        return self.chain.push(self.engine.submit(name, fn, queue="comm", deps=self.chain.deps(deps)))

    def exchange(self, name: str, sends: Dict[int, Callable[[], torch.Tensor]],
                 sinks: Dict[int, Callable[[torch.Tensor], None]], deps: Sequence[Handle] = (),
                 bulk: bool = True) -> Handle:
        """The send and recv primitives: sends[dst]() gives the payload for dst (evaluated
        when the task runs); sinks[src](payload) takes what src sent. Ranks are those of
        this context's transport. bulk: see :func:`direct_exchange`."""
        if self.executor is not None:
            occ = self._occurrence.get(name, 0)
            self._occurrence[name] = occ + 1
            key_name = f"{name}#{occ}"
            ex = self.executor

            def post(completion):
                ex.post(key_name, {d: f() for d, f in sends.items()}, sinks, completion)

            return self.engine.submit_deferred(name, post, queue="comm", deps=deps)
        tr = self.transport

        def run():
            got = direct_exchange(tr, {d: f() for d, f in sends.items()}, set(sinks), bulk)
            for src, buf in got.items():
                sinks[src](buf)

        return self.comm(name, run, deps)


class Strategy:
    """Builds the task graph that replaces ``flat`` (fp32, 1-D, CPU) by the average over
    ranks of the decoded aggregate. Returns the handle of the task after which ``flat``
    holds the result. ``bounds`` are the K partitions (offsets into ``flat``: no copies).
    """

    name = "strategy"

    def build(self, ctx: SyncContext, tensor_name: str, flat: torch.Tensor,
              bounds: Sequence[Tuple[int, int]], deps: Sequence[Handle] = (), **kw) -> Handle:
        """Extra keywords carry tensor facts some strategies need (low-rank: ``shape``, or
        ``segments``, the (offset, numel, shape) of each matrix of a fused buffer)."""
        raise NotImplementedError
