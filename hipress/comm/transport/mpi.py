"""Native MPI transport (C++: csrc/transport/mpi_transport_mpi.cc), the default under
``mpirun`` / ``horovodrun --mpi``.

    t = MpiTransport.world()                   # private dup of MPI_COMM_WORLD
    t = MpiTransport.from_mpi4py(comm)         # private dup of an mpi4py communicator

Sharing with mpi4py: when mpi4py is importable (and ``HIPRESS_MPI4PY`` is not ``0``),
``world()`` lets mpi4py initialize MPI (it asks for MPI_THREAD_MULTIPLE and finalizes at
exit) and duplicates ``MPI.COMM_WORLD`` through its Fortran handle, so user code may keep
using mpi4py beside hipress; without mpi4py the C++ core initializes MPI itself and
finalizes it at exit. Our traffic always runs on a private duplicate communicator.

Every call releases the GIL while MPI works and waits at most ``timeout_s``; see the
C++ header for the failure semantics (a timed-out communicator is unusable afterwards:
end the job, e.g. with :meth:`abort`). Buffers must be CPU memory unless
``HIPRESS_MPI_CUDA_AWARE=1`` (a CUDA-aware MPI).
"""
from __future__ import annotations

import atexit
from typing import Optional

from hipress import config
from hipress.comm.transport.base import Transport

__all__ = ["MpiTransport", "available"]


def _core():
    from hipress import _C

    if not getattr(_C, "with_mpi", False):
        raise RuntimeError("hipress was built without MPI (no mpicxx found at build time); "
                           "install an MPI (e.g. apt-get install libopenmpi-dev) and rebuild, or use "
                           "HIPRESS_TRANSPORT=torch")
    return _C


def available() -> bool:
    try:
        _core()
        return True
    except (ImportError, RuntimeError):
        return False


_atexit_registered = False


def _ensure_mpi_initialized():
    """Initialize MPI once per process: through mpi4py when present, else natively."""
    global _atexit_registered
    C = _core()
    mpi4py_comm = None
    if config.get("HIPRESS_MPI4PY"):
        try:
            from mpi4py import MPI  # noqa: F401  (initializes MPI, THREAD_MULTIPLE by default)

            mpi4py_comm = MPI.COMM_WORLD
        except ImportError:
            mpi4py_comm = None
    level = C.mpi_init()
    if level < C.MPI_THREAD_SERIALIZED:
        raise RuntimeError(f"MPI provides thread level {level}; hipress calls MPI from its comm thread and needs "
                           f"MPI_THREAD_SERIALIZED or better (mpi4py: set mpi4py.rc.thread_level = 'multiple')")
    if C.mpi_we_initialized() and not _atexit_registered:
        atexit.register(C.mpi_finalize_if_owned)
        _atexit_registered = True
    return C, mpi4py_comm


