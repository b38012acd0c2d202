"""How a CaSync strategy moves bytes: the send and recv primitives as engine tasks.

A strategy sees an :class:`Exchange` over some group of ranks (the world, the ranks of
this host, or one rank per host) and never a transport. Every operation submits one comm
task and returns its engine handle; payloads are produced when the task runs (``sends``
are callables) and handed to ``sinks`` when they arrive.

    sendrecv(name, send, dst, sink, src, deps)   one ring step: to dst, from src
    bulk(name, sends, sinks, deps)               {dst: send()} out, {src: sink(payload)} in
    allgather(name, send, sinks, deps)           send() to every rank, sinks from every rank
    broadcast(name, buf, root, deps)             root's buf into every rank's buf, in place
    allreduce(name, values, deps)                fp32 sum over the ranks, in place, by the
                                                 transport's own collective (has_allreduce);
                                                 sizes_agreed / agree_on skip or extend its check
    gather_rows(name, row, table, deps)          every rank's row of a fixed size into every
                                                 rank's table (a few bytes of per-step control)
    alltoallv(name, send, sc, recv, rc, deps)    the transport's alltoallv / allgatherv, sizes
    allgatherv(name, send, recv, rc, deps)       known on both sides (has_allreduce: direct only)

``max_bytes`` (sendrecv, bulk, allgather): the most bytes this rank accepts from a source,
from what it knows itself (the compressor's ``max_encoded_bytes`` of the payloads it
expects), never from what the peer announces. The direct exchange passes it to the
transport's ``*_alloc`` calls, which refuse a larger announcement before allocating it
(:class:`hipress.comm.transport.TransportError` naming the peer). The coordinated exchange
does not enforce it yet: its receive sizes come from the coordinator's plan.

Two implementations:

* :class:`DirectExchange` runs each operation on the comm queue as transport calls. The
  transports match messages in call order and each rank has one comm thread, so every rank
  must issue its communication in the same order: a :class:`CommChain` makes each comm task
  depend on the one submitted before it (submission order is the same on every rank, because
  gradients are submitted in backward-hook order and missing ones in bucket order). The
  exchanges of one rank's groups share one chain.
* :class:`CoordinatedExchange` posts each operation to the global coordinator's executor
  (hipress.comm.coordinator), which batches the messages of all ranks into slots over
  non-conflicting links. Messages are matched by a key derived from the operation's name
  and its occurrence, so no chain is needed. Group ranks are translated to world ranks, so
  the coordinator serves the local and cross groups of local aggregation too. It has no
  allreduce, so uncompressed sums go beside it, through direct exchanges of their own
  (``Exchanges.plain``) where the backend can run those while the executor runs its slots.

:func:`open_exchanges` makes the world, local and cross exchanges of this process.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hipress import config
from hipress.comm.coordinator.ahead import StepPredictor
from hipress.engine import Engine, Handle, exchanges_waited_on

__all__ = ["Exchange", "DirectExchange", "CoordinatedExchange", "CommChain", "Exchanges", "open_exchanges",
           "transfer"]

Send = Callable[[], torch.Tensor]
Sink = Callable[[torch.Tensor], None]
# ({dst: bytes sent}, {src: bytes received}) of an exchange whose sizes every rank knows in advance
Sizes = Tuple[Dict[int, int], Dict[int, int]]


class CommChain:
    """Orders comm tasks by submission (see the module docstring), and knows what the comm
    thread is waiting for (``in_flight``: the operation's name and the world ranks it receives
    from), so a timeout can name the peers that did not arrive."""

    def __init__(self):
        self.last: Optional[Handle] = None
        self.in_flight: Optional[tuple] = None

    def reset(self) -> None:
        """Forgets the last task: after a failed sync (hipress DistributedOptimizer.reset()), new
        communication must not depend on the failed task, or it would fail with it."""
        self.last = None
        self.in_flight = None

    def deps(self, extra: Sequence[Handle]) -> List[Handle]:
        return list(extra) + ([self.last] if self.last is not None else [])

    def push(self, h: Handle) -> Handle:
        self.last = h
        return h


class Exchange(abc.ABC):
    """Communication of one group of ranks, as engine tasks (see the module docstring)."""

    def __init__(self, engine: Engine, rank: int, size: int):
        self.engine = engine
        self.rank = rank
        self.size = size

    @abc.abstractmethod
    def _exchange(self, name: str, sends: Dict[int, Send], sinks: Dict[int, Sink], deps: Sequence[Handle],
                  pairwise: bool, max_bytes: Optional[Dict[int, int]] = None, sizes: Optional[Sizes] = None) -> Handle:
        """pairwise: exactly one destination and one source (a ring step); max_bytes: {src: bound};
        sizes: ({dst: bytes sent}, {src: bytes received}), as :meth:`bulk`'s."""

    @abc.abstractmethod
    def broadcast(self, name: str, buf: torch.Tensor, root: int, deps: Sequence[Handle] = ()) -> Handle:
        """Copies root's ``buf`` (contiguous) into every rank's ``buf``."""

    @property
    def has_allreduce(self) -> bool:
        """Whether :meth:`allreduce` is available (the transport has a native allreduce)."""
        return False

    def allreduce(self, name: str, values: torch.Tensor, deps: Sequence[Handle] = (), sizes_agreed: bool = False,
                  agree_on: Optional[int] = None) -> Handle:
        """In place: ``values`` (1-D contiguous, one of the transport's ``allreduce_dtypes``)
        becomes the sum over the group's ranks. ``sizes_agreed``, ``agree_on``: as the
        transport's (Transport.allreduce)."""
        raise NotImplementedError(f"{type(self).__name__} has no allreduce (see has_allreduce)")

    def alltoallv(self, name: str, send: torch.Tensor, send_counts: Sequence[int], recv: torch.Tensor,
                  recv_counts: Sequence[int], deps: Sequence[Handle] = (), sizes_agreed: bool = False,
                  agree_on: Optional[int] = None) -> Handle:
        """The transport's alltoallv of uint8 buffers whose sizes both sides know (the native
        reduce-scatter of uncompressed gradients, hipress.sync.allreduce; where has_allreduce);
        ``sizes_agreed``, ``agree_on``: its checking round, as :meth:`allreduce`'s."""
        raise NotImplementedError(f"{type(self).__name__} has no native alltoallv (see has_allreduce)")

    def allgatherv(self, name: str, send: torch.Tensor, recv: torch.Tensor, recv_counts: Sequence[int],
                   deps: Sequence[Handle] = (), sizes_agreed: bool = False) -> Handle:
        """The transport's allgatherv of uint8 buffers (the native all-gather of uncompressed
        gradients; where has_allreduce); ``sizes_agreed``: skip its checking round."""
        raise NotImplementedError(f"{type(self).__name__} has no native allgatherv (see has_allreduce)")

    def gather_rows(self, name: str, row: torch.Tensor, table: torch.Tensor, deps: Sequence[Handle] = ()) -> Handle:
        """``table`` (uint8, ``size`` rows of ``row.numel()`` bytes) gets every rank's ``row`` (uint8),
        in group rank order. The row's size must be fixed by a configuration the ranks compared
        once (the optimizer's, at wrap): a transport that can skips its checking round for it."""
        rows = table.view(self.size, row.numel())
        return self.allgather(name, lambda: row, {r: rows[r].copy_ for r in range(self.size)}, deps,
                              max_bytes=row.numel(), size=row.numel())

    def sendrecv(self, name: str, send: Send, dst: int, sink: Sink, src: int, deps: Sequence[Handle] = (),
                 max_bytes: Optional[int] = None, sizes: Optional[Tuple[int, int]] = None) -> Handle:
        """max_bytes: the most this rank accepts from src (None: no bound). sizes: (bytes sent,
        bytes received), where every rank knows them in advance (a compressor's encoded_bytes):
        the payload then goes without a size message first, one exchange instead of two (a
        round trip less per ring hop). The peers' calls must give them too; a payload of
        another size fails the task before anything is sent."""
        return self._exchange(name, {dst: send}, {src: sink}, deps, pairwise=True,
                              max_bytes=None if max_bytes is None else {src: max_bytes},
                              sizes=None if sizes is None else ({dst: sizes[0]}, {src: sizes[1]}))

    def bulk(self, name: str, sends: Dict[int, Send], sinks: Dict[int, Sink], deps: Sequence[Handle] = (),
             max_bytes: Optional[Dict[int, int]] = None, sizes: Optional[Sizes] = None) -> Handle:
        """Every rank of the group calls it; a rank may send to and hear from any subset.
        max_bytes: {src: the most this rank accepts from src} (sources left out: no bound).
        sizes: ({dst: bytes sent}, {src: bytes received}) for every destination and source, where
        every rank knows them in advance, as :meth:`sendrecv`'s: the payloads go without their
        sizes first, one round instead of two, where the transport posts to many peers at once."""
        return self._exchange(name, sends, sinks, deps, pairwise=False, max_bytes=max_bytes, sizes=sizes)

    def allgather(self, name: str, send: Send, sinks: Dict[int, Sink], deps: Sequence[Handle] = (),
                  max_bytes: Optional[int] = None, size: Optional[int] = None) -> Handle:
        """send() goes to every rank (itself included); sinks[src] takes src's payload.
        max_bytes: the most this rank accepts from any one rank (None: no bound). size: every
        rank's payload is this many bytes, known to all in advance (as :meth:`bulk`'s sizes)."""
        payload: dict = {}

        def once():  # evaluated once, whatever the number of destinations
            if "p" not in payload:
                payload["p"] = send()
            return payload["p"]

        return self.bulk(name, {dst: once for dst in range(self.size)}, sinks, deps,
                         max_bytes=None if max_bytes is None else {src: max_bytes for src in sinks},
                         sizes=None if size is None else ({dst: size for dst in range(self.size)},
                                                          {src: size for src in sinks}))


