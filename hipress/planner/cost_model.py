"""Cost model of selective compression and partitioning (HiPress paper, section 3.3).

Notation (paper Table 2): m gradient bytes, K partitions, N workers (ring) or
aggregators (PS), r compression rate (compressed bytes / original bytes),
T_send(m), T_enc(m), T_dec(m) the times to send, encode and decode m bytes.
The argument of T_dec is the *compressed* size, as in equation 2.

    T_sync^orig(m, K) = alpha * T_send(m / K)                                   (1)
    T_sync^cpr(m, K)  = alpha * T_send(r m / K) + beta * T_enc(m / K)
                        + gamma * T_dec(r m / K)                                (2)

alpha, beta, gamma per strategy and compression category come from
:func:`sync_params` (paper Table 3 and section 6.1, see docs/planner.md).

Partitions beyond N (paper: "grouping K partitions into ceil(K/N) batches"): the K
partitions, each of m/K bytes, are synchronized in ceil(K/N) sequential rounds of at
most N partitions; a round of k partitions costs equation 1 or 2 evaluated with
partition size m/K and the round's own beta(k)/gamma(k) (only CaSync-PS's beta
depends on k). For K <= N this is exactly equations 1 and 2.

Curves are plain callables of bytes -> seconds. Two kinds are provided:
  * :class:`AffineCurve`  a + b*m  (Hockney model: fixed cost + bytes / throughput);
  * :class:`PiecewiseAffineCurve`  linear interpolation through measured points of a
    size ladder. It captures what an affine fit cannot: GPU kernels and small
    messages have a flat, launch/latency-bound region below a knee and are
    throughput-bound above it.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

STRATEGIES = ("ring", "ps", "ps_colocated", "casync_ring", "casync_ps")
RING_STRATEGIES = ("ring", "casync_ring")
CATEGORIES = ("quantization", "sparsification", "lowrank")


# ----------------------------------------------------------------------------- curves
@dataclass(frozen=True)
class AffineCurve:
    """t(m) = a + b*m seconds for m bytes (a: fixed cost in s, b: s per byte)."""

    a: float
    b: float

    kind = "affine"

    def __post_init__(self):
        if not (math.isfinite(self.a) and math.isfinite(self.b)):
            raise ValueError(f"AffineCurve coefficients must be finite, got a={self.a}, b={self.b}")

    def __call__(self, m: float) -> float:
        return self.a + self.b * m

    @classmethod
    def from_throughput(cls, bytes_per_s: float, overhead_s: float = 0.0) -> "AffineCurve":
        if bytes_per_s <= 0:
            raise ValueError(f"throughput must be > 0 bytes/s, got {bytes_per_s}")
        return cls(float(overhead_s), 1.0 / float(bytes_per_s))

    @classmethod
    def fit(cls, sizes: Sequence[float], seconds: Sequence[float]) -> "AffineCurve":
        """Least-squares fit of a + b*m to (size, time) samples.

        Samples are weighted by 1/t (relative error) so the small sizes, whose
        times are tiny, still pin the fixed cost a. Exact for exactly affine data.
        """
        xs, ys = _check_samples(sizes, seconds, need=2)
        if len(set(xs)) < 2:
            raise ValueError("AffineCurve.fit needs at least two distinct sizes")
        ws = [1.0 / (y * y) if y > 0 else 1.0 for y in ys]  # weights of squared residuals
        sw = sum(ws)
        sx = sum(w * x for w, x in zip(ws, xs))
        sy = sum(w * y for w, y in zip(ws, ys))
        sxx = sum(w * x * x for w, x in zip(ws, xs))
        sxy = sum(w * x * y for w, x, y in zip(ws, xs, ys))
        det = sw * sxx - sx * sx
        if det <= 0:
            raise ValueError("AffineCurve.fit: degenerate sizes")
        b = (sw * sxy - sx * sy) / det
        a = (sy - b * sx) / sw
        return cls(a, b)

    def to_dict(self) -> dict:
        return {"kind": "affine", "a": self.a, "b": self.b}


@dataclass(frozen=True)
class PiecewiseAffineCurve:
    """Linear interpolation through (size, seconds) points of a size ladder.

    Below the smallest size the time is the smallest measured time (a latency
    floor: a smaller message or kernel is never modelled as cheaper than the
    smallest one measured). Above the largest size the last segment's slope is
    extended. Points are made non-decreasing (running maximum) when fitted, so
    measurement noise cannot make a larger transfer look cheaper.
    """

    sizes: Tuple[float, ...]
    seconds: Tuple[float, ...]

    kind = "piecewise"

    def __post_init__(self):
        xs, ys = _check_samples(self.sizes, self.seconds, need=1)
        if any(b <= a for a, b in zip(xs, xs[1:])):
            raise ValueError("PiecewiseAffineCurve sizes must be strictly increasing")
        object.__setattr__(self, "sizes", tuple(xs))
        object.__setattr__(self, "seconds", tuple(ys))

    def __call__(self, m: float) -> float:
        xs, ys = self.sizes, self.seconds
        if len(xs) == 1 or m <= xs[0]:
            return ys[0]
        if m >= xs[-1]:
            x0, x1, y0, y1 = xs[-2], xs[-1], ys[-2], ys[-1]
        else:
            i = bisect.bisect_right(xs, m)
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (m - x0) / (x1 - x0)

    @classmethod
    def fit(cls, sizes: Sequence[float], seconds: Sequence[float]) -> "PiecewiseAffineCurve":
        xs, ys = _check_samples(sizes, seconds, need=1)
        pts: Dict[float, List[float]] = {}
        for x, y in zip(xs, ys):
            pts.setdefault(x, []).append(y)
        ux = sorted(pts)
        uy, run = [], 0.0
        for x in ux:
            v = sorted(pts[x])[len(pts[x]) // 2]
            run = max(run, v)
            uy.append(run)
        return cls(tuple(ux), tuple(uy))

    def to_dict(self) -> dict:
        return {"kind": "piecewise", "sizes": list(self.sizes), "seconds": list(self.seconds)}


Curve = Callable[[float], float]


def curve_from_dict(d: dict):
    if not isinstance(d, dict) or "kind" not in d:
        raise ValueError(f"curve must be a dict with a 'kind', got {d!r}")
    if d["kind"] == "affine":
        return AffineCurve(float(d["a"]), float(d["b"]))
    if d["kind"] == "piecewise":
        return PiecewiseAffineCurve(tuple(float(x) for x in d["sizes"]), tuple(float(y) for y in d["seconds"]))
    raise ValueError(f"unknown curve kind {d['kind']!r} (expected 'affine' or 'piecewise')")


def _check_samples(sizes, seconds, need):
    xs, ys = [float(x) for x in sizes], [float(y) for y in seconds]
    if len(xs) != len(ys):
        raise ValueError(f"{len(xs)} sizes but {len(ys)} times")
    if len(xs) < need:
        raise ValueError(f"need at least {need} samples, got {len(xs)}")
    for x, y in zip(xs, ys):
        if not (math.isfinite(x) and math.isfinite(y)) or x < 0 or y < 0:
            raise ValueError(f"sizes and times must be finite and >= 0, got ({x}, {y})")
    return xs, ys


# ------------------------------------------------------------------- alpha/beta/gamma
@dataclass(frozen=True)
class SyncParams:
    """Serial communication steps (alpha), non-overlapped encodes (beta) and decodes (gamma)."""

    alpha: int
    beta: int
    gamma: int


def sync_params(strategy: str, category: str, n: int, k: int) -> SyncParams:
    """alpha, beta, gamma for one round of k <= n partitions (paper Table 3, section 6.1).

    ring            quant./spars.: 2(N-1), N,   N      low-rank: 2(N-1), 1, 1
    ps              quant./spars.: 2N,     K+1, N+1    low-rank: 2N,     1, 1
    ps_colocated    quant./spars.: 2(N-1), K,   N      low-rank: 2(N-1), 1, 1

    ps_colocated is the variant the paper evaluates (section 6.1: aggregators run on
    the workers, so a worker's own partition never crosses the network, is not
    encoded, and its aggregator decodes only N-1 remote partitions). Its low-rank
    row is not given in the paper; we use beta = gamma = 1 because low-rank payloads
    are aggregated without decoding, the same reason as for the other two rows.

    casync_ring     quant./spars.: 2(N-1), N,   2N-1   low-rank: 2(N-1), 1, 1
    casync_ps       quant./spars.: 2(N-1), K+1, N+K    low-rank: 2(N-1), 1, 1
    are hipress's CaSync-Ring and CaSync-PS as they execute (hipress.sync.ring/ps),
    which the planner uses at run time. Ring: the paper's counts, except that all N-1
    all-gather decodes are charged (N-1 merges + the owner's decode + N-1 all-gather
    decodes): on a CPU they compete with the next step for the same cores. PS:
    co-located aggregators (alpha as ps_colocated), but a worker encodes all K
    partitions (its own one too, the aggregator then merges it like any other) and the
    aggregator encodes its aggregate (K + 1 encodes); the aggregator decodes N payloads
    and the worker decodes the K aggregates (N + K decodes). Measured on the emulated
    cluster (docs/planner.md), the section 6.1 counts leave out about half of a
    compressed sync's compute.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {STRATEGIES}")
    if category not in CATEGORIES:
        raise ValueError(f"unknown compression category {category!r}; expected one of {CATEGORIES}")
    n, k = int(n), int(k)
    if n < 1:
        raise ValueError(f"N must be >= 1, got {n}")
    if not 1 <= k <= n:
        raise ValueError(f"a round has 1..N partitions, got k={k} with N={n}")
    lowrank = category == "lowrank"
    if strategy in RING_STRATEGIES:
        alpha = 2 * (n - 1)
        if lowrank:
            return SyncParams(alpha, 1, 1)
        return SyncParams(alpha, n, 2 * n - 1) if strategy == "casync_ring" else SyncParams(alpha, n, n)
    if strategy == "ps":
        alpha = 2 * n
        return SyncParams(alpha, 1, 1) if lowrank else SyncParams(alpha, k + 1, n + 1)
    alpha = 2 * (n - 1)  # ps_colocated, casync_ps
    if lowrank:
        return SyncParams(alpha, 1, 1)
    if strategy == "casync_ps":
        return SyncParams(alpha, k + 1, n + k)
    return SyncParams(alpha, k, n)


