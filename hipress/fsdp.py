"""``hipress.fsdp``: FSDP2's reduce-scatter by hipress (implemented in :mod:`hipress.torch.fsdp`).

    state = hipress.fsdp.register(model, compression="terngrad")   # after fully_shard
"""
from hipress.torch.fsdp import FsdpState, ReduceScatter, init, register

__all__ = ["FsdpState", "ReduceScatter", "init", "register"]