class MpiTransport(Transport):
    name = "mpi"

    def __init__(self, comm, timeout_s: Optional[float] = None, check: Optional[bool] = None):
        super().__init__(comm.rank, comm.size, timeout_s, check)
        self._comm = comm
        self._C = _core()
        self._force_p2p = config.get("HIPRESS_MPI_ALLTOALL") == "p2p"
        self._cuda_aware = config.get("HIPRESS_MPI_CUDA_AWARE")

    @classmethod
    def world(cls, timeout_s: Optional[float] = None, check: Optional[bool] = None) -> "MpiTransport":
        C, mpi4py_comm = _ensure_mpi_initialized()
        if mpi4py_comm is not None:
            return cls(C.MpiComm.from_fortran(mpi4py_comm.py2f()), timeout_s, check)
        return cls(C.MpiComm.world(), timeout_s, check)

    @classmethod
    def from_mpi4py(cls, comm, timeout_s: Optional[float] = None, check: Optional[bool] = None) -> "MpiTransport":
        """A transport over (a private duplicate of) an mpi4py communicator."""
        C, _ = _ensure_mpi_initialized()
        return cls(C.MpiComm.from_fortran(comm.py2f()), timeout_s, check)

    @property
    def concurrent_splits(self) -> bool:
        return self._C.mpi_thread_level() >= self._C.MPI_THREAD_MULTIPLE

    def _check_device(self, what, t):
        if t.device.type == "cpu" or (self._cuda_aware and t.device.type == "cuda"):
            return None
        return f"{what} is on {t.device}; the mpi transport takes CPU buffers (HIPRESS_MPI_CUDA_AWARE=1 for CUDA-aware MPI)"

    def _call(self, op: str, fn, *args):
        try:
            return fn(*args)
        except self._C.MpiTransportError as e:
            _, msg, peers = e.args
            raise self._err(op, msg, peers if peers else None) from None

    # ------------------------------------------------------------------ backend hooks
    def _raw_send(self, buf, dst, tag, op):
        self._call(op, self._comm.send, buf.data_ptr(), buf.numel(), dst, tag, self.timeout_s)

    def _raw_recv(self, buf, src, tag, op):
        self._call(op, self._comm.recv, buf.data_ptr(), buf.numel(), src, tag, self.timeout_s)

    def _raw_sendrecv(self, send_buf, dst, recv_buf, src, op):
        # A leg left out is a null pointer (its peer may be None): the native call skips it.
        self._call(op, self._comm.sendrecv,
                   send_buf.data_ptr() if send_buf is not None else 0, send_buf.numel() if send_buf is not None else 0,
                   -1 if send_buf is None else dst,
                   recv_buf.data_ptr() if recv_buf is not None else 0, recv_buf.numel() if recv_buf is not None else 0,
                   -1 if recv_buf is None else src, 31999, self.timeout_s)

    p2p_many = True  # nonblocking sends and receives, all posted, then waited for

    def _raw_p2p(self, sends, recvs, op):
        self._call(op, self._comm.exchange, [(b.data_ptr(), b.numel(), dst) for b, dst in sends],
                   [(b.data_ptr(), b.numel(), src) for b, src in recvs], 31999, self.timeout_s)

    def _raw_alltoallv(self, send_buf, send_counts, recv_buf, recv_counts, op):
        self._call(op, self._comm.alltoallv, send_buf.data_ptr(), list(send_counts), recv_buf.data_ptr(),
                   list(recv_counts), self.timeout_s, self._force_p2p)

    def _raw_allgather(self, send_buf, recv_buf, op):
        self._call(op, self._comm.allgather, send_buf.data_ptr(), send_buf.numel(), recv_buf.data_ptr(), self.timeout_s)

    def _raw_allgatherv(self, send_buf, recv_buf, recv_counts, op):
        self._call(op, self._comm.allgatherv, send_buf.data_ptr(), send_buf.numel(), recv_buf.data_ptr(),
                   list(recv_counts), self.timeout_s)

    def _raw_broadcast(self, buf, root, op):
        self._call(op, self._comm.bcast, buf.data_ptr(), buf.numel(), root, self.timeout_s)

    def _raw_allreduce(self, values, op):
        self._call(op, self._comm.allreduce_f32, values.data_ptr(), values.numel(), self.timeout_s)

    def _raw_barrier(self, op):
        self._call(op, self._comm.barrier, self.timeout_s)

    def _make_split(self, members, colors, color_of):
        color = color_of[self._rank]
        key = members.index(self._rank) if members is not None else 0
        sub = self._call("split", self._comm.split, color if members is not None else -1, key, self.timeout_s)
        if sub is None:
            return None
        if sub.rank != key or sub.size != len(members):
            raise self._err("split", f"MPI_Comm_split gave rank {sub.rank}/{sub.size}, expected {key}/{len(members)}")
        return MpiTransport(sub, self.timeout_s, self.check)

    def _raw_close(self):
        self._comm.free()

    def abort(self, code: int = 1) -> None:
        """MPI_Abort: end every rank of the job (after a TransportError the job cannot go on)."""
        self._comm.abort(code)

    @property
    def broken(self) -> bool:
        return self._comm.broken


def _connect(launch, timeout: float) -> MpiTransport:
    t = MpiTransport.world(timeout_s=timeout)
    launch.check_agrees(t, "MPI")
    return t


from hipress.comm.transport import Backend, register  # noqa: E402 - the registry imports this module

register(Backend("mpi", _connect, claims=lambda launch: launch.is_mpi and available(), priority=20))
