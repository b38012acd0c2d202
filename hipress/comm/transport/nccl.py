"""NCCL transport for CUDA byte buffers, straight through ``libnccl.so.2`` (the
``nvidia-nccl-cu12`` wheel, or a system NCCL) with ctypes; all-to-all is grouped
ncclSend/ncclRecv (HiPress paper 000, §5.1).

    boot = TorchDistTransport.create(rank, size, addr, port)      # CPU (gloo) bootstrap
    t = NcclTransport.create(boot)                                # ncclUniqueId via boot.broadcast

Import-safe everywhere: importing this module loads nothing; :func:`available` says
whether CUDA and an NCCL library are present, and :meth:`NcclTransport.create` raises a
clear error where they are not (e.g. on a CPU-only machine).

Shape checks and barriers run on the CPU bootstrap transport; only payload bytes go
through NCCL. Operations are enqueued on the current CUDA stream and then waited for
by polling a CUDA event and ``ncclCommGetAsyncError`` against ``timeout_s``; on timeout
or an asynchronous NCCL error the communicator is aborted (``ncclCommAbort``) and a
TransportError is raised; the transport is unusable afterwards.

Status: written against the NCCL 2.x C API but NOT exercised on a GPU in this
repository's CI (no GPU there); treat it as experimental until tests/gpu covers it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import time
from typing import Optional

from hipress import config
from hipress.comm.transport.base import Transport, TransportError

__all__ = ["NcclTransport", "available", "unavailable_reason"]

_NCCL_UINT8 = 1
_NCCL_FLOAT32 = 7  # nccl.h: ncclFloat32
_NCCL_SUM = 0  # nccl.h: ncclSum
_lib = None
_lib_error: Optional[str] = None


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


def _candidates():
    env = config.get("HIPRESS_NCCL_LIBRARY")
    if env:
        yield env
    try:
        import nvidia.nccl  # nvidia-nccl-cu12: a namespace package with lib/libnccl.so.2

        for base in getattr(nvidia.nccl, "__path__", []):
            yield from sorted(glob.glob(os.path.join(base, "lib", "libnccl.so*")))
    except ImportError:
        pass
    found = ctypes.util.find_library("nccl")
    if found:
        yield found
    yield "libnccl.so.2"


def _load():
    global _lib, _lib_error
    if _lib is not None or _lib_error is not None:
        return _lib
    errors = []
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
            break
        except OSError as e:
            errors.append(f"{path}: {e}")
    else:
        _lib_error = "no NCCL library found (pip install nvidia-nccl-cu12 or set HIPRESS_NCCL_LIBRARY): " + "; ".join(errors)
        return None
    vp = ctypes.c_void_p
    lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(_UniqueId)]
    lib.ncclCommInitRank.argtypes = [ctypes.POINTER(vp), ctypes.c_int, _UniqueId, ctypes.c_int]
    lib.ncclSend.argtypes = [vp, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, vp, vp]
    lib.ncclRecv.argtypes = [vp, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, vp, vp]
    lib.ncclAllGather.argtypes = [vp, vp, ctypes.c_size_t, ctypes.c_int, vp, vp]
    lib.ncclBroadcast.argtypes = [vp, vp, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, vp, vp]
    lib.ncclAllReduce.argtypes = [vp, vp, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, vp, vp]
    lib.ncclCommGetAsyncError.argtypes = [vp, ctypes.POINTER(ctypes.c_int)]
    lib.ncclCommAbort.argtypes = [vp]
    lib.ncclCommDestroy.argtypes = [vp]
    lib.ncclGetErrorString.argtypes = [ctypes.c_int]
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    _lib = lib
    return lib


def unavailable_reason() -> Optional[str]:
    """None where NCCL can be used, else why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "CUDA is not available (the NCCL transport moves CUDA buffers only)"
    if _load() is None:
        return _lib_error
    return None


def available() -> bool:
    return unavailable_reason() is None


