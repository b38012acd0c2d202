"""Wire format of the coordinator's control messages (fixed, versioned, validated).

Every message is a fixed-size frame so that the gather to rank 0 and the scatter back
are single alltoallv steps with counts known in advance:

  header  <4s H H i Q Q I I>  magic b"HPCO", version, type, rank, job token, slot,
                              flags, entry count                                (36 bytes)
  entries <Q i I Q>           key, peer, kind, nbytes                           (24 bytes each)
                              META (rank -> coordinator): one per newly pending send,
                                   peer = destination, kind = SEND
                              PLAN (coordinator -> rank): this rank's part of the slot,
                                   kind = SEND (peer = destination) or RECV (peer = source)
  zero padding to the frame size

Flags: META: CLOSING (this rank wants to stop once nothing is pending).
       PLAN: STOP (everyone is closing and nothing is pending: leave the loop),
             IDLE (nothing planned this slot).
Nothing here can carry code: only integers. A frame with a wrong magic, version, type,
token, slot, rank or an entry count beyond the frame is rejected with ProtocolError.
"""
from __future__ import annotations

import struct
from typing import List, Tuple

MAGIC = b"HPCO"
VERSION = 1
META, PLAN = 1, 2
CLOSING = 1
STOP, IDLE = 1, 2
SEND, RECV = 0, 1

_HDR = struct.Struct("<4sHHiQQII")
_ENT = struct.Struct("<QiIQ")  # key, peer, kind (SEND/RECV), nbytes
HEADER_BYTES = _HDR.size
ENTRY_BYTES = _ENT.size


class ProtocolError(RuntimeError):
    pass


def frame_bytes(max_entries: int) -> int:
    return HEADER_BYTES + ENTRY_BYTES * max_entries


def pack(mtype: int, rank: int, token: int, slot: int, flags: int,
         entries: List[Tuple[int, int, int, int]], max_entries: int) -> bytes:
    """entries: (key, peer, kind, nbytes)."""
    if len(entries) > max_entries:
        raise ProtocolError(f"{len(entries)} entries do not fit a frame of {max_entries}")
    body = b"".join(_ENT.pack(k, p, kind, n) for k, p, kind, n in entries)
    raw = _HDR.pack(MAGIC, VERSION, mtype, rank, token, slot, flags, len(entries)) + body
    return raw + bytes(frame_bytes(max_entries) - len(raw))


def unpack(raw: bytes, mtype: int, token: int, slot: int, rank: int, max_entries: int, n: int):
    """Validates a frame; returns (flags, [(key, peer, kind, nbytes)])."""
    if len(raw) != frame_bytes(max_entries):
        raise ProtocolError(f"frame of {len(raw)} bytes, expected {frame_bytes(max_entries)}")
    magic, ver, t, r, tok, sl, flags, count = _HDR.unpack_from(raw, 0)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: not a hipress coordinator frame")
    if ver != VERSION:
        raise ProtocolError(f"protocol version {ver}, this build speaks {VERSION}")
    if t != mtype:
        raise ProtocolError(f"message type {t}, expected {mtype}")
    if tok != token:
        raise ProtocolError("frame from another job (token mismatch)")
    if sl != slot:
        raise ProtocolError(f"frame for slot {sl}, expected slot {slot}: ranks out of step")
    if r != rank:
        raise ProtocolError(f"frame claims rank {r}, expected {rank}")
    if count > max_entries:
        raise ProtocolError(f"{count} entries exceed the frame's {max_entries}")
    out = []
    for i in range(count):
        key, peer, kind, nbytes = _ENT.unpack_from(raw, HEADER_BYTES + i * ENTRY_BYTES)
        if not 0 <= peer < n or kind not in (SEND, RECV):
            raise ProtocolError(f"entry {i}: peer {peer} / kind {kind} invalid for {n} ranks")
        out.append((key, peer, kind, nbytes))
    return flags, out
