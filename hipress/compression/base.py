"""The Compressor contract every CompLL algorithm implements (native or user-written).

Single-round compressors (quantization, sparsification)::

    c = hipress.compression.get("tbq", threshold=0.01)
    st = c.new_state(grad.numel(), grad.shape)      # per tensor: residual, RNG counter, ...
    buf = torch.empty(c.max_encoded_bytes(grad.numel()), dtype=torch.uint8)
    payload = c.encode(grad, st, out=buf)           # uint8 view of buf, self-describing header first
    c.decode(payload, out)                          # out (fp32, numel elements) = decoded
    c.decode_add(payload, acc)                      # acc += decoded   (fused decode + merge)

Contract
--------
* ``encode(grad, state=None, out=None) -> torch.Tensor``: ``grad`` is any CPU
  tensor (fp32 is read in place; fp16/bf16 are converted to fp32 first); the
  result is a 1-D uint8 payload, a view of ``out`` when given (``out`` needs
  ``max_encoded_bytes(numel)`` bytes). ``state`` carries everything an
  algorithm keeps between steps for this tensor (error-feedback residual, DGC
  momentum/accumulation, RNG counter, PowerSGD Q) and is updated in place.
  With ``state=None`` encode is a pure function of ``grad``: no residual, no
  momentum, RNG counter 0.
* ``decode(payload, out) -> out``: writes the decoded fp32 values into ``out``
  (``out.numel()`` must equal the payload's element count).
* ``decode_add(payload, acc, alpha=1.0) -> acc``: ``acc += alpha * decode(payload)``,
  fused (never materialises the decoded tensor for native compressors).
* A payload that is truncated, corrupt (header) or from another algorithm
  raises ``ValueError`` (``hipress._C.PayloadError``); decoding never reads out
  of bounds.
* Metadata: ``name``, ``category`` ("quantization" | "sparsification" |
  "lowrank"), ``rate`` (nominal compressed/original bytes), ``aggregatable``
  (payloads may be summed in compressed form), ``rounds`` (communication rounds
  per synchronisation).
* State objects are ``CompressorState``: ``state_dict()`` / ``load_state_dict()``
  give a bit-identical resume after a checkpoint.

Sparsification inside a ring (every step must send the same size): decode the
received payload into the dense partition with ``decode_add`` (merge), then call
``encode(merged_partition)`` **without a state**: it re-selects the top-k of the
merged dense buffer (DGC: exactly k = ceil(ratio * n) pairs, so every ring step
sends the same number of bytes; GradDrop: at most 2k). Residual bookkeeping
happens only in the first, stateful encode of the local gradient.

Low-rank, aggregatable compressors (``lowrank``; PowerSGD: ``rounds == 2``)::

    st = c.new_state(numel, shape=(rows, cols))
    p = c.encode_round(0, grad, st)            # P = M Q; M = grad + residual
    p_sum = allreduce_sum(p)                   # c.combine(a, b) adds two payloads
    q = c.encode_round(1, p_sum, st)           # orthogonalise, Q = M^T P^, residual
    q_sum = allreduce_sum(q)
    c.finish(q_sum, st, out)                   # out = P^ q_sum^T (a SUM over ranks: divide to average)

* ``encode_round(round, inp, state, out=None)``: round 0 takes the gradient,
  round r >= 1 takes the sum over ranks of round r-1's payloads. State is required.
* ``combine(a, b, out=None)``: elementwise sum of two payloads of the same round
  (the "merge" of aggregatable compressors); ``out`` may be ``a``.
* ``finish(payload, state, out, add=False)``: decodes the summed last-round payload.
* ``encode``/``decode`` still work in a single process (both rounds run locally and
  the payload carries P^ and Q), so every compressor can be used and tested alone.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Dict, Optional, Sequence, Tuple

import torch

CATEGORIES = ("quantization", "sparsification", "lowrank")
_NUM_SCALARS = 4  # rng counter, step, flags, reserved (csrc/compress/compressor.h StateScalar)


def flat_f32(t: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D fp32 CPU view of t (a copy only when t is not already that)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"CompLL kernels run on CPU tensors here, got a tensor on {t.device}")
    t = t.detach()
    if t.dtype != torch.float32:
        if not t.is_floating_point():
            raise TypeError(f"gradients must be floating point, got {t.dtype}")
        t = t.to(torch.float32)
    return t.contiguous().view(-1)


def is_f32_flat(t: torch.Tensor) -> bool:
    """Whether t is already what :func:`flat_f32` makes of it (a kernel may write into it). The
    cheapest tensor attributes (``t.device`` builds an object per call): this runs once per
    gradient per step in the optimizer's hook."""
    return t.dtype is torch.float32 and t.is_cpu and t.is_contiguous()


