"""``hipress.ddp``: the DDP communication hook (implemented in :mod:`hipress.torch.ddp`).

    state = hipress.ddp.HookState(compression="terngrad", named_parameters=model.named_parameters())
    model.register_comm_hook(state, hipress.ddp.hook)
"""
from hipress.torch.ddp import HookState, bf16_wrapper, comm_hook, fp16_wrapper, hook, init, register

__all__ = ["HookState", "bf16_wrapper", "comm_hook", "fp16_wrapper", "hook", "init", "register"]
