"""One transport interface on byte buffers, implemented over MPI, torch.distributed,
NCCL and in-process threads (loopback).

Every buffer is a 1-D, contiguous ``torch.uint8`` tensor (CPU; CUDA where the backend
allows), except ``allreduce``'s, which sums ``torch.float32`` values. The caller owns and sizes every buffer, except in the two ``*_alloc`` operations,
which exist for payloads whose size only the sender knows (sparsified gradients): they
move the sizes with the data in one protocol instead of a separate exchange.

Operations (all ranks of the transport call the collectives in the same order):

    send(buf, dst, tag=0)             recv(buf, src, tag=0)        # caller sizes buf exactly
    sendrecv(send_buf, dst, recv_buf, src)                          # one ring step
    alltoallv(send_buf, send_counts, recv_buf, recv_counts)         # the bulk step
    sendrecv_alloc(send_buf, dst, src) -> recv_buf                  # ... receive size not known:
    alltoallv_alloc(send_buf, send_counts) -> recv_buf, recv_counts # the transport allocates
    allgather(send_buf, recv_buf)     allgatherv(send_buf, recv_buf, recv_counts)
    broadcast(buf, root)              barrier()
    allreduce(values)                                               # fp32 sum, in place (optional:
                                                                    # see has_allreduce)
    split(color, key=None)            subgroup(ranks)               # sub-transports
    close()

Layout of ``alltoallv``: ``send_buf`` holds the segments for rank 0, 1, ..., size-1
back to back, ``send_counts[j]`` bytes for rank j (zero allowed); ``recv_buf`` receives
``recv_counts[i]`` bytes from rank i at offset ``sum(recv_counts[:i])``. Buffers may be
longer than the sum of their counts; the tail is left alone.

Checking. With ``check=True`` (the default; ``HIPRESS_TRANSPORT_CHECK=0`` turns it off)
every collective first all-gathers a few int64 of metadata (counts, buffer sizes, a
local-error flag) so that all ranks agree on the shapes *before* a byte moves: a count
that disagrees between two ranks, a buffer that is too small, or a bad root raises the
same :class:`TransportError` on every rank, and the transport stays usable. Point-to-point
messages carry an 8-byte header with the payload size; a receiver whose buffer does not
match drains the payload into scratch (keeping the stream in step) and raises. With
checks off, mismatches are undefined behaviour of the backend (gloo aborts the process).

Failure. Every wait is bounded by ``timeout_s`` (``HIPRESS_TIMEOUT_S``, default 60 s):
a peer that dies or never arrives ends the wait with a :class:`TransportError` naming
the operation and the peer(s), never a hang.

Implementing a backend: subclass :class:`Transport` and implement the ``_raw_*`` methods,
which may assume validated, consistent arguments, zero-length segments included.
"""
from __future__ import annotations

import abc
import struct
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from hipress import config

__all__ = ["Transport", "TransportError", "default_timeout_s", "default_check", "MAX_TAG"]

#: user tags for send/recv must lie in [0, MAX_TAG) (two backend tags per user tag;
#: MPI guarantees tags up to 32767).
MAX_TAG = 16000


class TransportError(RuntimeError):
    """A transport operation failed: a peer died, timed out, or the ranks disagree.

    ``op`` names the operation, ``peers`` the ranks (of this transport) involved,
    ``rank`` the rank that raised it.
    """

    def __init__(self, op: str, message: str, peers: Optional[Sequence[int]] = None,
                 rank: Optional[int] = None, transport: Optional[str] = None):
        self.op = op
        self.peers = sorted(set(int(p) for p in peers)) if peers is not None else None
        self.rank = rank
        self.transport = transport
        where = f"{transport} " if transport else ""
        who = f"rank {rank}: " if rank is not None else ""
        peer_s = f" (peers {self.peers})" if self.peers is not None else ""
        super().__init__(f"hipress {where}{op} failed on {who}{message}{peer_s}")


def default_timeout_s() -> float:
    """``HIPRESS_TIMEOUT_S`` (seconds, > 0: no wait may be unbounded)."""
    return config.get("HIPRESS_TIMEOUT_S")


def default_check() -> bool:
    return config.get("HIPRESS_TRANSPORT_CHECK")


_HDR = struct.Struct("<q")  # point-to-point header: payload size in bytes


