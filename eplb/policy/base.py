"""The protocols every placement algorithm and every planner follows.

Shape legend: W window (passes), L layers, E logical experts, P physical slots, R max replicas.

A :class:`Policy` is a placement algorithm: from a load forecast to phy2log [L, P]. A
:class:`Planner` is what the manager, the simulator and the engine adapters call on a recorded
window: ``planner(window_WLE, current) -> PlanLike``; ``eplb.solver.SolverPlanner`` runs ``solve``
with a registered policy, and tests or users may pass their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from eplb.placement.model import Placement
    from eplb.solver.predict import Prediction
    from eplb.solver.types import SolveOptions, Topology


class Policy(Protocol):
    """A placement algorithm (see eplb.solver.policies for the built-in ones)."""

    @property
    def name(self) -> str: ...

    def prediction(self, options: SolveOptions, num_passes: int) -> str:
        """The forecast method (``sum`` | ``decay`` | ``recent`` | ``robust``) this policy plans on."""
        ...

    def place(
        self,
        prediction: Prediction,
        topology: Topology,
        current: Placement | None,
        options: SolveOptions,
        stats: dict[str, float],
    ) -> np.ndarray:
        """phy2log int [L, P] for the forecast; may add numbers to ``stats``."""
        ...


class PlanLike(Protocol):
    """What a planner returns (eplb.solver.Plan satisfies it)."""

    @property
    def placement(self) -> Placement: ...
    @property
    def dispatch_weights_LER(self) -> np.ndarray | None: ...
    @property
    def predicted_balancedness(self) -> float | None: ...
    @property
    def apply(self) -> bool: ...
    @property
    def reason(self) -> str: ...


@dataclass(frozen=True)
class Proposal:
    """A plain :class:`PlanLike` for planners written by hand (tests, experiments)."""

    placement: Placement
    dispatch_weights_LER: np.ndarray | None = None
    """float [L, E, R] per-replica dispatch weights (weighted dispatch), or None."""
    apply: bool = True
    """False: keep the current placement (the planner judged the move not worth it)."""
    reason: str = ""
    predicted_balancedness: float | None = None
    """The planner's own forecast of model balancedness under ``placement``, when it makes one."""


class LoadHistory(Protocol):
    """Read access to recorded passes before the plan takes effect (the simulator's guarded view)."""

    now: int

    def recorded_steps(self) -> np.ndarray: ...

    def counts(self, steps: np.ndarray) -> np.ndarray: ...


class Planner(Protocol):
    """``planner(window_WLE float [W, L, E], current, history=None) -> plan``.

    ``history``, where the caller has one (the simulator), reaches further back than the window;
    the manager passes only the window.
    """

    def __call__(
        self, window_WLE: np.ndarray, current: Placement, history: LoadHistory | None = None
    ) -> PlanLike: ...
