"""Offline rebalance simulation: replay a load trace under each planner and dispatch mode.

``simulate(trace, runs, config)`` returns per-step balancedness and modeled MoE time for every
run and for the no-balancing baseline, with every rebalance's moves and costs, under SGLang's
periodic schedule or eplb's continuous one (``SimulationConfig.eplb``, the server's flags: an
``eplb.config.EplbConfig``). See docs/simulate.md.
"""

from __future__ import annotations

from eplb.config import DISPATCH_ALGORITHMS, REBALANCE_MODES
from eplb.policy.cost_model import CostModel, swap_beside_passes
from eplb.simulate.config import SimulationConfig
from eplb.simulate.engine import rebalance_steps, simulate
from eplb.simulate.planners import ALGORITHMS, PastView, RunSpec, parse_runs
from eplb.simulate.results import RebalanceEvent, RunResult, SimulationResult

__all__ = [
    "ALGORITHMS",
    "DISPATCH_ALGORITHMS",
    "REBALANCE_MODES",
    "CostModel",
    "PastView",
    "RebalanceEvent",
    "RunResult",
    "RunSpec",
    "SimulationConfig",
    "SimulationResult",
    "parse_runs",
    "rebalance_steps",
    "simulate",
    "swap_beside_passes",
]
