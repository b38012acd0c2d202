"""The built-in compressors, backed by the C++ kernels of csrc/compress/ (hipress._C).

Each class is a thin shell: it converts tensors into (pointer, size) pairs,
owns the output buffer when the caller gives none, and checks shapes; all
arithmetic runs in C++ with the GIL released.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from hipress import _C
from hipress.compression.base import (CompressorState, Compressor, check_payload, check_residual_in, flat_f32,
                                       is_f32_flat, out_buffer)

PayloadError = _C.PayloadError
_HEADER_BYTES = 48  # csrc/compress/format.h: kHeaderBytes, the payload header before its body
_KIND_BYTE = 7      # the header's payload kind (a low-rank payload's is its round + 1)


class NativeCompressor(Compressor):
    """A compressor from the C++ registry (``hipress._C.compress_names()``)."""

    # The parameter that sets the kept fraction of a sparsifier, or None. A sum of m ranks'
    # selections is re-encoded at m times the fraction, the density of their union (for_sum_of;
    # _density_for_sum_of gives the parameter's value). The subclass's constructor takes every
    # key of ``params`` by name.
    density_param: Optional[str] = None
    # Every payload of n elements is max_encoded_bytes(n) long (a quantizer of fixed width whose
    # format does not depend on the values or on state): encoded_bytes reports it.
    fixed_size: bool = False

    def __init__(self, algorithm: str, **params):
        self.params = {k: float(v) for k, v in params.items()}
        self._c = _C.compress_create(algorithm, self.params)
        self.name = algorithm
        self.category = self._c.category
        self.rate = self._c.rate
        self.aggregatable = self._c.aggregatable
        self.rounds = self._c.rounds

    def for_sum_of(self, contributions: int) -> Compressor:
        if self.density_param is None or contributions <= 1:
            return self
        made = self.__dict__.setdefault("_for_sum_of", {})  # one instance per count: sites keep their compressor
        if contributions not in made:
            made[contributions] = type(self)(**{**self.params, self.density_param: self._density_for_sum_of(contributions)})
        return made[contributions]

    def _density_for_sum_of(self, contributions: int) -> float:
        value = self.params[self.density_param] * contributions
        # "summands" (DGC, GradDrop) multiplies the density inside the spec, which caps it at all
        return value if self.density_param == "summands" else min(1.0, value)

    # Matrix view of a tensor (only low-rank compressors use it).
    def _matrix(self, numel: int, shape) -> Tuple[int, int]:
        return (0, 0)

    def max_encoded_bytes(self, numel: int, shape=None) -> int:
        m = self._matrix(numel, shape) if shape is not None else (0, 0)
        return self._c.max_encoded_bytes(int(numel), *m)

    def encoded_bytes(self, numel: int, shape=None) -> Optional[int]:
        return self.max_encoded_bytes(numel, shape) if self.fixed_size else None

    def new_state(self, numel: int, shape=None) -> CompressorState:
        m = self._matrix(numel, shape)
        bufs = dict(self._c.state_buffers(int(numel), *m))
        return CompressorState(self.name, numel, shape, bufs, m)

    def _state_arg(self, state: Optional[CompressorState], n: int):
        if state is None:
            return None
        if not isinstance(state, CompressorState):
            raise TypeError("state must be a CompressorState (from new_state)")
        if state.numel != n:
            raise ValueError(f"state was made for {state.numel} elements, the gradient has {n}")
        return state.native()

    def _encode_with(self, native, grad, state, out, residual_in: Optional[torch.Tensor] = None):
        g = flat_f32(grad)
        n = g.numel()
        st = self._state_arg(state, n)
        m = state.matrix if state is not None else (0, 0)
        buf = out_buffer(out, native.max_encoded_bytes(n, *m))
        nb = native.encode(g.data_ptr(), n, buf.data_ptr(), buf.numel(), st,
                           0 if residual_in is None else residual_in.data_ptr())
        return buf[:nb]

    def encode(self, grad, state=None, out=None):
        return self._encode_with(self._c, grad, state, out)

    def decode(self, payload, out):
        p = check_payload(payload)
        if is_f32_flat(out):
            self._c.decode(p.data_ptr(), p.numel(), out.data_ptr(), out.numel(), 1.0, False)
        else:
            tmp = torch.empty(out.numel(), dtype=torch.float32)
            self._c.decode(p.data_ptr(), p.numel(), tmp.data_ptr(), tmp.numel(), 1.0, False)
            out.copy_(tmp.view(out.shape))
        return out

    def decode_divided(self, payload, out, divisor: int):
        # A power of two folds into the decode's own scale (alpha, applied to each decoded float):
        # v * 2^-k and v / 2^k round the same real number once, so the bits are decode's then
        # div_'s, and the pass that divides afterwards is gone (10% of the engine's compute
        # thread on PS TernGrad, VGG19-like). Another divisor would round differently: it divides.
        if divisor > 0 and divisor & (divisor - 1) == 0 and is_f32_flat(out):
            p = check_payload(payload)
            self._c.decode(p.data_ptr(), p.numel(), out.data_ptr(), out.numel(), 1.0 / divisor, False)
            return out
        return super().decode_divided(payload, out, divisor)

    def decode_add(self, payload, acc, alpha: float = 1.0):
        p = check_payload(payload)
        if is_f32_flat(acc):
            self._c.decode(p.data_ptr(), p.numel(), acc.data_ptr(), acc.numel(), float(alpha), True)
        else:
            tmp = torch.empty(acc.numel(), dtype=torch.float32)
            self._c.decode(p.data_ptr(), p.numel(), tmp.data_ptr(), tmp.numel(), 1.0, False)
            acc.add_(tmp.view(acc.shape).to(acc.dtype), alpha=alpha)
        return acc

    def __repr__(self):
        args = ", ".join(f"{k}={v:g}" for k, v in self.params.items())
        return f"{type(self).__name__}({args})"


class OneBit(NativeCompressor):
    """1-bit SGD (Seide 2014): sign bits, decoded as +-scale with scale = ||x||_2 / sqrt(len) of
    each row x (1-bit Adam's norm-preserving scale, where Seide sends the means of the
    non-negative and negative parts; docs/convergence.md, cause 10, says why).

    rows: with a shape (``new_state(numel, shape)``, which the optimizer's allgather and PS
    partitions pass when a partition is whole rows of one tensor), a scale per row, a row being
    the elements after the first dimension (Seide's per-column values of a weight matrix; char
    LM perplexity 20.8 -> 15.1, docs/convergence.md, cause 12), for rows of at least MIN_ROW
    elements. Without a shape, for 1-D tensors, shorter rows, rows=False or a stateless encode
    (a ring's re-encode), one scale for the whole partition. The row length is the
    state's counter ``row`` (scalars[1]), so payloads describe themselves and any OneBit decodes them."""

    # Rows shorter than this share the tensor's one scale: a 4-byte scale costs 32 / row bits per
    # element (0.5 at 64), and digits' 3x3 kernels of one input channel (rows of 9) lost accuracy
    # (4 ranks, mean of seeds 42/1/2: 95.1 with them, 96.9 without; docs/convergence.md, cause 12).
    MIN_ROW = 64

    def __init__(self, rows: bool = True):
        super().__init__("onebit")
        self.rows = bool(rows)

    def row_length(self, numel: int, shape=None) -> int:
        """Elements per row for a tensor of this shape (0: the tensor is one row)."""
        if not self.rows or shape is None or len(shape) < 2 or not int(shape[0]):
            return 0
        row = int(numel) // int(shape[0])
        return row if row >= self.MIN_ROW else 0

    def new_state(self, numel: int, shape=None) -> CompressorState:
        st = super().new_state(numel, shape)
        st.scalars[1] = self.row_length(numel, shape)
        return st

    def encoded_bytes(self, numel: int, shape=None) -> Optional[int]:
        # the header, a sign bit per element, then a 4-byte scale per row (a state's row, as
        # new_state sets it; the whole tensor is one row without one, and an empty one none)
        n, row = int(numel), self.row_length(numel, shape)
        return _HEADER_BYTES + (n + 7) // 8 + 4 * (n // row if row else min(n, 1))

    def __repr__(self):
        return f"OneBit(rows={self.rows})"


class TBQ(NativeCompressor):
    """Threshold binary quantisation (Strom 2015) with a scale: {0, +scale, -scale} in 2 bits,
    for the elements below / above tau in magnitude; scale is the root mean square of those sent.
    tau is ``threshold`` if set (> 0, Strom's fixed threshold), else ``relative`` times the
    tensor's mean magnitude. (Strom sends +-tau; docs/convergence.md, causes 7 and 9, say why not.)"""

    fixed_size = True

    def __init__(self, threshold: float = 0.0, relative: float = 1.5):
        super().__init__("tbq", threshold=threshold, relative=relative)


class TernGrad(NativeCompressor):
    """TernGrad as in HiPress Fig. 5: min/max scaling, stochastic rounding to 2/4/8 bits."""

    fixed_size = True

    def __init__(self, bitwidth: int = 2, seed: int = 0):
        super().__init__("terngrad", bitwidth=bitwidth, seed=seed)


class DGC(NativeCompressor):
    """Deep gradient compression (Lin 2018): local accumulation, sampled-threshold exact
    top-k, the paper's warm-up of the density (25%, 6.25%, 1.56%, 0.39%, then ``ratio``) over
    ``warmup_steps`` steps (0: none), each stage lasting six times its mean delay 1 / density
    by default (24, 96, 384 and 1536 steps, as GradDrop's: docs/convergence.md, causes 9 and 14); with ``momentum`` > 0,
    the paper's momentum correction inside the compressor with momentum factor masking (the
    optimizer's momentum correction then applies no velocity of its own,
    ``momentum_in_compressor``). The default, momentum 0, leaves momentum correction to
    ``hipress.DistributedOptimizer`` (momentum_correction="auto"), which applies it to every
    algorithm; the accumulation is then error feedback."""

    # the spec multiplies every step's density by "summands" (its warm-up stages are no parameter)
    density_param = "summands"

    def __init__(self, ratio: float = 0.001, momentum: float = 0.0, sample_ratio: float = 0.01,
                 warmup_steps: int = 2040, seed: int = 0, summands: int = 1):
        super().__init__("dgc", ratio=ratio, momentum=momentum, sample_ratio=sample_ratio,
                         warmup_steps=warmup_steps, seed=seed, summands=summands)
        self._args = dict(ratio=ratio, sample_ratio=sample_ratio, warmup_steps=warmup_steps, seed=seed,
                          summands=summands)
        self.momentum = float(momentum)
        # with its own momentum, the optimizer must not apply a velocity too (a velocity of a velocity)
        self.momentum_in_compressor = self.momentum > 0

    def _merged_compressor(self) -> Compressor:
        # Momentum belongs to the local gradient only: a merged sum already carries it, so
        # partial sums are re-selected with accumulation (error feedback) but no momentum.
        return self if self.momentum == 0 else DGC(momentum=0.0, **self._args)


class GradDrop(NativeCompressor):
    """Gradient dropping (Aji & Heafield 2017): keep |g| above a sampled threshold (``ratio``
    kept, at most twice that), with the schedule of DGC's warm-up of the density (25%, 6.25%,
    1.56%, ..., never below ``ratio``) over ``warmup_steps`` steps, each stage lasting six times
    its mean delay 1 / density by default (24, 96 and 384 steps). The paper has no warm-up
    (``warmup_steps=0``); hipress turns it on by default because with a 1% density from the
    first step an element waits about 100 steps between sends, and short trainings end short
    of uncompressed accuracy (docs/convergence.md, cause 13). A call without a state encodes
    at ``ratio``."""

    # the spec multiplies every step's density by "summands", the warm-up's stages included (as DGC's)
    density_param = "summands"

    def __init__(self, ratio: float = 0.01, sample_ratio: float = 0.01, warmup_steps: int = 2040, seed: int = 0,
                 summands: int = 1):
        super().__init__("graddrop", ratio=ratio, sample_ratio=sample_ratio, warmup_steps=warmup_steps, seed=seed,
                         summands=summands)


class PowerSGD(NativeCompressor):
    """PowerSGD (Vogels 2019): rank-r power iteration, warm-started Q, error feedback,
    two aggregatable rounds (P then Q, summed across ranks). See base.py for the protocol.

    The matrix view of a tensor of shape (d0, d1, ...) is d0 x (d1 * ...); 1-D tensors
    are n x 1 (not compressible: the payload is as large as the input, so the low-rank sync
    sums them raw instead: hipress.sync.lowrank.sent_raw).

    Rank 8 by default: at rank 4 the char LM ends 22% above uncompressed perplexity and digits
    1.3 points short; rank 8 meets both accuracy targets (docs/convergence.md, cause 8)."""

    def __init__(self, rank: int = 8, seed: int = 0, error_feedback: bool = True):
        super().__init__("powersgd", rank=rank, seed=seed, error_feedback=1.0 if error_feedback else 0.0)

    def _matrix(self, numel, shape):
        numel = int(numel)
        if shape is None or len(shape) < 2 or numel == 0:
            return (numel, 1 if numel else 0)
        rows = int(shape[0])
        return (rows, numel // rows)

    def _state_for(self, grad, state):
        if state is None:  # a fresh state each call: random Q, no residual
            return self.new_state(grad.numel(), tuple(grad.shape))
        return state

    # the residual (M, then e) is the first state the encode updates, with its fused add
    takes_residual_in = True
    residual_buffer = "matrix"

    def encode(self, grad, state=None, out=None, residual_in=None):
        check_residual_in(residual_in, state, self.residual_buffer)
        return self._encode_with(self._c, grad, self._state_for(grad, state), out, residual_in)

    def encode_round(self, round, inp, state, out=None, residual_in=None):
        if state is None:
            raise ValueError("powersgd encode_round needs a state (new_state(numel, shape))")
        if residual_in is not None and round != 0:
            raise ValueError(f"{self.name}: residual_in is for round 0, got round {round}")
        check_residual_in(residual_in, state, self.residual_buffer)
        n = state.numel
        rows, cols = state.matrix
        r = min(int(self.params["rank"]), rows, cols)
        need = _HEADER_BYTES + 4 * r * (rows if round == 0 else cols)
        buf = out_buffer(out, need)
        if round == 0:
            g = flat_f32(inp)
            if g.numel() != n:
                raise ValueError(f"state was made for {n} elements, the gradient has {g.numel()}")
            nb = self._c.encode_round(0, g.data_ptr(), n, 0, 0, buf.data_ptr(), buf.numel(), state.native(),
                                      0 if residual_in is None else residual_in.data_ptr())
        else:
            p = check_payload(inp)
            nb = self._c.encode_round(int(round), 0, n, p.data_ptr(), p.numel(), buf.data_ptr(), buf.numel(),
                                      state.native())
        return buf[:nb]

    def combine(self, a, b, out=None):
        a, b = check_payload(a), check_payload(b)
        buf = out_buffer(out, a.numel())
        nb = self._c.combine(a.data_ptr(), a.numel(), b.data_ptr(), b.numel(), buf.data_ptr(), buf.numel())
        return buf[:nb]

    def finish(self, payload, state, out, add=False):
        p = check_payload(payload)
        target = out if is_f32_flat(out) else torch.zeros(out.numel(), dtype=torch.float32)
        if not is_f32_flat(out) and add:
            target.copy_(out.reshape(-1))
        self._c.finish(p.data_ptr(), p.numel(), target.data_ptr(), target.numel(), state.native(), bool(add))
        if target is not out:
            out.copy_(target.view(out.shape))
        return out

    def scale_sum(self, payload, factor):
        """The Q sum's floats (after the payload's header), in place: finish's product is linear in them."""
        p = check_payload(payload)
        if p.numel() < _HEADER_BYTES or int(p[_KIND_BYTE]) != self.rounds or (p.numel() - _HEADER_BYTES) % 4:
            raise ValueError(f"{self.name}: scale_sum takes the sum of the last round ({self.rounds}), a payload of "
                             f"kind {int(p[_KIND_BYTE]) if p.numel() > _KIND_BYTE else '?'} and {p.numel()} bytes")
        p[_HEADER_BYTES:].view(torch.float32).mul_(factor)
        return True


# ------------------------------------------------------------------ GRACE's quantizers (docs/grace.md)


class SignSGD(NativeCompressor):
    """signSGD (Bernstein 2018; GRACE ``signsgd``): one sign bit per element, decoded +-scale
    (scale 1: the paper's, the learning rate is the step). hipress averages the decoded signs
    (GRACE: majority vote). No memory."""

    fixed_size = True

    def __init__(self, scale: float = 1.0):
        super().__init__("signsgd", scale=scale)


class Signum(NativeCompressor):
    """SIGNUM (Bernstein 2018; GRACE ``signum``): the sign of the momentum
    m = momentum * m + (1 - momentum) * g kept in the compressor state. The momentum is the
    optimizer's: with hipress's momentum correction (a momentum SGD, "auto"), hipress applies
    weight decay locally and steps the SGD without momentum, but applies no velocity of its
    own (``momentum_in_compressor``; hipress/torch/momentum.py)."""

    fixed_size = True

    momentum_in_compressor = True

    def __init__(self, momentum: float = 0.9, scale: float = 1.0):
        super().__init__("signum", momentum=momentum, scale=scale)
        self._args = dict(scale=scale)
        self.momentum = float(momentum)

    def _merged_compressor(self) -> Compressor:
        # a merged sum is re-encoded as the sign of the sum (no momentum), with error feedback
        from hipress.compression.error_feedback import ErrorFeedback
        return ErrorFeedback(Signum(momentum=0.0, **self._args))


class EFSignSGD(NativeCompressor):
    """EF-SignSGD (Karimireddy 2019; GRACE ``efsignsgd``): (||x||_1 / d) * sign(x) with error
    feedback (on by default)."""

    fixed_size = True

    def __init__(self):
        super().__init__("efsignsgd")


class QSGD(NativeCompressor):
    """QSGD (Alistarh 2017; GRACE ``qsgd``): |x| / ||x||_2 stochastically rounded to one of
    ``quantum_num`` levels (default 64, GRACE's QSGD(64); at most 127), sign + level in 8 bits."""

    fixed_size = True

    def __init__(self, quantum_num: int = 64, seed: int = 0):
        super().__init__("qsgd", quantum_num=quantum_num, seed=seed)

    def _merged_compressor(self) -> Compressor:
        # A merged sum is re-encoded without error feedback: QSGD's variance bound is
        # min(d / s^2, sqrt(d) / s) ||x||^2, above ||x||^2 for tensors of more than s^2 elements, so
        # x - Q(x) is no contraction and a residual of it grows without bound (digits, 2 ranks, PS:
        # 9.1% with error feedback at the aggregator). Unbiased, the plain re-encode only adds noise.
        return self


class Natural(NativeCompressor):
    """Natural compression (Horvath 2019; GRACE ``natural``): stochastic rounding to a power of
    two, sign + exponent in 8 bits (GRACE's form). Error feedback on by default."""

    fixed_size = True

    def __init__(self, seed: int = 0):
        super().__init__("natural", seed=seed)


class TernGradGrace(NativeCompressor):
    """TernGrad as GRACE implements it (``terngrad_grace``): clip to ``clip`` * std (2.5),
    s = max |clipped|, s * sign(x) sent with probability |x| / s (2-bit codes). hipress's
    ``terngrad`` is HiPress's min/max form."""

    fixed_size = True

    algorithm = "terngrad_grace"  # the registered name (payload_info)

    def __init__(self, clip: float = 2.5, seed: int = 0):
        super().__init__("terngrad_grace", clip=clip, seed=seed)


class U8bit(NativeCompressor):
    """8-bit quantization (Dettmers 2016) as GRACE implements it (``u8bit``): scale = max |x|,
    |x| / scale rounded down to Dettmers' 128-entry table, sign + bin in 8 bits. Error
    feedback on by default."""

    fixed_size = True

    def __init__(self):
        super().__init__("u8bit")


class FP16(NativeCompressor):
    """The fp16 cast (GRACE's FP16Compressor): 2 bytes per element, round to nearest even."""

    fixed_size = True

    def __init__(self):
        super().__init__("fp16")

    @property
    def reencode_safe(self) -> bool:
        # a re-encode of a merged sum rounds it to fp16 again (relative error 2^-11, carried by
        # the merged compressor's error feedback): the ring keeps its accuracy (docs/grace.md)
        return True


class BF16(NativeCompressor):
    """The bfloat16 cast: 2 bytes per element, round to nearest even (torch's)."""

    fixed_size = True

    def __init__(self):
        super().__init__("bf16")

    @property
    def reencode_safe(self) -> bool:
        return True  # as FP16 (relative error 2^-8 per re-encode, carried by error feedback)


# ---- GRACE's sparsifiers and hybrids (GRACE, Xu et al. ICDCS 2021; docs/grace.md)


class RandomK(NativeCompressor):
    """Random-k (GRACE's ``randomk``): k = max(1, floor(ratio n)) distinct random positions,
    the same on every rank for a tensor in a step (``shared_rng``: GRACE seeds its draw with the
    tensor's name and the step), sent as index + value; residual memory (ErrorFeedback) by
    default. Shared positions train better than a stream per rank (digits, reference simulator,
    ratio 0.5, seeds 42/1/2: 2 ranks 97.6/98.3/98.3 against 95.6/98.7/98.3, 4 ranks
    87.9/85.5/87.9 against 77.8/89.6/70.4; docs/grace.md)."""

    density_param = "ratio"
    shared_rng = True

    def __init__(self, ratio: float = 0.01, seed: int = 0):
        super().__init__("randomk", ratio=ratio, seed=seed)


class TopK(NativeCompressor):
    """Top-k (GRACE's ``topk``): the max(1, floor(ratio n)) largest |g|, index + value; residual
    memory (ErrorFeedback) by default. sample_ratio only speeds the exact selection up."""

    density_param = "ratio"

    def __init__(self, ratio: float = 0.01, sample_ratio: float = 0.01, seed: int = 0):
        super().__init__("topk", ratio=ratio, sample_ratio=sample_ratio, seed=seed)


class Threshold(NativeCompressor):
    """Threshold-v (GRACE's ``threshold``): every element with |g| >= threshold (GRACE's 0.01),
    index + value; residual memory (ErrorFeedback) by default."""

    def __init__(self, threshold: float = 0.01):
        super().__init__("threshold", threshold=threshold)


class Adaq(NativeCompressor):
    """Adaptive threshold SGD as GRACE implements it (``adaq``, Dryden et al. 2016): per sign,
    about ratio of the elements above an adjusted threshold, sent as index + sign bit and
    decoded to the mean of that sign's selected values; residual memory by default."""

    density_param = "ratio"

    def __init__(self, ratio: float = 0.01, seed: int = 0):
        super().__init__("adaq", ratio=ratio, seed=seed)


class DGCGrace(NativeCompressor):
    """GRACE's DGC (``dgc_grace``): a sampled threshold adjusted at most 10 times until 0.7..1.3
    ratio n elements reach it, all of them sent; DGC memory (accumulation, and with momentum > 0
    GRACE's momentum correction with momentum factor masking: then use an optimizer without
    momentum). hipress's ``dgc`` selects exactly the top k instead."""

    density_param = "ratio"

    def __init__(self, ratio: float = 0.01, momentum: float = 0.0, seed: int = 0):
        super().__init__("dgc_grace", ratio=ratio, momentum=momentum, seed=seed)
        self._args = dict(ratio=ratio, seed=seed)
        self.momentum = float(momentum)

    def _merged_compressor(self) -> Compressor:
        # as DGC: a merged sum already carries momentum, so it is re-selected with accumulation only
        return self if self.momentum == 0 else DGCGrace(momentum=0.0, **self._args)


class Sketch(NativeCompressor):
    """SketchML as GRACE implements it (``sketch``, hand-written C++, csrc/compress/algo_sketch.cc):
    ``quantiles`` buckets between quantile edges (of ``sample`` random elements when there are
    more; 0: all), one byte per element, decoded to the bucket's mean; residual memory by default."""

    fixed_size = True

    def __init__(self, quantiles: int = 64, sample: int = 16384, seed: int = 0):
        super().__init__("sketch", quantiles=quantiles, sample=sample, seed=seed)


class PowerSGDGrace(PowerSGD):
    """PowerSGD as GRACE implements it (``powersgd_grace``): rank 1 by default and a fresh random
    Q every step, orthonormalised (no warm start); error feedback. hipress's ``powersgd``
    warm-starts Q (the PowerSGD paper's form) and defaults to rank 8."""

    def __init__(self, rank: int = 1, seed: int = 0):
        NativeCompressor.__init__(self, "powersgd_grace", rank=rank, seed=seed)


class Inceptionn(NativeCompressor):
    """INCEPTIONN (Li et al. 2018) as GRACE implements it (``inceptionn``, hand-written C++,
    csrc/compress/algo_inceptionn.cc): each element in 32, 16, 8 or 0 bits by the range of its
    exponent, plus a 2-bit tag. ``error_bound`` (GRACE's 2e-10) sets the smallest exponent kept,
    127 + trunc(log10(error_bound / 2)): 2^-10 for the default; smaller magnitudes are sent as 0.
    No memory (GRACE Table I)."""

    def __init__(self, error_bound: float = 2e-10):
        super().__init__("inceptionn", error_bound=error_bound)


BUILTIN_IDS = {1: OneBit, 2: TBQ, 3: TernGrad, 4: DGC, 5: GradDrop, 6: PowerSGD,
               7: SignSGD, 8: Signum, 9: EFSignSGD, 10: QSGD, 11: Natural, 12: TernGradGrace, 13: U8bit,
               14: FP16, 15: BF16,
               20: RandomK, 21: TopK, 22: Threshold, 23: Adaq, 24: DGCGrace, 25: Sketch, 26: PowerSGDGrace,
               27: Inceptionn}
