"""The rebalancer: from recorded expert load to a placement of replicas over GPUs.

``solve(load, topology, current, options) -> Plan`` is the rich entry point (forecast, placement,
dispatch weights, transfer and an apply/skip decision); ``rebalance_experts`` is a drop-in for
DeepSeek's entry point. Only numpy and SciPy are needed (torch only to build the drop-in's tensors).
See docs/solver.md.
"""

from __future__ import annotations

from eplb.placement.model import Placement
from eplb.solver.dropin import rebalance_experts
from eplb.solver.planner import SolverPlanner
from eplb.solver.policies.protocol import Policy
from eplb.solver.solve import solve
from eplb.solver.types import PREDICTIONS, Plan, SolveOptions, Topology

__all__ = [
    "PREDICTIONS",
    "Placement",
    "Plan",
    "Policy",
    "SolveOptions",
    "SolverPlanner",
    "Topology",
    "rebalance_experts",
    "solve",
]
