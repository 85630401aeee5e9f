"""The built-in placement policies the registry (eplb.policy) names: DeepSeek's EPLB and scipy.

Shape legend: L layers, E logical experts, P physical slots.

Each is a :class:`eplb.policy.Policy`: it says which forecast it plans on and turns that forecast
into phy2log [L, P]; ``solve`` does everything around it (checks, forecast, weights, the gate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from eplb.placement.model import Placement
from eplb.policy.registry import get_policy
from eplb.solver.greedy import deepseek_rebalance
from eplb.solver.predict import Prediction
from eplb.solver.types import SolveOptions, Topology


@dataclass(frozen=True)
class PlacementRequest:
    """What a policy places from: the forecast, where the slots live, the live placement, options."""

    prediction: Prediction
    topology: Topology
    current: Placement | None
    """The live placement (migration-aware policies keep what pays to keep), or None."""
    options: SolveOptions
    stats: dict[str, float]
    """Numbers about the solve that the policy may add to (Plan.stats)."""


class Policy(Protocol):
    """A placement algorithm that the registry (eplb.policy) can name, and what it can do."""

    @property
    def name(self) -> str: ...

    @property
    def migration_aware(self) -> bool:
        """It plans from the live placement and keeps what still serves (else it repacks)."""
        ...

    @property
    def budget_aware(self) -> bool:
        """It searches within ``max_moved_experts`` itself (else ``solve`` keeps the whole layers
        of its plan that pay best per copy, within the budget)."""
        ...

    @property
    def priced(self) -> bool:
        """Its plans pass the gate in seconds (eplb.policy.decision.gate); else they are applied
        whenever they change something, as SGLang applies DeepSeek's."""
        ...

    def prediction(self, options: SolveOptions, num_passes: int) -> str:
        """The forecast method (``sum`` | ``decay`` | ``recent`` | ``robust``) this policy plans on."""
        ...

    def place(self, request: PlacementRequest) -> np.ndarray:
        """phy2log int [L, P] for the request's forecast; may add numbers to ``request.stats``."""
        ...


def load_policy(name: str) -> Policy:
    """The registered policy ``name`` (aliases resolved), typed; ValueError for an unknown name."""
    policy: Policy = get_policy(name)
    return policy


@dataclass(frozen=True)
class DeepSeekPolicy:
    """DeepSeek's EPLB (greedy replicate + balanced packing), global or hierarchical, on the window sum."""

    name: str
    hierarchical: bool
    migration_aware: bool = False
    budget_aware: bool = False
    priced: bool = False

    def prediction(self, options: SolveOptions, num_passes: int) -> str:
        # SGLang runs DeepSeek's algorithm on the plain sum of the window.
        return "sum" if options.prediction == "auto" else options.prediction

    def place_with_rank(self, load_LE: np.ndarray, topology: Topology) -> tuple[np.ndarray, np.ndarray]:
        """(phy2log int64 [L, P], replica rank int64 [L, P]) as DeepSeek's code returns them."""
        num_logical = load_LE.shape[1]
        if self.hierarchical and not topology.hierarchical_ok(num_logical):
            raise ValueError(
                f"deepseek_hierarchical needs num_groups ({topology.num_groups}) to divide the experts "
                f"({num_logical}) and to be divisible by num_nodes ({topology.num_nodes})"
            )
        groups, nodes = (topology.num_groups, topology.num_nodes) if self.hierarchical else (1, 1)
        phy2log, rank, _ = deepseek_rebalance(
            load_LE, topology.num_physical, groups, nodes, topology.num_gpus
        )
        return phy2log, rank

    def place(self, request: PlacementRequest) -> np.ndarray:
        return self.place_with_rank(request.prediction.point_LE, request.topology)[0]


@dataclass(frozen=True)
class ScipyPolicy:
    """Forecast, greedy packing refined by swap search and MILP, incremental migration-aware plans."""

    name: str = "scipy"
    migration_aware: bool = True
    budget_aware: bool = True
    priced: bool = True

    def prediction(self, options: SolveOptions, num_passes: int) -> str:
        if options.prediction != "auto":
            return options.prediction
        # Budgeted (continuous) plans: robust's scenarios cost 4x the search time for no gain.
        robust = num_passes >= options.robust_from_passes and not options.budgeted
        return "robust" if robust else "decay"

    def place(self, request: PlacementRequest) -> np.ndarray:
        from eplb.solver.scipy_solver import scipy_phy2log

        r = request
        return scipy_phy2log(r.prediction, r.topology, r.current, r.options, r.stats)


DEEPSEEK = DeepSeekPolicy("deepseek", hierarchical=False)
DEEPSEEK_HIERARCHICAL = DeepSeekPolicy("deepseek_hierarchical", hierarchical=True)
SCIPY = ScipyPolicy()