def transfer(transport, payloads: Dict[int, torch.Tensor], recv_from, pairwise: bool,
             max_bytes: Optional[Dict[int, int]] = None, sizes: Optional[Sizes] = None) -> Dict[int, torch.Tensor]:
    """Moves payloads now, over the transport; receivers learn the sizes from the transport
    (payload sizes vary with the gradient for sparsifiers). Returns {src: payload}.

    pairwise: exactly one destination and one source (a ring step): one sendrecv_alloc.
    Otherwise one alltoallv_alloc (zero bytes to and from every peer not named). Every rank
    of the transport must make the same kind of call at the same point.

    max_bytes: {src: the most bytes accepted from src}, enforced by the transport before it
    allocates (sources left out: no bound).

    sizes: ({dst: bytes sent}, {src: bytes received}), known to both ends: one exchange of the
    payloads, no sizes first (where the transport can post them all at once).
    """
    bound = max_bytes or {}
    if sizes is not None and (pairwise or transport.p2p_many):
        return _exchange_known(transport, payloads, recv_from, *sizes)
    if pairwise:
        (dst, payload), = payloads.items()
        (src,) = recv_from
        return {src: transport.sendrecv_alloc(payload, dst, src, max_bytes=bound.get(src))}
    segs = [payloads[j].reshape(-1) if j in payloads else torch.empty(0, dtype=torch.uint8)
            for j in range(transport.size)]
    recv, recv_counts = transport.alltoallv_alloc(torch.cat(segs), [x.numel() for x in segs],
                                                  max_bytes=[bound.get(j) for j in range(transport.size)]
                                                  if bound else None)
    out, off = {}, 0
    for j, c in enumerate(recv_counts):
        if j in recv_from:
            out[j] = recv[off:off + c]
        off += c
    return out


