"""CaSync-Ring (paper 000 §3.1, Fig. 1; §5.3).

For each partition x (a view into the gradient), over N ranks, with chunks
c = 0..N-1 of x:

reduce-scatter, steps s = 0..N-2 on rank r:
  1. encode   chunk (r - s) mod N               (compute; EF state of that chunk)
  2. sendrecv payload to r+1, from r-1          (comm)
  3. merge    chunk (r - s - 1) mod N += decode(received)   (compute, fused decode_add)
  after step N-2, rank r holds the sum of chunk (r + 1) mod N over all ranks.
all-gather, steps t = 0..N-2:
  0. encode the owned chunk once and decode it in place, so the owner ends with the
     same values as everyone else
  1. sendrecv: forward the payload received last (first: the own one) to r+1
  2. decode   chunk (r - t) mod N from what was received
finally chunks are divided by N (op=Average): decode, then aggregate, then average;
compressed bytes are never averaged.

Each rank encodes each chunk exactly once per sync (chunks (r - s) for s = 0..N-1), so
per-chunk state lives on that rank. Only step 0 encodes the rank's own gradient; the
other encodes see merged partial sums of s + 1 ranks and use ``compressor.merged_for(s + 1)``
(error feedback at every site, so what a re-encode drops is sent in a later sync, not lost).
Sparsifiers re-select after every merge because step 1 encodes the merged dense chunk; their
density is scaled to the number of ranks summed (``Compressor.for_sum_of``). Aggregatable (low-rank)
compressors are synchronised by :mod:`hipress.sync.lowrank` instead.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch

from hipress.engine import Handle
from hipress.planner.plan import chunk_bounds
from hipress.sync.base import Strategy, SyncContext, decode_payload, known_sizes, no_larger_than_dense, payload_bound


class RingStrategy(Strategy):
    name = "ring"

    def __init__(self, average: bool = True):
        self.average = average

    def build(self, ctx: SyncContext, tensor_name: str, flat: torch.Tensor,
              bounds: Sequence[Tuple[int, int]], deps: Sequence[Handle] = (), **kw) -> Handle:
        def both(ctx, key, x, deps):  # each partition pipelines on its own
            return self._all_gather(ctx, key, x, [self._reduce_scatter(ctx, key, x, deps)])
        return self._each_range(ctx, tensor_name, flat, bounds, deps, both, "p")

    # The two phases are separate builds so that a schedule may run them apart (strategy
    # "dear": reduce-scatter in backward, all-gather before the next forward). Between them
    # the state lives in ``flat`` itself: rank r's reduced chunk (r + 1) mod N of each partition.
    def reduce_scatter(self, ctx: SyncContext, tensor_name: str, flat: torch.Tensor,
                       bounds: Sequence[Tuple[int, int]], deps: Sequence[Handle] = ()) -> Handle:
        """Reduce-scatter of every partition: afterwards this rank holds, in ``flat``, the sum
        over all ranks of chunk (rank + 1) mod N of each partition (not yet averaged)."""
        return self._each_range(ctx, tensor_name, flat, bounds, deps, self._reduce_scatter, "p")

    def all_gather(self, ctx: SyncContext, tensor_name: str, flat: torch.Tensor,
                   bounds: Sequence[Tuple[int, int]], deps: Sequence[Handle] = ()) -> Handle:
        """All-gather of the chunks :meth:`reduce_scatter` left on each rank (same name and
        bounds), then the average: afterwards ``flat`` is the synchronized gradient."""
        return self._each_range(ctx, tensor_name, flat, bounds, deps, self._all_gather, "p")

    def state_spans(self, ctx: SyncContext, tensor_name: str, bounds: Sequence[Tuple[int, int]]):
        """One state per chunk of each partition (encode_chunk's ``{key}/c{chunk}``): on each rank
        every chunk is encoded at exactly one site per sync (reduce-scatter hop or all-gather)."""
        return [(f"{tensor_name}/p{i}/c{c}", s + cs, s + ce)
                for i, (s, e) in enumerate(bounds) if e > s
                for c, (cs, ce) in enumerate(chunk_bounds(e - s, ctx.size))]

    @staticmethod
    def _views(ctx: SyncContext, x: torch.Tensor):
        return [x[s:e] for s, e in chunk_bounds(x.numel(), ctx.size)]

    def _reduce_scatter(self, ctx: SyncContext, key: str, x: torch.Tensor, deps: Sequence[Handle]) -> Handle:
        return reduce_scatter(ctx, key, self._views(ctx, x), deps, owned_offset=1)

    def _all_gather(self, ctx: SyncContext, key: str, x: torch.Tensor, deps: Sequence[Handle]) -> Handle:
        """All-gather of the encoded owned chunks, then the average."""
        n, r = ctx.size, ctx.rank
        comp = ctx.compressor
        views = self._views(ctx, x)
        nxt, prv = (r + 1) % n, (r - 1) % n
        owned = (r + 1) % n
        slot = {}

        # Each chunk is averaged as it is decoded (decode_divided: one pass where the compressor
        # can), but for a payload that is the owned chunk itself ('none' encodes without a copy):
        # that one is divided once it is sent, by the first decode.
        divisor = n if self.average else 1

        def encode_owned():
            p = encode_chunk(ctx, key, views, owned, n)
            later = divisor != 1 and p.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
            decode_payload(comp, p, views[owned], divisor=1 if later else divisor)
            slot[("fwd", 0)], slot["divide owned"] = p, later

        prev = ctx.compute(f"encode.{key}.ag", encode_owned, list(deps))
        finals = [prev]
        site = site_compressor(comp, n)  # every payload of this phase is an owner's encode
        for t in range(n - 1):
            c_in = (r - t) % n

            def received(buf, t=t):
                slot[("fwd", t + 1)] = slot[("dec", t)] = buf

            def decode(t=t, c=c_in):
                decode_payload(comp, slot.pop(("dec", t)), views[c], divisor=divisor)
                if t == 0 and slot.pop("divide owned"):
                    views[owned].div_(divisor)

            prev = ctx.exchange.sendrecv(f"sendrecv.{key}.ag{t}", lambda t=t: slot.pop(("fwd", t)), nxt,
                                         received, prv, [prev],
                                         max_bytes=payload_bound(comp, views[c_in].numel(), contributions=n),
                                         sizes=known_sizes(site, views[(c_in + 1) % n].numel(), views[c_in].numel()))
            finals.append(ctx.compute(f"decode.{key}.ag{t}", decode, [prev], nbytes=4 * x.numel() // n))

        return ctx.compute(f"done.{key}", slot.clear, finals)


def site_compressor(comp, contributions: int):
    """What encodes a chunk that sums ``contributions`` ranks' gradients: the compressor for a
    rank's own (1), its merged form for partial sums (see encode_chunk)."""
    return comp if contributions == 1 else comp.merged_for(contributions)


def encode_chunk(ctx: SyncContext, key: str, views: Sequence[torch.Tensor], c: int, contributions: int):
    """Encodes chunk ``c``, a sum of ``contributions`` ranks' gradients, with its state. Step 0
    of the reduce-scatter encodes this rank's own gradient (1); later encodes see merged partial
    sums and use the compressor's merged form for that many (error feedback at every site; a
    sparsifier keeps the density of their union). A chunk key has one role per rank, so its
    state always belongs to the same compressor. A sparsifier's sum denser than half travels as
    fp32 values (no_larger_than_dense)."""
    enc = site_compressor(ctx.compressor, contributions)
    payload = ctx.states.encode(f"{key}/c{c}", enc, views[c])
    return no_larger_than_dense(ctx.compressor, payload, views[c].numel())


def reduce_scatter(ctx: SyncContext, key: str, views: Sequence[torch.Tensor], deps: Sequence[Handle] = (),
                   owned_offset: int = 1) -> Handle:
    """The ring's compressed reduce-scatter phase over ``views`` (one contiguous chunk per rank,
    the same sizes on every rank): N-1 steps of encode, sendrecv to r+1 from r-1, decode-and-add.
    When the returned handle is done, rank r's chunk ``(r + owned_offset) mod N`` holds the sum
    over ranks (its own gradient exact, the peers' as decoded); the other chunks hold partial
    sums. The ring's all-reduce uses offset 1; FSDP2's reduce-scatter (hipress/torch/fsdp.py)
    offset 0, rank r owning chunk r. State keys are ``{key}/c{chunk}``."""
    n, r = ctx.size, ctx.rank
    comp = ctx.compressor
    if len(views) != n:
        raise ValueError(f"a ring reduce-scatter needs one chunk per rank ({n}), got {len(views)}")
    if n == 1:  # nothing to reduce
        return ctx.compute(f"reduced.{key}", lambda: None, list(deps))
    nxt, prv = (r + 1) % n, (r - 1) % n
    slot = {}
    last_compute = list(deps)
    for s in range(n - 1):
        cs, cr = (r - s + owned_offset - 1) % n, (r - s + owned_offset - 2) % n

        def encode(s=s, cs=cs):
            slot[("out", s)] = encode_chunk(ctx, key, views, cs, s + 1)

        def merge(s=s, cr=cr):
            decode_payload(comp, slot.pop(("in", s)), views[cr], add=True)

        nbytes = 4 * views[cs].numel()
        enc = ctx.compute(f"encode.{key}.rs{s}", encode, last_compute, nbytes=nbytes)
        sr = ctx.exchange.sendrecv(f"sendrecv.{key}.rs{s}", lambda s=s: slot.pop(("out", s)), nxt,
                                   lambda buf, s=s: slot.__setitem__(("in", s), buf), prv, [enc],
                                   max_bytes=payload_bound(comp, views[cr].numel(), contributions=n),
                                   sizes=known_sizes(site_compressor(comp, s + 1), views[cs].numel(),
                                                     views[cr].numel()))
        last_compute = [ctx.compute(f"merge.{key}.rs{s}", merge, [sr], nbytes=nbytes)]
    return last_compute[0]
