"""``SolverPlanner``: the :class:`eplb.policy.Planner` that runs ``solve`` with a registered policy.

Shape legend: W window (passes), L layers, E logical experts, R max replicas.

The manager, the simulator, ``eplb solve`` and the engine adapters all plan through it, so one set
of options means the same plan everywhere. The topology comes from the current placement.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from eplb.placement.model import Placement
from eplb.policy.base import LoadHistory
from eplb.policy.decision import Pricing
from eplb.solver.solve import solve
from eplb.solver.types import Plan, SolveOptions, Topology


@dataclass(frozen=True, kw_only=True)
class SolverPlanner:
    """``solve(window, topology of current, current, options)``."""

    options: SolveOptions = field(default_factory=SolveOptions)
    """What ``solve`` is asked for: the policy, the dispatch mode, budgets, pricing, ..."""
    num_groups: int = 1
    """Expert groups, for the hierarchical policy."""

    def for_unfitted_placement(self, *, drop_budget: bool = True) -> SolverPlanner:
        """This planner for a placement nobody fitted (eplb.policy.decision), with no noise price
        (``noise_price_passes``: the gains there are far above any noise). With ``drop_budget``
        (the unbudgeted first plan) it also drops the move budget (``max_moved_experts``,
        ``max_bytes_moved``, ``shift_max_moved_experts``) and plans fresh where that beats the
        current layer (``incremental=False``: a search from an unfitted placement fits the
        forecast's noise, the fresh packing its structure; on the deepseek-v3 preset in
        continuous mode the first plan then reaches 0.90 prefill balancedness against 0.87-0.88
        when searched). With the budget kept, it searches within it, since no whole fresh layer
        fits a budget of a few copies; the gate in seconds still decides."""
        options = replace(self.options, noise_price_passes=0.0)
        if drop_budget:
            options = replace(
                options,
                incremental=False,
                max_moved_experts=None,
                max_bytes_moved=None,
                shift_max_moved_experts=None,
            )
        return replace(self, options=options)

    def with_move_budget(self, budget: int, shift_budget: int | None) -> SolverPlanner:
        """This planner with ``max_moved_experts`` = ``budget`` and ``shift_max_moved_experts`` =
        ``shift_budget`` (continuous mode's allowance, eplb.policy.decision.MoveAllowance)."""
        options = replace(self.options, max_moved_experts=budget, shift_max_moved_experts=shift_budget)
        return replace(self, options=options)

    def with_pricing(self, pricing: Pricing) -> SolverPlanner:
        """This planner with ``pricing`` (horizon, the current placement's age, the transfer model)."""
        return replace(self, options=replace(self.options, pricing=pricing))

    def __call__(
        self, window_WLE: np.ndarray, current: Placement, history: LoadHistory | None = None
    ) -> Plan:
        topology = Topology(
            num_gpus=current.num_gpus,
            num_nodes=current.num_nodes,
            num_physical=current.num_physical,
            num_groups=self.num_groups,
        )
        return solve(window_WLE, topology, current, self.options)
