"""Byte-buffer transports: one interface (:class:`base.Transport`) and a registry of
backends, each of which registers itself by name:

=========  ===================================  =====================================
name       module                               chosen by itself when
=========  ===================================  =====================================
horovod    ``horovod_ext`` (entry point)        horovodrun started the job and ``horovod.torch`` imports
mpi        :mod:`hipress.comm.transport.mpi`    an MPI launcher started the job (and hipress has MPI)
torch      :mod:`...transport.torch_dist`       torch.distributed is already initialized; also the fallback
loopback   :mod:`...transport.loopback`         a single process
nccl       :mod:`...transport.nccl`             never (ask for it)
=========  ===================================  =====================================

A backend outside this package registers through the ``hipress.transports`` entry-point
group (a :class:`Backend` object), which is how Horovod's adapter joins without any core
module importing it. :func:`choose` picks one: ``init(transport=)``, else
``HIPRESS_TRANSPORT``, else the highest-priority backend that claims the launch, else torch.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Dict, List, Optional

from hipress import config
from hipress.comm.discovery import LaunchInfo
from hipress.comm.transport.base import MAX_TAG, Transport, TransportError

__all__ = ["Backend", "MAX_TAG", "Transport", "TransportError", "backend", "names", "register", "choose"]

_BUILTIN_MODULES = ("loopback", "mpi", "torch_dist", "nccl")
ENTRY_POINT_GROUP = "hipress.transports"


@dataclasses.dataclass(frozen=True)
class Backend:
    """A transport backend: how to connect this process's world, and whether a launch
    calls for it when nobody asked for a transport by name."""

    name: str
    create: Callable[[LaunchInfo, float], Transport]     # (launch, timeout_s) -> world transport
    claims: Callable[[LaunchInfo], bool] = lambda launch: False
    priority: int = 0                                    # claims are asked highest first


_registry: Dict[str, Backend] = {}
_loaded = False


def register(b: Backend) -> Backend:
    """Adds (or replaces) a backend by name."""
    _registry[b.name] = b
    return b


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for mod in _BUILTIN_MODULES:
        importlib.import_module(f"hipress.comm.transport.{mod}")
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            register(ep.load())
        except Exception as e:  # noqa: BLE001 - a broken plugin must not take the built-ins down
            import logging

            logging.getLogger("hipress").warning("hipress: transport plugin %s failed to load: %s", ep.value, e)


def names() -> List[str]:
    _load()
    return sorted(_registry)


def backend(name: str) -> Backend:
    _load()
    try:
        return _registry[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r}; expected one of {names()}") from None


def choose(requested: Optional[str], launch: LaunchInfo) -> Backend:
    """The backend for this launch (see the module docstring for the order)."""
    name = requested or (config.get("HIPRESS_TRANSPORT") or "").lower()  # the env value in any case, as before
    if name:
        try:
            return backend(name)
        except ValueError as e:
            raise ValueError(f"{e} (from {'init(transport=)' if requested else 'HIPRESS_TRANSPORT'})") from None
    _load()
    for b in sorted(_registry.values(), key=lambda b: -b.priority):
        if b.claims(launch):
            return b
    return backend("torch")
