"""Name -> compressor factory. Built-ins are registered here; users add their own
with ``register(name, cls)`` (any Compressor subclass or a factory callable)."""
from __future__ import annotations

from typing import Callable, Dict, List, Union

from hipress.compression.acpsgd import ACPSGD
from hipress.compression.base import Compressor
from hipress.compression.error_feedback import ErrorFeedback
from hipress.compression.native import (BF16, DGC, FP16, QSGD, TBQ, Adaq, DGCGrace, EFSignSGD, GradDrop, Inceptionn,
                                        Natural,
                                        OneBit, PowerSGD, PowerSGDGrace, RandomK, SignSGD, Signum, Sketch, TernGrad,
                                        TernGradGrace, Threshold, TopK, U8bit)
from hipress.compression.none import NoneCompressor

_REGISTRY: Dict[str, Callable[..., Compressor]] = {}
# Whether get() wraps the algorithm in ErrorFeedback unless told otherwise (the papers' defaults).
_DEFAULT_EF: Dict[str, bool] = {}


def register(name: str, factory: Callable[..., Compressor], *, error_feedback: bool = False,
             overwrite: bool = False) -> None:
    """Register ``factory(**params) -> Compressor`` under ``name``."""
    if not callable(factory):
        raise TypeError("factory must be a Compressor subclass or a callable returning a Compressor")
    key = name.lower()
    if key in _REGISTRY and not overwrite:
        raise ValueError(f"compressor {name!r} is registered already (pass overwrite=True)")
    _REGISTRY[key] = factory
    _DEFAULT_EF[key] = bool(error_feedback)


def available() -> List[str]:
    return sorted(_REGISTRY)


def get(name: Union[str, Compressor], *, error_feedback: Union[bool, None] = None, beta: float = 1.0,
        gamma: float = 1.0, **params) -> Compressor:
    """A configured compressor: ``get("tbq", threshold=0.05)``.

    error_feedback: wrap in ErrorFeedback(beta, gamma); None uses the algorithm's
    default (onebit, tbq, graddrop: on; terngrad: off (unbiased); dgc, powersgd:
    built in, their own error feedback / accumulation; GRACE's quantizers as GRACE pairs
    them: u8bit, efsignsgd, natural on, the others off; docs/grace.md).
    """
    if isinstance(name, Compressor):
        if params:
            raise ValueError("parameters given with a Compressor instance")
        return name
    key = str(name).lower()
    if key not in _REGISTRY:
        raise ValueError(f"unknown compressor {name!r}; available: {', '.join(available())}")
    comp = _REGISTRY[key](**params)
    if not isinstance(comp, Compressor):
        raise TypeError(f"factory for {name!r} returned {type(comp).__name__}, not a Compressor")
    ef = _DEFAULT_EF[key] if error_feedback is None else error_feedback
    if ef and not comp.lowrank:
        comp = ErrorFeedback(comp, beta=beta, gamma=gamma)
    elif ef and error_feedback:
        raise ValueError(f"{name} has its own error feedback (pass its own parameter)")
    return comp


register("none", NoneCompressor)
register("onebit", OneBit, error_feedback=True)
register("tbq", TBQ, error_feedback=True)
register("terngrad", TernGrad)
register("dgc", DGC)
register("graddrop", GradDrop, error_feedback=True)
register("powersgd", PowerSGD)
register("acpsgd", ACPSGD)  # PowerSGD alternating P and Q: one collective per step
# GRACE's quantizers under GRACE's names (docs/grace.md), with GRACE's memory (Table I)
register("u8bit", U8bit, error_feedback=True)
register("signsgd", SignSGD)
register("signum", Signum)
register("efsignsgd", EFSignSGD, error_feedback=True)
register("qsgd", QSGD)
register("natural", Natural, error_feedback=True)
register("terngrad_grace", TernGradGrace)
register("fp16", FP16)
register("bf16", BF16)
# GRACE's sparsifiers and hybrids, under GRACE's names, with the memory GRACE pairs them with
# (Table I: error feedback on; DGC: its own memory). docs/grace.md
register("randomk", RandomK, error_feedback=True)
register("topk", TopK, error_feedback=True)
register("threshold", Threshold, error_feedback=True)
register("adaq", Adaq, error_feedback=True)
register("dgc_grace", DGCGrace)
register("sketch", Sketch, error_feedback=True)
register("powersgd_grace", PowerSGDGrace)  # its own error feedback (residual memory), as GRACE's
register("inceptionn", Inceptionn)  # no memory (GRACE Table I)
