"""Wire format of the coordinator's control rounds (versioned, validated, sized to content).

A round is one all-gather of every rank's HEAD (fixed, 40 bytes) and, when some rank has
something to declare, one all-gather of the DECL bodies, each as long as what it carries
(the HEADs give the lengths). Every rank then runs the same planner on the same
declarations, so no plan travels.

  HEAD  <4s H H i Q Q I I I>  magic b"HPCO", version, type, rank, job token, round, flags,
                              number of declarations, body bytes                 (40 bytes)
  DECL body: what the rank declared since the last round, in its order, in groups: exchanges
          declared on submission, or a wave declared ahead (hipress.comm.coordinator.ahead); each
          <Q I I I I>  key, number of destinations, of sources, of predecessors, group (its
                       number, 0, 1, ... in order, with the WAVE bit where it is a wave)
          int32 x (destinations + sources)   world ranks the rank sends to / hears from
          uint64 x predecessors              keys of the rank's earlier exchanges that the
                                             exchange waits on (through its tasks)
          uint64 x destinations              the bytes expected of the message to each
                                             (0: unknown; planner.py's small messages)

Flags: CLOSING (this rank wants to stop: nothing of its own is pending). When every HEAD of
a round says CLOSING, every rank leaves.
Nothing here can carry code: only integers. A HEAD with a wrong magic, version, type,
token, round or rank, a body whose length disagrees with its entries, or a peer outside the
job is rejected with ProtocolError.
"""
from __future__ import annotations

import struct
from typing import List, Sequence, Tuple

MAGIC = b"HPCO"
# 4: a slot's batch may hold void messages (size -1; hipress/comm/coordinator/executor.py);
# 5: declarations carry expected message sizes, and a slot may pair a rank with several peers;
# 6: a round carries several waves of declarations (each declaration names its group).
VERSION = 6
HEAD = 1
CLOSING = 1
WAVE = 1 << 31

_HEAD = struct.Struct("<4sHHiQQIII")
_DECL = struct.Struct("<QIIII")  # key, destinations, sources, predecessors, group
HEAD_BYTES = _HEAD.size

# key, destinations, sources, predecessor keys, bytes expected per destination (0: unknown)
Decl = Tuple[int, List[int], List[int], List[int], List[int]]
# (whether a wave declared ahead, its declarations); otherwise declared on submission
Group = Tuple[bool, List[Decl]]


class ProtocolError(RuntimeError):
    pass


def pack_decls(groups: Sequence[Group]) -> bytes:
    """``groups``: (whether a wave, declarations), in the rank's order; empty ones are left out."""
    body = []
    for number, (wave, decls) in enumerate(g for g in groups if g[1]):
        for key, dsts, srcs, after, sizes in decls:
            peers = list(dsts) + list(srcs)
            if len(sizes) != len(dsts):
                raise ValueError(f"{len(sizes)} sizes for {len(dsts)} destinations")
            body += [_DECL.pack(key, len(dsts), len(srcs), len(after), number | (WAVE if wave else 0)),
                     struct.pack(f"<{len(peers)}i", *peers), struct.pack(f"<{len(after)}Q", *after),
                     struct.pack(f"<{len(sizes)}Q", *sizes)]
    return b"".join(body)


def pack_head(rank: int, token: int, rnd: int, flags: int, count: int, body_bytes: int) -> bytes:
    return _HEAD.pack(MAGIC, VERSION, HEAD, rank, token, rnd, flags, count, body_bytes)


def unpack_head(raw: bytes, token: int, rnd: int, rank: int) -> Tuple[int, int, int]:
    """Validates rank ``rank``'s HEAD of round ``rnd``; returns (flags, declarations, body bytes)."""
    if len(raw) != HEAD_BYTES:
        raise ProtocolError(f"head of {len(raw)} bytes, expected {HEAD_BYTES}")
    magic, ver, t, who, tok, rd, flags, count, nbytes = _HEAD.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: not a hipress coordinator frame")
    if ver != VERSION:
        raise ProtocolError(f"protocol version {ver}, this build speaks {VERSION}")
    if t != HEAD:
        raise ProtocolError(f"message type {t}, expected {HEAD}")
    if tok != token:
        raise ProtocolError("frame from another job (token mismatch)")
    if rd != rnd:
        raise ProtocolError(f"frame for round {rd}, expected round {rnd}: ranks out of step")
    if who != rank:
        raise ProtocolError(f"frame claims rank {who}, expected {rank}")
    return flags, count, nbytes


def unpack_decls(body: bytes, count: int, rank: int, n: int) -> List[Group]:
    """Validates rank ``rank``'s DECL body of ``count`` declarations in a job of ``n`` ranks; returns
    its groups (pack_decls)."""
    out: List[Group] = []
    off = 0
    for seen in range(count):
        if off + _DECL.size > len(body):
            raise ProtocolError(f"body of {len(body)} bytes ends inside declaration {seen} of rank {rank}")
        key, nd, ns, na, group = _DECL.unpack_from(body, off)
        off += _DECL.size
        tail = f"<{nd + ns}i{na + nd}Q"  # peers, then predecessors and sizes: one unpack per declaration
        tail_bytes = struct.calcsize(tail)
        if off + tail_bytes > len(body):
            raise ProtocolError(f"body of {len(body)} bytes ends inside declaration {seen} of rank {rank}")
        number, wave = group & ~WAVE, bool(group & WAVE)
        if number == len(out):
            out.append((wave, []))
        elif number != len(out) - 1 or wave != out[-1][0]:
            raise ProtocolError(f"declaration {seen} of rank {rank} is in group {group:#x} after "
                                f"{len(out)} groups: groups are numbered in order and hold one kind")
        got = struct.unpack_from(tail, body, off)
        off += tail_bytes
        peers = got[:nd + ns]
        for p in peers:
            if not 0 <= p < n or p == rank:
                raise ProtocolError(f"peer {p} is not another rank of {n} (declared by rank {rank})")
        after = nd + ns + na
        out[-1][1].append((key, list(peers[:nd]), list(peers[nd:]), list(got[nd + ns:after]), list(got[after:])))
    if off != len(body):
        raise ProtocolError(f"body of {len(body)} bytes holds {off} bytes of declarations (rank {rank})")
    return out
