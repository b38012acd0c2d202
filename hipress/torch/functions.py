"""Broadcasting model and optimizer state from one rank, Horovod style.

Nothing a peer sends is unpickled by default (docs/security.md): ``broadcast_object`` loads
with ``torch.load(weights_only=True)`` (tensors, numbers, strings, containers; a class
registered with ``torch.serialization.add_safe_globals``), and arbitrary objects only with
``allow_pickle=True``; ``broadcast_optimizer_state`` sends the state_dict's structure as JSON
and its tensors as raw bytes.
"""
from __future__ import annotations

import io
import json
from typing import Any, Iterable, List, Tuple, Union

import torch

from hipress.comm import world


def _broadcast_tensor_(t: torch.Tensor, root_rank: int) -> None:
    world.quiesce()  # nothing of hipress's still in flight beside this operation
    tr = world.transport()
    src = t.detach()
    host = src.to("cpu").contiguous()
    buf = host.view(-1).view(torch.uint8) if host.numel() else torch.empty(0, dtype=torch.uint8)
    tr.broadcast(buf, root_rank)
    if host.data_ptr() != src.data_ptr() or not src.is_contiguous():
        with torch.no_grad():
            t.copy_(host.view_as(t))


def broadcast_parameters(params: Union[dict, Iterable[Tuple[str, torch.Tensor]], Iterable[torch.Tensor]],
                         root_rank: int = 0) -> None:
    """Copies parameters (a state_dict, named_parameters() or a list) from root_rank to all ranks."""
    world.init()
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        items = list(params)
        if items and not isinstance(items[0], tuple):
            items = [(str(i), p) for i, p in enumerate(items)]
    if world.size() == 1:
        return
    for _, p in items:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"broadcast_parameters takes tensors, got {type(p).__name__}")
        _broadcast_tensor_(p.data if isinstance(p, torch.nn.Parameter) else p, root_rank)


class UnsafeObjectError(TypeError):
    """``broadcast_object``'s object cannot be loaded without unpickling arbitrary code."""


_REFUSED = -1  # the header root_rank sends instead of a size when it cannot send the object


def _send_header(tr, value: int, root_rank: int) -> int:
    n = torch.tensor([value], dtype=torch.int64)
    tr.broadcast(n.view(torch.uint8), root_rank)
    return int(n[0])


def _why(e: BaseException) -> str:
    """The line of torch's weights_only error that names what was refused."""
    text = str(e)
    for line in text.splitlines():
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].split(". Please use", 1)[0].strip()
    return (text.splitlines() or [type(e).__name__])[0][:300]


def _safe_load(data: bytes, root_rank: int):
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises UnpicklingError (or others) naming the global
        raise UnsafeObjectError(
            f"broadcast_object: the object from rank {root_rank} cannot be loaded safely "
            f"(torch.load(weights_only=True) allows tensors, numbers, strings, None and "
            f"dict/list/tuple of them): {_why(e)}. "
            f"Register its classes with torch.serialization.add_safe_globals([...]) on every rank, "
            f"or pass allow_pickle=True on every rank if you trust every peer: unpickling runs whatever "
            f"code the sender put in the payload (docs/security.md)") from e


def broadcast_object(obj, root_rank: int = 0, allow_pickle: bool = False):
    """Returns root_rank's obj on every rank, serialised with ``torch.save``.

    Safe by default: the other ranks load it with ``torch.load(weights_only=True)``, which
    builds tensors, numbers, strings, None, dicts, lists, tuples and the classes registered
    with ``torch.serialization.add_safe_globals``, and never runs code the sender chose. An
    object that needs more raises :class:`UnsafeObjectError` on every rank (root_rank checks
    its own payload first and tells the others). ``allow_pickle=True`` (give it on every
    rank) unpickles anything, as Horovod's ``broadcast_object`` does: only between peers you
    trust, since a payload can run code on every receiving rank (docs/security.md)."""
    world.init()
    if world.size() == 1:
        return obj
    world.quiesce()  # nothing of hipress's still in flight beside this operation
    tr = world.transport()
    me = world.rank()
    if me == root_rank:
        bio = io.BytesIO()
        try:
            torch.save(obj, bio)
        except BaseException:
            _send_header(tr, _REFUSED, root_rank)  # the others raise too, instead of waiting
            raise
        data = bio.getvalue()
        refused = None
        if not allow_pickle:
            try:
                _safe_load(data, root_rank)
            except UnsafeObjectError as e:
                refused = e
        n = _send_header(tr, _REFUSED if refused is not None else len(data), root_rank)
        if refused is not None:
            raise refused
        tr.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), root_rank)
        return obj
    n = _send_header(tr, 0, root_rank)
    if n == _REFUSED:
        raise UnsafeObjectError(f"broadcast_object: rank {root_rank}'s object cannot be loaded without "
                                f"unpickling (rank {root_rank} says why); pass allow_pickle=True on every rank "
                                f"if you trust every peer, or register its classes with "
                                f"torch.serialization.add_safe_globals (docs/security.md)")
    if n < 0:
        raise ValueError(f"broadcast_object: rank {root_rank} sent a size of {n} bytes")
    payload = torch.empty(n, dtype=torch.uint8)
    tr.broadcast(payload, root_rank)
    data = payload.numpy().tobytes()
    if allow_pickle:
        return torch.load(io.BytesIO(data), weights_only=False)
    return _safe_load(data, root_rank)


