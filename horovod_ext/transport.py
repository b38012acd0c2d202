"""hipress transport over Horovod's collectives (``horovod.torch``), gloo or MPI controller.

    t = HorovodTransport.world()       # hvd.init(process_sets="dynamic") unless already initialized

Every hipress operation becomes Horovod collectives on a Horovod *process set*:

================  ==========================================================================
alltoallv         ``hvd.alltoall(splits=...)`` on the transport's process set
allgather(v)      ``hvd.allgather`` (first dimensions may differ between ranks)
broadcast         ``hvd.broadcast_`` (in place; Horovod takes the root's global rank)
barrier           a one-byte ``hvd.allgather``
allreduce         ``hvd.allreduce_async_`` (sum, in place) on the transport's process set
send/recv         ``hvd.broadcast_`` rooted at the sender on the process set of the pair
sendrecv          both of the above posted together, then waited for
split/subgroup    ``hvd.add_process_set`` for each group formed (reused when it exists)
================  ==========================================================================

Process sets. Horovod registers a process set collectively over *all* Horovod ranks, so
new sets are made only by splits of a transport that spans every rank (the world and
anything equal to it); a split of a smaller transport works when the sets it needs exist
already (or have one member), and raises a clear TransportError otherwise. Point-to-point
needs one process set per pair of ranks: the world transport registers them when it is made
if ``HIPRESS_HOROVOD_P2P`` is ``pairs`` (default for up to 16 ranks; each set costs Horovod's
background loop a little negotiation per cycle). With ``HIPRESS_HOROVOD_P2P=collective`` no
pair set is made: ``send``/``recv`` raise, and ``sendrecv`` becomes an alltoall over the
transport, which is right when all of its ranks call ``sendrecv`` together (ring steps).
Process sets need Horovod's dynamic process sets: the transport initializes Horovod with
``process_sets="dynamic"``; a script that calls ``hvd.init()`` itself must do the same.

Ranks are kept in the transport's own order (a split may order its members by key); Horovod
orders a process set by global rank, and the transport permutes segments where they differ.
Operations are named ``hipress.<transport id>.<n>`` so that Horovod matches them across ranks
whatever else the job runs. Horovod has no per-operation timeout: each wait polls the handle
and raises a TransportError after ``timeout_s``; the transport (and Horovod) cannot be used
after that. Buffers are CPU tensors (the wheel built by scripts/install_horovod.sh is CPU-only).
"""
from __future__ import annotations

import itertools
import os
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from hipress import config
from hipress.comm.transport.base import Transport, TransportError, displacements

__all__ = ["HorovodTransport", "horovod_info"]

_PAIRS_AUTO_MAX = 16


def _hvd():
    import horovod.torch as hvd

    return hvd


def _init_horovod():
    hvd = _hvd()
    if not hvd.is_initialized():
        hvd.init(process_sets="dynamic")
    return hvd


def horovod_info() -> dict:
    """What Horovod says about this process (initializes Horovod if needed)."""
    hvd = _init_horovod()
    return {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
            "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
            "controller": "gloo" if hvd.gloo_enabled() else ("mpi" if hvd.mpi_enabled() else "?"),
            "version": __import__("horovod").__version__}


class _Registry:
    """Process sets by their (sorted) global ranks; one per process, shared by all transports.

    Every world-collective registration happens in the same order on every Horovod rank, so
    the registries of all ranks hold the same sets."""

    def __init__(self, hvd):
        self.hvd = hvd
        self.sets: Dict[Tuple[int, ...], object] = {tuple(range(hvd.size())): hvd.global_process_set}
        self.dynamic = os.environ.get("HOROVOD_DYNAMIC_PROCESS_SETS", "0").strip().lower() in ("1", "true", "yes", "on")
        self._adopt_existing()

    def _adopt_existing(self):
        """Sets registered by the user's own code (hvd.init(process_sets=[...]) or add_process_set)."""
        try:
            from horovod.common.process_sets import ProcessSet, _basics

            table = _basics._get_process_set_ids_and_ranks()
        except Exception:  # noqa: BLE001 - private API; without it we only know our own sets
            return
        for psid, ranks in table.items():
            key = tuple(sorted(int(r) for r in ranks))
            if key not in self.sets:
                ps = ProcessSet(list(key))
                ps.process_set_id = psid
                self.sets[key] = ps

    def get(self, ranks: Sequence[int]):
        return self.sets.get(tuple(sorted(ranks)))

    def add(self, ranks: Sequence[int]):
        """World-collective: every Horovod rank calls it with the same ranks, in the same order."""
        key = tuple(sorted(ranks))
        if key in self.sets or len(key) < 2:
            return self.sets.get(key)
        if not self.dynamic:
            raise RuntimeError("Horovod was initialized without dynamic process sets; call "
                               "hvd.init(process_sets='dynamic') (or set HOROVOD_DYNAMIC_PROCESS_SETS=1) "
                               "before hipress.init()")
        ps = self.hvd.add_process_set(list(key))
        self.sets[key] = ps
        return ps


