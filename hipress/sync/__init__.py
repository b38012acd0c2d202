"""CaSync strategies: task-graph builders for gradient synchronization."""
from hipress.sync.allreduce import AllreduceStrategy
from hipress.sync.base import StateStore, Strategy, SyncContext
from hipress.sync.factory import STRATEGIES, Sync, make_sync, resolve_strategy, use_local_aggregation
from hipress.sync.ps import PSStrategy
from hipress.sync.ring import RingStrategy

__all__ = ["AllreduceStrategy", "StateStore", "Strategy", "SyncContext", "PSStrategy", "RingStrategy", "STRATEGIES", "Sync", "make_sync",
           "resolve_strategy", "use_local_aggregation"]
