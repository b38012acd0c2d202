"""Rendezvous: a torch Store every rank of the job can reach, for the transports that
need one (torch.distributed, and NCCL's bootstrap).

Where the address comes from: torchrun's env:// agent store; MASTER_ADDR/MASTER_PORT (or
``init(master_addr=, master_port=)``); under horovodrun (gloo) rank 0 publishes a fresh
address in Horovod's HTTP key-value store; under an MPI launcher rank 0 picks one and MPI
broadcasts it. ``HIPRESS_ADDR`` overrides the address rank 0 announces.
"""
from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from typing import Optional

from hipress import config
from hipress.comm.discovery import LaunchInfo
from hipress.comm.transport.base import TransportError
from hipress.comm.transport.mpi import available as with_mpi

__all__ = ["store"]

# Each world made in this process publishes under its own key (init, shutdown, init again).
_generation = 0


def store(launch: LaunchInfo, timeout: float):
    """A torch Store shared by all ranks."""
    global _generation
    _generation += 1
    import datetime

    import torch.distributed as dist

    td = datetime.timedelta(seconds=timeout)
    if launch.size == 1:
        return dist.HashStore()
    if launch.launcher == "torchrun" and launch.master_addr and launch.master_port:
        # torch's env:// handler knows torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE)
        agent_store, _, _ = next(dist.rendezvous("env://", launch.rank, launch.size, timeout=td))
        return agent_store
    addr, port = launch.master_addr, launch.master_port
    if (addr is None or port is None) and launch.launcher == "horovod-gloo":
        addr, port = _horovod_master(launch, timeout, _generation)
    if (addr is None or port is None) and launch.is_mpi and with_mpi():
        addr, port = _mpi_master(launch, timeout)
    if addr is None or port is None:
        raise RuntimeError(f"{launch.launcher} launch of {launch.size} ranks: the torch transport needs a master "
                           f"address; set MASTER_ADDR and MASTER_PORT or call init(master_addr=, master_port=)")
    try:
        return dist.TCPStore(addr, int(port), launch.size, launch.rank == 0, timeout=td, wait_for_workers=True)
    except Exception as e:  # noqa: BLE001
        raise TransportError("rendezvous", f"TCPStore at {addr}:{port} for {launch.size} ranks failed: {e}",
                             None, launch.rank, "torch") from e


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _my_address(toward: Optional[str] = None) -> str:
    """This host's address as seen on the route to ``toward`` (no packet is sent)."""
    forced = config.get("HIPRESS_ADDR")
    if forced:
        return forced
    if toward:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((toward, 9))
                return s.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _horovod_master(launch: LaunchInfo, timeout: float, generation: int):
    """Rank 0 publishes ``addr:port`` of a fresh TCPStore in Horovod's HTTP KV store."""
    base = f"http://{launch.rendezvous_addr}:{launch.rendezvous_port}/hipress/master{generation}"
    if launch.rank == 0:
        addr, port = _my_address(launch.rendezvous_addr), _free_port()
        req = urllib.request.Request(base, data=f"{addr}:{port}".encode(), method="PUT")
        urllib.request.urlopen(req, timeout=timeout).read()
        return addr, port
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = urllib.request.urlopen(base, timeout=timeout).read().decode()
            addr, port = value.rsplit(":", 1)
            return addr, int(port)
        except urllib.error.HTTPError as e:
            if e.code != 404:
                raise
        if time.monotonic() > deadline:
            raise TransportError("rendezvous", f"rank 0 did not publish its address at {base} within {timeout:g} s",
                                 [0], launch.rank, "torch")
        time.sleep(0.05)


def _mpi_master(launch: LaunchInfo, timeout: float):
    """Under an MPI launcher without MASTER_ADDR: rank 0 picks an address, MPI broadcasts it."""
    import torch

    from hipress.comm.transport.mpi import MpiTransport

    boot = MpiTransport.world(timeout_s=timeout)
    try:
        buf = torch.zeros(256, dtype=torch.uint8)
        if boot.rank == 0:
            raw = f"{_my_address()}:{_free_port()}".encode()
            buf[: len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        boot.broadcast(buf, 0)
        addr, port = bytes(buf.tolist()).rstrip(b"\0").decode().rsplit(":", 1)
        return addr, int(port)
    finally:
        boot.close()


