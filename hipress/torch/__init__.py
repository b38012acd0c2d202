"""PyTorch integration: the optimizer wrapper and broadcast helpers."""
from hipress.torch.functions import (UnsafeObjectError, broadcast_object, broadcast_optimizer_state,
                                     broadcast_parameters)
from hipress.torch.optimizer import Average, DistributedOptimizer, Sum

__all__ = ["Average", "DistributedOptimizer", "Sum", "UnsafeObjectError", "broadcast_object", "broadcast_optimizer_state",
           "broadcast_parameters"]