# ---------------------------------------------------------------------------- optimizer state as JSON + tensors
# The structure of a state_dict as JSON: scalars (int, float incl. nan/inf, bool, None, str)
# as themselves, containers as one-key objects: {"d": [[key, value], ...]} (keys of any
# encodable type: optimizer state is keyed by int), {"l": [...]}, {"t": [...]} (tuple),
# {"T": [index, dtype, shape]} (the index-th tensor, sent after the structure as raw bytes).
def _encode(x: Any, tensors: List[torch.Tensor], where: str):
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, torch.Tensor):
        tensors.append(x)
        return {"T": [len(tensors) - 1, str(x.dtype).replace("torch.", ""), list(x.shape)]}
    if isinstance(x, dict):
        return {"d": [[_encode(k, tensors, where), _encode(v, tensors, f"{where}[{k!r}]")] for k, v in x.items()]}
    if isinstance(x, list):
        return {"l": [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(x)]}
    if isinstance(x, tuple):
        return {"t": [_encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(x)]}
    raise TypeError(f"broadcast_optimizer_state: {where} is a {type(x).__name__}; the optimizer state is sent "
                    f"as tensors, numbers, strings, None, dicts, lists and tuples only")


def _decode(x: Any, tensors: List[torch.Tensor], root_rank: int):
    """The structure, with an empty CPU tensor (appended to ``tensors``) where each tensor goes."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, dict) and len(x) == 1:
        (tag, v), = x.items()
        if tag == "T" and isinstance(v, list) and len(v) == 3:
            index, dtype_name, shape = v
            dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
            if (isinstance(dtype, torch.dtype) and type(index) is int and index == len(tensors)
                    and isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
                tensors.append(torch.empty(shape, dtype=dtype))
                return tensors[-1]
        elif tag == "d" and isinstance(v, list) and all(isinstance(kv, list) and len(kv) == 2 for kv in v):
            return {_decode(k, tensors, root_rank): _decode(val, tensors, root_rank) for k, val in v}
        elif tag in ("l", "t") and isinstance(v, list):
            items = [_decode(e, tensors, root_rank) for e in v]
            return items if tag == "l" else tuple(items)
    raise ValueError(f"broadcast_optimizer_state: malformed state structure from rank {root_rank}: {str(x)[:200]}")


def _broadcast_state(sd: dict, root_rank: int) -> dict:
    """root_rank's ``sd`` on every rank, without pickle: the structure as JSON, then each
    tensor's bytes (received into CPU tensors of the announced dtype and shape)."""
    world.quiesce()  # nothing of hipress's still in flight beside this operation
    tr = world.transport()
    if world.rank() == root_rank:
        tensors: List[torch.Tensor] = []
        try:
            raw = json.dumps(_encode(sd, tensors, "state_dict"), allow_nan=True).encode()
        except TypeError:
            _send_header(tr, _REFUSED, root_rank)
            raise
        _send_header(tr, len(raw), root_rank)
        tr.broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8), root_rank)
        for t in tensors:
            host = t.detach().to("cpu").contiguous()
            tr.broadcast(host.view(-1).view(torch.uint8) if host.numel() else torch.empty(0, dtype=torch.uint8),
                         root_rank)
        return sd
    n = _send_header(tr, 0, root_rank)
    if n == _REFUSED:
        raise TypeError(f"broadcast_optimizer_state: rank {root_rank}'s optimizer state holds a value that cannot "
                        f"be sent without pickle (rank {root_rank} says which)")
    if n < 0:
        raise ValueError(f"broadcast_optimizer_state: rank {root_rank} sent a size of {n} bytes")
    buf = torch.empty(n, dtype=torch.uint8)
    tr.broadcast(buf, root_rank)
    try:
        structure = json.loads(buf.numpy().tobytes().decode())
    except ValueError as e:
        raise ValueError(f"broadcast_optimizer_state: rank {root_rank} sent a structure that is not JSON: {e}") from e
    tensors: List[torch.Tensor] = []
    sd = _decode(structure, tensors, root_rank)
    for t in tensors:  # in the order root_rank sends them
        tr.broadcast(t.view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8), root_rank)
    return sd


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Makes every rank's optimizer state equal to root_rank's, except hipress's own state
    (``state_dict()["hipress"]``: compressor residuals, PS aggregator and ring-chunk states,
    random streams, momentum-correction velocities). That state differs across ranks by
    design, so each rank keeps its own: copying rank 0's to every rank made a resumed run
    end 0.009-0.049 away from the uninterrupted one, or fail outright where the ranks'
    states have different shapes. To resume exactly, every rank saves and loads its own
    ``optimizer.state_dict()``; loaded on rank 0 alone, the other ranks start their
    compression state afresh.

    No pickle: the state_dict's structure travels as JSON (numbers, strings, None, dicts,
    lists, tuples) and its tensors as raw bytes of the dtype and shape the structure
    names; a state holding anything else raises TypeError on every rank."""
    world.init()
    if world.size() == 1:
        return
    sd = optimizer.state_dict()
    own = sd.pop("hipress", None)
    sd = _broadcast_state(sd, root_rank)
    if own is not None:
        sd["hipress"] = own
    optimizer.load_state_dict(sd)