def _exchange_known(transport, payloads, recv_from, sent: Dict[int, int], received: Dict[int, int]):
    """transfer() where both ends know every size: the payloads in one transport exchange."""
    wrong = [f"a payload of {p.numel()} bytes for rank {d}, which expects {sent[d]}"
             for d, p in payloads.items() if p.numel() != sent[d]]
    if wrong:  # the peers would read a wrong count of bytes: nothing goes
        raise ValueError("; ".join(wrong) + " (the compressor's encoded_bytes): nothing was sent")
    device = next(iter(payloads.values())).device if payloads else torch.device("cpu")
    got = {src: torch.empty(received[src], dtype=torch.uint8, device=device) for src in recv_from}
    me = transport.rank
    if me in got:  # this rank's own payload: no message
        got[me].copy_(payloads[me])
    transport.exchange({d: p for d, p in payloads.items() if d != me}, {s: b for s, b in got.items() if s != me})
    return got


class DirectExchange(Exchange):
    """Transport calls on the comm queue, chained in submission order."""

    def __init__(self, engine: Engine, transport, chain: CommChain, members: Optional[Sequence[int]] = None):
        super().__init__(engine, transport.rank, transport.size)
        self.transport = transport
        self.chain = chain
        self.members = list(members) if members is not None else list(range(transport.size))

    def _comm(self, name: str, fn: Callable[[], None], deps: Sequence[Handle]) -> Handle:
        return self.chain.push(self.engine.submit(name, fn, queue="comm", deps=self.chain.deps(deps)))

    def _exchange(self, name, sends, sinks, deps, pairwise, max_bytes=None, sizes=None):
        tr = self.transport

        waits_for = sorted(self.members[s] for s in sinks if s != self.rank)

        def run():
            payloads = {d: f() for d, f in sends.items()}
            self.chain.in_flight = (name, waits_for, tr, self.members)
            got = transfer(tr, payloads, set(sinks), pairwise, max_bytes, sizes)
            self.chain.in_flight = None
            for src, buf in got.items():
                sinks[src](buf)

        return self._comm(name, run, deps)

    def broadcast(self, name, buf, root, deps=()):
        tr = self.transport
        waits_for = [self.members[root]] if root != self.rank else [m for m in self.members if m != self.members[root]]

        def run():
            if buf.numel():
                self.chain.in_flight = (name, waits_for, tr, self.members)
                tr.broadcast(buf.view(-1).view(torch.uint8), root)
                self.chain.in_flight = None

        return self._comm(name, run, deps)

    def gather_rows(self, name, row, table, deps=()):
        # one collective, no checking round
        return self._native(name, deps, lambda tr: tr.allgather(row, table, sizes_agreed=True))

    @property
    def has_allreduce(self) -> bool:
        return self.transport.has_allreduce

    def alltoallv(self, name, send, send_counts, recv, recv_counts, deps=(), sizes_agreed=False, agree_on=None):
        return self._native(name, deps, lambda tr: tr.alltoallv(send, send_counts, recv, recv_counts,
                                                                sizes_agreed, agree_on))

    def allgatherv(self, name, send, recv, recv_counts, deps=(), sizes_agreed=False):
        return self._native(name, deps, lambda tr: tr.allgatherv(send, recv, recv_counts, sizes_agreed))

    def _native(self, name, deps, call) -> Handle:
        tr = self.transport
        waits_for = [m for i, m in enumerate(self.members) if i != self.rank]

        def run():
            self.chain.in_flight = (name, waits_for, tr, self.members)
            call(tr)
            self.chain.in_flight = None

        return self._comm(name, run, deps)

    def allreduce(self, name, values, deps=(), sizes_agreed=False, agree_on=None):
        if not self.has_allreduce:
            return super().allreduce(name, values, deps)
        return self._native(name, deps, lambda tr: tr.allreduce(values, sizes_agreed, agree_on))


