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

Strategy names: "ring", "ps" and "allgather" are hipress's own strategies as they execute (the
names a user passes, ``DistributedOptimizer(strategy=...)``; the models used at run time); the
paper's Table-3 rows are "paper_ring", "paper_ps" and "paper_ps_colocated". The executed
strategies are not rows of that table: :meth:`CostModel.t_sync` evaluates the critical path
of the task graph hipress.sync builds (the same alpha/beta/gamma structure, counted from
the executed graph, plus the memory passes and task hand-offs the paper's equations leave
out; see :func:`executed_ring`, :func:`executed_ps` and :func:`executed_allgather`).

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
import statistics
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

PAPER_STRATEGIES = ("paper_ring", "paper_ps", "paper_ps_colocated")
EXECUTED_STRATEGIES = ("ring", "ps", "allgather")
STRATEGIES = PAPER_STRATEGIES + EXECUTED_STRATEGIES
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
    extended. Points are made non-decreasing when fitted (see :meth:`fit`), so
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
        """Through the median of each size, made non-decreasing by isotonic regression
        (adjacent violators pooled into their mean): one slow outlier at a small size
        lowers its neighbours' excess instead of lifting every larger size to it."""
        xs, ys = _check_samples(sizes, seconds, need=1)
        pts: Dict[float, List[float]] = {}
        for x, y in zip(xs, ys):
            pts.setdefault(x, []).append(y)
        ux = sorted(pts)
        blocks: List[List[float]] = []  # [mean, count] of pooled runs
        for x in ux:
            blocks.append([statistics.median(pts[x]), 1])
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                (m1, c1), (m2, c2) = blocks.pop(-2), blocks.pop()
                blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
        uy = [m for m, c in blocks for _ in range(c)]
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

    paper_ring          quant./spars.: 2(N-1), N,   N      low-rank: 2(N-1), 1, 1
    paper_ps            quant./spars.: 2N,     K+1, N+1    low-rank: 2N,     1, 1
    paper_ps_colocated  quant./spars.: 2(N-1), K,   N      low-rank: 2(N-1), 1, 1

    paper_ps_colocated is the variant the paper evaluates (section 6.1: aggregators run on
    the workers, so a worker's own partition never crosses the network, is not
    encoded, and its aggregator decodes only N-1 remote partitions). Its low-rank
    row is not given in the paper; we use beta = gamma = 1 because low-rank payloads
    are aggregated without decoding, the same reason as for the other two rows.

    """
    if strategy not in PAPER_STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; expected one of {PAPER_STRATEGIES}")
    if category not in CATEGORIES:
        raise ValueError(f"unknown compression category {category!r}; expected one of {CATEGORIES}")
    n, k = int(n), int(k)
    if n < 1:
        raise ValueError(f"N must be >= 1, got {n}")
    if not 1 <= k <= n:
        raise ValueError(f"a round has 1..N partitions, got k={k} with N={n}")
    lowrank = category == "lowrank"
    if strategy == "paper_ring":
        alpha = 2 * (n - 1)
        return SyncParams(alpha, 1, 1) if lowrank else SyncParams(alpha, n, n)
    if strategy == "paper_ps":
        alpha = 2 * n
        return SyncParams(alpha, 1, 1) if lowrank else SyncParams(alpha, k + 1, n + 1)
    alpha = 2 * (n - 1)  # paper_ps_colocated
    return SyncParams(alpha, 1, 1) if lowrank else SyncParams(alpha, k, n)


def rounds(n: int, k: int) -> List[int]:
    """Partitions per sequential round when K partitions are spread over N peers."""
    if k < 1 or n < 1:
        raise ValueError(f"need K >= 1 and N >= 1, got K={k}, N={n}")
    q, rem = divmod(k, n)
    return [n] * q + ([rem] if rem else [])


# ------------------------------------------------------------- hipress as executed
def _zero(m: float) -> float:
    return 0.0


@dataclass(frozen=True)
class ExecutedOps:
    """The operators one executed sync is made of, as seconds.

    send(p): one transfer of p bytes (for CaSync-PS the per-peer share of a bulk exchange
    with N aggregators; send_one: with one aggregator); enc(m): encode m fp32 bytes;
    dec(p): decode or merge an encoded payload of p bytes; copy(m): a memory pass over m
    bytes; task: the hand-off of one compute task; rate: payload bytes per fp32 byte."""

    send: Curve
    send_one: Curve
    enc: Curve
    dec: Curve
    copy: Curve
    task: float
    rate: float


def executed_ring(op: ExecutedOps, m: float, n: int, k: int) -> float:
    """Critical path of CaSync-Ring (hipress.sync.ring) for m bytes in k partitions.

    Each partition of x = m/k bytes is N chunks of c = x/N; one rank's tasks per partition:
    reduce-scatter steps s = 0..N-2: encode(c), sendrecv(p), merge(p); encode the owned
    chunk and decode it in place; all-gather steps: N-1 sendrecv(p) in a chain, each
    followed by a decode(p) that overlaps the next step; average (a pass over x).
    Comm tasks run in submission order (CommChain), so partitions follow each other on
    the link; a partition's first encode runs during the previous partition's steps,
    and the last decode and the average of one partition during the next one's first step:

        T = [o + E]  +  k * [2(N-1) S + (N-1)(2o + E + D) + D]  +  [o + D]  +  [o + pass(x)]

    with S = send(p), E = enc(c), D = dec(p), o = task (the bracketed ends are the first
    encode, the last all-gather decode and the last average). Ranks are symmetric, so
    one rank's critical path is the sync's. alpha = 2(N-1), beta = N, gamma = N+1 per
    partition in the paper's terms, the other N-2 all-gather decodes hidden behind steps.
    """
    c = m / k / n
    p = op.rate * c
    s, e, d, o = op.send(p), op.enc(c), op.dec(p), op.task
    per_partition = 2 * (n - 1) * s + (n - 1) * (2 * o + e + d) + d
    last_decode = o + d if n > 1 else 0.0
    return (o + e) + k * per_partition + last_decode + o + op.copy(m / k)


def executed_ps(op: ExecutedOps, m: float, n: int, k: int) -> float:
    """Critical path of CaSync-PS (hipress.sync.ps, co-located aggregators) for m bytes in k
    partitions of x = m/k bytes, p = payload bytes of one, q = ceil(k/N) partitions on the
    busiest aggregator (owners are balanced by bytes). Three compute tasks, two exchanges:

        encode     o + k E(x) + pass(k p)                 k encodes, framed per aggregator
        gather     (N-1) S(q p)                           the busiest aggregator hears q p from each peer
        aggregate  o + q [pass(x) + N D(p) + E(x)] + pass(q p)   zero, N merges, re-encode, frame
        bcast      (N-1) S(q p)                           it sends its q aggregates to every peer
        decode     o + k D(p) + pass(m)                   decode every partition, divide by N

    S interpolates between send_one (one aggregator) and send (N) in the number of
    aggregators A = min(k, N); send is the per-peer share of a bulk exchange, so (N-1) S
    is one exchange. Every exchange waits for the slowest rank, so the phases add up. In
    the paper's terms alpha = 2(N-1), beta = k + q, gamma = k + qN (Table 3's co-located
    row is k, N: the own partition is neither encoded nor decoded there).
    """
    x = m / k
    p = op.rate * x
    q = -(-k // n)
    e, d, o = op.enc(x), op.dec(p), op.task
    t = o + k * e + op.copy(k * p)
    share = (min(k, n) - 1) / (n - 1) if n > 1 else 1.0
    s_one, s_all = op.send_one(q * p), op.send(q * p)
    t += 2 * (n - 1) * (s_one + share * (s_all - s_one))
    t += o + q * (op.copy(x) + n * d + e) + op.copy(q * p)
    t += o + k * d + op.copy(m)
    return t


def executed_allgather(op: ExecutedOps, m: float, n: int, k: int) -> float:
    """Critical path of the allgather strategy (hipress.sync.allgather, GRACE's form) for m bytes
    in k partitions of x = m/k bytes, p = payload bytes of one. Two compute tasks around one
    bulk exchange, nothing re-encoded:

        encode     o + k E(x) + pass(k p)        k encodes, framed into one segment
        allgather  (N-1) S(k p)                  the segment to every peer, every peer's from it
        aggregate  o + k N D(p) + pass(m)        per partition the N payloads decoded into the
                                                 sum in rank order, then divided by N

    S is the per-peer share of a bulk exchange in which every rank sends to every rank (what
    the profile measures for this strategy, as for CaSync-PS with N aggregators), so (N-1) S
    is the exchange. In the paper's terms alpha = N-1 transfers of the whole payload, beta = k,
    gamma = kN. Partitions buy no parallelism here (one exchange carries them all); they only
    change the codec's sizes.
    """
    x = m / k
    p = op.rate * x
    t = op.task + k * op.enc(x) + op.copy(k * p)
    t += (n - 1) * op.send(k * p)
    return t + op.task + k * n * op.dec(p) + op.copy(m)


EXECUTED = {"ring": executed_ring, "ps": executed_ps, "allgather": executed_allgather}


def executed_allreduce(send: Curve, copy: Curve, task: float, m: float, n: int,
                       allreduce: Optional[Curve] = None) -> float:
    """Time of m uncompressed bytes through the backend's allreduce (hipress.sync.allreduce):
    one collective, one hand-off, and the divide by N (a pass over m). K does not enter: the
    partitions of a bucket are one collective. The collective is the profile's measured curve
    ``allreduce`` (A, bytes -> seconds) where it has one; else (profiles measured before it)
    it is priced as a bandwidth-optimal ring over the measured link, 2(N-1) transfers of m/N
    bytes each, run by the backend without a task per step.

        T = A(m) + o + pass(m)        or        T = 2(N-1) S(m/N) + o + pass(m)
    """
    if n <= 1:
        return 0.0
    wire = allreduce(m) if allreduce is not None else 2 * (n - 1) * send(m / n)
    return wire + task + copy(m)


def executed_allreduce16(send: Curve, copy: Curve, task: float, m: float, n: int,
                         allreduce: Optional[Curve] = None) -> float:
    """The same m fp32 bytes sent as bf16 (hipress.sync.allreduce with wire=torch.bfloat16):
    half the bytes on the links (the collective priced at m/2 bytes, as fp32's of that size),
    and otherwise the fp32 path's costs: the optimizer casts each fp32 gradient in its copy into
    the bucket (_Bucket.send_bf16; a bf16 write where fp32's copy writes fp32), and the average
    goes back into the gradients in one pass, as fp32's does. (A bucket of other gradients is
    cast by a task of its own, a pass more, which this leaves unpriced.)

        T = A(m/2) + o + pass(m)     (A(m/2) or 2(N-1) S(m/2N), as above)
    """
    if n <= 1:
        return 0.0
    wire = allreduce(m / 2) if allreduce is not None else 2 * (n - 1) * send(m / (2 * n))
    return wire + task + copy(m)


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
    # the uncompressed branch travels as bf16 (the plain16 path beat fp32; t_orig is its time)
    bf16: bool = False

    @property
    def t_best(self) -> float:
        return self.t_cpr if self.compress else self.t_orig


@dataclass(frozen=True)
class CostModel:
    """The sync time of one gradient for one cluster shape and compression algorithm.

    send(m): seconds of one transfer of m bytes between two peers; enc(m): seconds to
    encode m fp32 bytes; dec(m): seconds to decode an m-byte *compressed* payload.
    n: workers (ring) or aggregators (ps); rate: compressed / original bytes.

    Paper strategies ("paper_ring", "paper_ps", "paper_ps_colocated"): equations 1 and 2
    with :func:`sync_params`, K counting the paper's partitions (ring chunks for "paper_ring").

    Executed strategies ("ring", "ps", "allgather": hipress's CaSync-Ring, CaSync-PS and GRACE's
    allgather): the critical path of the task graph hipress.sync builds for K *executed* partitions
    (:func:`executed_ring`, :func:`executed_ps`, :func:`executed_allgather`), which also needs
      enc_plain / dec_plain: the uncompressed path's operators (hipress synchronizes
          uncompressed gradients through the identity codec: encode is a view, decode
          a copy or merge-add); dec_plain(m) also prices any memory pass over m bytes
          (framing copies, zero fills, the final divide by N);
      task_s: the engine's hand-off of one compute task (submit, run, completion);
      send_one: CaSync-PS's T_send with a single aggregator (send: with N); with A
          aggregators the model interpolates linearly in A (the bytes on the busiest
          link are the same, the number of messages posted is not);
      plain_allreduce: uncompressed gradients go through the backend's allreduce (what
          hipress does where the transport has one) rather than through the strategy's own
          graph: their time is :func:`executed_allreduce`;
      allreduce: that collective's measured time (bytes -> seconds); None (profiles measured
          before it): priced from ``send``.
      plain16: that allreduce also sums bf16, so an uncompressed gradient may travel as bf16
          where :func:`executed_allreduce16` beats it (``decide(allow_16bit=True)``).
      plain_fusion_bytes: runs of buckets the plan leaves uncompressed are fused up to this many
          bytes before they are sent (the optimizer's ``fuse_uncompressed``), so the plain branch
          of a smaller bucket is priced as its share of one allreduce of that size, m / F times
          T(F): priced alone, a 1 MiB bucket paid the allreduce's fixed costs by itself, and the
          plan compressed every bucket of a model whose fused fp32 sync was faster (BERT-like,
          docs/benchmarks.md). 0: each bucket alone. Optimistic for a lone uncompressed bucket
          between compressed ones, which is sent by itself.
    Curves left out (profiles measured before they existed) cost nothing; send_one
    defaults to send.
    """

    send: Curve
    enc: Curve
    dec: Curve
    n: int
    strategy: str = "paper_ps_colocated"
    category: str = "quantization"
    rate: float = 1.0 / 16
    enc_plain: Optional[Curve] = None
    dec_plain: Optional[Curve] = None
    task_s: float = 0.0
    send_one: Optional[Curve] = None
    plain_allreduce: bool = False
    plain16: bool = False
    plain_fusion_bytes: float = 0.0
    allreduce: Optional[Curve] = None

    def __post_init__(self):
        if self.strategy in EXECUTED_STRATEGIES:
            if self.category == "lowrank":
                raise ValueError(f"{self.strategy} models single-round compressors; low-rank (multi-round) "
                                 f"compressors are synchronized by hipress.sync.lowrank, which has no model")
            sync_params("paper_ring", self.category, self.n, 1)  # validates category and n
        else:
            sync_params(self.strategy, self.category, self.n, 1)  # validates
        if not (math.isfinite(self.rate) and self.rate > 0):
            raise ValueError(f"rate must be a positive finite number, got {self.rate}")
        if not (math.isfinite(self.task_s) and self.task_s >= 0):
            raise ValueError(f"task_s must be a finite number >= 0, got {self.task_s}")
        if not (math.isfinite(self.plain_fusion_bytes) and self.plain_fusion_bytes >= 0):
            raise ValueError(f"plain_fusion_bytes must be a finite number >= 0, got {self.plain_fusion_bytes}")

    @property
    def offers_bf16(self) -> bool:
        """Whether an uncompressed gradient may travel as bf16: through the backend's allreduce
        (plain_allreduce) where it sums bf16 (plain16), under an executed strategy."""
        return self.plain16 and self.plain_allreduce and self.strategy in EXECUTED_STRATEGIES

    def params(self, k: int) -> SyncParams:
        return sync_params(self.strategy, self.category, self.n, k)

    def t_orig(self, m: float, k: int) -> float:
        """Equation 1, with ceil(K/N) sequential rounds when K > N (paper strategies)."""
        part = m / k
        return sum(self.params(kb).alpha * self.send(part) for kb in rounds(self.n, k))

    def t_cpr(self, m: float, k: int) -> float:
        """Equation 2, with ceil(K/N) sequential rounds when K > N (paper strategies)."""
        part, r = m / k, self.rate
        total = 0.0
        for kb in rounds(self.n, k):
            p = self.params(kb)
            total += p.alpha * self.send(r * part) + p.beta * self.enc(part) + p.gamma * self.dec(r * part)
        return total

    def t_sync(self, m: float, compress: bool, k: int, bf16: bool = False) -> float:
        """Predicted time of m bytes synchronized (compressed or not; uncompressed as bf16 with
        ``bf16``) in K partitions: the executed graph for hipress's strategies, equation 1 or 2
        for the paper's rows."""
        if self.strategy not in EXECUTED_STRATEGIES:
            return self.t_cpr(m, k) if compress else self.t_orig(m, k)
        copy, one = self.dec_plain or _zero, self.send_one or self.send
        if not compress and self.plain_allreduce:
            run = executed_allreduce16 if bf16 else executed_allreduce
            f = self.plain_fusion_bytes
            if f and m < f:
                return m / f * run(self.send, copy, self.task_s, f, self.n, self.allreduce)
            return run(self.send, copy, self.task_s, m, self.n, self.allreduce)
        if compress:
            op = ExecutedOps(self.send, one, self.enc, self.dec, copy, self.task_s, self.rate)
        else:
            op = ExecutedOps(self.send, one, self.enc_plain or _zero, copy, copy, self.task_s, 1.0)
        return EXECUTED[self.strategy](op, m, self.n, int(k))

    def decide(self, m: float, k_max: Optional[int] = None, allow_compress: bool = True,
               k_min: int = 1, bf16: Optional[bool] = False) -> Decision:
        """Minimise over compress in {False, True} and K in k_min..k_max (default N).
        K counts executed partitions for the executed strategies, the paper's K otherwise.
        bf16 (needs plain16): whether the uncompressed branch travels as bf16: None, where it
        is faster than fp32; True, always; False, never.

        Exhaustive over K: the range is small (tens), and with piecewise curves or
        K > N rounds the cost is not convex in K, so a convex search could miss the
        optimum. Ties go to no compression and then to the smaller K.
        """
        k_max = self.n if k_max is None else int(k_max)
        if k_min < 1 or k_max < k_min:
            raise ValueError(f"need 1 <= k_min <= k_max, got k_min={k_min}, k_max={k_max}")
        t_o, k_o = min((self.t_sync(m, False, k), k) for k in range(k_min, k_max + 1))
        if bf16 is not False:
            if not self.offers_bf16:
                if bf16:
                    raise ValueError("bf16=True needs a backend whose allreduce sums bf16 (CostModel.plain16)")
                bf16 = False
            else:
                t16 = self.t_sync(m, False, k_o, bf16=True)
                bf16 = bool(bf16) or t16 < t_o
                if bf16:
                    t_o = t16  # K: as fp32's (the partitions of a bucket are one collective)
        if allow_compress:
            t_c, k_c = min((self.t_sync(m, True, k), k) for k in range(k_min, k_max + 1))
        else:
            t_c, k_c = math.inf, k_min
        compress = t_c < t_o
        return Decision(compress, k_c if compress else k_o, t_o, k_o, t_c, k_c, bf16)