def rounds(n: int, k: int) -> List[int]:
    """Partitions per sequential round when K partitions are spread over N peers."""
    if k < 1 or n < 1:
        raise ValueError(f"need K >= 1 and N >= 1, got K={k}, N={n}")
    q, rem = divmod(k, n)
    return [n] * q + ([rem] if rem else [])


# -------------------------------------------------------------------------- the model
@dataclass(frozen=True)
class Decision:
    """The model's choice for one gradient. Times in seconds.

    t_orig / k_orig: the best uncompressed time and its K; t_cpr / k_cpr: the best
    compressed time and its K (inf when compression is not allowed). ``k`` is the
    K of the chosen branch.
    """

    compress: bool
    k: int
    t_orig: float
    k_orig: int
    t_cpr: float
    k_cpr: int

    @property
    def t_best(self) -> float:
        return self.t_cpr if self.compress else self.t_orig


@dataclass(frozen=True)
class CostModel:
    """Equations 1 and 2 for one cluster shape and one compression algorithm.

    send(m): seconds to send m bytes between two peers; enc(m): seconds to encode m
    fp32 bytes; dec(m): seconds to decode an m-byte *compressed* payload.
    n: workers (ring) or aggregators (ps); rate: compressed / original bytes.

    Two extensions fit the model to what hipress executes (both default to the paper):
    enc_plain / dec_plain: the cost of the uncompressed path's own encode (a copy into
    the send buffer) and decode (merge-add) operators, charged in equation 1 with the
    same beta / gamma. The paper's equation 1 is the case of zero curves; measured
    profiles fill them in, because on a CPU a merge of m bytes is not free next to T_send.
    chunks: paper partitions per *executed* partition. The paper's K for CaSync-Ring
    counts ring chunks (K = N is the classic ring); hipress's ring splits every
    executed partition into N chunks, so a profile for "ring" sets chunks = N and the
    K of :meth:`decide` / :meth:`t_sync` (what the plan and the optimizer execute) is
    evaluated as K * N paper partitions, i.e. K rounds of N.
    """

    send: Curve
    enc: Curve
    dec: Curve
    n: int
    strategy: str = "ps_colocated"
    category: str = "quantization"
    rate: float = 1.0 / 16
    enc_plain: Optional[Curve] = None
    dec_plain: Optional[Curve] = None
    chunks: int = 1

    def __post_init__(self):
        sync_params(self.strategy, self.category, self.n, 1)  # validates
        if not (math.isfinite(self.rate) and self.rate > 0):
            raise ValueError(f"rate must be a positive finite number, got {self.rate}")
        if int(self.chunks) < 1:
            raise ValueError(f"chunks must be >= 1, got {self.chunks}")

    def params(self, k: int) -> SyncParams:
        return sync_params(self.strategy, self.category, self.n, k)

    def t_orig(self, m: float, k: int) -> float:
        """Equation 1, with ceil(K/N) sequential rounds when K > N."""
        part = m / k
        total = 0.0
        for kb in rounds(self.n, k):
            p = self.params(kb)
            total += p.alpha * self.send(part)
            if self.enc_plain is not None:
                total += p.beta * self.enc_plain(part)
            if self.dec_plain is not None:
                total += p.gamma * self.dec_plain(part)
        return total

    def t_cpr(self, m: float, k: int) -> float:
        """Equation 2, with ceil(K/N) sequential rounds when K > N."""
        part, r = m / k, self.rate
        total = 0.0
        for kb in rounds(self.n, k):
            p = self.params(kb)
            total += p.alpha * self.send(r * part) + p.beta * self.enc(part) + p.gamma * self.dec(r * part)
        return total

    def t_sync(self, m: float, compress: bool, k: int) -> float:
        """Predicted time of m bytes synchronized in k *executed* partitions (see ``chunks``)."""
        pieces = int(k) * int(self.chunks)
        return self.t_cpr(m, pieces) if compress else self.t_orig(m, pieces)

    def decide(self, m: float, k_max: Optional[int] = None, allow_compress: bool = True,
               k_min: int = 1) -> Decision:
        """Minimise over compress in {False, True} and K in k_min..k_max (default N).
        K counts executed partitions (see ``chunks``; with chunks = 1, the paper's K).

        Exhaustive over K: the range is small (tens), and with piecewise curves or
        K > N rounds the cost is not convex in K, so a convex search could miss the
        optimum. Ties go to no compression and then to the smaller K.
        """
        k_max = self.n if k_max is None else int(k_max)
        if k_min < 1 or k_max < k_min:
            raise ValueError(f"need 1 <= k_min <= k_max, got k_min={k_min}, k_max={k_max}")
        t_o, k_o = min((self.t_sync(m, False, k), k) for k in range(k_min, k_max + 1))
        if allow_compress:
            t_c, k_c = min((self.t_sync(m, True, k), k) for k in range(k_min, k_max + 1))
        else:
            t_c, k_c = math.inf, k_min
        compress = t_c < t_o
        return Decision(compress, k_c if compress else k_o, t_o, k_o, t_c, k_c)
