"""Shared pieces of the CaSync strategies (paper 000 §3.1, §5).

A strategy turns one gradient partition into a task graph of the five primitives
(encode, decode, merge on the compute queue; send/recv on the comm queue). It never
moves bytes itself: send/recv go through an :class:`hipress.comm.exchange.Exchange`
(which keeps communication in one order on every rank, or lets the global coordinator
schedule it), compute tasks call the compressor.
"""
from __future__ import annotations

import struct
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from hipress import config
from hipress.comm.exchange import Exchange
from hipress.compression.base import Compressor
from hipress.engine import Engine, Handle
from hipress.sync.undo import UndoLog

_LEN = struct.Struct("<q")


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


def payload_bound(comp: Compressor, numel: int, shape=None, contributions: int = 1) -> Optional[int]:
    """The most bytes a peer's payload of ``numel`` elements may take, from the receiver's own
    knowledge (``max_encoded_bytes`` of the compressor and of its merged form for sums of up to
    ``contributions`` ranks, which re-encodes partial sums); passed to the exchange as
    ``max_bytes`` so a peer's announcement is never trusted for allocation. None when the
    compressor does not implement ``max_encoded_bytes``."""
    try:
        return max(int(c.max_encoded_bytes(numel) if shape is None else c.max_encoded_bytes(numel, shape))
                   for c in (comp, comp.merged_for(contributions)))
    except NotImplementedError:
        return None


def known_sizes(enc: Compressor, sent_numel: int, received_numel: int) -> Optional[Tuple[int, int]]:
    """(bytes sent, bytes received) of a pairwise step whose two payloads ``enc`` encodes from
    ``sent_numel`` and ``received_numel`` elements (no shape), where its payloads have a size
    known in advance (``encoded_bytes``); else None, and the sizes travel first. A sparsifier's
    (no_larger_than_dense may swap its payload) never has one."""
    sent, received = enc.encoded_bytes(sent_numel), enc.encoded_bytes(received_numel)
    return None if sent is None or received is None else (sent, received)


def known_frames(sent: Dict[int, Optional[int]], received: Dict[int, Optional[int]]):
    """A bulk exchange's ({dst: bytes sent}, {src: bytes received}) where every size is known
    in advance (frame_bound of payloads of known size), else None: the sizes travel first."""
    if any(v is None for v in (*sent.values(), *received.values())):
        return None
    return sent, received


def row_length(numel: int, shape) -> int:
    """A tensor's row: the elements after its first dimension; 0 where it has no rows (fewer than
    two dimensions, or none in the first). Where partitions may cut (bucket_bounds' at_rows) and
    what a partition of whole rows is (partition_shape) read it here."""
    if shape is None or len(shape) < 2 or not shape[0]:
        return 0
    return numel // int(shape[0])


