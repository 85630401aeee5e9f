"""What ``solve`` asks of a placement policy, and the typed access to the registry's policies.

Shape legend: L layers, P physical slots.

A :class:`Policy` says which forecast it plans on and turns that forecast into phy2log [L, P];
``solve`` does everything around it (checks, forecast, weights, the gate). The built-in ones
(eplb.solver.policies.deepseek, eplb.solver.policies.scipy_policy) are named by the registry
(eplb.policy.registry), which loads them by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from eplb.placement.model import Placement
from eplb.policy.registry import get_policy
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
    current_share_LP: np.ndarray | None = None
    """float64 [L, P]: the live placement's slot shares as the dispatch splits tokens
    (eplb.placement.share.ShareModel.share_LP), where the caller has them: a search from
    the live placement starts from them instead of computing them again."""


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
        """Its plans pass the gate in seconds (eplb.policy.decision.judge); else they are applied
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
