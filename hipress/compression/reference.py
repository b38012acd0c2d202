"""Pure numpy reference of every CompLL algorithm: the test oracle.

Written from the papers and the format description in csrc/compress/format.h,
independently of the C++ code, and deliberately simple (no chunking, no
sampling shortcuts where the result does not depend on them). It produces the
same payload bytes as the native kernels for the deterministic parts
(headers, bit codes, selected indices and values, random streams); the only
floating-point differences allowed are in sums over many elements (onebit's
means, PowerSGD's matmuls), which the tests compare with a tolerance.

It is also the "pure reference" of the kernel benchmark.
"""
from __future__ import annotations

import math
import struct
from typing import Dict, Optional, Tuple

import numpy as np

MAGIC = 0x5A435048
VERSION = 1
HEADER_BYTES = 48
ALGO_IDS = {"onebit": 1, "tbq": 2, "terngrad": 3, "dgc": 4, "graddrop": 5, "powersgd": 6,
            # GRACE's quantizers (docs/grace.md)
            "signsgd": 7, "signum": 8, "efsignsgd": 9, "qsgd": 10, "natural": 11, "terngrad_grace": 12, "u8bit": 13,
            "fp16": 14, "bf16": 15,
# GRACE's sparsifiers and hybrids (docs/grace.md)
            "randomk": 20, "topk": 21, "threshold": 22, "adaq": 23, "dgc_grace": 24, "sketch": 25,
            "powersgd_grace": 26, "inceptionn": 27}
_HDR = struct.Struct("<IBBBBIIQQ4I")
_M64 = (1 << 64) - 1

# ---------------------------------------------------------------- random (rng.h)


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def rng_key(seed: int) -> Tuple[int, int]:
    s = splitmix64(int(seed) & _M64)
    return s & 0xFFFFFFFF, s >> 32