def zeroed_f32(out: torch.Tensor) -> torch.Tensor:
    """A zeroed flat fp32 buffer to sum into for ``out``: ``out`` itself where it is flat fp32 (a
    strategy's bucket), else a new one. A fresh block of 32 MiB or more is mapped anew by glibc on
    every allocation, and its pages fault in again each step: for a 32 MB gradient that took twice
    as long as the four decodes summed in it."""
    return out.view(-1).zero_() if is_f32_flat(out) else torch.zeros(out.numel(), dtype=torch.float32)


def check_payload(p: torch.Tensor) -> torch.Tensor:
    if not isinstance(p, torch.Tensor) or p.dtype != torch.uint8:
        raise TypeError("a payload is a uint8 torch.Tensor")
    if p.device.type != "cpu":
        raise ValueError("payload must be on the CPU")
    return p.contiguous().view(-1)


def check_residual_in(residual_in: Optional[torch.Tensor], state, buffer: str) -> Optional[torch.Tensor]:
    """``residual_in`` (see Compressor.takes_residual_in), checked against the state's buffer named
    ``buffer`` that receives the new residual: None passes through."""
    if residual_in is None:
        return None
    if state is None:
        raise ValueError("residual_in needs a state to write the residual into")
    want = state.buffers[buffer].numel()
    if residual_in.dtype != torch.float32 or residual_in.numel() != want or not residual_in.is_contiguous():
        raise ValueError(f"residual_in must be {want} contiguous fp32 elements, like the state's {buffer}")
    return residual_in


def out_buffer(out: Optional[torch.Tensor], need: int) -> torch.Tensor:
    if out is None:
        return torch.empty(need, dtype=torch.uint8)
    if out.dtype != torch.uint8 or out.device.type != "cpu" or not out.is_contiguous():
        raise TypeError("out must be a contiguous uint8 CPU tensor")
    out = out.view(-1)
    if out.numel() < need:
        raise ValueError(f"out has {out.numel()} bytes, needs max_encoded_bytes = {need}")
    return out


class CompressorState:
    """Per-tensor state of a compressor: named fp32 buffers plus a few int64 scalars
    (RNG counter, step, flags). The kernels update buffers in place, and ``load_state_dict``
    copies into them; only the undo log's out-of-place encode (StateStore.encode) swaps in other
    tensors, so read them from ``buffers`` when used, not once for good.
    """

    __slots__ = ("algorithm", "numel", "shape", "matrix", "buffers", "scalars", "key", "__weakref__")

    def __init__(self, algorithm: str, numel: int, shape: Optional[Sequence[int]] = None,
                 buffers: Optional[Dict[str, int]] = None, matrix: Tuple[int, int] = (0, 0)):
        self.algorithm = algorithm
        self.numel = int(numel)
        self.shape = tuple(int(s) for s in shape) if shape is not None else (self.numel,)
        if math.prod(self.shape) != self.numel:
            raise ValueError(f"shape {self.shape} does not hold {self.numel} elements")
        self.matrix = tuple(int(x) for x in matrix)
        self.buffers: "OrderedDict[str, torch.Tensor]" = OrderedDict(
            (name, torch.zeros(int(n), dtype=torch.float32)) for name, n in (buffers or {}).items())
        self.scalars = torch.zeros(_NUM_SCALARS, dtype=torch.int64)
        # The StateStore key of the state (hipress/sync/base.py; None outside a store): a ported
        # GRACE compressor's memory keys its residual by it
        self.key: Optional[str] = None

    def add_buffer(self, name: str, n: int) -> torch.Tensor:
        if name in self.buffers:
            raise ValueError(f"state buffer {name!r} exists already")
        self.buffers[name] = torch.zeros(int(n), dtype=torch.float32)
        return self.buffers[name]

    @property
    def rng_counter(self) -> int:
        return int(self.scalars[0])

    @property
    def step(self) -> int:
        return int(self.scalars[1])

    def native(self):
        """(buffers [(ptr, len)], scalars ptr, rows, cols) for hipress._C."""
        return ([(b.data_ptr(), b.numel()) for b in self.buffers.values()], self.scalars.data_ptr(),
                self.matrix[0], self.matrix[1])

    def state_dict(self) -> dict:
        return {"algorithm": self.algorithm, "numel": self.numel, "shape": self.shape, "matrix": self.matrix,
                "buffers": {k: v.clone() for k, v in self.buffers.items()}, "scalars": self.scalars.clone()}

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("algorithm") != self.algorithm or int(sd.get("numel", -1)) != self.numel:
            raise ValueError(f"state for {sd.get('algorithm')!r} with {sd.get('numel')} elements cannot be loaded "
                             f"into a {self.algorithm!r} state of {self.numel} elements (was the checkpoint saved by "
                             f"a job of another layout: another number of ranks, other buckets?)")
        if tuple(sd.get("matrix", self.matrix)) != self.matrix:
            raise ValueError(f"state matrix shape {sd.get('matrix')} differs from {self.matrix}")
        bufs = sd["buffers"]
        if list(bufs) != list(self.buffers):
            raise ValueError(f"state buffers {list(bufs)} differ from {list(self.buffers)}")
        for k, v in bufs.items():
            if v.numel() != self.buffers[k].numel():
                raise ValueError(f"state buffer {k!r} has {v.numel()} elements, expected {self.buffers[k].numel()}")
            self.buffers[k].copy_(v.reshape(-1))
        self.scalars.copy_(sd["scalars"])

    def __repr__(self):
        b = ", ".join(f"{k}[{v.numel()}]" for k, v in self.buffers.items())
        return f"CompressorState({self.algorithm}, numel={self.numel}, buffers=({b}), scalars={self.scalars.tolist()})"


