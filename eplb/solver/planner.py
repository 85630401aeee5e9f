"""``SolverPlanner``: the :class:`eplb.policy.Planner` that runs ``solve`` with a registered policy.

Shape legend: W window (passes), L layers, E logical experts, R max replicas.

The manager, the simulator, ``eplb solve`` and the engine adapters all plan through it, so one set
of options means the same plan everywhere. The topology comes from the current placement.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from eplb.placement.model import Placement
from eplb.policy.base import LoadHistory
from eplb.solver.solve import solve
from eplb.solver.types import Plan, SolveOptions, Topology


@dataclass(frozen=True, kw_only=True)
class SolverPlanner:
    """``solve(window, topology of current, current, options)`` with the options below."""

    algorithm: str = "auto"
    """A registered policy name (eplb.policy.policy_names())."""
    num_groups: int = 1
    """Expert groups, for the hierarchical policy."""
    bytes_per_expert: int = 0
    """Bytes of one expert's weights in one layer (byte counts, byte budgets)."""
    weighted: bool = False
    """Also fit per-replica dispatch weights (weighted dispatch)."""
    static_dispatch: bool = False
    """The server dispatches by static per-rank maps: plans are scored with their shares."""
    seed: int = 0
    """Passed to SolveOptions.seed."""
    extra_options: Mapping[str, Any] = field(default_factory=dict)
    """More ``SolveOptions`` fields by name (prediction, time_budget_s, min_gain, ...)."""

    def __post_init__(self) -> None:
        self.options()  # unknown or invalid options fail when the planner is made, not at a rebalance

    def options(self) -> SolveOptions:
        """The ``SolveOptions`` this planner passes; unknown or invalid fields raise ValueError."""
        try:
            return SolveOptions(
                algorithm=self.algorithm,
                weighted=self.weighted,
                static_dispatch=self.static_dispatch,
                bytes_per_expert=self.bytes_per_expert,
                seed=self.seed,
                **dict(self.extra_options),
            )
        except TypeError as exc:
            raise ValueError(f"solver option: {exc}") from None

    def for_unfitted_placement(self) -> SolverPlanner:
        """This planner with no move budget (``max_moved_experts``, ``max_bytes_moved``) and no
        copy price (``copy_cost`` 0): the first plan from a placement nobody fitted
        (eplb.policy.schedule). Both exist to keep a fitted placement's traffic small; from an
        unfitted one every layer gains far more than its copies cost (from the trivial placement
        on the deepseek-v3 preset, +0.39 balancedness against a price of 0.40 at the default
        ``copy_cost``, which kept the first plans from being applied)."""
        dropped = ("max_moved_experts", "max_bytes_moved", "shift_max_moved_experts")
        options = {k: v for k, v in self.extra_options.items() if k not in dropped}
        return replace(self, extra_options={**options, "copy_cost": 0.0})

    def with_move_budget(self, budget: int, shift_budget: int | None) -> SolverPlanner:
        """This planner with ``max_moved_experts`` = ``budget`` and ``shift_max_moved_experts`` =
        ``shift_budget`` (continuous mode's allowance, eplb.policy.schedule.MoveAllowance)."""
        options = {**self.extra_options, "max_moved_experts": budget}
        options["shift_max_moved_experts"] = shift_budget
        return replace(self, extra_options=options)

    def __call__(
        self, window_WLE: np.ndarray, current: Placement, history: LoadHistory | None = None
    ) -> Plan:
        topology = Topology(
            num_gpus=current.num_gpus,
            num_nodes=current.num_nodes,
            num_physical=current.num_physical,
            num_groups=self.num_groups,
        )
        return solve(window_WLE, topology, current, self.options())
