"""hipress: compression-aware data-parallel training for PyTorch.

    import hipress
    hipress.init()
    opt = hipress.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression="tbq")
    hipress.broadcast_parameters(model.state_dict(), root_rank=0)

Submodules load on first use, so ``import hipress.planner`` (pure Python) does not
need the native core; anything that runs tasks imports ``hipress._C``.
"""
import importlib

__version__ = "0.1.0"

# name -> (module, attribute)
_EXPORTS = {
    "init": ("hipress.comm.world", "init"),
    "shutdown": ("hipress.comm.world", "shutdown"),
    "is_initialized": ("hipress.comm.world", "is_initialized"),
    "rank": ("hipress.comm.world", "rank"),
    "size": ("hipress.comm.world", "size"),
    "local_rank": ("hipress.comm.world", "local_rank"),
    "local_size": ("hipress.comm.world", "local_size"),
    "cross_rank": ("hipress.comm.world", "cross_rank"),
    "cross_size": ("hipress.comm.world", "cross_size"),
    "DistributedOptimizer": ("hipress.torch.optimizer", "DistributedOptimizer"),
    "Average": ("hipress.torch.optimizer", "Average"),
    "Sum": ("hipress.torch.optimizer", "Sum"),
    "broadcast_parameters": ("hipress.torch.functions", "broadcast_parameters"),
    "broadcast_optimizer_state": ("hipress.torch.functions", "broadcast_optimizer_state"),
    "broadcast_object": ("hipress.torch.functions", "broadcast_object"),
    "Engine": ("hipress.engine", "Engine"),
    "Handle": ("hipress.engine", "Handle"),
    "TaskError": ("hipress.engine", "TaskError"),
    "get_engine": ("hipress.engine", "get_engine"),
    "ddp": ("hipress.ddp", None),  # the DDP communication hook (a module)
}
__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        mod, attr = _EXPORTS[name]
        module = importlib.import_module(mod)
        value = module if attr is None else getattr(module, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hipress' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_EXPORTS))
