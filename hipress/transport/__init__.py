"""Byte-buffer transports: one interface (base.Transport) over MPI (mpi), torch.distributed
(torch_dist), NCCL (nccl) and in-process threads (loopback). Backends are imported on use."""
from hipress.transport.base import MAX_TAG, Transport, TransportError

__all__ = ["Transport", "TransportError", "MAX_TAG"]
