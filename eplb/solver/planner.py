"""``SolverPlanner``: the :class:`eplb.policy.Planner` that runs ``solve`` with a registered policy.

Shape legend: W window (passes), L layers, E logical experts, R max replicas.

The manager, the simulator, ``eplb solve`` and the engine adapters all plan through it (by way of
eplb.policy.decision, which prepares it for each rebalance with the methods below), so one set of
options means the same plan everywhere. The topology comes from the current placement, or, for a
plan without one (an engine with no live map), from its own ``topology``.
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
    topology: Topology | None = None
    """The topology of a plan without a current placement (:meth:`plan_fresh`; its ``num_groups``
    is this planner's); None: only the current placement's."""

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

    def for_lost_ranks(self, alive: tuple[bool, ...], reload_source: str | None = None) -> SolverPlanner:
        """This planner for the degraded plan over the ranks ``alive`` marks (``alive_ranks``),
        reloading from ``reload_source`` (None: the options' own)."""
        options = replace(self.options, alive_ranks=alive)
        if reload_source is not None:
            options = replace(options, reload_source=reload_source)
        return replace(self, options=options)

    def plan_fresh(self, window_WLE: np.ndarray) -> Plan:
        """``solve(window, topology, None, options)``: a fresh plan on :attr:`topology`."""
        if self.topology is None:
            raise ValueError("a plan without a current placement needs the planner's topology")
        return solve(window_WLE, replace(self.topology, num_groups=self.num_groups), None, self.options)

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