class NcclTransport(Transport):
    name = "nccl"

    def __init__(self, comm: int, boot: Transport, device, timeout_s: Optional[float] = None,
                 check: Optional[bool] = None):
        super().__init__(boot.rank, boot.size, timeout_s if timeout_s is not None else boot.timeout_s, check)
        self._lib = _load()
        self._comm = ctypes.c_void_p(comm)
        self.boot = boot
        self.device = device
        self._broken: Optional[str] = None

    @classmethod
    def create(cls, boot: Transport, device=None, timeout_s: Optional[float] = None,
               check: Optional[bool] = None) -> "NcclTransport":
        """Collective over ``boot`` (a CPU transport over the same ranks)."""
        import torch

        why = unavailable_reason()
        if why:
            raise TransportError("init", why, None, boot.rank, "nccl")
        lib = _load()
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        uid = _UniqueId()
        if boot.rank == 0:
            cls._ok(lib, lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId", boot.rank)
        raw = torch.frombuffer(bytearray(bytes(uid)), dtype=torch.uint8).clone()
        boot.broadcast(raw, 0)
        ctypes.memmove(ctypes.addressof(uid), bytes(raw.tolist()), 128)
        comm = ctypes.c_void_p()
        with torch.cuda.device(dev):
            cls._ok(lib, lib.ncclCommInitRank(ctypes.byref(comm), boot.size, uid, boot.rank), "ncclCommInitRank", boot.rank)
        return cls(comm.value, boot, dev, timeout_s, check)

    @staticmethod
    def _ok(lib, rc: int, what: str, rank: int) -> None:
        if rc != 0:
            raise TransportError(what, f"NCCL error {rc}: {lib.ncclGetErrorString(rc).decode()}", None, rank, "nccl")

    def _check_device(self, what, t):
        if t.device.type != "cuda":
            return f"{what} is on {t.device}; the nccl transport takes CUDA buffers"
        return None

    def _meta_gather(self, op, values):
        return self.boot._meta_gather(op, values)

    # ------------------------------------------------------------------ enqueue + wait
    def _run(self, op: str, peers, enqueue) -> None:
        import torch

        if self._broken:
            raise self._err(op, f"the NCCL communicator was aborted after an earlier failure ({self._broken})", peers)
        lib = self._lib
        with torch.cuda.device(self.device):
            stream = torch.cuda.current_stream()
            s = ctypes.c_void_p(stream.cuda_stream)
            lib.ncclGroupStart()
            try:
                enqueue(s)
            finally:
                rc = lib.ncclGroupEnd()
            if rc != 0:
                self._abort(op, f"ncclGroupEnd: {lib.ncclGetErrorString(rc).decode()}", peers)
            ev = torch.cuda.Event()
            ev.record(stream)
        deadline = time.monotonic() + self.timeout_s
        err = ctypes.c_int(0)
        while not ev.query():
            lib.ncclCommGetAsyncError(self._comm, ctypes.byref(err))
            if err.value != 0:
                self._abort(op, f"asynchronous NCCL error: {lib.ncclGetErrorString(err.value).decode()}", peers)
            if time.monotonic() > deadline:
                self._abort(op, f"timed out after {self.timeout_s:g} s waiting for rank(s) {sorted(set(peers))}", peers)
            time.sleep(0.0001)

    def _abort(self, op, msg, peers):
        self._broken = f"{op}: {msg}"
        self._lib.ncclCommAbort(self._comm)
        raise self._err(op, msg, peers)

    def _enq(self, op, rc):
        if rc != 0:
            raise self._err(op, f"NCCL error {rc}: {self._lib.ncclGetErrorString(rc).decode()}")

    # ------------------------------------------------------------------ backend hooks
    def _raw_send(self, buf, dst, tag, op):
        self._run(op, [dst], lambda s: self._enq(op, self._lib.ncclSend(buf.data_ptr(), buf.numel(), _NCCL_UINT8, dst, self._comm, s)))

    def _raw_send_many(self, msgs, dst, op):
        def enq(s):
            for b, _ in msgs:
                self._enq(op, self._lib.ncclSend(b.data_ptr(), b.numel(), _NCCL_UINT8, dst, self._comm, s))
        self._run(op, [dst], enq)

    def _raw_recv(self, buf, src, tag, op):
        # NCCL has no tags: messages between two ranks match in order.
        self._run(op, [src], lambda s: self._enq(op, self._lib.ncclRecv(buf.data_ptr(), buf.numel(), _NCCL_UINT8, src, self._comm, s)))

    def _raw_sendrecv(self, send_buf, dst, recv_buf, src, op):
        def enq(s):
            if send_buf is not None:
                self._enq(op, self._lib.ncclSend(send_buf.data_ptr(), send_buf.numel(), _NCCL_UINT8, dst, self._comm, s))
            if recv_buf is not None:
                self._enq(op, self._lib.ncclRecv(recv_buf.data_ptr(), recv_buf.numel(), _NCCL_UINT8, src, self._comm, s))
        self._run(op, [dst, src], enq)

    def _raw_alltoallv(self, send_buf, send_counts, recv_buf, recv_counts, op):
        sd = rd = 0
        sends, recvs = [], []
        for p in range(self._size):
            sends.append((p, sd, send_counts[p]))
            recvs.append((p, rd, recv_counts[p]))
            sd += send_counts[p]
            rd += recv_counts[p]
        sp, rp = send_buf.data_ptr(), recv_buf.data_ptr()

        def enq(s):
            for p, off, n in sends:
                if n:
                    self._enq(op, self._lib.ncclSend(sp + off, n, _NCCL_UINT8, p, self._comm, s))
            for p, off, n in recvs:
                if n:
                    self._enq(op, self._lib.ncclRecv(rp + off, n, _NCCL_UINT8, p, self._comm, s))
        self._run(op, [p for p in range(self._size) if p != self._rank], enq)

    def _raw_allgather(self, send_buf, recv_buf, op):
        self._run(op, [p for p in range(self._size) if p != self._rank],
                  lambda s: self._enq(op, self._lib.ncclAllGather(send_buf.data_ptr(), recv_buf.data_ptr(), send_buf.numel(),
                                                                  _NCCL_UINT8, self._comm, s)))

    def _raw_allgatherv(self, send_buf, recv_buf, recv_counts, op):
        off, rp = 0, recv_buf.data_ptr()

        def enq(s):
            nonlocal off
            for p in range(self._size):
                n = recv_counts[p]
                if n:  # a grouped broadcast per contributor
                    src = send_buf.data_ptr() if p == self._rank else rp + off
                    self._enq(op, self._lib.ncclBroadcast(src, rp + off, n, _NCCL_UINT8, p, self._comm, s))
                off += n
        self._run(op, [p for p in range(self._size) if p != self._rank], enq)

    def _raw_broadcast(self, buf, root, op):
        peers = [root] if self._rank != root else [p for p in range(self._size) if p != root]
        self._run(op, peers, lambda s: self._enq(op, self._lib.ncclBroadcast(buf.data_ptr(), buf.data_ptr(), buf.numel(),
                                                                             _NCCL_UINT8, root, self._comm, s)))

    def _raw_allreduce(self, values, op):
        p = values.data_ptr()  # in place: NCCL allows sendbuff == recvbuff
        self._run(op, [q for q in range(self._size) if q != self._rank],
                  lambda s: self._enq(op, self._lib.ncclAllReduce(p, p, values.numel(), _NCCL_FLOAT32, _NCCL_SUM,
                                                                  self._comm, s)))

    def _raw_barrier(self, op):
        self.boot.barrier()

    def _make_split(self, members, colors, color_of):
        sub_boot = self.boot.split(color_of[self._rank] if members is not None else None, key=(
            members.index(self._rank) if members is not None else None))
        if sub_boot is None:
            return None
        return NcclTransport.create(sub_boot, self.device, self.timeout_s, self.check)

    def _raw_close(self):
        if self._comm and self._comm.value:
            if self._broken is None:
                self._lib.ncclCommDestroy(self._comm)
            self._comm = ctypes.c_void_p(0)
        self.boot.close()


def _connect(launch, timeout: float) -> NcclTransport:
    from hipress.comm import rendezvous
    from hipress.comm.transport.torch_dist import TorchDistTransport

    boot = TorchDistTransport.create(launch.rank, launch.size, backend="gloo", timeout_s=timeout,
                                     store=rendezvous.store(launch, timeout))
    try:
        return NcclTransport.create(boot, timeout_s=timeout)
    except BaseException:
        boot.close()
        raise


from hipress.comm.transport import Backend, register  # noqa: E402 - the registry imports this module

register(Backend("nccl", _connect))  # never chosen by itself: ask for it by name