class CoordinatedExchange(Exchange):
    """Messages scheduled by the global coordinator; ``members`` maps group ranks to world ranks.
    No allreduce: the coordinator plans point-to-point messages only, so uncompressed gradients
    go beside it (``Exchanges.plain``), or where the backend has nothing beside it, through
    hipress's ring over it."""

    def __init__(self, engine: Engine, executor, members: Sequence[int], predictor: Optional[StepPredictor] = None):
        """``predictor``: names and declares the exchanges, and may declare the next step's ahead
        (hipress.comm.coordinator.ahead); one is shared by the groups of an optimizer. None: this
        group's own, which never predicts (nobody tells it where steps end)."""
        me = executor.rank
        if me not in members:
            raise ValueError(f"world rank {me} is not a member of the group {list(members)}")
        super().__init__(engine, list(members).index(me), len(members))
        self.executor = executor
        self.predictor = predictor if predictor is not None else StepPredictor(executor, enabled=False)
        self.group = self.predictor.add_group()
        self.members = list(members)

    def _exchange(self, name, sends, sinks, deps, pairwise, max_bytes=None, sizes=None):
        # max_bytes is not enforced here, nor sizes used (see the module docstring): the receiver
        # learns each payload's size from its sender's batch.
        ex, world, me = self.executor, self.members, self.executor.rank
        deps = list(deps)
        # Declared now (before anything submitted after it; or confirmed, if the last step's end
        # declared it ahead), planned ahead of its payloads: after the exchanges its tasks wait on.
        waits_on, after_all = exchanges_waited_on(deps)
        dsts, srcs = [world[d] for d in sends if world[d] != me], [world[s] for s in sinks if world[s] != me]
        key_name, key, position = self.predictor.exchange(self.group, name, dsts, srcs, after_all, waits_on)

        def post(completion):
            payloads = {world[d]: f() for d, f in sends.items()}
            self.predictor.posted(position, {d: p.numel() * p.element_size() for d, p in payloads.items()})
            ex.post(key_name, key, payloads, {world[s]: sink for s, sink in sinks.items()}, completion)

        handle = self.engine.submit_deferred(name, post, queue="comm", deps=deps)
        handle.exchange_key = key
        # What waits on this exchange waits on its predecessors through it: its messages are
        # planned after theirs. With nothing on the network here, it has no messages to order
        # by, so it passes its predecessors on.
        if dsts or srcs:
            handle.waits_on = handle.after_all = (handle,)
        return handle

    def broadcast(self, name, buf, root, deps=()):
        flat = buf.view(-1).view(torch.uint8)
        if self.rank == root:
            sends = {d: (lambda: flat) for d in range(self.size) if d != root}
            sinks: Dict[int, Sink] = {}
        else:
            sends, sinks = {}, {root: flat.copy_}
        return self._exchange(name, sends, sinks, deps, pairwise=False)


