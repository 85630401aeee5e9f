"""The protocol every planner follows, and what it returns.

Shape legend: W window (passes), L layers, E logical experts, P physical slots, R max replicas.

A :class:`Planner` is what the manager, the simulator and the engine adapters call on a recorded
window: ``planner(window_WLE, current) -> PlanLike``; ``eplb.solver.SolverPlanner`` runs ``solve``
with a registered policy (the placement algorithms, ``eplb.solver.Policy``), and tests or users may
pass their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from eplb.placement.model import Placement


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
