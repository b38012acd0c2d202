"""hipress: compression-aware data-parallel training for PyTorch."""
from hipress import _C  # noqa: F401  (fails early with a clear ImportError if the core is not built)
from hipress.engine import Engine, Handle, TaskError, get_engine

__version__ = "0.1.0"
__all__ = ["Engine", "Handle", "TaskError", "get_engine", "__version__"]