@dataclasses.dataclass(frozen=True)
class Exchanges:
    """This process's exchanges: over all ranks, the ranks of its host, one rank per host."""

    world: Exchange
    local: Exchange
    cross: Exchange
    predictor: Optional[StepPredictor] = None  # the coordinator's (hipress.comm.coordinator.ahead); None without
    # Beside the coordinator: the direct exchanges whose allreduce sums uncompressed gradients
    # (hipress.sync.factory; issue 21, compression never a loss). None: direct exchanges sum their
    # own; coordinated ones where the backend cannot run both at once send them through the coordinator.
    plain: Optional["Exchanges"] = None

    @property
    def comm_thread_world(self) -> Exchange:
        """The world exchange whose transfers run on this rank's comm thread (what a timeout names
        the peers of: ``waiting_words``): this set's, or beside the coordinator its plain set's."""
        return (self.plain or self).world

    def rebind(self, world_transport, local_transport, cross_transport) -> None:
        """Moves the exchanges onto fresh transports (after ``world.reconnect()``; collective): the
        direct ones onto the new transports, the coordinated ones onto a new executor over the new
        world transport (``coordinator.replace``), their predictor starting over."""
        if self.plain is not None:
            self.plain.rebind(world_transport, local_transport, cross_transport)
        if self.predictor is not None:
            from hipress.comm import coordinator

            ex = coordinator.replace(self.predictor.executor, world_transport)
            self.predictor.restart(ex)
            for c in (self.world, self.local, self.cross):
                c.executor = ex
            return
        for ex, tr in ((self.world, world_transport), (self.local, local_transport), (self.cross, cross_transport)):
            ex.transport = tr

    def reset(self) -> None:
        """New communication no longer waits on (or fails with) what was submitted before."""
        chain = getattr(self.world, "chain", None)
        if chain is not None:
            chain.reset()
        if self.predictor is not None:
            self.predictor.reset()
        if self.plain is not None:
            self.plain.reset()

    def step_submitted(self) -> None:
        """A training step's communication is all submitted (the coordinator may declare the next
        step's ahead: hipress.comm.coordinator.ahead)."""
        if self.predictor is not None:
            self.predictor.step_submitted()


