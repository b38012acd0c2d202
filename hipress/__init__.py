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
    "NonFiniteGradientError": ("hipress.torch.nonfinite", "NonFiniteGradientError"),
    "NonFiniteGradientWarning": ("hipress.torch.nonfinite", "NonFiniteGradientWarning"),
    "broadcast_parameters": ("hipress.torch.functions", "broadcast_parameters"),
    "broadcast_optimizer_state": ("hipress.torch.functions", "broadcast_optimizer_state"),
    "broadcast_object": ("hipress.torch.functions", "broadcast_object"),
    "UnsafeObjectError": ("hipress.torch.functions", "UnsafeObjectError"),
    "Engine": ("hipress.engine", "Engine"),
    "Handle": ("hipress.engine", "Handle"),
    "TaskError": ("hipress.engine", "TaskError"),
    "get_engine": ("hipress.engine", "get_engine"),
    # Horovod's collective API (hipress/torch/collectives.py, docs/horovod.md)
    "Adasum": ("hipress.torch.collectives", "Adasum"),
    "Min": ("hipress.torch.collectives", "Min"),
    "Max": ("hipress.torch.collectives", "Max"),
    "Product": ("hipress.torch.collectives", "Product"),
    "HorovodInternalError": ("hipress.torch.collectives", "HorovodInternalError"),
    "ProcessSet": ("hipress.torch.collectives", "ProcessSet"),
    "global_process_set": ("hipress.torch.collectives", "global_process_set"),
    "add_process_set": ("hipress.torch.collectives", "add_process_set"),
    "remove_process_set": ("hipress.torch.collectives", "remove_process_set"),
    "allreduce": ("hipress.torch.collectives", "allreduce"),
    "allreduce_": ("hipress.torch.collectives", "allreduce_"),
    "allreduce_async": ("hipress.torch.collectives", "allreduce_async"),
    "allreduce_async_": ("hipress.torch.collectives", "allreduce_async_"),
    "grouped_allreduce": ("hipress.torch.collectives", "grouped_allreduce"),
    "grouped_allreduce_": ("hipress.torch.collectives", "grouped_allreduce_"),
    "grouped_allreduce_async": ("hipress.torch.collectives", "grouped_allreduce_async"),
    "grouped_allreduce_async_": ("hipress.torch.collectives", "grouped_allreduce_async_"),
    "allgather": ("hipress.torch.collectives", "allgather"),
    "allgather_async": ("hipress.torch.collectives", "allgather_async"),
    "grouped_allgather": ("hipress.torch.collectives", "grouped_allgather"),
    "grouped_allgather_async": ("hipress.torch.collectives", "grouped_allgather_async"),
    "allgather_object": ("hipress.torch.collectives", "allgather_object"),
    "broadcast": ("hipress.torch.collectives", "broadcast"),
    "broadcast_": ("hipress.torch.collectives", "broadcast_"),
    "broadcast_async": ("hipress.torch.collectives", "broadcast_async"),
    "broadcast_async_": ("hipress.torch.collectives", "broadcast_async_"),
    "alltoall": ("hipress.torch.collectives", "alltoall"),
    "alltoall_async": ("hipress.torch.collectives", "alltoall_async"),
    "reducescatter": ("hipress.torch.collectives", "reducescatter"),
    "reducescatter_async": ("hipress.torch.collectives", "reducescatter_async"),
    "grouped_reducescatter": ("hipress.torch.collectives", "grouped_reducescatter"),
    "grouped_reducescatter_async": ("hipress.torch.collectives", "grouped_reducescatter_async"),
    "synchronize": ("hipress.torch.collectives", "synchronize"),
    "poll": ("hipress.torch.collectives", "poll"),
    "barrier": ("hipress.torch.collectives", "barrier"),
    "join": ("hipress.torch.collectives", "join"),
    "start_timeline": ("hipress.torch.collectives", "start_timeline"),
    "stop_timeline": ("hipress.torch.collectives", "stop_timeline"),
    "mpi_built": ("hipress.torch.collectives", "mpi_built"),
    "mpi_enabled": ("hipress.torch.collectives", "mpi_enabled"),
    "mpi_threads_supported": ("hipress.torch.collectives", "mpi_threads_supported"),
    "gloo_built": ("hipress.torch.collectives", "gloo_built"),
    "gloo_enabled": ("hipress.torch.collectives", "gloo_enabled"),
    "nccl_built": ("hipress.torch.collectives", "nccl_built"),
    "ddl_built": ("hipress.torch.collectives", "ddl_built"),
    "ccl_built": ("hipress.torch.collectives", "ccl_built"),
    "cuda_built": ("hipress.torch.collectives", "cuda_built"),
    "rocm_built": ("hipress.torch.collectives", "rocm_built"),
    "sycl_built": ("hipress.torch.collectives", "sycl_built"),
    "is_homogeneous": ("hipress.torch.collectives", "is_homogeneous"),
    "Compression": ("hipress.torch.compression", "Compression"),
    "SyncBatchNorm": ("hipress.torch.sync_batch_norm", "SyncBatchNorm"),
    "ddp": ("hipress.ddp", None),  # the DDP communication hook (a module; hipress/torch/ddp.py)
    "fsdp": ("hipress.fsdp", None),  # FSDP2's reduce-scatter (a module; hipress/torch/fsdp.py)
    "grace": ("hipress.compression.grace_api", None),  # GRACE's API as a porting layer (a module)
    "clipping": ("hipress.torch.clipping", None),  # grad_clip= values: sigma(c), PAPER (a module)
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
