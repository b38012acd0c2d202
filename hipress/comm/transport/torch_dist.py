"""Transport over torch.distributed process groups: gloo for CPU buffers, nccl for CUDA.

    t = TorchDistTransport.create(rank, size, "10.0.0.1", 29500)      # own TCPStore + gloo group
    t = TorchDistTransport.from_default_group()                       # the user's init_process_group

The transport drives the ``ProcessGroup`` object directly (``pg.send``, ``pg.alltoall_base``,
...), so sub-groups made by :meth:`split` are plain ``ProcessGroupGloo`` objects over a
``PrefixStore`` that only their members construct; nothing is registered in torch's
global group table and non-members never have to take part.

alltoallv: concurrent point-to-point sends and receives by default (gloo's
``alltoall_base`` moved a 16 MB 2-rank exchange at half the link rate on the emulated
cluster); ``HIPRESS_TORCH_ALLTOALL=native`` selects ``alltoall_base`` (falling back to
point-to-point if the backend refuses it). allgatherv is always made of sends and receives.
allreduce is the process group's own (``pg.allreduce``, sum).

Every gloo group a transport makes (splits, private groups beside the user's default group) shares
the network device of the group it is made from, so a rank has one gloo event loop however many
groups it holds: each device's loop thread wakes 100 times a second even when idle, and with ranks
on every core a few idle loops per rank cost a few percent of a training step (issue 21).

Errors from the backend (a peer that closed its connection, gloo's own timeout) come back
as :class:`TransportError` naming the operation and the peers involved.
"""
from __future__ import annotations

import datetime
from typing import List, Optional

import torch
import torch.distributed as dist

from hipress import config
from hipress.comm.transport.base import Transport, TransportError, displacements

__all__ = ["TorchDistTransport"]

# internal point-to-point tags (user tags map to [0, 2*MAX_TAG))
_TAG_SENDRECV = 1 << 20
_TAG_A2A = (1 << 20) + 1
_TAG_AGV = (1 << 20) + 2
# All-gathers up to this many bytes per rank go as pairwise messages (one round of latency)
# instead of gloo's ring (size - 1 rounds in a row): control rows, checking rounds.
SMALL_ALLGATHER_BYTES = 64 << 10


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=float(seconds))


