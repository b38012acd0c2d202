"""hipress on Horovod: a transport that moves hipress's bytes with Horovod's own
collectives, and Horovod's DistributedOptimizer as a baseline.

    from horovod_ext import available, unavailable_reason, started_by_horovodrun
    from horovod_ext.transport import HorovodTransport      # needs horovod.torch
    from horovod_ext.baseline import horovod_optimizer      # Horovod's own data parallelism

hipress picks the Horovod transport by itself when the job was started by ``horovodrun``
(gloo or MPI mode) and ``horovod.torch`` imports; ``HIPRESS_TRANSPORT=horovod`` asks for it
explicitly, ``HIPRESS_TRANSPORT=torch`` / ``mpi`` for another one. Where Horovod is missing
hipress works without it and says once why (see :func:`unavailable_reason`).

Install Horovod for this torch with ``bash scripts/install_horovod.sh`` (docs/horovod.md).
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

__all__ = ["available", "unavailable_reason", "started_by_horovodrun"]

_reason_cache: Optional[str] = None
_checked = False

# What horovodrun leaves in a worker's environment. Gloo mode: HOROVOD_RANK, HOROVOD_SIZE & co.
# MPI mode (0.28) sets no HOROVOD_* variable; its mpirun command line always carries
# `--tag-output -mca pml ob1 -mca btl ^openib` (runner/mpi_run.py), which OpenMPI hands every
# rank as these variables. HIPRESS_HOROVODRUN=1/0 overrides the guess either way.
_HOROVODRUN_OMPI_FINGERPRINT = {"OMPI_MCA_orte_tag_output": "1", "OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "^openib"}


def started_by_horovodrun(env: Optional[Mapping[str, str]] = None) -> bool:
    """True when this process looks like a worker started by ``horovodrun`` (either mode)."""
    from hipress import config

    env = os.environ if env is None else env
    forced = config.get("HIPRESS_HOROVODRUN", env)
    if forced is not None:
        return forced
    if env.get("HOROVOD_RANK") is not None and env.get("HOROVOD_SIZE") is not None:
        return True  # gloo mode (and Horovod's other non-MPI launchers)
    if env.get("OMPI_COMM_WORLD_SIZE") is not None:
        return all(env.get(k) == v for k, v in _HOROVODRUN_OMPI_FINGERPRINT.items())
    return False


def unavailable_reason() -> Optional[str]:
    """None when ``horovod.torch`` imports (the transport can be used), else why not."""
    global _reason_cache, _checked
    if _checked:
        return _reason_cache
    try:
        import horovod.torch  # noqa: F401
    except ImportError as e:
        _reason_cache = (f"horovod.torch does not import ({type(e).__name__}: {e}); install Horovod with its "
                         f"PyTorch extension: bash scripts/install_horovod.sh")
    except Exception as e:  # noqa: BLE001 - a broken build raises all sorts of errors at import
        _reason_cache = f"horovod.torch failed to import ({type(e).__name__}: {e})"
    else:
        _reason_cache = None
    _checked = True
    return _reason_cache


def available() -> bool:
    return unavailable_reason() is None


# ---------------------------------------------------------------------------- transport plugin
_warned = False


def _claims(launch) -> bool:
    """horovodrun started the job and horovod.torch imports; else say once (rank 0) why not."""
    global _warned
    if launch.launcher == "explicit" or not started_by_horovodrun():
        return False
    reason = unavailable_reason()
    if reason is None:
        return True
    if not _warned and launch.rank == 0:
        import logging

        logging.getLogger("hipress").warning("hipress: started by horovodrun but the Horovod transport is unavailable "
                                             "(%s); using hipress's own transport instead", reason)
    _warned = True
    return False


def _connect(launch, timeout: float):
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"the horovod transport was asked for but {reason}")
    from horovod_ext.transport import HorovodTransport

    t = HorovodTransport.world(timeout_s=timeout)
    launch.check_agrees(t, "Horovod")
    return t


def _backend():
    from hipress.comm.transport import Backend

    return Backend("horovod", _connect, claims=_claims, priority=30)


#: hipress's transport registry loads this through the ``hipress.transports`` entry point
#: (setup.py), so no module of hipress imports horovod_ext.
backend = _backend()
