"""Selective compression and partitioning planner (HiPress paper, section 3.3).

The cost model (equations 1 and 2 with alpha/beta/gamma from Table 3 and section 6.1)
decides, per gradient, whether to compress it and into how many partitions to split
it. See docs/planner.md.
"""
from hipress.planner.cost_model import (  # noqa: F401
    CATEGORIES, STRATEGIES, AffineCurve, CostModel, Decision, PiecewiseAffineCurve, SyncParams,
    curve_from_dict, rounds, sync_params,
)
from hipress.planner.plan import (  # noqa: F401
    Overrides, Plan, PlanEntry, chunk_bounds, fastest_plan, make_plan, plan_one,
)