def partition_shape(segments, s: int, e: int) -> Optional[Tuple[int, int]]:
    """The shape (rows, row length) of the partition [s, e) of a fused buffer when it is whole rows of
    one tensor of two or more dimensions (a row: the elements after the first dimension), else None.
    ``segments`` are the buffer's tensors as (offset, numel, shape) (the optimizer's bucket.segments).
    A compressor with per-row values (onebit) gets it through ``new_state(numel, shape)``."""
    for off, numel, shape in segments or ():
        if off <= s and e <= off + numel:
            row = row_length(numel, shape)
            if row and e > s and (s - off) % row == 0 and (e - s) % row == 0:
                return ((e - s) // row, row)
            return None
    return None


def _sparsifier(comp: Compressor) -> bool:
    """Whether ``comp`` keeps a fraction of the elements that grows with the ranks summed
    (for_sum_of: DGC, GradDrop, top-k, ...), so that a re-encoded sum may outgrow dense fp32."""
    return comp.for_sum_of(2) is not comp


def no_larger_than_dense(comp: Compressor, payload: torch.Tensor, numel: int) -> torch.Tensor:
    """``payload`` of ``numel`` elements as it is sent by the ring and PS. A sparsifier's payload
    (a value and an index per kept element) outgrows the ``numel`` fp32 values it stands for above
    half density: a sum re-encoded at the density of its union (four ranks' 25% in DGC's warm-up:
    all of them, 8 bytes an element), or a ratio set that high. Such a payload travels as those
    values instead, decoded here: the same numbers in half the bytes or fewer. A sparse payload
    that is sent is thus always smaller than 4 x numel bytes, which is how :func:`decode_payload`
    tells the two apart."""
    if payload.numel() < 4 * numel or not _sparsifier(comp):
        return payload
    dense = torch.empty(numel, dtype=torch.float32)
    comp.decode(payload, dense)
    return dense.view(torch.uint8)


def fp32_view(payload: torch.Tensor) -> torch.Tensor:
    """Received bytes of raw fp32 values as floats (copied where they do not start 4-aligned: a
    record inside a frame or a concatenated payload may not)."""
    return (payload if payload.storage_offset() % 4 == 0 else payload.clone()).view(torch.float32)


def decode_payload(comp: Compressor, payload: torch.Tensor, out: torch.Tensor, add: bool = False,
                   divisor: int = 1) -> torch.Tensor:
    """comp.decode_divided (out = decode / divisor; a divisor of 1 is decode itself) or, with
    ``add``, comp.decode_add, of a payload that :func:`no_larger_than_dense` may have turned into
    fp32 values."""
    if add and divisor != 1:
        raise ValueError("decode_payload: a divisor divides a decoded payload, not a sum it is added to")
    if payload.numel() == 4 * out.numel() and _sparsifier(comp):
        values = fp32_view(payload).view_as(out)
        return out.add_(values) if add else torch.div(values, divisor, out=out)
    return comp.decode_add(payload, out) if add else comp.decode_divided(payload, out, divisor)


def frame_bound(bounds: Sequence[Optional[int]]) -> Optional[int]:
    """The size bound of :func:`frame` of payloads with these bounds (None if any is None)."""
    if any(b is None for b in bounds):
        return None
    return sum(8 + b for b in bounds)


def rng_stream_start(rank: int, key: str) -> int:
    """Where the RNG counter of state ``key`` on ``rank`` starts: a position in the 2^63
    counter space fixed by (rank, key), so ranks draw independent random numbers. With
    one shared stream (every rank's counter starting at 0), TernGrad's stochastic rounding
    rounded every element the same way on every rank: the noise did not average out over
    ranks and training diverged (digits, 4 ranks: 11.8%; docs/convergence.md)."""
    h = zlib.crc32(key.encode()) | (int(rank) << 32)
    return _splitmix64(h) >> 1


def _splitmix64(x: int) -> int:
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


class StateStore:
    """Per-(tensor, partition, role) compressor state of one rank, created on first use.

    Keys are strings, so ``state_dict()`` is a plain dict a checkpoint can hold. A new
    state's RNG counter starts at :func:`rng_stream_start` (independent random numbers per
    rank), except for aggregatable compressors, whose payloads are combined in compressed
    form and so must draw the same random numbers on every rank (PowerSGD's initial Q; their
    counter starts at 0). A compressor with ``shared_rng`` (Random-k's positions, as GRACE
    draws them) starts every rank at rank 0's place.
    """

    def __init__(self, rank: int = 0):
        self.rank = int(rank)
        self._states: Dict[str, object] = {}
        self._pending: Dict[str, dict] = {}
        # Copy-on-write log of the states this step touched (off unless enabled): the optimizer
        # undoes a step whose gradients were not finite on some rank (hipress/torch/nonfinite.py).
        # Every site that uses a state gets it here first, in the step it changes it.
        self.undo_log = UndoLog()

    def get(self, key: str, compressor, numel: int, shape=None):
        st = self._states.get(key)
        if st is None:
            st = compressor.new_state(numel, shape)
            st.key = key
            pending = self._pending.pop(key, None)
            if pending is not None:
                st.load_state_dict(pending)
            elif not compressor.aggregatable:
                st.scalars[0] = rng_stream_start(0 if compressor.shared_rng else self.rank, key)
            self._states[key] = st
            self.undo_log.created(key, pending)
        else:
            self.undo_log.touch(key, [*st.buffers.values(), st.scalars])
        return st

    def encode(self, key: str, compressor, x: torch.Tensor, shape=None) -> torch.Tensor:
        """``compressor.encode(x)`` with the state stored under ``key`` (``get``; ``_for_update``)."""
        st, old = self._for_update(key, compressor, x.numel(), shape)
        return compressor.encode(x, st) if old is None else compressor.encode(x, st, residual_in=old)

    def encode_round0(self, key: str, compressor, x: torch.Tensor, shape=None):
        """(``compressor.encode_round(0, x, state)``, the state): a low-rank sync's first round, the
        state got as :meth:`encode` gets it."""
        st, old = self._for_update(key, compressor, x.numel(), shape)
        if old is None:
            return compressor.encode_round(0, x, st), st
        return compressor.encode_round(0, x, st, residual_in=old), st

    def _for_update(self, key: str, compressor, numel: int, shape):
        """The state under ``key`` for an encode that updates it, and where the residual's old values
        are (None: in the state). Where the undo log must keep this step's first copy of the state of
        a compressor that takes ``residual_in``, the new residual goes into the log's spare buffer and
        the old one stays as the copy (UndoLog.replace): the encode reads it anyway, so the residual is
        not copied first (one pass over it saved per step)."""
        st = self._states.get(key)
        if st is None or not compressor.takes_residual_in:
            return self.get(key, compressor, numel, shape), None
        names = list(st.buffers)
        r = names.index(compressor.residual_buffer)
        old = [*st.buffers.values(), st.scalars]
        new = self.undo_log.replace(key, old)
        if new[0] is old[0]:  # nothing to keep: in place
            return st, None
        for i, (dst, src) in enumerate(zip(new, old)):
            if i != r:  # the other buffers and the counters, copied as touch copies them
                dst.copy_(src)
        st.buffers = OrderedDict(zip(names, new[:-1]))
        st.scalars = new[-1]
        return st, old[r]

    def commit(self) -> None:
        """Keeps this step's changes (forgets the undo log's copies)."""
        self.undo_log.commit()

    def undo(self) -> None:
        """Every state as before this step: touched ones copied back, new ones dropped (made
        again, the same, on next use; one restored from a checkpoint goes back to pending)."""
        def restore(key, copies, pending):
            if copies is None:
                self._states.pop(key, None)
                if pending is not None:
                    self._pending[key] = pending
                return
            st = self._states[key]
            for dst, src in zip([*st.buffers.values(), st.scalars], copies):
                dst.copy_(src)

        self.undo_log.undo(restore)

    def state_dict(self) -> dict:
        out = {k: v.state_dict() for k, v in self._states.items()}
        out.update(self._pending)  # restored but not used yet: keep it
        return out

    def load_state_dict(self, sd: dict) -> None:
        self.undo_log.commit()
        self._states.clear()
        self._pending = dict(sd)

    def take(self, key: str) -> Optional[Dict[str, torch.Tensor]]:
        """Removes the state ``key`` (in use, or restored and not used yet) and returns its
        buffers by name (None if there is none). For buckets that are rebuilt with another
        layout (bucket_bytes="tune"): the optimizer hands their residuals back to the gradients."""
        st = self._states.pop(key, None)
        pending = self._pending.pop(key, None)
        self.undo_log.forget([key])
        if st is not None:
            return dict(st.buffers)
        if pending is not None:
            return {k: v.reshape(-1) for k, v in pending["buffers"].items()}
        return None

    def discard(self, prefix: str) -> int:
        """Drops every state (in use or restored and not used yet) whose key starts with
        ``prefix``; returns how many. For buckets that no longer exist (DDP rebuilt its buckets:
        hipress/torch/ddp.py), so their residuals are neither checkpointed nor replayed later."""
        gone = [k for k in self._states if k.startswith(prefix)] + [k for k in self._pending if k.startswith(prefix)]
        for k in gone:
            self._states.pop(k, None)
            self._pending.pop(k, None)
        self.undo_log.forget(gone)
        return len(gone)


@dataclass
class SyncContext:
    """What a strategy needs to emit tasks for one gradient: the engine for compute tasks,
    the exchange of its group of ranks for comm tasks, the compressor and its state."""

    engine: Engine
    exchange: Exchange
    compressor: Compressor
    states: StateStore
    # Compute tasks of partitions up to this many bytes run in batches (see compute()).
    batch_compute_bytes: int = field(default_factory=lambda: config.get("HIPRESS_BATCH_COMPUTE_BYTES"))

    @property
    def rank(self) -> int:
        return self.exchange.rank

    @property
    def size(self) -> int:
        return self.exchange.size

    def compute(self, name: str, fn, deps: Sequence[Handle] = (), nbytes: int = -1, keep=None) -> Handle:
        """A compute task (a callable, or a native work with ``keep``: the tensors it touches).
        Given the bytes it works on, small ones (<= batch_compute_bytes) of the same primitive
        batch with those queued right behind them: batch compression (paper §3.2), one hand-off
        and one completion pass for many small gradients."""
        batch = None
        if 0 <= nbytes <= self.batch_compute_bytes:
            batch = name.split(".", 1)[0]
        return self.engine.submit(name, fn, queue="compute", deps=deps, batch=batch, keep=keep)


class Strategy:
    """Builds the task graph that replaces ``flat`` (fp32, 1-D, CPU) by the average over
    ranks of the decoded aggregate. Returns the handle of the task after which ``flat``
    holds the result. ``bounds`` are the K partitions (offsets into ``flat``: no copies).
    """

    name = "strategy"
    # Whether all partitions of a gradient travel framed together (one message per peer), so
    # that more partitions cost compute calls but no messages (allgather, PS; not the ring,
    # where each partition has its own chain of exchanges).
    frames_partitions = False
    # Whether build() takes ``into``: tensors the result is written to instead of ``flat``
    # (the fused gradients themselves, so that no copy back follows; hipress.sync.allreduce).
    writes_into = False

    def build(self, ctx: SyncContext, tensor_name: str, flat: torch.Tensor,
              bounds: Sequence[Tuple[int, int]], deps: Sequence[Handle] = (), **kw) -> Handle:
        """Extra keywords carry tensor facts some strategies need (low-rank: ``shape``, or
        ``segments``, the (offset, numel, shape) of each matrix of a fused buffer)."""
        raise NotImplementedError

    def spread(self, ranks: int) -> int:
        """Over how many of the ``ranks`` a gradient's partitions share the strategy's work, so
        that one partition per rank runs that work in parallel (PS: each partition's aggregator);
        1: more partitions gain nothing here (the ring and allgather already spread every byte)."""
        return 1

    @staticmethod
    def _each_range(ctx: SyncContext, tensor_name: str, flat: torch.Tensor, ranges: Sequence[Tuple[int, int]],
                    deps: Sequence[Handle], phase, tag: str, kw=None) -> Handle:
        """``phase(ctx, key, flat[s:e], deps, **kw(i))`` on each non-empty range i (keys
        ``{tensor_name}/{tag}{i}``; no keywords without ``kw``), joined into one handle: a strategy's
        phases run per partition (ring) or per span (allreduce)."""
        finals = [phase(ctx, f"{tensor_name}/{tag}{i}", flat[s:e], deps, **(kw(i) if kw else {}))
                  for i, (s, e) in enumerate(ranges) if e > s]
        if len(finals) == 1:
            return finals[0]
        return ctx.compute(f"done.{tensor_name}", lambda: None, deps=finals or list(deps))

    def reserve(self, ctx: SyncContext, tensor_name: str, bounds: Sequence[Tuple[int, int]]) -> None:
        """Declares a gradient's partitions before its first build. A strategy whose
        per-partition choices depend on the order partitions first appear in (PS: which rank
        aggregates) makes them here, so they do not depend on which gradient is synced first
        (COVAP syncs a different subset each step, and a resumed run starts elsewhere)."""

    def state_spans(self, ctx: SyncContext, tensor_name: str,
                    bounds: Sequence[Tuple[int, int]]) -> List[Tuple[str, int, int]]:
        """Every compressor-state key this rank may use for the gradient, with the elements
        [start, end) of ``flat`` that the state's per-element buffers (a residual) stand for:
        the key scheme of :meth:`build`, in one place beside it. The optimizer maps residuals
        back to parameters with it when buckets are rebuilt (bucket_bytes="tune")."""
        raise NotImplementedError(f"strategy {self.name!r} does not list its state keys")

    def forget_layout(self) -> None:
        """The gradients were regrouped (bucket_bytes="tune"): per-gradient choices made on first
        sight (PS's aggregators) are dropped, so the new layout gets them as a fresh job would."""

    def layout_state(self) -> dict:
        """The choices made on first sight (PS's aggregators), for a checkpoint: they depend on
        the order gradients were first seen in (COVAP's profiling steps sync whole buckets
        before its units), which a resumed job does not replay, and a state saved on its
        aggregator belongs there. Empty where there are none."""
        return {}

    def load_layout_state(self, sd: dict) -> None:
        """Restores :meth:`layout_state` (of a job with the same layout)."""