def _mix32(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def rng_u32(seed: int, counter: int, n: int) -> np.ndarray:
    """32-bit random words for counters counter .. counter + n - 1."""
    k0, k1 = rng_key(seed)
    c = np.uint64(counter) + np.arange(n, dtype=np.uint64)
    lo = (c & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    hi = (c >> np.uint64(32)).astype(np.uint32)
    with np.errstate(over="ignore"):
        return _mix32(_mix32(lo ^ np.uint32(k0)) ^ hi ^ np.uint32(k1))


def random_uniform(seed: int, counter: int, n: int) -> np.ndarray:
    return (rng_u32(seed, counter, n) >> np.uint32(8)).astype(np.float32) * np.float32(1.0 / 16777216.0)


def random_index(seed: int, counter: int, upper: int, n: int) -> np.ndarray:
    h = rng_u32(seed, counter, n).astype(np.uint64)
    return ((h * np.uint64(upper)) >> np.uint64(32)).astype(np.uint32)


# ---------------------------------------------------------------- format (format.h)


def fnv1a(data: bytes) -> int:
    h = 2166136261
    for b in data:
        h = ((h ^ b) * 16777619) & 0xFFFFFFFF
    return h


def f32_word(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", float(np.float32(v))))[0]


def word_f32(w: int) -> np.float32:
    return np.float32(struct.unpack("<f", struct.pack("<I", w))[0])


def make_header(algo: str, numel: int, body_bytes: int, bits: int = 0, kind: int = 0, count: int = 0,
                words=(0, 0, 0, 0)) -> bytes:
    w = [int(x) & 0xFFFFFFFF for x in words] + [0] * (4 - len(words))
    raw = _HDR.pack(MAGIC, ALGO_IDS[algo], VERSION, bits, kind, 0, count, numel, body_bytes, *w)
    return _HDR.pack(MAGIC, ALGO_IDS[algo], VERSION, bits, kind, fnv1a(raw), count, numel, body_bytes, *w)


def parse_header(payload: bytes) -> Dict[str, object]:
    if len(payload) < HEADER_BYTES:
        raise ValueError("payload truncated")
    magic, algo, ver, bits, kind, check, count, numel, body, *words = _HDR.unpack(bytes(payload[:HEADER_BYTES]))
    if magic != MAGIC or ver != VERSION:
        raise ValueError("not a hipress payload")
    raw = _HDR.pack(magic, algo, ver, bits, kind, 0, count, numel, body, *words)
    if fnv1a(raw) != check:
        raise ValueError("corrupt header")
    if body > len(payload) - HEADER_BYTES:
        raise ValueError("payload truncated")
    if body < len(payload) - HEADER_BYTES:
        raise ValueError("payload has trailing bytes")
    return dict(algo=algo, bits=bits, kind=kind, count=count, numel=numel, body_bytes=body, words=words)


# ---------------------------------------------------------------- bit packing


def pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """Element i at byte i*bits//8, bit (i*bits)%8, LSB first."""
    codes = np.asarray(codes, dtype=np.uint8)
    per = 8 // bits
    n = codes.size
    padded = np.zeros(((n + per - 1) // per) * per, dtype=np.uint8)
    padded[:n] = codes
    grid = padded.reshape(-1, per).astype(np.uint16)
    shifts = (np.arange(per, dtype=np.uint16) * bits)
    return (grid << shifts).sum(axis=1).astype(np.uint8)


def unpack_bits(packed: np.ndarray, n: int, bits: int) -> np.ndarray:
    per = 8 // bits
    packed = np.asarray(packed, dtype=np.uint8)
    shifts = np.arange(per, dtype=np.uint8) * bits
    codes = (packed[:, None] >> shifts) & np.uint8((1 << bits) - 1)
    return codes.reshape(-1)[:n].astype(np.uint8)


def _body(payload) -> np.ndarray:
    return np.frombuffer(bytes(payload), dtype=np.uint8)[HEADER_BYTES:]


# ---------------------------------------------------------------- onebit


def onebit_row_length(n: int, row: int) -> int:
    """The kernel's row length: ``row`` elements, or the whole tensor for row <= 0 or row >= n."""
    return n if row <= 0 or row >= n else row


def onebit_encode(g: np.ndarray, row: int = 0) -> bytes:
    """Sign bits, decoded as +-scale with scale = ||x||_2 / sqrt(len) of each row x of ``row``
    elements (the last one shorter; 0: the tensor is one row) (hipress/dsl/specs/onebit.cll).
    Payload: header (count = the row length), the packed sign bits, one float scale per row."""
    g = np.asarray(g, dtype=np.float32).reshape(-1)
    n = g.size
    length = onebit_row_length(n, int(row))
    scales = np.empty(-(-n // length) if n else 0, dtype=np.float32)
    sq = (g * g).astype(np.float64)  # the kernel: squares in float, each row's mean accumulated in double
    for r in range(scales.size):
        part = sq[r * length:(r + 1) * length]
        scales[r] = np.sqrt(np.float32(part.sum() / part.size), dtype=np.float32)
    bits = np.packbits(np.signbit(g).astype(np.uint8), bitorder="little")
    body = bits.tobytes() + scales.tobytes()
    return make_header("onebit", n, len(body), bits=1, count=length) + body


def onebit_decode(payload, n: int) -> np.ndarray:
    h = parse_header(payload)
    length = int(h["count"])
    body = _body(payload)
    nbits = -(-n // 8)
    scales = np.frombuffer(body[nbits:].tobytes(), dtype=np.float32)
    if n and (length < 1 or scales.size != -(-n // length)):
        raise ValueError("onebit payload: row length and scales do not match")
    signs = unpack_bits(body[:nbits], n, 1)
    per_elem = np.repeat(scales, length)[:n] if n else np.zeros(0, np.float32)
    return np.where(signs == 1, -per_elem, per_elem).astype(np.float32)


# ---------------------------------------------------------------- TBQ


def tbq_encode(g: np.ndarray, threshold: float = 0.0, relative: float = 1.5) -> bytes:
    """+-scale where |g| > tau, else 0; tau = threshold if set, else relative * mean |g|;
    scale = the root mean square of the elements sent (hipress/dsl/specs/tbq.cll)."""
    g = np.asarray(g, dtype=np.float32).reshape(-1)
    if threshold > 0:
        tau = np.float32(threshold)
    else:  # the kernel: the mean accumulated in double, rounded to float, times the float parameter in float
        tau = np.float32(relative) * np.float32(np.abs(g).astype(np.float64).mean() if g.size else 0.0)
    above = (g > tau) | (g < -tau)
    count = int(above.sum())
    # the kernel: the squares in float, their sum accumulated in double, rounded to float, divided in
    # float by the count as a float, sqrt in float
    sq = g[above] * g[above]
    scale = (np.sqrt(np.float32(sq.astype(np.float64).sum()) / np.float32(count), dtype=np.float32)
             if count else np.float32(0))
    codes = np.where(g > tau, 1, np.where(g < -tau, 2, 0)).astype(np.uint8)
    body = pack_bits(codes, 2)
    return make_header("tbq", g.size, body.size, bits=2, words=(f32_word(scale),)) + body.tobytes()


def tbq_decode(payload, n: int) -> np.ndarray:
    h = parse_header(payload)
    scale = word_f32(h["words"][0])
    table = np.array([0, scale, -scale, 0], dtype=np.float32)
    return table[unpack_bits(_body(payload), n, 2)]


# ---------------------------------------------------------------- TernGrad


def terngrad_encode(g: np.ndarray, bitwidth: int = 2, seed: int = 0, counter: int = 0) -> bytes:
    g = np.asarray(g, dtype=np.float32).reshape(-1)
    n = g.size
    mn = np.float32(g.min()) if n else np.float32(0)
    mx = np.float32(g.max()) if n else np.float32(0)
    levels = np.float32((1 << bitwidth) - 1)
    gap = np.float32((mx - mn) / levels)
    inv_gap = np.float32(np.float32(1) / gap) if gap > 0 else np.float32(0)
    u = random_uniform(seed, counter, n)
    r = (g - mn) * inv_gap
    r = r + u
    f = np.floor(r)
    f = np.where(f > 0, f, np.float32(0))
    f = np.where(f < levels, f, levels)
    body = pack_bits(f.astype(np.uint8), bitwidth)
    words = (f32_word(mn), f32_word(mx), f32_word(gap))
    return make_header("terngrad", n, body.size, bits=bitwidth, words=words) + body.tobytes()


def terngrad_decode(payload, n: int) -> np.ndarray:
    h = parse_header(payload)
    mn, gap = word_f32(h["words"][0]), word_f32(h["words"][2])
    codes = np.arange(1 << h["bits"], dtype=np.float32)
    table = (mn + codes * gap).astype(np.float32)
    return table[unpack_bits(_body(payload), n, h["bits"])]


# ---------------------------------------------------------------- sparsification


def count_for(density: float, n: int) -> int:
    if n == 0:
        return 0
    return int(min(n, max(1, math.ceil(density * n))))


def topk_abs_exact(v: np.ndarray, k: int) -> Tuple[np.ndarray, np.ndarray]:
    """Exact top-k by |v|; ties at the k-th magnitude go to the lowest indices; ascending indices."""
    v = np.asarray(v, dtype=np.float32).reshape(-1)
    n = v.size
    k = min(k, n)
    if k == 0:
        return np.zeros(0, np.uint32), np.zeros(0, np.float32)
    a = np.abs(v)
    t = np.partition(a, n - k)[n - k]
    gt = a > t
    eq = np.flatnonzero(a == t)[: k - int(gt.sum())]
    sel = gt.copy()
    sel[eq] = True
    idx = np.flatnonzero(sel).astype(np.uint32)
    return idx, v[idx]


def sparse_payload(algo: str, n: int, idx: np.ndarray, val: np.ndarray, p0: float = 0.0) -> bytes:
    k = idx.size
    return (make_header(algo, n, 8 * k, count=k, words=(f32_word(p0), 0)) + idx.astype("<u4").tobytes()
            + val.astype("<f4").tobytes())


def sparse_decode(payload, n: int) -> np.ndarray:
    h = parse_header(payload)
    k = h["count"]
    body = _body(payload)
    idx = body[: 4 * k].view("<u4")
    val = body[4 * k: 8 * k].view("<f4")
    out = np.zeros(n, np.float32)
    out[idx] = val
    return out


def sparse_indices(payload) -> Tuple[np.ndarray, np.ndarray]:
    h = parse_header(payload)
    k = h["count"]
    body = _body(payload)
    return body[: 4 * k].view("<u4").copy(), body[4 * k: 8 * k].view("<f4").copy()


def graddrop_sample_size(n: int, sample_ratio: float) -> int:
    return 0 if n == 0 else max(1024, math.ceil(sample_ratio * n))


def graddrop_encode(g: np.ndarray, ratio: float = 0.01, sample_ratio: float = 0.01, seed: int = 0,
                    counter: int = 0, density: Optional[float] = None) -> bytes:
    """GradDrop at ``density`` (default: ``ratio``, the stateless form; a stateful encode passes
    :func:`warmup_density` at its step)."""
    g = np.asarray(g, dtype=np.float32).reshape(-1)
    d = ratio if density is None else density
    n = g.size
    s = graddrop_sample_size(n, sample_ratio)
    kmax = min(n, 2 * count_for(d, n))
    if n == 0:
        return sparse_payload("graddrop", 0, np.zeros(0, np.uint32), np.zeros(0, np.float32), 0.0)
    a = np.abs(g)
    sm = a[random_index(seed, counter, n, s)]
    r = max(1, min(s, math.ceil(d * s)))
    thr = np.sort(sm)[::-1][r - 1]
    sel = (a >= thr) & (a > 0)
    idx = np.flatnonzero(sel).astype(np.uint32)
    if idx.size > kmax:
        idx, _ = topk_abs_exact(g, kmax)
    return sparse_payload("graddrop", n, idx, g[idx], float(thr))


class GradDropReference:
    """GradDrop with its own state: the RNG counter and the step of the density warm-up."""

    def __init__(self, n: int, ratio=0.01, sample_ratio=0.01, warmup_steps=2040, seed=0, counter=0, summands=1):
        self.n, self.ratio, self.sample_ratio = n, ratio, sample_ratio
        self.warmup, self.seed, self.counter, self.step = warmup_steps, seed, counter, 0
        self.summands = summands  # ranks summed in the input: the density is that many times larger

    def encode(self, g: np.ndarray) -> bytes:
        d = min(1.0, warmup_density(self.ratio, self.warmup, self.step) * self.summands)
        out = graddrop_encode(g, self.ratio, self.sample_ratio, self.seed, self.counter, d)
        self.counter += graddrop_sample_size(self.n, self.sample_ratio)  # as the kernel's: the sample drawn
        self.step += 1
        return out


def dgc_warmup_stage(step: int, warmup_steps: int) -> int:
    """DGC's warm-up stage (0..3, density 0.25^(stage+1)) at ``step`` < ``warmup_steps``: stage
    i lasts warmup_steps * 4^(i+1) / 340 steps, so it ends after warmup_steps * (4^(i+2) - 4) / 1020."""
    t, w = 1020.0 * step, float(warmup_steps)
    return 0 if t < 12.0 * w else 1 if t < 60.0 * w else 2 if t < 252.0 * w else 3


def warmup_density(ratio: float, warmup_steps: int, step: int) -> float:
    """The density of DGC's warm-up (also GradDrop's) at ``step``: 0.25^(stage + 1), never below
    ``ratio``, then ``ratio`` from ``warmup_steps`` on (0: no warm-up)."""
    if warmup_steps == 0 or step >= warmup_steps:
        return ratio
    return max(ratio, 0.25 ** (dgc_warmup_stage(step, warmup_steps) + 1))


class DGCReference:
    """DGC with its own state (momentum u, accumulation v, step)."""

    def __init__(self, n: int, ratio=0.001, momentum=0.0, warmup_steps=2040, summands=1):
        self.ratio, self.momentum, self.warmup = ratio, np.float32(momentum), warmup_steps
        self.summands = summands  # ranks summed in the input: the density is that many times larger
        self.u = np.zeros(n, np.float32)
        self.v = np.zeros(n, np.float32)
        self.step = 0

    def density(self, step: int) -> float:
        return min(1.0, warmup_density(self.ratio, self.warmup, step) * self.summands)

    def encode(self, g: np.ndarray) -> bytes:
        g = np.asarray(g, dtype=np.float32).reshape(-1)
        if self.momentum != 0:
            self.u = self.momentum * self.u + g
            self.v = self.v + self.u
        else:  # u is not kept (it stays zeros); v accumulates g itself
            self.v = self.v + g
        d = self.density(self.step)
        idx, val = topk_abs_exact(self.v, count_for(d, g.size))
        self.v[idx] = 0
        self.u[idx] = 0
        self.step += 1
        return sparse_payload("dgc", g.size, idx, val, d)


def dgc_encode_stateless(g: np.ndarray, ratio: float = 0.001) -> bytes:
    g = np.asarray(g, dtype=np.float32).reshape(-1)
    idx, val = topk_abs_exact(g, count_for(ratio, g.size))
    return sparse_payload("dgc", g.size, idx, val, ratio)


# ---------------------------------------------------------------- GRACE's sparsifiers and hybrids
# Written from GRACE (Xu et al., ICDCS 2021, Table I and section IV-C) and its code
# (github.com/sands-lab/grace), with the differences hipress's versions document
# (hipress/dsl/specs/{randomk,topk,threshold,adaq,dgc_grace}.cll, csrc/compress/algo_sketch.cc).
# An encoder that draws random numbers takes the RNG counter; *_counter_advance says by how much
# the native kernel moves it per encode.


def grace_count(ratio: float, n: int) -> int:
    """GRACE's k = max(1, int(n * ratio)) (floor), at most n; 0 for an empty tensor."""
    if n == 0:
        return 0
    return int(min(n, max(1, math.floor(ratio * n))))


def sampled_threshold(x: np.ndarray, keep: float, s: int, seed: int, counter: int) -> np.float32:
    """The ceil(keep * s)-th largest |x| over s random positions (with replacement); 0 if empty."""
    n = x.size
    if n == 0 or s == 0:
        return np.float32(0)
    sm = np.abs(x[random_index(seed, counter, n, s)])
    r = max(1, min(s, math.ceil(keep * s)))
    return np.float32(np.sort(sm)[::-1][r - 1])


def randomk_counter_advance(n: int, ratio: float = 0.01) -> int:
    return n + min(n, 4096)  # one key per element, then the sort's sample (only speeds it up)


def randomk_encode(g: np.ndarray, ratio: float = 0.01, seed: int = 0, counter: int = 0) -> bytes:
    """k = max(1, floor(ratio n)) distinct uniformly random positions: the k largest of n random
    keys (counters counter .. counter + n - 1; ties to the lower index). Selected elements equal
    to 0 or NaN are not sent."""
    g = np.asarray(g, dtype=np.float32).reshape(-1)
    n = g.size
    keys = random_uniform(seed, counter, n)
    idx, _ = topk_abs_exact(keys, grace_count(ratio, n))
    idx = idx[np.abs(g[idx]) > 0]
    return sparse_payload("randomk", n, idx, g[idx])


def topk_counter_advance(n: int, sample_ratio: float = 0.01) -> int:
    return min(n, max(4096, math.ceil(sample_ratio * n)))


def topk_encode(g: np.ndarray, ratio: float = 0.01) -> bytes:
    """GRACE's Top-k: the max(1, floor(ratio n)) largest |g| (ties to the lower index)."""
    g = np.asarray(g, dtype=np.float32).reshape(-1)
    idx, val = topk_abs_exact(g, grace_count(ratio, g.size))
    return sparse_payload("topk", g.size, idx, val)


def threshold_encode(g: np.ndarray, threshold: float = 0.01) -> bytes:
    """Threshold-v: every element with |g| >= v (and g != 0)."""
    g = np.asarray(g, dtype=np.float32).reshape(-1)
    a = np.abs(g)
    v = np.float32(threshold)
    idx = np.flatnonzero((a >= v) & (a > 0)).astype(np.uint32)
    return sparse_payload("threshold", g.size, idx, g[idx], float(v))


def adaq_counter_advance(n: int) -> int:
    return max(1, n // 100)


def _mean_f32(v: np.ndarray) -> np.float32:
    """The kernels' reduce(..., mean): a double sum over the count, rounded to float."""
    return np.float32(v.astype(np.float64).sum() / v.size) if v.size else np.float32(0)


def adaq_encode(g: np.ndarray, ratio: float = 0.01, seed: int = 0, counter: int = 0) -> bytes:
    """GRACE's adaptive threshold (adaq): per sign, a threshold adjusted at most 20 times (x1.25
    above 1.25 K selected, x0.9 below 0.8 K, K = ceil(ratio * count of that sign)), starting at
    the ceil(ratio s)-th largest |g| of s = max(1, n // 100) random elements; the selected
    elements are sent as index + sign bit, decoded to the mean of that sign's selected values."""
    g = np.asarray(g, dtype=np.float32).reshape(-1)
    n = g.size
    thr0 = sampled_threshold(g, ratio, max(1, n // 100), seed, counter)
    masks, means = [], []
    for part in (np.where(g > 0, g, np.float32(0)), np.where(g < 0, -g, np.float32(0))):
        k = np.float32(np.ceil(np.float32(int((part > 0).sum())) * np.float32(ratio)))  # float32, as GRACE's TF
        hi, lo = np.float32(np.float32(1.25) * k), np.float32(np.float32(0.8) * k)
        thr = thr0
        sel = int((part > thr).sum())
        for _ in range(20):
            if not (sel > hi or sel < lo):
                break
            thr = np.float32(np.float32(1.25) * thr) if sel > hi else np.float32(np.float32(0.9) * thr)
            sel = int((part >= thr).sum())
        if sel < 1:
            thr = np.float32(np.float32(0.8) * thr)
        m = part > thr
        masks.append(m)
        means.append(_mean_f32(g[m]))
    idx = np.flatnonzero(masks[0] | masks[1]).astype(np.uint32)
    signs = pack_bits((g[idx] < 0).astype(np.uint8), 1)
    k = idx.size
    return (make_header("adaq", n, 4 * k + signs.size, bits=1, count=k,
                        words=(f32_word(means[0]), f32_word(means[1])))
            + idx.astype("<u4").tobytes() + signs.tobytes())


def adaq_decode(payload, n: int) -> np.ndarray:
    h = parse_header(payload)
    k = h["count"]
    body = _body(payload)
    idx = body[: 4 * k].view("<u4")
    neg = unpack_bits(body[4 * k:], k, 1)
    table = np.array([word_f32(h["words"][0]), word_f32(h["words"][1])], dtype=np.float32)
    out = np.zeros(n, np.float32)
    out[idx] = table[neg]
    return out


def dgc_grace_counter_advance(n: int) -> int:
    return max(1, n // 100)


class DGCGraceReference:
    """GRACE's DGC (grace_dl/torch compressor + DGC memory) as hipress's dgc_grace: u = m u + g,
    v = v + u; threshold: the max(1, floor(ratio n / 100))-th largest |v| of max(1, n // 100)
    random elements, adjusted at most 10 times (x1.3 above 1.3 ratio n, x0.7 below 0.7 ratio n);
    every |v| >= threshold (v != 0) sent; u and v zeroed where sent."""

    def __init__(self, n: int, ratio=0.01, momentum=0.0, seed=0, counter=0):
        self.ratio, self.m, self.seed, self.counter = ratio, np.float32(momentum), int(seed), int(counter)
        self.u = np.zeros(n, np.float32)
        self.v = np.zeros(n, np.float32)

    def select(self, x: np.ndarray, counter: int):
        n = x.size
        s = max(1, n // 100)
        ks = max(1, math.floor(self.ratio * n / 100))
        thr = sampled_threshold(x, (ks - 0.5) / s, s, self.seed, counter)
        a = np.abs(x)
        hi, lo = np.float32(13 * n * self.ratio / 10), np.float32(7 * n * self.ratio / 10)  # torch: float32
        sel = int(((a >= thr) & (a > 0)).sum())
        for _ in range(10):
            if not (sel > hi or sel < lo):
                break
            thr = np.float32(np.float32(1.3) * thr) if sel > hi else np.float32(np.float32(0.7) * thr)
            sel = int(((a >= thr) & (a > 0)).sum())
        return np.flatnonzero((a >= thr) & (a > 0)).astype(np.uint32), thr

    def encode(self, g: np.ndarray) -> bytes:
        g = np.asarray(g, dtype=np.float32).reshape(-1)
        self.u = self.m * self.u + g
        self.v = self.v + self.u
        idx, thr = self.select(self.v, self.counter)
        self.counter += dgc_grace_counter_advance(g.size)
        val = self.v[idx].copy()
        self.v[idx] = 0
        self.u[idx] = 0
        return sparse_payload("dgc_grace", g.size, idx, val, float(thr))


def dgc_grace_encode_stateless(g: np.ndarray, ratio: float = 0.01, seed: int = 0) -> bytes:
    g = np.asarray(g, dtype=np.float32).reshape(-1)
    idx, thr = DGCGraceReference(0, ratio, 0.0, seed).select(g, 0)
    return sparse_payload("dgc_grace", g.size, idx, g[idx], float(thr))


def sketch_counter_advance(n: int, sample: int = 16384) -> int:
    return sample if 0 < sample < n else 0


def sketch_encode(g: np.ndarray, quantiles: int = 64, sample: int = 16384, seed: int = 0,
                  counter: int = 0) -> bytes:
    """SketchML as GRACE implements it: q buckets between the j/q quantiles (linear
    interpolation) of the values (of `sample` random ones when there are more), each element
    sent as its bucket's index (uint8), decoded to its bucket's mean."""
    g = np.asarray(g, dtype=np.float32).reshape(-1)
    n, q = g.size, int(quantiles)
    vals = g if (sample == 0 or n <= sample) else g[random_index(seed, counter, n, sample)]
    srt = np.sort(vals).astype(np.float64)
    m = srt.size
    edges = np.zeros(max(0, q - 1), np.float32)
    if m:
        for j in range(1, q):
            pos = j * (m - 1) / q
            lo = math.floor(pos)
            hi = min(m - 1, lo + 1)
            edges[j - 1] = np.float32(srt[lo] + (srt[hi] - srt[lo]) * (pos - lo))
    codes = np.searchsorted(edges, g, side="right").astype(np.int64)
    codes[np.isnan(g)] = 0
    sums = np.bincount(codes, weights=g.astype(np.float64), minlength=q)
    counts = np.bincount(codes, minlength=q)
    with np.errstate(invalid="ignore", divide="ignore"):
        means = np.where(counts > 0, sums / np.maximum(counts, 1), 0.0).astype(np.float32)
    means[~np.isfinite(means)] = 0
    return (make_header("sketch", n, 4 * q + n, bits=8, count=q) + means.astype("<f4").tobytes()
            + codes.astype(np.uint8).tobytes())


def sketch_decode(payload, n: int) -> np.ndarray:
    h = parse_header(payload)
    q = h["count"]
    body = _body(payload)
    means = body[: 4 * q].view("<f4")
    return means[body[4 * q: 4 * q + n]].astype(np.float32)


# ---------------------------------------------------------------- error feedback (GRACE eq. 4)


def error_feedback_step(encode, decode, g: np.ndarray, residual: np.ndarray, beta=1.0, gamma=1.0):
    """Returns (payload, new residual): comp = beta*m + gamma*g; m' = comp - decode(encode(comp))."""
    g = np.asarray(g, dtype=np.float32).reshape(-1)
    if beta == 1.0 and gamma == 1.0:
        comp = residual + g
    else:
        comp = np.float32(beta) * residual + np.float32(gamma) * g
    payload = encode(comp)
    return payload, comp - decode(payload, g.size)


# ---------------------------------------------------------------- PowerSGD


def orthogonalize(P: np.ndarray, eps: float = 1e-8) -> np.ndarray:
    """Gram-Schmidt with the projections run twice; eps is relative to each column's norm before
    its projections (scale-free)."""
    P = P.astype(np.float64).copy()
    for j in range(P.shape[1]):
        before = np.linalg.norm(P[:, j])
        for _ in range(2):
            for l in range(j):
                P[:, j] -= (P[:, l] @ P[:, j]) * P[:, l]
        P[:, j] = P[:, j] / (np.linalg.norm(P[:, j]) + eps * before) if before > 0 else 0.0
    return P.astype(np.float32)


class PowerSGDReference:
    """One rank of PowerSGD (Vogels 2019); for N ranks, call round0 on all, sum
    the P's, round1 on all with the sum, sum the Q's, finish on all. fresh_q: GRACE's variant
    (powersgd_grace), a new random Q every step, orthonormalised, instead of the warm start."""

    def __init__(self, rows: int, cols: int, rank: int = 8, seed: int = 0, error_feedback: bool = True,
                 fresh_q: bool = False, counter: int = 0):
        self.rows, self.cols = rows, cols
        self.r = min(rank, rows, cols)
        self.ef = error_feedback
        self.e = np.zeros((rows, cols), np.float32)
        self.seed, self.counter, self.fresh_q = seed, counter, fresh_q
        self.Q = None if fresh_q else self._draw()
        self.P = None
        self.M = None

    def _draw(self) -> np.ndarray:
        q = (np.float32(2) * random_uniform(self.seed, self.counter, self.cols * self.r) - np.float32(1))
        self.counter += self.cols * self.r
        return q.reshape(self.cols, self.r)

    def round0(self, g: np.ndarray) -> np.ndarray:
        g = np.asarray(g, np.float32).reshape(self.rows, self.cols)
        self.M = (self.e + g) if self.ef else g.copy()
        if self.fresh_q:  # GRACE's PowerSGD (powersgd_grace): a new orthonormalised Q every step
            self.Q = orthogonalize(self._draw())
        return self.M @ self.Q

    def round1(self, p_sum: np.ndarray) -> np.ndarray:
        self.P = orthogonalize(p_sum)
        q = self.M.T @ self.P
        self.e = (self.M - self.P @ q.T) if self.ef else np.zeros_like(self.M)
        return q

    def finish(self, q_sum: np.ndarray) -> np.ndarray:
        self.Q = q_sum.astype(np.float32)
        return (self.P @ self.Q.T).reshape(-1)

    def step(self, g: np.ndarray) -> np.ndarray:
        """Single process: both rounds locally; returns the decoded approximation."""
        q = self.round1(self.round0(g))
        return self.finish(q)


def acpsgd_first_q(seed: int, rows: int, cols: int, r: int) -> np.ndarray:
    """ACP-SGD's first Q (cols x r), the same on every rank: seeded by the seed and the shape."""
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + rows * 7919 + cols)
    return torch.randn(cols * r, generator=g).numpy().reshape(cols, r)


class ACPSGDReference:
    """One rank of ACP-SGD (hipress/compression/acpsgd.py): PowerSGD's two halves alternated over
    the steps. For N ranks: local(g) on all, sum the factors, finish(sum) on all."""

    def __init__(self, rows: int, cols: int, rank: int = 32, seed: int = 0, error_feedback: bool = True):
        self.rows, self.cols = rows, cols
        self.r = min(rank, rows, cols)
        self.ef = error_feedback
        self.e = np.zeros((rows, cols), np.float32)
        self.Q = acpsgd_first_q(seed, rows, cols, self.r)
        self.P = np.zeros((rows, self.r), np.float32)
        self.step = 0

    def local(self, g: np.ndarray) -> np.ndarray:
        m = np.asarray(g, np.float32).reshape(self.rows, self.cols)
        if self.ef:
            m = m + self.e
        if self.step % 2 == 0:
            self.Q = np.linalg.qr(self.Q)[0]  # Householder, as the compressor (not Gram-Schmidt: see there)
            f = m @ self.Q
            approx = f @ self.Q.T
        else:
            self.P = np.linalg.qr(self.P)[0]
            f = m.T @ self.P
            approx = self.P @ f.T
        if self.ef:
            self.e = m - approx
        return f

    def finish(self, total: np.ndarray) -> np.ndarray:
        """The decoded SUM over the ranks; the summed factor is kept for the next step."""
        if self.step % 2 == 0:
            self.P = total.astype(np.float32)
        else:
            self.Q = total.astype(np.float32)
        self.step += 1
        return (self.P @ self.Q.T).reshape(-1)


# ---------------------------------------------------------------- GRACE's quantizers (docs/grace.md)
# Written from the GRACE paper (Xu et al. 2021, §III-A) and its methods' papers; where GRACE's
# implementation fixes a detail (8-bit codes, table, clipping) the reference follows it.


def _sign_payload(algo: str, neg: np.ndarray, scale) -> bytes:
    body = np.packbits(neg.astype(np.uint8), bitorder="little")
    return make_header(algo, neg.size, body.size, bits=1, words=(f32_word(scale),)) + body.tobytes()


def sign_decode(payload, n: int) -> np.ndarray:
    """signsgd / signum / efsignsgd: +-scale by the sign bit."""
    h = parse_header(payload)
    s = word_f32(h["words"][0])
    return np.array([s, -s], dtype=np.float32)[unpack_bits(_body(payload), n, 1)]


def _sign_sums(g: np.ndarray):
    """The sums (in double, rounded to float) of the elements without and with the sign bit."""
    neg = np.signbit(g)
    return np.float32(g[~neg].astype(np.float64).sum()), np.float32(g[neg].astype(np.float64).sum())


def signsgd_encode(g: np.ndarray, scale: float = 1.0) -> bytes:
    """signSGD (Bernstein 2018): the sign bit of every element; decoded +-scale."""
    g = np.asarray(g, dtype=np.float32).reshape(-1)
    return _sign_payload("signsgd", np.signbit(g), np.float32(scale))


class SignumReference:
    """SIGNUM (Bernstein 2018): the sign of m = momentum * m + (1 - momentum) * g (per tensor)."""

    def __init__(self, n: int, momentum: float = 0.9, scale: float = 1.0):
        self.m = np.zeros(n, np.float32)
        self.beta, self.scale = np.float32(momentum), np.float32(scale)

    def encode(self, g: np.ndarray) -> bytes:
        g = np.asarray(g, dtype=np.float32).reshape(-1)
        self.m = self.beta * self.m + (np.float32(1) - self.beta) * g
        return _sign_payload("signum", np.signbit(self.m), self.scale)


def signum_encode_stateless(g: np.ndarray, scale: float = 1.0) -> bytes:
    g = np.asarray(g, dtype=np.float32).reshape(-1)
    return _sign_payload("signum", np.signbit(g), np.float32(scale))


def efsignsgd_encode(g: np.ndarray) -> bytes:
    """EF-SignSGD's compressor (Karimireddy 2019): (||g||_1 / d) * sign(g)."""
    g = np.asarray(g, dtype=np.float32).reshape(-1)
    pos, neg = _sign_sums(g)  # ||g||_1 / d as the kernel computes it: (pos - neg) / d in float
    scale = np.float32((pos - neg) / np.float32(g.size)) if g.size else np.float32(0)
    return _sign_payload("efsignsgd", np.signbit(g), scale)


def qsgd_encode(g: np.ndarray, quantum_num: int = 64, seed: int = 0, counter: int = 0, norm=None) -> bytes:
    """QSGD (Alistarh 2017): |g_i| / ||g||_2 * s rounded stochastically to a neighbouring level;
    code = sign * 128 + level. ``norm``: use this ||g||_2 (the kernel's, a double sum in another
    order, may differ from numpy's in the last bit)."""
    g = np.asarray(g, dtype=np.float32).reshape(-1)
    n = g.size
    s = np.float32(quantum_num)
    if norm is None:
        norm = np.sqrt(np.square(g).astype(np.float64).sum()) if n else 0.0
    norm = np.float32(norm)
    inv = np.float32(s / norm) if norm > 0 else np.float32(0)
    unit = np.float32(norm / s)
    with np.errstate(invalid="ignore"):
        lv = np.abs(g) * inv
        f = np.floor(lv)
        u = random_uniform(seed, counter, n)
        q = np.minimum(f + np.where(u < lv - f, np.float32(1), np.float32(0)), s)
    codes = (np.where((g < 0) & (q > 0), 128, 0) + np.nan_to_num(q)).astype(np.uint8)
    return make_header("qsgd", n, n, bits=8, words=(f32_word(norm), f32_word(unit))) + codes.tobytes()


def qsgd_decode(payload, n: int) -> np.ndarray:
    h = parse_header(payload)
    unit = word_f32(h["words"][1])
    c = _body(payload)[:n]
    v = (c & 127).astype(np.float32) * unit
    return np.where(c >= 128, -v, v).astype(np.float32)


def natural_encode(g: np.ndarray, seed: int = 0, counter: int = 0) -> bytes:
    """Natural compression (Horvath 2019) in GRACE's 8 bits: |x| in [2^e, 2^(e+1)) goes to
    2^(e+1) with probability |x| / 2^e - 1, else 2^e; code = sign * 128 + (e + 109) for e in
    [-109, 18], 0 below (zero), 127 above (2^18)."""
    g = np.asarray(g, dtype=np.float32).reshape(-1)
    n = g.size
    a = np.abs(g)
    mant, ex = np.frexp(a)            # a = mant * 2^ex, mant in [0.5, 1): e = ex - 1
    e = ex.astype(np.int64) - 1
    frac = (mant * np.float32(2) - np.float32(1)).astype(np.float32)   # a / 2^e - 1, exact
    u = random_uniform(seed, counter, n)
    r = np.minimum(e + (u < frac), 18)
    sign = np.where(np.signbit(g), 128, 0)
    codes = sign + r + 109
    codes = np.where(e > 18, sign + 127, codes)
    codes = np.where((e < -109) | (a == 0) | np.isnan(g), 0, codes)
    codes = np.where(np.isinf(g), sign + 127, codes)
    codes = codes.astype(np.uint8)
    return make_header("natural", n, n, bits=8) + codes.tobytes()


def natural_decode(payload, n: int) -> np.ndarray:
    parse_header(payload)
    c = _body(payload)[:n].astype(np.int64)
    k = c & 127
    v = np.where(k == 0, np.float32(0), np.ldexp(np.float32(1), k - 109).astype(np.float32))
    return np.where((c >= 128) & (k > 0), -v, v).astype(np.float32)


def terngrad_grace_encode(g: np.ndarray, clip: float = 2.5, seed: int = 0, counter: int = 0, scalar=None) -> bytes:
    """GRACE's TernGrad (Wen 2017): clip to clip * std, s = max |clipped|, send s * sign(x) with
    probability |clipped x| / s. ``scalar``: use this s (the kernel's mean and variance are
    double sums in another order than numpy's)."""
    g = np.asarray(g, dtype=np.float32).reshape(-1)
    n = g.size
    top = np.float32(np.abs(g).max()) if n else np.float32(0)
    if scalar is None:
        pos, neg = _sign_sums(g)
        mu = np.float32((pos + neg) / np.float32(n)) if n else np.float32(0)
        d = g - mu
        sigma = np.float32(np.sqrt(np.float32((d * d).astype(np.float64).mean()))) if n else np.float32(0)
        scalar = min(np.float32(np.float32(clip) * sigma), top) if clip > 0 else top
    c = np.float32(scalar)
    a = np.minimum(np.abs(g), c)
    u = random_uniform(seed, counter, n)
    keep = u * c < a
    codes = np.where(keep, np.where(g > 0, 1, np.where(g < 0, 2, 0)), 0).astype(np.uint8)
    body = pack_bits(codes, 2)
    return make_header("terngrad_grace", n, body.size, bits=2, words=(f32_word(c),)) + body.tobytes()


def terngrad_grace_decode(payload, n: int) -> np.ndarray:
    h = parse_header(payload)
    s = word_f32(h["words"][0])
    return np.array([0, s, -s, 0], dtype=np.float32)[unpack_bits(_body(payload), n, 2)]


# GRACE's dict128 (U8bitCompressor): Dettmers' dynamic tree table, the bin edges of |x| / max |x|.
U8BIT_TABLE = np.array([
    1.5000001e-06, 2.7500000e-06, 7.2499997e-06, 1.8750001e-05, 3.6250000e-05, 5.8749996e-05, 8.6249995e-05,
    1.4375000e-04, 2.3125000e-04, 3.1875001e-04, 4.0625001e-04, 5.1874999e-04, 6.5624999e-04, 7.9374999e-04,
    9.3124999e-04, 1.2187500e-03, 1.6562500e-03, 2.0937501e-03, 2.5312500e-03, 2.9687500e-03, 3.4062499e-03,
    3.8437501e-03, 4.2812498e-03, 4.8437500e-03, 5.5312500e-03, 6.2187500e-03, 6.9062500e-03, 7.5937500e-03,
    8.2812496e-03, 8.9687500e-03, 9.6562495e-03, 1.1093750e-02, 1.3281250e-02, 1.5468750e-02, 1.7656250e-02,
    1.9843750e-02, 2.2031249e-02, 2.4218749e-02, 2.6406251e-02, 2.8593751e-02, 3.0781250e-02, 3.2968748e-02,
    3.5156250e-02, 3.7343752e-02, 3.9531250e-02, 4.1718751e-02, 4.3906249e-02, 4.6718750e-02, 5.0156251e-02,
    5.3593751e-02, 5.7031251e-02, 6.0468748e-02, 6.3906237e-02, 6.7343749e-02, 7.0781253e-02, 7.4218743e-02,
    7.7656247e-02, 8.1093743e-02, 8.4531240e-02, 8.7968737e-02, 9.1406241e-02, 9.4843738e-02, 9.8281242e-02,
    1.0546875e-01, 1.1640625e-01, 1.2734374e-01, 1.3828126e-01, 1.4921875e-01, 1.6015625e-01, 1.7109375e-01,
    1.8203124e-01, 1.9296876e-01, 2.0390625e-01, 2.1484375e-01, 2.2578125e-01, 2.3671874e-01, 2.4765626e-01,
    2.5859374e-01, 2.6953125e-01, 2.8046876e-01, 2.9140624e-01, 3.0234376e-01, 3.1328124e-01, 3.2421875e-01,
    3.3515626e-01, 3.4609374e-01, 3.5703126e-01, 3.6796874e-01, 3.7890625e-01, 3.8984376e-01, 4.0078124e-01,
    4.1171876e-01, 4.2265624e-01, 4.3359375e-01, 4.4453126e-01, 4.5859376e-01, 4.7578123e-01, 4.9296874e-01,
    5.1015621e-01, 5.2734375e-01, 5.4453123e-01, 5.6171870e-01, 5.7890624e-01, 5.9609371e-01, 6.1328125e-01,
    6.3046873e-01, 6.4765620e-01, 6.6484374e-01, 6.8203121e-01, 6.9921869e-01, 7.1640623e-01, 7.3359370e-01,
    7.5078118e-01, 7.6796871e-01, 7.8515619e-01, 8.0234367e-01, 8.1953120e-01, 8.3671868e-01, 8.5390615e-01,
    8.7109369e-01, 8.8828117e-01, 9.0546864e-01, 9.2265618e-01, 9.3984365e-01, 9.5703113e-01, 9.7421867e-01,
    9.9140614e-01, 9.9570298e-01], dtype=np.float32)


def u8bit_encode(g: np.ndarray) -> bytes:
    """GRACE's 8-bit quantization: scale = max |g|; the bin of |g| / scale in U8BIT_TABLE (the
    largest k with table[k] <= v, 0 below the first entry); code = sign * 128 + bin (bin 0: zero)."""
    g = np.asarray(g, dtype=np.float32).reshape(-1)
    n = g.size
    scale = np.float32(np.abs(g).max()) if n else np.float32(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        v = np.abs(g) / scale
    b = np.maximum(np.searchsorted(U8BIT_TABLE, np.nan_to_num(v, nan=-1.0), side="right") - 1, 0)
    codes = (np.where((g < 0) & (b > 0), 128, 0) + b).astype(np.uint8)
    return make_header("u8bit", n, n, bits=8, words=(f32_word(scale),)) + codes.tobytes()


def u8bit_decode(payload, n: int) -> np.ndarray:
    h = parse_header(payload)
    scale = word_f32(h["words"][0])
    c = _body(payload)[:n].astype(np.int64)
    k = c & 127
    v = np.where(k == 0, np.float32(0), U8BIT_TABLE[k] * scale).astype(np.float32)
    return np.where(c >= 128, -v, v).astype(np.float32)


def half_encode(g: np.ndarray, algo: str = "fp16") -> bytes:
    """fp16 / bf16 casts (GRACE's FP16Compressor): 2 bytes per element, round to nearest even
    (bf16: the upper 16 bits after adding 0x7FFF + the lowest kept bit; NaN -> 0x7FC0)."""
    g = np.asarray(g, dtype=np.float32).reshape(-1)
    if algo == "fp16":
        with np.errstate(over="ignore"):  # beyond 65504: inf, as the cast
            body = g.astype(np.float16).view(np.uint16)
    else:
        u = g.view(np.uint32).astype(np.uint64)
        body = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        body = np.where(np.isnan(g), np.uint16(0x7FC0), body).astype(np.uint16)
    return make_header(algo, g.size, 2 * g.size, bits=16) + body.astype("<u2").tobytes()


def half_decode(payload, n: int) -> np.ndarray:
    h = parse_header(payload)
    raw = _body(payload)[: 2 * n].view("<u2")
    if h["algo"] == ALGO_IDS["fp16"]:
        return raw.view(np.float16).astype(np.float32)
    return (raw.astype(np.uint32) << 16).view(np.float32)


# ---------------------------------------------------------------- inceptionn (csrc/compress/algo_inceptionn.cc)


def inceptionn_bound(error_bound: float = 2e-10) -> int:
    """The smallest biased exponent sent (GRACE's formula, with log10): 117 (2^-10) for 2e-10."""
    return 127 + int(math.trunc(math.log10(error_bound / 2)))


def inceptionn_encode(g: np.ndarray, error_bound: float = 2e-10) -> bytes:
    """Tags 3 (e >= 127: fp32 bits), 2 (mid <= e < 127: sign + 15-bit field, top bit 2^-1),
    1 (eb <= e < mid: sign + 7-bit field, top bit 2^(mid-128)), 0 (e < eb: nothing); fields are
    the significand shifted right, i.e. |x| truncated to the field's resolution."""
    u = np.asarray(g, dtype=np.float32).reshape(-1).view(np.uint32).astype(np.int64)
    eb = inceptionn_bound(error_bound)
    mid = eb + (127 - eb + 1) // 2
    e = (u >> 23) & 0xFF
    tag = np.where(e >= 127, 3, np.where(e >= mid, 2, np.where(e >= eb, 1, 0))).astype(np.uint8)
    sig = (u & 0x7FFFFF) | 0x800000
    sign = u >> 31

    def code(width, top, sel):
        shift = 25 - width + top - e[sel]
        field = np.where(shift >= 24, 0, sig[sel] >> np.minimum(shift, 23))
        return (sign[sel] << (width - 1)) | field

    v32 = u[tag == 3].astype("<u4")
    v16 = code(16, 126, tag == 2).astype("<u2")
    v8 = code(8, mid - 1, tag == 1).astype(np.uint8)
    body = pack_bits(tag, 2).tobytes() + v32.tobytes() + v16.tobytes() + v8.tobytes()
    return make_header("inceptionn", u.size, len(body), bits=2, words=(v32.size, v16.size, v8.size, eb)) + body


def inceptionn_decode(payload, n: int) -> np.ndarray:
    h = parse_header(payload)
    n32, n16, n8, eb = h["words"]
    mid = eb + (127 - eb + 1) // 2
    body = _body(payload)
    tb = (n + 3) // 4
    tag = unpack_bits(body[:tb], n, 2)
    v32 = body[tb: tb + 4 * n32].view("<f4")
    v16 = body[tb + 4 * n32: tb + 4 * n32 + 2 * n16].view("<u2").astype(np.int64)
    v8 = body[tb + 4 * n32 + 2 * n16: tb + 4 * n32 + 2 * n16 + n8].astype(np.int64)

    def value(c, width, lsb_exp):
        mag = (c & ((1 << (width - 1)) - 1)).astype(np.float32) * np.float32(2.0 ** lsb_exp)
        return np.where(c >> (width - 1) == 1, -mag, mag).astype(np.float32)

    out = np.zeros(n, dtype=np.float32)
    out[tag == 3] = v32
    out[tag == 2] = value(v16, 16, -15)
    out[tag == 1] = value(v8, 8, mid - 1 - 127 - 6)
    return out
