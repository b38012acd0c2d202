"""CaSync strategies: task-graph builders for gradient synchronization."""
from hipress.sync.base import CommChain, StateStore, Strategy, SyncContext, chunk_bounds
from hipress.sync.ps import PSStrategy
from hipress.sync.ring import RingStrategy

STRATEGIES = {"ring": RingStrategy, "ps": PSStrategy}


def get_strategy(name: str, average: bool = True) -> Strategy:
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; expected one of {sorted(STRATEGIES)} or 'auto'") from None
    return cls(average=average)


__all__ = ["CommChain", "StateStore", "Strategy", "SyncContext", "chunk_bounds", "PSStrategy", "RingStrategy",
           "STRATEGIES", "get_strategy"]