class TorchDistTransport(Transport):
    name = "torch"
    allreduce_dtypes = (torch.float32, torch.bfloat16, torch.float16)  # gloo and NCCL sum all three

    def __init__(self, pg, rank: int, size: int, store=None, backend: str = "gloo",
                 timeout_s: Optional[float] = None, check: Optional[bool] = None, prefix: str = "hipress"):
        super().__init__(rank, size, timeout_s, check)
        self.pg = pg
        self.store = store
        self.backend = backend
        self.name = f"torch/{backend}"
        self._prefix = prefix
        self._splits = 0
        self._devices = _gloo_devices(pg) if backend == "gloo" else None  # what new groups share
        self._a2a_mode = config.get("HIPRESS_TORCH_ALLTOALL")
        self._device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(cls, rank: int, size: int, master_addr: str = "127.0.0.1", master_port: int = 29500,
               backend: str = "gloo", timeout_s: Optional[float] = None, check: Optional[bool] = None,
               store=None) -> "TorchDistTransport":
        """Rendezvous through a TCPStore (rank 0 hosts it) and build a process group."""
        from hipress.comm.transport.base import default_timeout_s

        timeout = default_timeout_s() if timeout_s is None else float(timeout_s)
        if store is None:  # rank 0 listens on master_addr only (hipress.comm.rendezvous)
            from hipress.comm import rendezvous

            store = rendezvous.tcp_store(master_addr, int(master_port), int(size), int(rank), timeout,
                                         secret=config.get("HIPRESS_JOB_SECRET"), transport=f"torch/{backend}")
        pg = cls._new_pg(dist.PrefixStore("hipress/world", store), rank, size, backend, timeout)
        return cls(pg, rank, size, store, backend, timeout, check)

    @classmethod
    def from_default_group(cls, timeout_s: Optional[float] = None, check: Optional[bool] = None) -> "TorchDistTransport":
        """Wrap the process group made by the user's ``dist.init_process_group``."""
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized")
        pg = dist.distributed_c10d._get_default_group()
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - older/newer torch: splits then need a store
            store = None
        backend = dist.get_backend()
        backend = "nccl" if "nccl" in backend and torch.cuda.is_available() and "gloo" not in backend else "gloo"
        return cls(pg, dist.get_rank(), dist.get_world_size(), store, backend, timeout_s, check, prefix="hipress/default")

    @classmethod
    def private_gloo(cls, store, prefix: str, rank: int, size: int, timeout_s: float) -> "TorchDistTransport":
        """A gloo group of its own over an existing store (keys under ``prefix``): hipress's
        traffic then never shares a group with the user's torch.distributed collectives (DDP)."""
        default = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
        pg = cls._new_pg(dist.PrefixStore(prefix, store), rank, size, "gloo", timeout_s, _gloo_devices(default))
        return cls(pg, rank, size, store, "gloo", timeout_s, prefix=prefix)

    @staticmethod
    def _new_pg(store, rank: int, size: int, backend: str, timeout_s: float, devices=None):
        """A new group; a gloo one over ``devices`` (another group's, see the module's docstring)
        where given, else over a device of its own."""
        try:
            if backend == "gloo":
                if not devices:
                    return dist.ProcessGroupGloo(store, rank, size, _td(timeout_s))
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout, opts._devices = _td(timeout_s), devices
                return dist.ProcessGroupGloo(store, rank, size, opts)
            if backend == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = _td(timeout_s)
                return dist.ProcessGroupNCCL(store, rank, size, opts)
        except Exception as e:  # noqa: BLE001
            raise TransportError("rendezvous", f"creating the {backend} group of {size} ranks failed: {e}",
                                 None, rank, f"torch/{backend}") from e
        raise ValueError(f"unknown torch.distributed backend {backend!r} (gloo or nccl)")

    def _check_device(self, what, t):
        if self.backend == "nccl":
            if t.device.type != "cuda":
                return f"{what} is on {t.device}; the torch/nccl transport takes CUDA buffers"
            return None
        if t.device.type != "cpu":
            return f"{what} is on {t.device}; the torch/gloo transport takes CPU buffers (use nccl for CUDA)"
        return None

    def _meta_device(self, t):
        return t.to(self._device) if self._device.type != "cpu" else t

    def _meta_gather(self, op, values):
        if self._device.type == "cpu":
            return super()._meta_gather(op, values)
        n = len(values)
        send = torch.tensor(list(values), dtype=torch.int64, device=self._device).view(torch.uint8)
        recv = torch.empty(n * self._size * 8, dtype=torch.uint8, device=self._device)
        self._raw_allgather(send, recv, op)
        return recv.view(torch.int64).cpu().view(self._size, n).tolist()

    # ------------------------------------------------------------------ waiting
    def _wait(self, op: str, works: list, peers) -> None:
        """peers: the ranks involved; when it has one entry per work (point to point), a failure
        names only the peers whose work had not completed (those that did not arrive)."""
        self._in_wait = (works, peers)
        try:
            for w in works:
                w.wait(_td(self.timeout_s))
            if self.backend == "nccl":
                torch.cuda.current_stream().synchronize()
        except TransportError:
            raise
        except Exception as e:  # noqa: BLE001 - DistBackendError, RuntimeError from gloo
            msg = str(e).split(" This is typically caused")[0]
            if len(peers) == len(works) > 0:
                pending = sorted({p for w, p in zip(works, peers) if not _completed(w)})
                if pending:
                    msg += f"; waiting for rank(s) {pending}"
                    peers = pending
            raise self._err(op, f"{type(e).__name__}: {msg}", peers) from e
        finally:
            self._in_wait = None

    def pending_peers(self) -> Optional[List[int]]:
        """The peers (ranks of this transport) whose part of the operation now waited on has not
        completed (point-to-point operations), or None. Read from another thread to name whom a
        stalled operation waits for."""
        current = getattr(self, "_in_wait", None)
        if current is None or len(current[0]) != len(current[1]):
            return None
        works, peers = current
        return sorted({p for w, p in zip(works, peers) if not _completed(w)})

    def _post(self, op: str, peers, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001
            raise self._err(op, f"{type(e).__name__}: {e}", peers) from e

    # ------------------------------------------------------------------ point to point
    def _raw_send(self, buf, dst, tag, op):
        self._wait(op, [self._post(op, [dst], self.pg.send, [buf], dst, tag)], [dst])

    def _raw_send_many(self, msgs, dst, op):
        self._wait(op, [self._post(op, [dst], self.pg.send, [b], dst, tag) for b, tag in msgs], [dst])

    def _raw_recv(self, buf, src, tag, op):
        self._wait(op, [self._post(op, [src], self.pg.recv, [buf], src, tag)], [src])

    def _raw_sendrecv(self, send_buf, dst, recv_buf, src, op):
        self._raw_p2p([] if send_buf is None else [(send_buf, dst)], [] if recv_buf is None else [(recv_buf, src)], op)

    @property
    def p2p_many(self) -> bool:
        return self.backend == "gloo"  # NCCL would need its messages in one group call

    def _raw_p2p(self, sends, recvs, op):
        works, peers = [], []
        for buf, src in recvs:  # receives first: gloo sends a payload once its receive is posted
            self._post_p2p(op, works, peers, self.pg.recv, buf, src, _TAG_SENDRECV)
        for buf, dst in sends:
            self._post_p2p(op, works, peers, self.pg.send, buf, dst, _TAG_SENDRECV)
        self._wait(op, works, peers)

    # ------------------------------------------------------------------ collectives
    def _others(self) -> List[int]:
        return [p for p in range(self._size) if p != self._rank]

    def _raw_alltoallv(self, send_buf, send_counts, recv_buf, recv_counts, op):
        ts, tr = sum(send_counts), sum(recv_counts)
        if self._a2a_mode == "native":
            try:
                work = self.pg.alltoall_base(recv_buf[:tr], send_buf[:ts], list(recv_counts), list(send_counts),
                                             dist.AllToAllOptions())
            except (RuntimeError, NotImplementedError) as e:
                if "not supported" not in str(e).lower() and "unsupported" not in str(e).lower():
                    raise self._err(op, f"{type(e).__name__}: {e}", self._others()) from e
                self._a2a_mode = "p2p"
            else:
                self._wait(op, [work], self._others())
                return
        self._p2p_alltoallv(send_buf, send_counts, recv_buf, recv_counts, op)

    def _post_p2p(self, op, works, peers, fn, buf, peer, tag) -> None:
        works.append(self._post(op, [peer], fn, [buf], peer, tag))
        peers.append(peer)

    def _post_recvs(self, op, works, peers, recv_buf, recv_counts, tag) -> None:
        """Posts the receive of recv_counts[src] bytes (at src's displacement in recv_buf) from every
        other rank that sends any, in an order staggered by rank to spread the load."""
        rd = displacements(recv_counts)
        r, n = self._rank, self._size
        for k in range(1, n):
            src = (r - k) % n
            if recv_counts[src]:
                self._post_p2p(op, works, peers, self.pg.recv, recv_buf[rd[src]:rd[src] + recv_counts[src]], src, tag)

    def _p2p_alltoallv(self, send_buf, send_counts, recv_buf, recv_counts, op):
        sd, rd = displacements(send_counts), displacements(recv_counts)
        r, n = self._rank, self._size
        works, peers = [], []
        # receives first, then sends, in an order staggered by rank to spread the load
        self._post_recvs(op, works, peers, recv_buf, recv_counts, _TAG_A2A)
        for k in range(1, n):
            dst = (r + k) % n
            if send_counts[dst]:
                self._post_p2p(op, works, peers, self.pg.send, send_buf[sd[dst]:sd[dst] + send_counts[dst]], dst, _TAG_A2A)
        if recv_counts[r]:
            recv_buf[rd[r]:rd[r] + recv_counts[r]].copy_(send_buf[sd[r]:sd[r] + send_counts[r]])
        self._wait(op, works, peers)

    def _raw_allgather(self, send_buf, recv_buf, op):
        if self.backend == "gloo" and send_buf.numel() <= SMALL_ALLGATHER_BYTES:
            self._raw_allgatherv(send_buf, recv_buf, [send_buf.numel()] * self._size, op)
            return
        self._wait(op, [self._post(op, self._others(), self.pg._allgather_base, recv_buf, send_buf)], self._others())

    def _raw_allgatherv(self, send_buf, recv_buf, recv_counts, op):
        rd = displacements(recv_counts)
        r, n = self._rank, self._size
        works, peers = [], []
        self._post_recvs(op, works, peers, recv_buf, recv_counts, _TAG_AGV)
        if recv_counts[r]:
            for k in range(1, n):
                dst = (r + k) % n
                self._post_p2p(op, works, peers, self.pg.send, send_buf, dst, _TAG_AGV)
            own = recv_buf[rd[r]:rd[r] + recv_counts[r]]
            if own.data_ptr() != send_buf.data_ptr():  # not sent from its place in recv_buf
                own.copy_(send_buf)
        self._wait(op, works, peers)

    def _raw_broadcast(self, buf, root, op):
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        peers = [root] if self._rank != root else self._others()
        self._wait(op, [self._post(op, peers, self.pg.broadcast, [buf], opts)], peers)

    @property
    def concurrent_splits(self) -> bool:
        return self.backend == "gloo"  # another process group: its own connections and thread

    def _raw_allreduce(self, values, op):
        # The backend's own algorithm (gloo: ring or halving-doubling by size; NCCL's on CUDA
        # buffers). A collective cannot tell which peer is late, so a failure names every other rank.
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self._wait(op, [self._post(op, self._others(), self.pg.allreduce, [values], opts)], self._others())

    def _raw_barrier(self, op):
        if self.backend == "gloo":
            self._wait(op, [self._post(op, self._others(), self.pg.barrier)], self._others())
        else:
            self._meta_gather(op, [1])

    # ------------------------------------------------------------------ groups
    def _make_split(self, members, colors, color_of):
        seq = self._splits
        self._splits += 1
        if members is None:
            return None
        if self.store is None:
            raise self._err("split", "this process group has no store to build sub-groups with")
        color = color_of[self._rank]
        prefix = f"{self._prefix}/split{seq}/c{color}"
        my = members.index(self._rank)
        pg = self._new_pg(dist.PrefixStore(prefix, self.store), my, len(members), self.backend, self.timeout_s,
                          self._devices)
        return TorchDistTransport(pg, my, len(members), self.store, self.backend, self.timeout_s, self.check, prefix)

    def reconnect(self) -> "TorchDistTransport":
        """A fresh group of the same ranks over the same store, under a new prefix (collective;
        every rank's n-th call meets the others' n-th). This transport is left as it is."""
        if self.store is None:
            raise self._err("reconnect", "this process group has no store to build a new group with")
        self._reconnects = getattr(self, "_reconnects", 0) + 1
        prefix = f"{self._prefix}/reconnect{self._reconnects}"
        pg = self._new_pg(dist.PrefixStore(prefix, self.store), self._rank, self._size, self.backend, self.timeout_s)
        return TorchDistTransport(pg, self._rank, self._size, self.store, self.backend, self.timeout_s, self.check,
                                  prefix)

    def _raw_close(self):
        # Dropping the reference closes gloo's pairs; shutdown() exists on newer torch.
        pg, self.pg = self.pg, None
        if pg is not None and not (dist.is_initialized() and pg is dist.distributed_c10d._get_default_group()):
            shut = getattr(pg, "shutdown", None)
            if shut is not None:
                try:
                    shut()
                except Exception:  # noqa: BLE001 - best effort
                    pass


def _gloo_devices(pg) -> Optional[list]:
    """The network devices of gloo group ``pg`` (a ProcessGroup holding a gloo backend, or the
    backend itself); None where it has none (not gloo, or no group: ``pg`` None)."""
    try:
        backend = pg._get_backend(torch.device("cpu")) if isinstance(pg, dist.ProcessGroup) else pg
        return list(backend.options._devices) if isinstance(backend, dist.ProcessGroupGloo) else None
    except Exception:  # noqa: BLE001 - no CPU backend (an NCCL-only group)
        return None


def _completed(work) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001 - a work that failed
        return False


def _connect(launch, timeout: float) -> TorchDistTransport:
    from hipress.comm import rendezvous

    if dist.is_available() and dist.is_initialized():
        return TorchDistTransport.from_default_group(timeout_s=timeout)
    backend = config.get("HIPRESS_TORCH_BACKEND")
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("HIPRESS_TORCH_BACKEND=nccl but CUDA is not available")
    return TorchDistTransport.create(launch.rank, launch.size, backend=backend, timeout_s=timeout,
                                     store=rendezvous.store(launch, timeout))


from hipress.comm.transport import Backend, register  # noqa: E402 - the registry imports this module

# Claims a job whose torch.distributed is already up; also the registry's fallback.
register(Backend("torch", _connect, claims=lambda launch: dist.is_available() and dist.is_initialized(),
                 priority=10))