def _is_byte_buffer(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1 and t.is_contiguous()


class Transport(abc.ABC):
    """Byte-buffer transport over ``size`` ranks; this object is rank ``rank``.

    A transport is used by one thread at a time (hipress's comm thread); it is not
    thread-safe. Collectives must be called by every rank in the same order.
    """

    #: short backend name ("torch", "mpi", "nccl", "loopback")
    name: str = "transport"

    def __init__(self, rank: int, size: int, timeout_s: Optional[float] = None, check: Optional[bool] = None):
        self._rank = int(rank)
        self._size = int(size)
        self.timeout_s = default_timeout_s() if timeout_s is None else float(timeout_s)
        self.check = default_check() if check is None else bool(check)
        self._closed = False
        self._subgroups: list = []

    # ------------------------------------------------------------------ identity
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        return f"<hipress {self.name} transport rank {self._rank}/{self._size}>"

    # ------------------------------------------------------------------ helpers
    def _err(self, op: str, message: str, peers: Optional[Sequence[int]] = None) -> TransportError:
        return TransportError(op, message, peers, self._rank, self.name)

    def _ensure_open(self, op: str) -> None:
        if self._closed:
            raise self._err(op, "transport is closed")

    def _check_buf(self, op: str, what: str, t) -> Optional[str]:
        if not _is_byte_buffer(t):
            if not isinstance(t, torch.Tensor):
                return f"{what} must be a torch.uint8 tensor, got {type(t).__name__}"
            return (f"{what} must be a 1-D contiguous torch.uint8 tensor, got dtype {t.dtype}, "
                    f"shape {tuple(t.shape)}, contiguous={t.is_contiguous()}")
        return self._check_device(what, t)

    def _check_device(self, what: str, t: torch.Tensor) -> Optional[str]:
        """Backends override to reject devices they cannot move (return a message)."""
        if t.device.type != "cpu":
            return f"{what} is on {t.device}; the {self.name} transport takes CPU buffers"
        return None

    def _check_peer(self, op: str, peer: int, what: str) -> None:
        if not isinstance(peer, int) or not 0 <= peer < self._size:
            raise self._err(op, f"{what} {peer!r} is not a rank of this transport (size {self._size})")

    def _check_tag(self, op: str, tag: int) -> None:
        if not isinstance(tag, int) or not 0 <= tag < MAX_TAG:
            raise self._err(op, f"tag {tag!r} must be an int in [0, {MAX_TAG})")

    def _meta_gather(self, op: str, values: Sequence[int]) -> List[List[int]]:
        """All-gather ``len(values)`` int64 from every rank (same length everywhere)."""
        n = len(values)
        send = torch.tensor(list(values), dtype=torch.int64).view(torch.uint8)
        recv = torch.empty(n * self._size, dtype=torch.int64)
        self._raw_allgather(self._meta_device(send), self._meta_device(recv.view(torch.uint8)), op)
        return recv.view(self._size, n).tolist()

    def _meta_device(self, t: torch.Tensor) -> torch.Tensor:
        return t

    # ------------------------------------------------------------------ point to point
    def _check_p2p(self, what: str, role: str, peer: int, tag: int, buf: torch.Tensor, to_self: str) -> str:
        """Checks one send/recv (open, peer, tag, buffer, not this rank); returns its op name for errors."""
        op = f"{what}({role}={peer}, tag={tag})"
        self._ensure_open(op)
        self._check_peer(op, peer, role)
        self._check_tag(op, tag)
        bad = self._check_buf(op, "buf", buf)
        if bad:
            raise self._err(op, bad, [peer])
        if peer == self._rank:
            raise self._err(op, to_self, [peer])
        return op

    def send(self, buf: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Send all of ``buf`` to rank ``dst``; returns once ``buf`` may be reused."""
        op = self._check_p2p("send", "dst", dst, tag, buf, "send to self is not supported (use a local copy)")
        n = buf.numel()
        msgs = [(self._header(n, buf), 2 * tag)] if self.check else []
        if n:
            msgs.append((buf, 2 * tag + 1))
        if msgs:
            self._raw_send_many(msgs, dst, op)

    def recv(self, buf: torch.Tensor, src: int, tag: int = 0) -> None:
        """Receive exactly ``buf.numel()`` bytes from rank ``src`` into ``buf``."""
        op = self._check_p2p("recv", "src", src, tag, buf, "recv from self is not supported")
        n = buf.numel()
        if self.check:
            hdr = self._header(0, buf)
            self._raw_recv(hdr, src, 2 * tag, op)
            sent = self._header_value(hdr)
            if sent != n:
                if sent > 0:  # drain the payload so the stream stays in step
                    self._raw_recv(torch.empty(sent, dtype=torch.uint8, device=buf.device), src, 2 * tag + 1, op)
                raise self._err(op, f"rank {src} sent {sent} bytes but the receive buffer holds {n}", [src])
        if n:
            self._raw_recv(buf, src, 2 * tag + 1, op)

    def sendrecv(self, send_buf: torch.Tensor, dst: int, recv_buf: torch.Tensor, src: int) -> None:
        """Send ``send_buf`` to ``dst`` while receiving ``recv_buf`` from ``src`` (a ring step).

        Either peer may be this rank only if both are (a plain copy)."""
        op = f"sendrecv(dst={dst}, src={src})"
        self._ensure_open(op)
        self._check_peer(op, dst, "dst")
        self._check_peer(op, src, "src")
        for what, t in (("send_buf", send_buf), ("recv_buf", recv_buf)):
            bad = self._check_buf(op, what, t)
            if bad:
                raise self._err(op, bad, [dst, src])
        if dst == self._rank or src == self._rank:
            if dst == src == self._rank:
                if send_buf.numel() != recv_buf.numel():
                    raise self._err(op, f"self sendrecv of {send_buf.numel()} bytes into {recv_buf.numel()}", [src])
                recv_buf.copy_(send_buf)
                return
            raise self._err(op, "sendrecv with self on one side only is not supported", [dst, src])
        ns, nr = send_buf.numel(), recv_buf.numel()
        if self.check:
            hs, hr = self._header(ns, send_buf), self._header(0, recv_buf)
            self._raw_sendrecv(hs, dst, hr, src, op)
            sent = self._header_value(hr)
            if sent != nr:
                scratch = torch.empty(sent, dtype=torch.uint8, device=recv_buf.device)
                self._raw_sendrecv(send_buf if ns else None, dst, scratch if sent else None, src, op)
                raise self._err(op, f"rank {src} sent {sent} bytes but the receive buffer holds {nr}", [src])
        if ns or nr:
            self._raw_sendrecv(send_buf if ns else None, dst, recv_buf if nr else None, src, op)

    def sendrecv_alloc(self, send_buf: Optional[torch.Tensor], dst: Optional[int], src: Optional[int],
                       max_bytes: Optional[int] = None) -> Optional[torch.Tensor]:
        """A ring step whose receive size is not known in advance: send ``send_buf`` to ``dst``
        and return what ``src`` sent, in a buffer this call allocates (on ``send_buf``'s device,
        else on the CPU).

        One leg may be left out: ``dst=None`` (and ``send_buf=None``) only receives, and
        ``src=None`` only sends and returns None (the coordinator's slots, where a rank may
        only send or only receive). The peer's call must have the matching leg.

        The sizes travel first, then the payload: two backend exchanges, with or without
        checking (a caller exchanging a byte count over checked ``sendrecv`` pays four).

        ``max_bytes``: the most this rank will accept from ``src`` (what the receiver knows,
        e.g. the compressor's ``max_encoded_bytes`` for the chunk it expects). A larger
        announcement raises :class:`TransportError` naming ``src`` before anything of that
        size is allocated; ``send_buf`` still goes to ``dst``, so ``dst`` is not left waiting,
        but ``src``'s payload is never received: its send fails or times out on ``src``
        (eager backends complete it and leave it undelivered), and the link from ``src`` is
        out of step afterwards. Treat the error as fatal for the job, like a timeout."""
        op = f"sendrecv_alloc(dst={dst}, src={src})"
        self._ensure_open(op)
        peers = [p for p in (dst, src) if p is not None]
        if dst is None and src is None:
            raise self._err(op, "needs a dst, a src or both")
        if (dst is None) != (send_buf is None):
            raise self._err(op, "send_buf and dst go together (both None to only receive)", peers)
        if dst is not None:
            self._check_peer(op, dst, "dst")
            bad = self._check_buf(op, "send_buf", send_buf)
            if bad:
                raise self._err(op, bad, peers)
        if src is not None:
            self._check_peer(op, src, "src")
        limit = self._max_bytes(op, max_bytes, peers)
        if self._rank in (dst, src):
            if dst == src == self._rank:
                if limit is not None and send_buf.numel() > limit:
                    raise self._err(op, f"rank {src} announced {send_buf.numel()} bytes, more than the "
                                    f"{limit} this rank accepts (max_bytes)", [src])
                return send_buf.clone()
            raise self._err(op, "sendrecv with self on one side only is not supported", peers)
        ns = send_buf.numel() if send_buf is not None else 0
        device = send_buf.device if send_buf is not None else torch.device("cpu")
        hs = self._header(ns, send_buf) if send_buf is not None else None
        hr = self._header(0, send_buf if send_buf is not None else torch.empty(0, dtype=torch.uint8)) \
            if src is not None else None
        self._raw_sendrecv(hs, dst, hr, src, op)
        if src is None:
            if ns:
                self._raw_sendrecv(send_buf, dst, None, src, op)
            return None
        nr = self._header_value(hr)
        if nr < 0 or (limit is not None and nr > limit):
            if ns:  # our leg of the step, so dst is not left waiting; src's payload is refused
                self._raw_sendrecv(send_buf, dst, None, src, op)
            if nr < 0:
                raise self._err(op, f"rank {src} announced {nr} bytes", [src])
            raise self._err(op, f"rank {src} announced {nr} bytes, more than the {limit} this rank accepts "
                            "(max_bytes); its payload was not received", [src])
        recv_buf = torch.empty(nr, dtype=torch.uint8, device=device)
        if ns or nr:
            self._raw_sendrecv(send_buf if ns else None, dst, recv_buf if nr else None, src, op)
        return recv_buf

    def exchange(self, sends: Dict[int, torch.Tensor], recvs: Dict[int, torch.Tensor]) -> None:
        """Point to point with several peers at once: ``sends[dst]`` goes to each ``dst`` while
        ``recvs[src]`` is filled from each ``src`` (byte buffers of sizes both ends know: no size
        travels); every peer makes the matching call, ranks named nowhere take no part. All are
        posted at once, so this costs one round of latency whatever the number of peers. With one
        destination and one source at most, every backend; more need :attr:`p2p_many`."""
        op = f"exchange(dsts={sorted(sends)}, srcs={sorted(recvs)})"
        self._ensure_open(op)
        peers = sorted(set(sends) | set(recvs))
        for p in peers:
            self._check_peer(op, p, "peer")
            if p == self._rank:
                raise self._err(op, "this rank cannot be its own peer", peers)
        for buf in list(sends.values()) + list(recvs.values()):
            bad = self._check_buf(op, "buffer", buf)
            if bad:
                raise self._err(op, bad, peers)
        out = [(b, d) for d, b in sends.items() if b.numel()]
        into = [(b, s) for s, b in recvs.items() if b.numel()]
        if len(out) <= 1 and len(into) <= 1:
            if out or into:
                (sb, dst), (rb, src) = out[0] if out else (None, None), into[0] if into else (None, None)
                self._raw_sendrecv(sb, dst, rb, src, op)
            return
        if not self.p2p_many:
            raise self._err(op, f"the {self.name} transport posts one send and one receive at a time", peers)
        self._raw_p2p(out, into, op)

    @property
    def p2p_many(self) -> bool:
        """Whether the backend posts sends to and receives from many ranks at once and then waits
        for them all (:meth:`exchange` with several peers)."""
        return False

    def _max_bytes(self, op: str, max_bytes, peers) -> Optional[int]:
        if max_bytes is None:
            return None
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise self._err(op, f"max_bytes must be None or an int >= 0, got {max_bytes!r}", peers)
        return max_bytes

    def _raise_unless_agreed(self, op: str, agreed: List[int]) -> None:
        """Every rank's ``agree_on`` digest (0: none) from the checking round must be the same."""
        if len(set(agreed)) != 1:
            raise self._err(op, f"ranks disagree on what the sizes follow from (agree_on): {agreed}",
                            [i for i, a in enumerate(agreed) if a != agreed[0]] + [0])

    def _header(self, n: int, like: torch.Tensor) -> torch.Tensor:
        h = torch.frombuffer(bytearray(_HDR.pack(n)), dtype=torch.uint8).clone()
        return h.to(like.device) if like.device.type != "cpu" else h

    @staticmethod
    def _header_value(h: torch.Tensor) -> int:
        return _HDR.unpack(bytes(h.cpu().tolist()))[0]

    # ------------------------------------------------------------------ collectives
    def alltoallv(self, send_buf: torch.Tensor, send_counts: Sequence[int],
                  recv_buf: torch.Tensor, recv_counts: Sequence[int], sizes_agreed: bool = False,
                  agree_on: Optional[int] = None) -> None:
        """Rank i sends ``send_counts[j]`` bytes to each rank j (segments in rank order).

        ``agree_on`` and ``sizes_agreed`` as for :meth:`allreduce`: a digest compared in the
        checking round, and the round skipped where an earlier comparison fixed the counts."""
        op = "alltoallv"
        self._ensure_open(op)
        n = self._size
        problems = []
        sc = self._segments(op, "send", send_buf, send_counts, problems)
        rc = self._segments(op, "recv", recv_buf, recv_counts, problems)
        if problems:
            sc = rc = [0] * n
        if self.check and not sizes_agreed:
            rows = self._meta_gather(op, [0 if problems else 1] + sc + rc + [0 if agree_on is None else int(agree_on)])
            self._raise_local_or_remote(op, problems, rows)
            self._raise_unless_agreed(op, [r[-1] for r in rows])
            bad_links = [(i, j, rows[i][1 + j], rows[j][1 + n + i])
                         for i in range(n) for j in range(n) if rows[i][1 + j] != rows[j][1 + n + i]]
            if bad_links:
                desc = "; ".join(f"rank {i} sends {s} bytes to rank {j}, which expects {r}" for i, j, s, r in bad_links[:8])
                more = f" (+{len(bad_links) - 8} more)" if len(bad_links) > 8 else ""
                peers = {p for i, j, _, _ in bad_links for p in (i, j)}
                raise self._err(op, f"send/recv counts disagree: {desc}{more}", sorted(peers))
        elif problems:
            raise self._err(op, "; ".join(problems))
        self._raw_alltoallv(send_buf, sc, recv_buf, rc, op)

    def alltoallv_alloc(self, send_buf: torch.Tensor, send_counts: Sequence[int],
                        max_bytes=None):
        """The bulk step when receivers do not know what they get: rank i sends
        ``send_counts[j]`` bytes to each rank j; returns ``(recv_buf, recv_counts)``, the
        segments from rank 0, 1, ... back to back in a buffer this call allocates.

        Two backend collectives: the counts (with checking, the all-gather that validates
        every rank's arguments carries them), then the payloads.

        ``max_bytes``: the most this rank accepts from each rank (an int for all, or a
        sequence of ``size`` ints or None, one per source; None: no bound), from what the
        receiver knows (``max_encoded_bytes`` of the payloads it expects). A larger count
        raises :class:`TransportError` naming the sender before the payload buffer is
        allocated. With checking, every rank's bounds travel in the validating all-gather, so
        every rank raises the same error and no payload moves (the transport stays usable);
        without it, only the receiver knows: it raises, and the senders' payload collective
        fails when it times out."""
        op = "alltoallv_alloc"
        self._ensure_open(op)
        n = self._size
        problems = []
        sc = self._segments(op, "send", send_buf, send_counts, problems)
        limits = self._limits(max_bytes, problems)
        if problems:
            sc = [0] * n
            limits = [-1] * n
        if self.check:
            rows = self._meta_gather(op, [0 if problems else 1] + sc + limits)
            self._raise_local_or_remote(op, problems, rows)
            rc = [rows[i][1 + self._rank] for i in range(n)]
            over = [(i, j, rows[i][1 + j], rows[j][1 + n + i]) for i in range(n) for j in range(n)
                    if 0 <= rows[j][1 + n + i] < rows[i][1 + j]]
            if over:
                desc = "; ".join(f"rank {i} announced {c} bytes to rank {j}, which accepts at most {m}"
                                 for i, j, c, m in over[:8])
                more = f" (+{len(over) - 8} more)" if len(over) > 8 else ""
                raise self._err(op, f"counts over the receivers' max_bytes: {desc}{more}",
                                sorted({p for i, j, _, _ in over for p in (i, j)}))
        elif problems:
            raise self._err(op, "; ".join(problems))
        else:
            counts_in = self._meta_device(torch.empty(8 * n, dtype=torch.uint8))
            self._raw_alltoallv(self._meta_device(torch.tensor(sc, dtype=torch.int64).view(torch.uint8)), [8] * n,
                                counts_in, [8] * n, op)
            rc = counts_in.cpu().view(torch.int64).tolist()
            over = [i for i in range(n) if rc[i] < 0 or 0 <= limits[i] < rc[i]]
            if over:
                raise self._err(op, "; ".join(f"rank {i} announced {rc[i]} bytes, this rank accepts at most "
                                              f"{limits[i] if limits[i] >= 0 else 0}" for i in over[:8])
                                + " (max_bytes); the payload exchange was not joined", over)
        recv_buf = torch.empty(sum(rc), dtype=torch.uint8, device=send_buf.device)
        self._raw_alltoallv(send_buf, sc, recv_buf, rc, op)
        return recv_buf, rc

    def allgather(self, send_buf: torch.Tensor, recv_buf: torch.Tensor, sizes_agreed: bool = False) -> None:
        """``recv_buf[i*m:(i+1)*m]`` = rank i's ``send_buf`` (m bytes, the same on every rank).

        ``sizes_agreed``: the caller has already made every rank's m the same (a size fixed by a
        configuration that was compared across ranks once), so the checking round is skipped even
        with ``check``: a local problem raises on this rank only, and the peers' wait ends at the
        timeout. For small per-step exchanges, where that round would double the cost."""
        op = "allgather"
        self._ensure_open(op)
        problems = []
        for what, t in (("send_buf", send_buf), ("recv_buf", recv_buf)):
            bad = self._check_buf(op, what, t)
            if bad:
                problems.append(bad)
        m = 0 if problems else send_buf.numel()
        if not problems and recv_buf.numel() < m * self._size:
            problems.append(f"recv_buf holds {recv_buf.numel()} bytes, needs size*{m} = {m * self._size}")
        if self.check and not sizes_agreed:
            rows = self._meta_gather(op, [0 if problems else 1, m])
            self._raise_local_or_remote(op, problems, rows)
            sizes = [r[1] for r in rows]
            if len(set(sizes)) != 1:
                raise self._err(op, f"send sizes differ between ranks: {sizes} (use allgatherv)",
                                [i for i, s in enumerate(sizes) if s != sizes[0]] + [0])
        elif problems:
            raise self._err(op, "; ".join(problems))
        if m == 0:
            return
        self._raw_allgather(send_buf, recv_buf[: m * self._size] if recv_buf.numel() != m * self._size else recv_buf, op)

    def allgatherv(self, send_buf: torch.Tensor, recv_buf: torch.Tensor, recv_counts: Sequence[int],
                   sizes_agreed: bool = False) -> None:
        """Rank i's ``send_buf`` (``recv_counts[i]`` bytes) lands at offset ``sum(recv_counts[:i])``.
        ``send_buf`` may be that very segment of ``recv_buf`` (in place).

        ``sizes_agreed``: every rank's ``recv_counts`` came from one exchange all ranks made (the
        coordinator's heads), so the checking round is skipped even with ``check``, as for
        :meth:`allgather`."""
        op = "allgatherv"
        self._ensure_open(op)
        n = self._size
        problems = []
        rc = self._counts(recv_counts, "recv_counts", problems)
        for what, t in (("send_buf", send_buf), ("recv_buf", recv_buf)):
            bad = self._check_buf(op, what, t)
            if bad:
                problems.append(bad)
        if not problems:
            if sum(rc) > recv_buf.numel():
                problems.append(f"recv_counts sum to {sum(rc)} bytes but recv_buf holds {recv_buf.numel()}")
            if send_buf.numel() != rc[self._rank]:
                problems.append(f"send_buf holds {send_buf.numel()} bytes but recv_counts[{self._rank}] = {rc[self._rank]}")
        if problems:
            rc = [0] * n
        if self.check and not sizes_agreed:
            rows = self._meta_gather(op, [0 if problems else 1, 0 if problems else send_buf.numel()] + rc)
            self._raise_local_or_remote(op, problems, rows)
            actual = [r[1] for r in rows]
            bad = [i for i in range(n) if rows[i][2:] != actual]
            if bad:
                raise self._err(op, f"recv_counts disagree with the send sizes {actual}: "
                                + "; ".join(f"rank {i} expects {rows[i][2:]}" for i in bad[:8]), bad)
        elif problems:
            raise self._err(op, "; ".join(problems))
        if sum(rc) == 0:
            return
        self._raw_allgatherv(send_buf, recv_buf, rc, op)

    def broadcast(self, buf: torch.Tensor, root: int) -> None:
        """Every rank's ``buf`` becomes ``root``'s (same size on every rank)."""
        op = f"broadcast(root={root})"
        self._ensure_open(op)
        problems = []
        bad = self._check_buf(op, "buf", buf)
        if bad:
            problems.append(bad)
        if not isinstance(root, int) or not 0 <= root < self._size:
            problems.append(f"root {root!r} is not a rank of this transport (size {self._size})")
        nb = 0 if problems else buf.numel()
        if self.check:
            rows = self._meta_gather(op, [0 if problems else 1, nb, root if isinstance(root, int) else -1])
            self._raise_local_or_remote(op, problems, rows)
            roots = [r[2] for r in rows]
            if len(set(roots)) != 1:
                raise self._err(op, f"ranks disagree on the root: {roots}", list(range(self._size)))
            sizes = [r[1] for r in rows]
            bad_r = [i for i, s in enumerate(sizes) if s != sizes[root]]
            if bad_r:
                raise self._err(op, f"buffer sizes differ from root {root}'s {sizes[root]} bytes: {sizes}", bad_r + [root])
        elif problems:
            raise self._err(op, "; ".join(problems))
        if self._size == 1 or nb == 0:
            return
        self._raw_broadcast(buf, root, op)

    @property
    def has_allreduce(self) -> bool:
        """Whether this backend has a native sum (:meth:`allreduce`); hipress syncs uncompressed
        gradients with it where it has one, and with its own ring where not."""
        return type(self)._raw_allreduce is not Transport._raw_allreduce

    @property
    def p2p_needs_all_ranks(self) -> bool:
        """Whether a point-to-point call only completes when every rank makes one (a backend that
        builds it from collectives); the coordinator's slots, which pair a few ranks, need False."""
        return False

    @property
    def concurrent_splits(self) -> bool:
        """Whether a split of this transport may run collectives on another thread while this one
        runs its own (:func:`hipress.comm.world.control_transport`)."""
        return False

    # The dtypes :meth:`allreduce` sums (where :attr:`has_allreduce`); backends whose collective
    # also sums 16-bit floats add them (hipress's plan may send uncompressed gradients as bf16).
    allreduce_dtypes: Tuple[torch.dtype, ...] = (torch.float32,)

    def allreduce(self, values: torch.Tensor, sizes_agreed: bool = False, agree_on: Optional[int] = None) -> None:
        """In place: every rank's ``values`` (1-D contiguous, one of :attr:`allreduce_dtypes`
        (fp32 everywhere), the same length on every rank) becomes the element-wise sum over the
        ranks, computed by the backend's own collective (gloo/NCCL allreduce, MPI_Allreduce).
        Every rank ends with the same bits. Backends without one raise NotImplementedError
        (see :attr:`has_allreduce`).

        ``agree_on``: an int64 that every rank must pass the same, compared in the checking round
        (a digest of what later calls' sizes follow from, such as a bucket layout): a mismatch
        raises on every rank. ``sizes_agreed``: an earlier such comparison already made the
        length the same on every rank, so the checking round is skipped (as ``allgather``'s)."""
        op = "allreduce"
        self._ensure_open(op)
        if not self.has_allreduce:
            raise NotImplementedError(f"the {self.name} transport has no allreduce; sync through its "
                                      f"point-to-point operations (hipress's ring) instead")
        problems = []
        if not isinstance(values, torch.Tensor):
            problems.append(f"values must be a torch tensor, got {type(values).__name__}")
        elif values.dtype not in self.allreduce_dtypes or values.dim() != 1 or not values.is_contiguous():
            problems.append(f"values must be a 1-D contiguous tensor of dtype "
                            f"{' or '.join(map(str, self.allreduce_dtypes))}, got dtype {values.dtype}, "
                            f"shape {tuple(values.shape)}, contiguous={values.is_contiguous()}")
        else:
            bad = self._check_device("values", values)
            if bad:
                problems.append(bad)
        n = 0 if problems else values.numel()
        if self.check and not sizes_agreed:
            rows = self._meta_gather(op, [0 if problems else 1, n, 0 if agree_on is None else int(agree_on)])
            self._raise_local_or_remote(op, problems, rows)
            sizes = [r[1] for r in rows]
            if len(set(sizes)) != 1:
                raise self._err(op, f"element counts differ between ranks: {sizes}",
                                [i for i, s in enumerate(sizes) if s != sizes[0]] + [0])
            self._raise_unless_agreed(op, [r[2] for r in rows])
        elif problems:
            raise self._err(op, "; ".join(problems))
        if self._size == 1 or n == 0:
            return
        self._raw_allreduce(values, op)

    def barrier(self) -> None:
        self._ensure_open("barrier")
        if self._size > 1:
            self._raw_barrier("barrier")

    def _counts(self, counts, what: str, problems: list) -> List[int]:
        try:
            c = [int(x) for x in counts]
        except (TypeError, ValueError):
            problems.append(f"{what} must be a sequence of ints")
            return [0] * self._size
        if len(c) != self._size:
            problems.append(f"{what} has {len(c)} entries, expected size={self._size}")
            return [0] * self._size
        if any(x < 0 for x in c):
            problems.append(f"{what} has negative entries: {c}")
            return [0] * self._size
        return c

    def _limits(self, max_bytes, problems: list) -> List[int]:
        """Per-source byte bounds of alltoallv_alloc (-1: none)."""
        n = self._size
        if max_bytes is None:
            return [-1] * n
        if isinstance(max_bytes, int) and not isinstance(max_bytes, bool):
            per = [max_bytes] * n
        else:
            try:
                per = list(max_bytes)
            except TypeError:
                per = None
            if per is None or len(per) != n:
                problems.append(f"max_bytes must be None, an int or {n} ints/None (one per source), "
                                f"got {max_bytes!r}")
                return [-1] * n
        out = []
        for m in per:
            if m is None:
                out.append(-1)
            elif isinstance(m, bool) or not isinstance(m, int) or m < 0:
                problems.append(f"max_bytes entries must be ints >= 0 or None, got {m!r}")
                return [-1] * n
            else:
                out.append(m)
        return out

    def _segments(self, op: str, side: str, buf, counts, problems: list) -> List[int]:
        """Validated per-rank byte counts of one side ("send"/"recv") of an alltoallv and its
        buffer; what is wrong goes to ``problems``."""
        c = self._counts(counts, f"{side}_counts", problems)
        bad = self._check_buf(op, f"{side}_buf", buf)
        if bad:
            problems.append(bad)
        elif sum(c) > buf.numel():
            problems.append(f"{side}_counts sum to {sum(c)} bytes but {side}_buf holds {buf.numel()}")
        return c

    def _raise_local_or_remote(self, op: str, problems: list, rows: List[List[int]]) -> None:
        if problems:
            raise self._err(op, "; ".join(problems))
        bad = [i for i, r in enumerate(rows) if r[0] != 1]
        if bad:
            raise self._err(op, f"rank(s) {bad} passed invalid arguments (see their errors)", bad)

    # ------------------------------------------------------------------ groups
    def split(self, color: Optional[int], key: Optional[int] = None) -> Optional["Transport"]:
        """Collective over this transport: ranks with the same ``color`` form a new
        transport, ordered by ``(key, rank)``. ``color=None`` joins no group (returns None)."""
        op = "split"
        self._ensure_open(op)
        if color is not None and (not isinstance(color, int) or color < 0):
            raise self._err(op, f"color must be a non-negative int or None, got {color!r}")
        key = self._rank if key is None else int(key)
        rows = self._meta_gather(op, [-1 if color is None else color, key])
        if color is None:
            members = None
        else:
            members = sorted((r[1], i) for i, r in enumerate(rows) if r[0] == color)
            members = [i for _, i in members]
        all_colors = sorted({r[0] for r in rows if r[0] >= 0})
        sub = self._make_split(members, all_colors, [r[0] for r in rows])
        if sub is not None:
            self._subgroups.append(sub)
        return sub

    def subgroup(self, ranks: Sequence[int]) -> Optional["Transport"]:
        """Collective over this transport (every rank calls it with the same ``ranks``):
        the members get a transport over ``ranks`` (rank i there = ``ranks[i]`` here);
        the others get None."""
        ranks = [int(r) for r in ranks]
        if len(set(ranks)) != len(ranks) or any(not 0 <= r < self._size for r in ranks) or not ranks:
            raise self._err("subgroup", f"ranks {ranks} must be distinct ranks of this transport (size {self._size})")
        if self._rank in ranks:
            return self.split(0, ranks.index(self._rank))
        return self.split(None)

    @abc.abstractmethod
    def _make_split(self, members: Optional[List[int]], colors: List[int], color_of: List[int]) -> Optional["Transport"]:
        """Create the sub-transport over ``members`` (parent ranks, in new-rank order).

        Called collectively on every rank; ``colors`` lists every group formed (sorted),
        ``color_of[r]`` is rank r's color (-1 none); ``members`` is None for this rank."""

    def close(self) -> None:
        """Release the backend resources (sub-transports made by split are closed too)."""
        if self._closed:
            return
        for s in self._subgroups:
            try:
                s.close()
            except Exception:  # pragma: no cover - best effort
                pass
        self._subgroups.clear()
        self._closed = True
        self._raw_close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ backend hooks
    @abc.abstractmethod
    def _raw_send(self, buf: torch.Tensor, dst: int, tag: int, op: str) -> None: ...

    def _raw_send_many(self, msgs, dst: int, op: str) -> None:
        """Send [(buf, tag), ...] to ``dst`` in order; backends may post them all at once."""
        for buf, tag in msgs:
            self._raw_send(buf, dst, tag, op)

    @abc.abstractmethod
    def _raw_recv(self, buf: torch.Tensor, src: int, tag: int, op: str) -> None: ...

    @abc.abstractmethod
    def _raw_sendrecv(self, send_buf: Optional[torch.Tensor], dst: int,
                      recv_buf: Optional[torch.Tensor], src: int, op: str) -> None:
        """Either side may be None (skip that leg); buffers are non-empty."""

    def _raw_p2p(self, sends, recvs, op: str) -> None:
        """Posts every send [(buf, dst)] and receive [(buf, src)] at once, then waits for them all
        (buffers non-empty; at most one of each per peer). Backends with :attr:`p2p_many` override it."""
        raise NotImplementedError(f"the {self.name} transport posts one send and one receive at a time")

    @abc.abstractmethod
    def _raw_alltoallv(self, send_buf: torch.Tensor, send_counts: List[int],
                       recv_buf: torch.Tensor, recv_counts: List[int], op: str) -> None: ...

    @abc.abstractmethod
    def _raw_allgather(self, send_buf: torch.Tensor, recv_buf: torch.Tensor, op: str) -> None:
        """``recv_buf.numel() == size * send_buf.numel()`` (non-zero)."""

    @abc.abstractmethod
    def _raw_allgatherv(self, send_buf: torch.Tensor, recv_buf: torch.Tensor, recv_counts: List[int], op: str) -> None: ...

    @abc.abstractmethod
    def _raw_broadcast(self, buf: torch.Tensor, root: int, op: str) -> None: ...

    @abc.abstractmethod
    def _raw_barrier(self, op: str) -> None: ...

    def _raw_allreduce(self, values: torch.Tensor, op: str) -> None:
        """In-place sum of a non-empty fp32 ``values`` over the ranks (validated, same length
        everywhere). Optional: backends that have a native allreduce override it."""
        raise NotImplementedError(f"the {self.name} transport has no allreduce")

    def _raw_close(self) -> None:
        pass


def displacements(counts: Sequence[int]) -> List[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out
