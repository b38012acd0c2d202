"""Broadcasting model and optimizer state from one rank, Horovod style."""
from __future__ import annotations

import io
from typing import Iterable, Tuple, Union

import torch

from hipress.comm import world


def _broadcast_tensor_(t: torch.Tensor, root_rank: int) -> None:
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


def broadcast_object(obj, root_rank: int = 0):
    """Returns root_rank's obj on every rank (serialised with torch.save; trusted peers only)."""
    world.init()
    if world.size() == 1:
        return obj
    tr = world.transport()
    if world.rank() == root_rank:
        bio = io.BytesIO()
        torch.save(obj, bio)
        payload = torch.frombuffer(bytearray(bio.getvalue()), dtype=torch.uint8)
        n = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        n = torch.zeros(1, dtype=torch.int64)
    tr.broadcast(n.view(torch.uint8), root_rank)
    if world.rank() != root_rank:
        payload = torch.empty(int(n[0]), dtype=torch.uint8)
    tr.broadcast(payload, root_rank)
    if world.rank() == root_rank:
        return obj
    return torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=False)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Makes every rank's optimizer state equal to root_rank's, except hipress's own state
    (``state_dict()["hipress"]``: compressor residuals, PS aggregator and ring-chunk states,
    random streams, momentum-correction velocities). That state differs across ranks by
    design, so each rank keeps its own: copying rank 0's to every rank made a resumed run
    end 0.009-0.049 away from the uninterrupted one, or fail outright where the ranks'
    states have different shapes. To resume exactly, every rank saves and loads its own
    ``optimizer.state_dict()``; loaded on rank 0 alone, the other ranks start their
    compression state afresh."""
    world.init()
    if world.size() == 1:
        return
    sd = optimizer.state_dict()
    own = sd.pop("hipress", None)
    sd = broadcast_object(sd, root_rank)
    if own is not None:
        sd["hipress"] = own
    optimizer.load_state_dict(sd)
