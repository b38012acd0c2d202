"""What the launcher told this process, read before any connection is made.

First match wins (explicit ``init`` arguments override the environment):

=================  =====================================================================
explicit           ``init(rank=, size=, master_addr=, master_port=)`` (MASTER_ADDR/PORT as fallback)
horovodrun (gloo)  HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_RANK, HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT:
                   rank 0 publishes a TCPStore address in Horovod's HTTP key-value store
mpirun / horovodrun --mpi
                   OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK (OpenMPI), PMI_RANK/PMI_SIZE (MPICH, Slurm)
torchrun           RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; TORCHELASTIC_USE_AGENT_STORE=True:
                   torchrun's agent hosts the store (else rank 0 does, as under ``hipress.launch``)
none               a single process: size 1
=================  =====================================================================

These are the launchers' own variables, not hipress settings (those are in hipress.config).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

__all__ = ["LaunchInfo", "detect_launch"]


@dataclasses.dataclass(frozen=True)
class LaunchInfo:
    """What the launcher told this process (before any connection is made)."""

    launcher: str                      # explicit | horovod-gloo | horovod | mpi | torchrun | single
    rank: int
    size: int
    local_rank: Optional[int] = None   # the launcher's hint; the runtime recomputes it from hostnames
    local_size: Optional[int] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    rendezvous_addr: Optional[str] = None   # Horovod's HTTP rendezvous server (gloo mode)
    rendezvous_port: Optional[int] = None
    agent_store: bool = False               # torchrun's agent hosts the store at master_addr:master_port

    @property
    def is_mpi(self) -> bool:
        return self.launcher == "mpi"

    def check_agrees(self, t, who: str) -> None:
        """A backend that numbers the ranks itself (MPI, Horovod) must agree with the launcher:
        else ``t`` is closed and the mismatch raised."""
        if self.launcher != "single" and (t.rank, t.size) != (self.rank, self.size):
            t.close()
            raise RuntimeError(f"{who} says rank {t.rank} of {t.size} but the {self.launcher} launch says "
                               f"rank {self.rank} of {self.size}")


def _env_int(env, *names) -> Optional[int]:
    for n in names:
        v = env.get(n)
        if v not in (None, ""):
            try:
                return int(v)
            except ValueError:
                raise ValueError(f"environment variable {n}={v!r} is not an integer") from None
    return None


def detect_launch(env=None, rank: Optional[int] = None, size: Optional[int] = None,
                  master_addr: Optional[str] = None, master_port: Optional[int] = None) -> LaunchInfo:
    """Read the launcher's environment (``env`` defaults to ``os.environ``)."""
    env = os.environ if env is None else env
    m_addr = master_addr or env.get("MASTER_ADDR") or None
    m_port = master_port if master_port is not None else _env_int(env, "MASTER_PORT")
    if rank is not None or size is not None:
        if rank is None or size is None:
            raise ValueError("init(): give both rank= and size=, or neither")
        return LaunchInfo("explicit", int(rank), int(size), _env_int(env, "LOCAL_RANK"), None, m_addr, m_port)
    if env.get("HOROVOD_RANK") is not None and env.get("HOROVOD_SIZE") is not None:
        r, s = _env_int(env, "HOROVOD_RANK"), _env_int(env, "HOROVOD_SIZE")
        lr, ls = _env_int(env, "HOROVOD_LOCAL_RANK"), _env_int(env, "HOROVOD_LOCAL_SIZE")
        if env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"):
            return LaunchInfo("horovod-gloo", r, s, lr, ls, m_addr, m_port, env["HOROVOD_GLOO_RENDEZVOUS_ADDR"],
                              _env_int(env, "HOROVOD_GLOO_RENDEZVOUS_PORT"))
        if env.get("OMPI_COMM_WORLD_SIZE") is None and env.get("PMI_SIZE") is None:
            return LaunchInfo("horovod", r, s, lr, ls, m_addr, m_port)
    if env.get("OMPI_COMM_WORLD_SIZE") is not None:
        return LaunchInfo("mpi", _env_int(env, "OMPI_COMM_WORLD_RANK"), _env_int(env, "OMPI_COMM_WORLD_SIZE"),
                          _env_int(env, "OMPI_COMM_WORLD_LOCAL_RANK"), _env_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"),
                          m_addr, m_port)
    if env.get("PMI_SIZE") is not None and env.get("PMI_RANK") is not None:
        return LaunchInfo("mpi", _env_int(env, "PMI_RANK"), _env_int(env, "PMI_SIZE"),
                          _env_int(env, "MPI_LOCALRANKID"), _env_int(env, "MPI_LOCALNRANKS"), m_addr, m_port)
    if env.get("RANK") is not None and env.get("WORLD_SIZE") is not None:
        return LaunchInfo("torchrun", _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE"),
                          _env_int(env, "LOCAL_RANK"), _env_int(env, "LOCAL_WORLD_SIZE"), m_addr, m_port,
                          agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")
    return LaunchInfo("single", 0, 1)


