"""One body of transport checks, run by every driver (loopback threads, gloo processes,
mpirun processes): each check moves known bytes and asserts the exact bytes received.

    from hipress.comm.transport.testing import run_checks
    run_checks(transport)            # raises AssertionError naming the check, rank and bytes

Every check is collective: all ranks of the transport must call it together.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch

from hipress.comm.transport.base import Transport, TransportError

__all__ = ["pattern", "CHECKS", "ERROR_CHECKS", "run_checks"]


def pattern(seed: int, n: int, device="cpu") -> torch.Tensor:
    """n deterministic bytes that differ for different seeds and offsets."""
    idx = torch.arange(n, dtype=torch.int64)
    return ((idx * 131 + seed * 7919 + (idx >> 8) * 17) % 251).to(torch.uint8).to(device)


def _eq(name: str, t: Transport, got: torch.Tensor, want: torch.Tensor) -> None:
    got, want = got.cpu(), want.cpu()
    if got.shape != want.shape or not torch.equal(got, want):
        bad = (got != want).nonzero() if got.shape == want.shape else None
        first = int(bad[0]) if bad is not None and len(bad) else None
        raise AssertionError(f"{name}: rank {t.rank}/{t.size} ({t.name}) got wrong bytes: shapes {tuple(got.shape)} vs "
                             f"{tuple(want.shape)}, first difference at {first}"
                             + (f" (got {int(got[first])}, want {int(want[first])})" if first is not None else ""))


# sizes used by the checks: zero, tiny, odd, page-ish, and one above a megabyte
SIZES = [0, 1, 7, 4096 + 3, (1 << 20) + 5]


def check_send_recv(t: Transport) -> None:
    """Every ordered pair exchanges messages of every size, one pair at a time."""
    for i in range(t.size):
        for j in range(t.size):
            if i == j:
                continue
            for k, n in enumerate(SIZES):
                seed = 1000 * i + 100 * j + k
                if t.rank == i:
                    t.send(pattern(seed, n), j, tag=k)
                elif t.rank == j:
                    buf = torch.full((n,), 255, dtype=torch.uint8)
                    t.recv(buf, i, tag=k)
                    _eq(f"send_recv {i}->{j} {n}B", t, buf, pattern(seed, n))


def check_sendrecv_ring(t: Transport) -> None:
    """Ring steps to the right and to the left, sizes differing per sender (zero included);
    each also as sendrecv_alloc, whose receiver does not know the size."""
    n, r = t.size, t.rank
    for shift in (1, -1):
        dst, src = (r + shift) % n, (r - shift) % n
        for k in range(len(SIZES)):
            size_of = lambda rank: SIZES[(k + rank) % len(SIZES)]  # noqa: E731
            out = pattern(50 + 10 * r + k, size_of(r))
            want = pattern(50 + 10 * src + k, size_of(src))
            buf = torch.full((size_of(src),), 255, dtype=torch.uint8)
            t.sendrecv(out, dst, buf, src)
            _eq(f"sendrecv shift {shift} k {k}", t, buf, want)
            _eq(f"sendrecv_alloc shift {shift} k {k}", t, t.sendrecv_alloc(out, dst, src), want)


def check_exchange(t: Transport) -> None:
    """``exchange`` (sizes known to both ends): a ring step each way, one leg absent on some
    ranks; where the backend posts many messages at once, every rank to every other (sizes
    per pair, zero included) and a star (all to rank 0, which sends nothing); elsewhere, several
    peers are refused before anything moves."""
    n, r = t.size, t.rank

    def size_of(src: int, dst: int, k: int) -> int:
        return SIZES[(3 * src + dst + k) % len(SIZES)]

    for k, shift in enumerate((1, -1)):
        dst, src = (r + shift) % n, (r - shift) % n
        send_leg = r % 2 == 0 or n == 1  # odd ranks only receive, and their receivers get nothing
        out = {dst: pattern(900 + 10 * r + k, size_of(r, dst, k))} if send_leg and dst != r else {}
        src_sends = (src % 2 == 0) and src != r
        got = {src: torch.full((size_of(src, r, k),), 255, dtype=torch.uint8)} if src_sends else {}
        t.exchange(out, got)
        for s, buf in got.items():
            _eq(f"exchange ring shift {shift}", t, buf, pattern(900 + 10 * s + k, size_of(s, r, k)))
    if n < 3:
        return
    others = [p for p in range(n) if p != r]
    if not t.p2p_many:
        _expect_error("exchange with several peers", t, lambda: t.exchange(
            {p: pattern(1, 4) for p in others}, {p: torch.empty(4, dtype=torch.uint8) for p in others}), True,
            "one send and one receive at a time")
        return
    got = {p: torch.full((size_of(p, r, 7),), 255, dtype=torch.uint8) for p in others}
    t.exchange({p: pattern(950 + 10 * r + p, size_of(r, p, 7)) for p in others}, got)
    for p, buf in got.items():
        _eq(f"exchange all to all from {p}", t, buf, pattern(950 + 10 * p + r, size_of(p, r, 7)))
    star = {p: torch.empty(100 + p, dtype=torch.uint8) for p in others} if r == 0 else {}
    t.exchange({} if r == 0 else {0: pattern(990 + r, 100 + r)}, star)
    for p, buf in star.items():
        _eq(f"exchange star from {p}", t, buf, pattern(990 + p, 100 + p))


def _a2a_counts(n: int, scale: int, variant: int) -> List[List[int]]:
    """counts[i][j]: bytes rank i sends to rank j; uneven, with zeros (self included)."""
    if variant == 0:
        return [[((i * 7 + j * 3 + 1) % 5) * scale + (i + 2 * j) % 3 if (i + j) % 4 != 1 else 0 for j in range(n)] for i in range(n)]
    if variant == 1:
        return [[scale] * n for _ in range(n)]
    if variant == 2:
        return [[0] * n for _ in range(n)]
    return [[scale * (j + 1) if i == 0 else 0 for j in range(n)] for i in range(n)]  # only rank 0 sends


def check_alltoallv(t: Transport) -> None:
    """Uneven counts with zeros; each exchange also as alltoallv_alloc, whose receivers learn
    the counts from the transport."""
    n, r = t.size, t.rank
    for scale in (1, 1000, 300_001):
        for variant in range(4):
            counts = _a2a_counts(n, scale, variant)
            sc = counts[r]
            rc = [counts[i][r] for i in range(n)]
            send = torch.cat([pattern(10_000 + 100 * r + j + scale, sc[j]) for j in range(n)]
                             + [torch.full((2,), 7, dtype=torch.uint8)])  # longer than the counts: tail not sent
            recv = torch.full((sum(rc) + 3,), 255, dtype=torch.uint8)  # longer than needed: tail untouched
            t.alltoallv(send, sc, recv, rc)
            want = torch.cat([pattern(10_000 + 100 * i + r + scale, rc[i]) for i in range(n)])
            what = f"scale {scale} variant {variant} counts {counts}"
            _eq(f"alltoallv {what}", t, recv, torch.cat([want, torch.full((3,), 255, dtype=torch.uint8)]))
            got, got_rc = t.alltoallv_alloc(send, sc)
            if got_rc != rc:
                raise AssertionError(f"alltoallv_alloc {what}: rank {r} got counts {got_rc}, want {rc}")
            _eq(f"alltoallv_alloc {what}", t, got, want)


def check_allgather(t: Transport) -> None:
    n, r = t.size, t.rank
    for m in (0, 1, 13, 65536 + 1):
        recv = torch.full((n * m,), 255, dtype=torch.uint8)
        t.allgather(pattern(700 + r + m, m), recv)
        _eq(f"allgather {m}B", t, recv, torch.cat([pattern(700 + i + m, m) for i in range(n)]))


def check_allgatherv(t: Transport) -> None:
    n, r = t.size, t.rank
    for scale in (1, 4099):
        for rc in ([(i * 5 + 2) % 4 * scale for i in range(n)], [0] * n, [scale if i == n - 1 else 0 for i in range(n)]):
            recv = torch.full((sum(rc),), 255, dtype=torch.uint8)
            t.allgatherv(pattern(900 + r + scale, rc[r]), recv, rc)
            _eq(f"allgatherv counts {rc}", t, recv, torch.cat([pattern(900 + i + scale, rc[i]) for i in range(n)]))
            # in place: this rank's part sent from its own place in recv_buf (dear's all-gather)
            want = torch.cat([pattern(950 + i + scale, rc[i]) for i in range(n)])
            recv = torch.full((sum(rc),), 255, dtype=torch.uint8)
            at = sum(rc[:r])
            recv[at:at + rc[r]] = want[at:at + rc[r]]
            t.allgatherv(recv[at:at + rc[r]], recv, rc)
            _eq(f"allgatherv in place, counts {rc}", t, recv, want)


def check_broadcast(t: Transport) -> None:
    n, r = t.size, t.rank
    for root in range(n):
        for m in (0, 5, 200_003):
            buf = pattern(1300 + root + m, m) if r == root else torch.full((m,), 255, dtype=torch.uint8)
            t.broadcast(buf, root)
            _eq(f"broadcast root {root} {m}B", t, buf, pattern(1300 + root + m, m))


def check_allreduce(t: Transport) -> None:
    """Sums of small integers (exact in fp32 whatever order the backend adds in), sizes from
    nothing to above a megabyte, every rank the same bits; the same in each 16-bit dtype the
    backend sums; then a length that differs on the
    last rank raises on every rank (with checking). Skipped by backends without one."""
    if not t.has_allreduce:
        return
    n, r = t.size, t.rank
    for m in (0, 1, 7, 4096 + 3, (1 << 18) + 5):
        values = pattern(1700 + r + m, m).float()
        t.allreduce(values)
        want = sum(pattern(1700 + i + m, m).float() for i in range(n)) if m else torch.empty(0)
        _eq(f"allreduce {m} floats", t, values.view(torch.uint8), want.view(torch.uint8))
    for dtype in t.allreduce_dtypes:  # 16-bit sums too, where the backend has them (small integers: exact)
        if dtype != torch.float32:
            values = (pattern(1800 + r, 4099) % 16).to(dtype)
            t.allreduce(values)
            want = sum((pattern(1800 + i, 4099) % 16).float() for i in range(n)).to(dtype)
            _eq(f"allreduce {dtype}", t, values.view(torch.uint8), want.view(torch.uint8))
    if t.check and n > 1:
        _expect_error("allreduce length mismatch", t, lambda: t.allreduce(torch.zeros(3 + (r == n - 1))), True,
                      "element counts differ")
        values = torch.full((5,), float(r + 1))  # still usable after the error
        t.allreduce(values)
        _eq("allreduce after an error", t, values.view(torch.uint8),
            torch.full((5,), float(n * (n + 1) // 2)).view(torch.uint8))


def check_barrier(t: Transport) -> None:
    for _ in range(3):
        t.barrier()


def check_groups(t: Transport) -> None:
    """split by parity and subgroup in reversed order; collectives inside the groups."""
    n, r = t.size, t.rank
    sub = t.split(r % 2, key=-r)  # descending parent rank
    members = sorted((i for i in range(n) if i % 2 == r % 2), reverse=True)
    assert sub is not None and sub.size == len(members) and sub.rank == members.index(r), \
        f"split: rank {r} got {sub!r}, expected rank {members.index(r)} of {len(members)}"
    recv = torch.empty(sub.size * 4, dtype=torch.uint8)
    sub.allgather(pattern(r, 4), recv)
    _eq("split allgather", t, recv, torch.cat([pattern(m, 4) for m in members]))
    if sub.size > 1:
        counts = _a2a_counts(sub.size, 3, 0)
        s = sub.rank
        send = torch.cat([pattern(40 * members[s] + j, counts[s][j]) for j in range(sub.size)])
        rc = [counts[i][s] for i in range(sub.size)]
        recv = torch.empty(sum(rc), dtype=torch.uint8)
        sub.alltoallv(send, counts[s], recv, rc)
        _eq("split alltoallv", t, recv, torch.cat([pattern(40 * members[i] + s, rc[i]) for i in range(sub.size)]))
    if n >= 2:
        ranks = [n - 1, 0]
        g = t.subgroup(ranks)
        if r in ranks:
            assert g is not None and g.size == 2 and g.rank == ranks.index(r), f"subgroup: rank {r} got {g!r}"
            buf = pattern(77, 1000) if g.rank == 0 else torch.zeros(1000, dtype=torch.uint8)
            g.broadcast(buf, 0)
            _eq("subgroup broadcast", t, buf, pattern(77, 1000))
            other = 1 - g.rank
            out = torch.empty(10, dtype=torch.uint8)
            g.sendrecv(pattern(g.rank, 10), other, out, other)
            _eq("subgroup sendrecv", t, out, pattern(other, 10))
        else:
            assert g is None, f"subgroup: non-member rank {r} got {g!r}"
    t.barrier()


def _expect_error(name: str, t: Transport, fn: Callable[[], None], must_raise: bool, needle: str = "") -> None:
    try:
        fn()
    except TransportError as e:
        if not must_raise and needle == "":
            raise AssertionError(f"{name}: rank {t.rank} raised unexpectedly: {e}") from e
        if needle and needle not in str(e):
            raise AssertionError(f"{name}: rank {t.rank} error lacks {needle!r}: {e}") from e
        return
    if must_raise:
        raise AssertionError(f"{name}: rank {t.rank} did not raise a TransportError")


def check_mismatch_errors(t: Transport) -> None:
    """Disagreeing shapes raise TransportError (on every rank for collectives) and the
    transport stays usable afterwards. Needs ``t.check``."""
    n, r = t.size, t.rank
    if n < 2:
        return
    # alltoallv: rank 0 claims to send one byte more to rank 1 than rank 1 expects
    sc = [1] * n
    rc = [1] * n
    if r == 0:
        sc[1] = 2
    send = torch.zeros(sum(sc), dtype=torch.uint8)
    recv = torch.zeros(sum(rc), dtype=torch.uint8)
    _expect_error("alltoallv count mismatch", t, lambda: t.alltoallv(send, sc, recv, rc), True, "rank 0 sends 2 bytes to rank 1")
    # alltoallv: recv buffer too small on the last rank -> every rank raises
    rc2 = [4] * n
    recv2 = torch.zeros(4 * n - (1 if r == n - 1 else 0), dtype=torch.uint8)
    _expect_error("alltoallv small recv_buf", t,
                  lambda: t.alltoallv(torch.zeros(4 * n, dtype=torch.uint8), [4] * n, recv2, rc2), True)
    # allgatherv: last rank's recv_counts disagree
    rcv = [3] * n
    if r == n - 1:
        rcv[0] = 4
    _expect_error("allgatherv mismatch", t, lambda: t.allgatherv(torch.zeros(rcv[r], dtype=torch.uint8),
                                                                 torch.zeros(sum(rcv), dtype=torch.uint8), rcv), True)
    # broadcast: sizes differ
    _expect_error("broadcast size mismatch", t, lambda: t.broadcast(torch.zeros(5 + (r == n - 1), dtype=torch.uint8), 0), True)
    # allgather: sizes differ
    _expect_error("allgather size mismatch", t, lambda: t.allgather(torch.zeros(2 + (r == 1), dtype=torch.uint8),
                                                                    torch.zeros(3 * n, dtype=torch.uint8)), True)
    # recv buffer too small / too large: only the receiver raises; the stream stays in step
    for k, (sent, room) in enumerate(((10, 5), (5, 10), (0, 3), (3, 0))):
        if r == 0:
            t.send(pattern(k, sent), 1, tag=k)
        elif r == 1:
            _expect_error(f"recv {sent}B into {room}B", t, lambda: t.recv(torch.zeros(room, dtype=torch.uint8), 0, tag=k),
                          True, f"rank 0 sent {sent} bytes")
    # alltoallv_alloc: the last rank's counts overrun its buffer -> every rank raises
    bad_sc = [2] * n
    _expect_error("alltoallv_alloc counts overrun", t,
                  lambda: t.alltoallv_alloc(torch.zeros(2 * n - (1 if r == n - 1 else 0), dtype=torch.uint8), bad_sc),
                  True, "invalid arguments" if r != n - 1 else "send_counts sum")
    # ... and a correct exchange after all that still delivers the right bytes
    check_alltoallv_small(t)
    if r == 0:
        t.send(pattern(99, 33), 1, tag=3)
    elif r == 1:
        buf = torch.zeros(33, dtype=torch.uint8)
        t.recv(buf, 0, tag=3)
        _eq("recv after mismatches", t, buf, pattern(99, 33))
    t.barrier()


def check_alltoallv_small(t: Transport) -> None:
    n, r = t.size, t.rank
    counts = _a2a_counts(n, 2, 0)
    sc = counts[r]
    rc = [counts[i][r] for i in range(n)]
    send = torch.cat([pattern(5000 + 10 * r + j, sc[j]) for j in range(n)])
    recv = torch.empty(sum(rc), dtype=torch.uint8)
    t.alltoallv(send, sc, recv, rc)
    _eq("alltoallv small", t, recv, torch.cat([pattern(5000 + 10 * i + r, rc[i]) for i in range(n)]))


CHECKS: Dict[str, Callable[[Transport], None]] = {
    "send_recv": check_send_recv,
    "sendrecv_ring": check_sendrecv_ring,
    "exchange": check_exchange,
    "alltoallv": check_alltoallv,
    "allgather": check_allgather,
    "allgatherv": check_allgatherv,
    "broadcast": check_broadcast,
    "allreduce": check_allreduce,
    "barrier": check_barrier,
    "groups": check_groups,
}
ERROR_CHECKS: Dict[str, Callable[[Transport], None]] = {
    "mismatch_errors": check_mismatch_errors,
}


def run_checks(t: Transport, names: Optional[List[str]] = None, errors: bool = True) -> List[str]:
    """Run the named checks (default: all, plus the error checks when ``t.check``)."""
    table = dict(CHECKS)
    if errors and t.check:
        table.update(ERROR_CHECKS)
    names = list(table) if names is None else names
    for name in names:
        table[name](t)
    return names