def waiting_for(world_exchange) -> Optional[tuple]:
    """(operation name, world ranks it still waits to hear from) of the transfer in progress on
    ``world_exchange``'s comm thread, or None (nothing in flight, or the coordinator schedules it;
    ``Exchanges.comm_thread_world`` is the exchange to ask)."""
    chain = getattr(world_exchange, "chain", None)
    current = chain.in_flight if chain is not None else None
    if current is None:
        return None
    name, waits_for, tr, members = current
    pending = getattr(tr, "pending_peers", lambda: None)()
    return name, [members[p] for p in pending] if pending else waits_for


def waiting_words(world_exchange) -> str:
    """Whom this rank was waiting for when a deadline passed, in words (for timeout messages)."""
    pending = waiting_for(world_exchange)
    if pending is None:
        return "no transfer was in flight on this rank (a compute task or the coordinator was still running)"
    op, ranks = pending
    return f"waiting for rank(s) {ranks} in '{op}'"


def open_exchanges(engine: Engine, coordinated: bool = False, plain: Optional[Exchanges] = None) -> Exchanges:
    """Collective when coordinated (starts the executor over the world). Needs ``world.init()``.
    ``plain`` (coordinated only): direct exchanges already open to sum uncompressed gradients on
    (by default new ones); none where the backend cannot run a split's collectives beside the world's."""
    from hipress.comm import world

    def direct() -> Exchanges:
        chain = CommChain()  # one order for all of this rank's communication
        return Exchanges(DirectExchange(engine, world.transport(), chain, world.members("world")),
                         DirectExchange(engine, world.local_transport(), chain, world.members("local")),
                         DirectExchange(engine, world.cross_transport(), chain, world.members("cross")))

    if coordinated and world.size() > 1:
        from hipress.comm import coordinator

        # groups of a few ranks (local aggregation's) make exchanges some ranks do not declare
        every_rank = all(len(world.members(g)) in (1, world.size()) for g in ("local", "cross"))
        ex = coordinator.start(world.transport(), every_rank_declares=every_rank)
        predictor = StepPredictor(ex, enabled=config.get("HIPRESS_COORDINATOR_AHEAD"))
        make = {g: CoordinatedExchange(engine, ex, world.members(g), predictor) for g in ("world", "local", "cross")}
        # beside the executor, which runs on splits of the world's transport, where the backend allows
        plain = (plain or direct()) if world.transport().concurrent_splits else None
        return Exchanges(make["world"], make["local"], make["cross"], predictor, plain)
    return direct()
