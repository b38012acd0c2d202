"""CaSync-PS with aggregators co-located on the workers (paper 000 §3.1, §5.1).

For a gradient split into K partitions, each partition has one aggregator rank,
chosen the first time the partition is seen (K <= N partitions on K distinct ranks, the
least loaded by bytes assigned so far; see :meth:`PSStrategy.owners`) and kept after
that, so aggregator-side state stays on one rank. All ranks make the same choice
because they submit gradients in the same order.

  1. encode   (compute) every partition with the worker's state; payloads for the
              same aggregator are framed into one segment
  2. gather   (comm)    one bulk exchange: segment j goes to aggregator j (the own
              segment stays local)
  3. aggregate(compute) for each owned partition: acc = sum over ranks of decode(payload),
              then encode(acc) with compressor.merged_for(N) and the aggregator's state
  4. bcast    (comm)    one bulk exchange: each aggregator sends its encoded aggregates
              to every rank
  5. decode   (compute) every partition from its aggregator's payload, divide by N
Without the coordinator a bulk exchange is two alltoallv (byte counts, then payloads:
sizes vary for sparsifiers); with it, the coordinator batches the messages into slots.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from hipress.compression.base import zeroed_f32
from hipress.engine import Handle
from hipress.sync.base import (Strategy, SyncContext, decode_payload, frame, frame_bound, no_larger_than_dense,
                               known_frames, partition_shape, payload_bound, unframe)


class PSStrategy(Strategy):
    name = "ps"
    frames_partitions = True

    def __init__(self, average: bool = True):
        self.average = average
        self._owner: Dict[str, int] = {}
        self._load: List[int] = []

    def owners(self, parts: Sequence[Tuple[str, int]], size: int) -> List[int]:
        """The aggregator of each (key, bytes) partition of one gradient. A new partition goes
        to the rank holding the fewest bytes of this gradient's partitions, among those the one
        with the fewest bytes assigned so far (ties to the lowest rank): a gradient's K <= N
        equal partitions land on K distinct aggregators, which then work in parallel, partitions
        of unequal sizes (a fused bucket's tensors, each its own) spread by their bytes, and the
        load balances across gradients. (By count instead of bytes, a fused bucket of blocks of
        four tensors put every block's weight on the same one of four ranks.)"""
        if len(self._load) != size:
            self._load = [0] * size
        mine = [0] * size
        for key, nbytes in parts:
            if key in self._owner:
                mine[self._owner[key]] += nbytes
        for key, nbytes in parts:
            if key not in self._owner:
                a = min(range(size), key=lambda j: (mine[j], self._load[j], j))
                self._load[a] += nbytes
                mine[a] += nbytes
                self._owner[key] = a
        return [self._owner[key] for key, _ in parts]

    def spread(self, ranks: int) -> int:
        return ranks

    @staticmethod
    def _parts(tensor_name: str, bounds) -> List[Tuple[str, int, int]]:
        return [(f"{tensor_name}/p{i}", s, e) for i, (s, e) in enumerate(bounds) if e > s]

    def reserve(self, ctx: SyncContext, tensor_name: str, bounds: Sequence[Tuple[int, int]]) -> None:
        self.owners([(key, 4 * (e - s)) for key, s, e in self._parts(tensor_name, bounds)], ctx.size)

    def state_spans(self, ctx: SyncContext, tensor_name: str, bounds: Sequence[Tuple[int, int]]):
        """The worker's state of each partition, and the aggregator's where this rank aggregates it
        (listed for every partition: a key this rank never used has no state)."""
        return [(f"{key}/{role}", s, e) for key, s, e in self._parts(tensor_name, bounds)
                for role in ("worker", "aggregator")]

    def forget_layout(self) -> None:
        self._owner.clear()
        self._load = []

    def layout_state(self) -> dict:
        return {"aggregators": dict(self._owner), "load": list(self._load)} if self._owner else {}

    def load_layout_state(self, sd: dict) -> None:
        if sd:
            self._owner = {str(k): int(v) for k, v in sd["aggregators"].items()}
            self._load = [int(v) for v in sd["load"]]

    def build(self, ctx: SyncContext, tensor_name: str, flat: torch.Tensor,
              bounds: Sequence[Tuple[int, int]], deps: Sequence[Handle] = (), segments=None, **kw) -> Handle:
        """``segments``: as the allgather strategy's (a partition of whole rows of one tensor gets its shape)."""
        n, r = ctx.size, ctx.rank
        comp = ctx.compressor
        parts = self._parts(tensor_name, bounds)
        if not parts:
            return ctx.compute(f"done.{tensor_name}", lambda: None, deps)
        owners = self.owners([(key, 4 * (e - s)) for key, s, e in parts], n)
        aggregators = sorted(set(owners))
        mine = [i for i, a in enumerate(owners) if a == r]
        slot = {"gather_in": {}, "bcast_in": {}}

        def encode():
            per_dst: Dict[int, List[torch.Tensor]] = {a: [] for a in aggregators}
            for (key, s, e), a in zip(parts, owners):
                payload = ctx.states.encode(f"{key}/worker", comp, flat[s:e], partition_shape(segments, s, e))
                per_dst[a].append(no_larger_than_dense(comp, payload, e - s))
            slot["gather_out"] = {a: frame(p) for a, p in per_dst.items()}

        def aggregate():
            received = [unframe(slot["gather_in"].pop(src), len(mine)) for src in range(n)]
            out = []
            for j, i in enumerate(mine):
                key, s, e = parts[i]
                acc = zeroed_f32(flat[s:e])  # this rank's piece: encoded already, overwritten by decode()
                for src in range(n):
                    decode_payload(comp, received[src][j], acc, add=True)
                m = comp.merged_for(n)  # error feedback at the aggregator: what its re-encode drops is not lost
                payload = ctx.states.encode(f"{key}/aggregator", m, acc, partition_shape(segments, s, e))
                out.append(no_larger_than_dense(comp, payload, e - s))
            slot["bcast_out"] = frame(out)

        # The average divides each partition as it is decoded (decode_divided: one pass where the
        # compressor can) where the partitions cover the gradient; else after, all of it.
        divide_parts = self.average and sum(e - s for _, s, e in parts) == flat.numel()

        def decode():
            for a in aggregators:
                idx = [i for i, o in enumerate(owners) if o == a]
                for i, payload in zip(idx, unframe(slot["bcast_in"].pop(a), len(idx))):
                    _, s, e = parts[i]
                    decode_payload(comp, payload, flat[s:e], divisor=n if divide_parts else 1)
            if self.average and not divide_parts:
                flat.div_(n)

        def sink(name):
            return lambda src: (lambda buf: slot[name].__setitem__(src, buf))

        gather_sink, bcast_sink = sink("gather_in"), sink("bcast_in")
        # What each peer may send, from this rank's own knowledge of the partitions (max_bytes):
        # every worker frames this aggregator's partitions; each aggregator frames its own.
        part_bound = [payload_bound(comp, e - s, contributions=n) for _, s, e in parts]
        gather_max = frame_bound([part_bound[i] for i in mine])
        bcast_max = {a: frame_bound([part_bound[i] for i, o in enumerate(owners) if o == a]) for a in aggregators}
        # Where the compressor knows its payloads' sizes in advance (encoded_bytes), so does every
        # rank its frames': they go without their sizes first.
        worker = [comp.encoded_bytes(e - s, partition_shape(segments, s, e)) for _, s, e in parts]
        aggregator = [comp.merged_for(n).encoded_bytes(e - s, partition_shape(segments, s, e)) for _, s, e in parts]

        def frames(sizes, owner):  # the frame of the partitions ``owner`` aggregates
            return frame_bound([sizes[i] for i, o in enumerate(owners) if o == owner])

        enc = ctx.compute(f"encode.{tensor_name}", encode, deps, nbytes=4 * flat.numel())
        # Every worker sends to every aggregator of this gradient; aggregators hear from all.
        g = ctx.exchange.bulk(f"gather.{tensor_name}", {a: (lambda a=a: slot["gather_out"].pop(a)) for a in aggregators},
                              {src: gather_sink(src) for src in range(n)} if mine else {}, [enc],
                              max_bytes=None if gather_max is None else {src: gather_max for src in range(n)},
                              sizes=known_frames({a: frames(worker, a) for a in aggregators},
                                                 {src: frames(worker, r) for src in range(n)} if mine else {}))
        agg = ctx.compute(f"aggregate.{tensor_name}", aggregate, [g]) if mine else g
        b = ctx.exchange.bulk(f"bcast.{tensor_name}", {dst: (lambda: slot["bcast_out"]) for dst in range(n)} if mine else {},
                              {a: bcast_sink(a) for a in aggregators}, [agg],
                              max_bytes={a: m for a, m in bcast_max.items() if m is not None},
                              sizes=known_frames({dst: frames(aggregator, r) for dst in range(n)} if mine else {},
                                                 {a: frames(aggregator, a) for a in aggregators}))
        return ctx.compute(f"decode.{tensor_name}", decode, [b], nbytes=4 * flat.numel())
