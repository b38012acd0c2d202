"""CaSync-PS with aggregators co-located on the workers (paper 000 §3.1, §5.1).

For a gradient split into K partitions, each partition has one aggregator rank,
chosen the first time the partition is seen (least bytes assigned so far, ties to the
lowest rank) and kept after that, so aggregator-side state stays on one rank. All
ranks make the same choice because they submit gradients in the same order.

  1. encode   (compute) every partition with the worker's state; payloads for the
              same aggregator are framed into one segment
  2. gather   (comm)    one alltoallv: segment j goes to rank j (zero bytes to ranks
              that aggregate nothing of this gradient; the own segment stays local)
  3. aggregate(compute) for each owned partition: acc = sum over ranks of decode(payload),
              then encode(acc) with the aggregator's state
  4. bcast    (comm)    one alltoallv: each aggregator sends its encoded aggregates to
              every rank
  5. decode   (compute) every partition from its aggregator's payload, divide by N
Each bulk step first exchanges the byte counts (payload sizes vary for sparsifiers).
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from hipress.engine import Handle
from hipress.sync.base import Strategy, SyncContext, frame, unframe


def bulk_exchange(transport, segments: List[torch.Tensor]) -> List[torch.Tensor]:
    """alltoallv of one segment per rank (zero-length allowed); returns one per source."""
    n = transport.size
    send_counts = [s.numel() for s in segments]
    counts_out = torch.tensor(send_counts, dtype=torch.int64).view(torch.uint8)
    counts_in = torch.empty(8 * n, dtype=torch.uint8)
    transport.alltoallv(counts_out, [8] * n, counts_in, [8] * n)
    recv_counts = counts_in.view(torch.int64).tolist()
    send = torch.cat(segments) if segments else torch.empty(0, dtype=torch.uint8)
    recv = torch.empty(sum(recv_counts), dtype=torch.uint8)
    transport.alltoallv(send, send_counts, recv, recv_counts)
    out, off = [], 0
    for c in recv_counts:
        out.append(recv[off:off + c])
        off += c
    return out


class PSStrategy(Strategy):
    name = "ps"

    def __init__(self, average: bool = True):
        self.average = average
        self._owner: Dict[str, int] = {}
        self._load: List[int] = []

    def owner(self, key: str, nbytes: int, size: int) -> int:
        if key not in self._owner:
            if len(self._load) != size:
                self._load = [0] * size
            a = min(range(size), key=lambda j: (self._load[j], j))
            self._load[a] += nbytes
            self._owner[key] = a
        return self._owner[key]

    def build(self, ctx: SyncContext, tensor_name: str, flat: torch.Tensor,
              bounds: Sequence[Tuple[int, int]], deps: Sequence[Handle] = (), **kw) -> Handle:
        n, r = ctx.size, ctx.rank
        comp, tr = ctx.compressor, ctx.transport
        parts = [(f"{tensor_name}/p{i}", s, e) for i, (s, e) in enumerate(bounds) if e > s]
        if not parts:
            return ctx.compute(f"done.{tensor_name}", lambda: None, deps)
        owners = [self.owner(key, 4 * (e - s), n) for key, s, e in parts]
        mine = [i for i, a in enumerate(owners) if a == r]
        slot = {}

        def encode():
            per_dst: List[List[torch.Tensor]] = [[] for _ in range(n)]
            for (key, s, e), a in zip(parts, owners):
                per_dst[a].append(comp.encode(flat[s:e], ctx.states.get(f"{key}/worker", comp, e - s)))
            slot["gather_out"] = [frame(p) if p else torch.empty(0, dtype=torch.uint8) for p in per_dst]

        def gather():
            slot["gather_in"] = bulk_exchange(tr, slot.pop("gather_out"))

        def aggregate():
            received = [unframe(seg, len(mine)) for seg in slot.pop("gather_in")]
            out = []
            for j, i in enumerate(mine):
                key, s, e = parts[i]
                acc = torch.zeros(e - s, dtype=torch.float32)
                for src in range(n):
                    comp.decode_add(received[src][j], acc)
                out.append(comp.encode(acc, ctx.states.get(f"{key}/aggregator", comp, e - s)))
            seg = frame(out) if out else torch.empty(0, dtype=torch.uint8)
            slot["bcast_out"] = [seg] * n

        def bcast():
            slot["bcast_in"] = bulk_exchange(tr, slot.pop("bcast_out"))

        def decode():
            segs = slot.pop("bcast_in")
            for a in range(n):
                idx = [i for i, o in enumerate(owners) if o == a]
                for i, payload in zip(idx, unframe(segs[a], len(idx))):
                    _, s, e = parts[i]
                    comp.decode(payload, flat[s:e])
            if self.average:
                flat.div_(n)

        enc = ctx.compute(f"encode.{tensor_name}", encode, deps)
        g = ctx.comm(f"gather.{tensor_name}", gather, [enc])
        agg = ctx.compute(f"aggregate.{tensor_name}", aggregate, [g])
        b = ctx.comm(f"bcast.{tensor_name}", bcast, [agg])
        return ctx.compute(f"decode.{tensor_name}", decode, [b])