_registry: Optional[_Registry] = None
_world_generation = itertools.count()


def _get_registry(hvd) -> _Registry:
    global _registry
    if _registry is None or _registry.hvd is not hvd:
        _registry = _Registry(hvd)
    return _registry


class HorovodTransport(Transport):
    name = "horovod"

    def __init__(self, hvd, members: List[int], tid: str, registry: _Registry, p2p: str,
                 timeout_s: Optional[float] = None, check: Optional[bool] = None):
        me = hvd.rank()
        if me not in members:
            raise ValueError(f"Horovod rank {me} is not among the members {members}")
        super().__init__(members.index(me), len(members), timeout_s, check)
        self.hvd = hvd
        self.controller = "gloo" if hvd.gloo_enabled() else ("mpi" if hvd.mpi_enabled() else "?")
        self.name = f"horovod/{self.controller}"
        self.members = list(members)            # global Horovod rank of each transport rank
        self._tid = tid
        self._reg = registry
        self._p2p = p2p
        self._sorted = sorted(self.members)
        self._set_rank = [self._sorted.index(g) for g in self.members]   # transport rank -> set rank
        self._of_set_rank = [self.members.index(g) for g in self._sorted]  # set rank -> transport rank
        self._permuted = self._sorted != self.members
        self._pset = registry.get(self.members) if self._size > 1 else None
        if self._size > 1 and self._pset is None:
            raise ValueError(f"no Horovod process set for ranks {self._sorted}")
        self._seq = 0
        self._p2p_seq: Dict[tuple, int] = {}
        self._splits = 0
        self._broken: Optional[str] = None
        # what Horovod says about this process (hipress.comm.world groups by hostname; they agree)
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()
        self.cross_rank, self.cross_size = hvd.cross_rank(), hvd.cross_size()

    # ------------------------------------------------------------------ construction
    @classmethod
    def world(cls, timeout_s: Optional[float] = None, check: Optional[bool] = None,
              p2p: Optional[str] = None) -> "HorovodTransport":
        """A transport over all Horovod ranks (collective: every rank calls it)."""
        hvd = _init_horovod()
        n = hvd.size()
        mode = (p2p or config.get("HIPRESS_HOROVOD_P2P")).strip().lower()
        if mode not in ("auto", "pairs", "collective"):
            raise ValueError(f"HIPRESS_HOROVOD_P2P must be auto, pairs or collective, got {mode!r}")
        if mode == "auto":
            mode = "pairs" if n <= _PAIRS_AUTO_MAX else "collective"
        reg = _get_registry(hvd)
        if mode == "pairs" and n > 2:
            if not reg.dynamic:
                mode = "collective"
            else:
                try:
                    for i in range(n):
                        for j in range(i + 1, n):
                            reg.add([i, j])
                except Exception as e:  # noqa: BLE001
                    raise TransportError("rendezvous", f"registering Horovod process sets for point-to-point "
                                         f"failed: {type(e).__name__}: {e}", None, hvd.rank(), "horovod") from e
        return cls(hvd, list(range(n)), f"w{next(_world_generation)}", reg, mode, timeout_s, check)

    # ------------------------------------------------------------------ waiting
    def _name(self, what: str) -> str:
        self._seq += 1
        return f"hipress.{self._tid}.{what}.{self._seq}"

    def _post(self, op: str, peers, fn, *args, **kw):
        if self._broken:
            raise self._err(op, f"unusable after an earlier failure ({self._broken})", peers)
        try:
            return fn(*args, **kw)
        except Exception as e:  # noqa: BLE001 - HorovodInternalError, ValueError on bad args
            raise self._err(op, f"{type(e).__name__}: {e}", peers) from e

    def _wait(self, op: str, handles: list, peers) -> list:
        """Poll the handles until all are done (at most timeout_s), then synchronize them."""
        hvd = self.hvd
        deadline = time.monotonic() + self.timeout_s
        pending = list(handles)
        delay = 2e-5
        while pending:
            try:
                pending = [h for h in pending if not hvd.poll(h)]
            except Exception as e:  # noqa: BLE001
                raise self._err(op, f"{type(e).__name__}: {e}", peers) from e
            if not pending:
                break
            if time.monotonic() > deadline:
                self._broken = f"{op} timed out"
                raise self._err(op, f"timed out after {self.timeout_s:g} s waiting for Horovod "
                                    f"(a peer died, stalled or called a different operation)", peers)
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
        out = []
        for h in handles:
            try:
                out.append(hvd.synchronize(h))
            except Exception as e:  # noqa: BLE001 - HorovodInternalError
                raise self._err(op, f"{type(e).__name__}: {e}", peers) from e
        return out

    def _others(self) -> List[int]:
        return [p for p in range(self._size) if p != self._rank]

    # ------------------------------------------------------------------ collectives
    def _raw_alltoallv(self, send_buf, send_counts, recv_buf, recv_counts, op):
        n = self._size
        sd = displacements(send_counts)
        if n == 1:
            if recv_counts[0]:
                recv_buf[:recv_counts[0]].copy_(send_buf[:send_counts[0]])
            return
        if self._permuted:
            order = self._of_set_rank
            send = torch.cat([send_buf[sd[j]:sd[j] + send_counts[j]] for j in order])
            splits = [send_counts[j] for j in order]
        else:
            send = send_buf[:sum(send_counts)]
            splits = list(send_counts)
        hvd = self.hvd
        h = self._post(op, self._others(), hvd.alltoall_async, send,
                       torch.tensor(splits, dtype=torch.int32), self._name("a2a"), self._pset)
        out, got_splits = self._wait(op, [h], self._others())[0]
        got = [int(x) for x in got_splits.tolist()]
        want = [recv_counts[self._of_set_rank[s]] for s in range(n)]
        if got != want:
            raise self._err(op, f"Horovod delivered segments of {got} bytes (set order), expected {want}",
                            self._others())
        if not self._permuted:
            tr = sum(recv_counts)
            if tr:
                recv_buf[:tr].copy_(out)
            return
        self._place(out, recv_buf, recv_counts)

    def _place(self, out: torch.Tensor, recv_buf: torch.Tensor, recv_counts) -> None:
        """Copies out, the ranks' segments in process-set order, into recv_buf at the displacements
        of recv_counts (rank order)."""
        rd = displacements(recv_counts)
        off = 0
        for s in range(self._size):
            i = self._of_set_rank[s]
            c = recv_counts[i]
            if c:
                recv_buf[rd[i]:rd[i] + c].copy_(out[off:off + c])
            off += c

    def _gather(self, op: str, send_buf: torch.Tensor) -> torch.Tensor:
        h = self._post(op, self._others(), self.hvd.allgather_async, send_buf, self._name("ag"), self._pset)
        return self._wait(op, [h], self._others())[0]

    def _raw_allgather(self, send_buf, recv_buf, op):
        m, n = send_buf.numel(), self._size
        if n == 1:
            recv_buf[:m].copy_(send_buf)
            return
        out = self._gather(op, send_buf)
        if out.numel() != m * n:
            raise self._err(op, f"Horovod gathered {out.numel()} bytes, expected {m * n}", self._others())
        if not self._permuted:
            recv_buf[:m * n].copy_(out)
            return
        for s in range(n):
            i = self._of_set_rank[s]
            recv_buf[i * m:(i + 1) * m].copy_(out[s * m:(s + 1) * m])

    def _raw_allgatherv(self, send_buf, recv_buf, recv_counts, op):
        n = self._size
        if n == 1:
            if recv_counts[0]:
                recv_buf[:recv_counts[0]].copy_(send_buf)
            return
        out = self._gather(op, send_buf)
        if out.numel() != sum(recv_counts):
            raise self._err(op, f"Horovod gathered {out.numel()} bytes, expected {sum(recv_counts)}", self._others())
        self._place(out, recv_buf, recv_counts)

    def _raw_broadcast(self, buf, root, op):
        peers = [root] if self._rank != root else self._others()
        h = self._post(op, peers, self.hvd.broadcast_async_, buf, self.members[root], self._name("bc"), self._pset)
        self._wait(op, [h], peers)

    def _raw_allreduce(self, values, op):
        # In place on the transport's process set; a sum does not depend on the ranks' order
        hvd, name = self.hvd, self._name("ar")
        h = self._post(op, self._others(),
                       lambda: hvd.allreduce_async_(values, name=name, op=hvd.Sum, process_set=self._pset))
        self._wait(op, [h], self._others())

    def _raw_barrier(self, op):
        if self._size > 1:
            self._gather(op, torch.zeros(1, dtype=torch.uint8))

    # ------------------------------------------------------------------ point to point
    def _pair_set(self, op: str, peer: int):
        if self._size == 2:
            return self._pset
        ps = self._reg.get([self.members[self._rank], self.members[peer]]) if self._p2p == "pairs" else None
        if ps is None:
            raise self._err(op, "point-to-point over Horovod needs a process set per pair of ranks, which this "
                                f"job does not have (HIPRESS_HOROVOD_P2P={self._p2p}; use pairs, with Horovod's "
                                f"dynamic process sets)", [peer])
        return ps

    def _p2p_post(self, op: str, buf: torch.Tensor, src: int, dst: int, tag) -> object:
        """One message src -> dst (transport ranks): a broadcast rooted at src on the pair's set."""
        peer = dst if src == self._rank else src
        key = (src, dst, tag)
        k = self._p2p_seq.get(key, 0)
        self._p2p_seq[key] = k + 1
        name = f"hipress.{self._tid}.p{src}>{dst}.{tag}.{k}"
        return self._post(op, [peer], self.hvd.broadcast_async_, buf, self.members[src], name,
                          self._pair_set(op, peer))

    def _raw_send(self, buf, dst, tag, op):
        self._wait(op, [self._p2p_post(op, buf, self._rank, dst, tag)], [dst])

    def _raw_send_many(self, msgs, dst, op):
        self._wait(op, [self._p2p_post(op, b, self._rank, dst, tag) for b, tag in msgs], [dst])

    def _raw_recv(self, buf, src, tag, op):
        self._wait(op, [self._p2p_post(op, buf, src, self._rank, tag)], [src])

    @property
    def p2p_needs_all_ranks(self) -> bool:
        return self._p2p == "collective" and self._size > 2

    def _raw_sendrecv(self, send_buf, dst, recv_buf, src, op):
        if self.p2p_needs_all_ranks:
            return self._sendrecv_collective(send_buf, dst, recv_buf, src, op)
        handles = []
        if recv_buf is not None:
            handles.append(self._p2p_post(op, recv_buf, src, self._rank, "sr"))
        if send_buf is not None:
            handles.append(self._p2p_post(op, send_buf, self._rank, dst, "sr"))
        self._wait(op, handles, [dst, src])

    def _sendrecv_collective(self, send_buf, dst, recv_buf, src, op):
        """sendrecv as an alltoall over the whole transport (all ranks must be in a sendrecv)."""
        n = self._size
        sc, rc = [0] * n, [0] * n
        if send_buf is not None:
            sc[dst] = send_buf.numel()
        if recv_buf is not None:
            rc[src] = recv_buf.numel()
        send = send_buf if send_buf is not None else torch.empty(0, dtype=torch.uint8)
        recv = recv_buf if recv_buf is not None else torch.empty(0, dtype=torch.uint8)
        self._raw_alltoallv(send, sc, recv, rc, op)

    # ------------------------------------------------------------------ groups
    def _make_split(self, members, colors, color_of):
        seq = self._splits
        self._splits += 1
        groups = {c: [self.members[i] for i in range(self._size) if color_of[i] == c] for c in colors}
        spans_world = sorted(self.members) == list(range(self.hvd.size()))
        missing = [g for c, g in sorted(groups.items()) if len(g) > 1 and self._reg.get(g) is None]
        if missing:
            if not spans_world:
                raise self._err("split", f"Horovod process sets {[sorted(g) for g in missing]} do not exist, and only a "
                                         f"split of a transport over all {self.hvd.size()} Horovod ranks can register "
                                         f"new ones (Horovod registers process sets collectively over every rank)")
            try:
                for g in missing:
                    self._reg.add(g)
            except Exception as e:  # noqa: BLE001
                raise self._err("split", f"registering Horovod process sets {[sorted(g) for g in missing]} failed: "
                                         f"{type(e).__name__}: {e}") from e
        if members is None:
            return None
        color = color_of[self._rank]
        return HorovodTransport(self.hvd, [self.members[p] for p in members], f"{self._tid}.s{seq}c{color}",
                                self._reg, self._p2p, self.timeout_s, self.check)

    def _raw_close(self):
        # Horovod's process sets stay registered (removing one is collective over every
        # Horovod rank); Horovod itself shuts down at exit, or with hvd.shutdown().
        pass

    @property
    def broken(self) -> bool:
        return self._broken is not None