class Compressor:
    """Base class of every compressor; see the module docstring for the full contract.

    Subclasses implement ``max_encoded_bytes``, ``encode`` and ``decode``; the
    defaults of ``decode_add`` (decode into a temporary, add) and ``new_state``
    (no buffers) work for any of them.
    """

    name: str = "compressor"
    category: str = "quantization"
    rate: float = 1.0
    aggregatable: bool = False
    # Every rank draws the same random numbers for a tensor in a step (its RNG counter starts
    # at the same place on every rank, hipress/sync/base.py StateStore), as aggregatable
    # compressors must. Otherwise each rank has its own stream.
    shared_rng: bool = False
    rounds: int = 1
    # The one strategy this compressor syncs with (None: any). A ported GRACE compressor
    # (hipress/compression/grace_api.py) has "allgather": its communicator's reduction runs
    # in aggregate_payloads, which only the allgather strategy calls.
    fixed_strategy: Optional[str] = None
    # encode(..., residual_in=t) (a low-rank one: encode_round(0, ..., residual_in=t)) reads the
    # residual before this encode from t and writes the new one into the state's buffer named
    # residual_buffer (error feedback's residual, PowerSGD's matrix): a caller that must keep the
    # old residual (the undo log, StateStore.encode) then does not copy it first.
    takes_residual_in: bool = False
    residual_buffer: str = "residual"

    @property
    def lowrank(self) -> bool:
        """Synchronized as whole matrices in rounds of summed factors (hipress/sync/lowrank.py):
        PowerSGD's two rounds per step, ACP-SGD's one. Its payloads are combined, never decoded
        and re-encoded, so it takes no strategy, no error-feedback wrapper and no momentum
        correction (it keeps momentum after aggregation, as PowerSGD's paper)."""
        return self.category == "lowrank"

    @property
    def reencode_safe(self) -> bool:
        """Whether re-encoding merged partial sums (ring hops, PS aggregators) keeps this
        algorithm's accuracy; ``strategy="auto"`` avoids strategies that re-encode when not.
        No unless an algorithm says so: every built-in lossy algorithm lost accuracy to it
        (4 ranks, ring / allgather: digits onebit 87.9 / 92.6, TBQ 67.0 / 82.2, DGC 66.3 /
        76.1, GradDrop 84.8 / 92.6; TernGrad char LM perplexity 16.4 / 14.8, transformer task
        96.0 / 99.9; docs/convergence.md)."""
        return False

    @property
    def merged(self) -> "Compressor":
        """The compressor a strategy re-encodes merged partial sums with (ring hops after the
        first, PS aggregators), each site with its own state. Its payloads decode like this
        compressor's. Default: this compressor with error feedback, so what a re-encode drops
        is carried to the site's next sync instead of lost (TernGrad through a PS aggregator:
        11.8% -> 94.6% on digits, docs/convergence.md). Compressors whose state is already a
        residual (error feedback, DGC's accumulation) return themselves; a residual is linear,
        so compensating partial sums loses nothing."""
        m = self.__dict__.get("_merged")
        if m is None:
            m = self.__dict__["_merged"] = self._merged_compressor()
        return m

    def _merged_compressor(self) -> "Compressor":
        from hipress.compression.error_feedback import ErrorFeedback  # it subclasses Compressor

        return self if self.lowrank else ErrorFeedback(self)

    def merged_for(self, contributions: int) -> "Compressor":
        """The compressor that re-encodes, at one site, a merged sum of ``contributions`` ranks'
        gradients (a ring chunk after s hops holds s + 1; a PS aggregator's sum and the ring's
        reduced chunk hold N): :meth:`for_sum_of` in its merged form."""
        return self.for_sum_of(contributions).merged

    def for_sum_of(self, contributions: int) -> "Compressor":
        """This compressor as it should encode a sum of ``contributions`` ranks' gradients.
        Itself, except for sparsifiers whose kept fraction is a parameter (NativeCompressor's
        ``density_param``): re-selecting one rank's k from a sum of m ranks' selections cuts
        their union back by up to m, and what waits in residuals arrives steps late (4 ranks,
        ring, digits: DGC 86.5%, GradDrop 84.8% against 95.6% uncompressed; docs/convergence.md,
        cause 11)."""
        return self

    def max_encoded_bytes(self, numel: int, shape=None) -> int:
        raise NotImplementedError

    def encoded_bytes(self, numel: int, shape=None) -> Optional[int]:
        """The size of every payload :meth:`encode` returns for ``numel`` elements (with a state
        made by ``new_state(numel, shape)``, or none), where it depends on nothing else: not on the
        values (a sparsifier's), nor on a state that changes from step to step. A receiver that
        knows it needs no size message first (hipress.sync.base.known_sizes, known_frames).
        None: not known in advance (the default)."""
        return None

    def encode(self, grad: torch.Tensor, state: Optional[CompressorState] = None,
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, payload: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def decode_divided(self, payload: torch.Tensor, out: torch.Tensor, divisor: int) -> torch.Tensor:
        """out = decode(payload) / divisor, element by element: the bits of decode followed by
        ``out.div_(divisor)`` (a strategy's average of a sum). A compressor may do both in one
        pass where that keeps those bits (NativeCompressor)."""
        self.decode(payload, out)
        return out.div_(divisor) if divisor != 1 else out

    def decode_add(self, payload: torch.Tensor, acc: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
        tmp = torch.empty(acc.numel(), dtype=torch.float32)
        self.decode(payload, tmp)
        acc.view(-1).add_(tmp.to(acc.dtype), alpha=alpha)
        return acc

    def new_state(self, numel: int, shape=None) -> CompressorState:
        return CompressorState(self.name, numel, shape)

    def aggregate_payloads(self, payloads: Sequence[torch.Tensor], out: torch.Tensor, average: bool) -> torch.Tensor:
        """out = the sum of every rank's decoded payload (rank order: every rank adds the same
        numbers in the same order), divided by their number if average: the allgather
        strategy's aggregation of one partition. A ported GRACE compressor overrides it with
        its communicator's reduction."""
        acc = zeroed_f32(out)
        for p in payloads:
            self.decode_add(p, acc)
        if acc.data_ptr() != out.data_ptr():
            out.copy_(acc.view(out.shape))
        if average:
            out.div_(len(payloads))
        return out

    # ---- low-rank (lowrank: rounds of summed factors) ----
    def encode_round(self, round: int, inp: torch.Tensor, state: CompressorState,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if round == 0 and not self.lowrank:
            return self.encode(inp, state, out)
        raise NotImplementedError(f"{self.name} is a single-round compressor")

    def combine(self, a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        raise ValueError(f"{self.name} payloads are not aggregatable: decode, add and re-encode instead")

    def finish(self, payload: torch.Tensor, state: CompressorState, out: torch.Tensor,
               add: bool = False) -> torch.Tensor:
        if not self.lowrank:
            return self.decode_add(payload, out) if add else self.decode(payload, out)
        raise NotImplementedError

    def scale_sum(self, payload: torch.Tensor, factor: float) -> bool:
        """Multiplies the last round's sum, ``payload``, in place by ``factor``, where ``finish``
        decodes it linearly (PowerSGD's Q: the gradient is P Q^T), so that the decoded gradient is
        ``factor`` times the sum's. Averaging there touches a few factors instead of the whole
        decoded matrix. False (nothing done) where the compressor cannot: the caller scales the
        decoded tensor instead."""
        return False

    def __repr__(self):
        return f"{type(self).__name__}(name={self.name!r}, category={self.category!r}, rate={self.rate:g})"
