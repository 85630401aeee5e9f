"""Planners the simulator compares, and the guard that lets them see only the past.

Shape legend: F steps, W window (recorded steps), L layers, E logical experts, R max replicas.

A planner turns the recorded window into a new placement. Everything it learns about the trace
comes through :class:`PastView`, which refuses (``AssertionError``) any step at or after the
first step that will run on the plan: planning sees only the past. The solver-backed planners
are ``eplb.solver.SolverPlanner`` (imported lazily, so "none" runs without SciPy); every planner
follows ``eplb.policy.Planner`` and is handed the guarded view as its ``history``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from eplb.config import DISPATCH_ALGORITHMS
from eplb.policy import Planner, policy_names
from eplb.traces import Trace

if TYPE_CHECKING:
    from eplb.simulate.config import SimulationConfig

ALGORITHMS = ("none", *policy_names())
"""Every registered policy, and "none" (keep the initial placement)."""


@dataclass(frozen=True)
class RunSpec:
    """One simulated configuration: a planning algorithm and a dispatch mode."""

    algorithm: str
    """none, or a registered policy (eplb.policy.policy_names())."""
    dispatch: str
    """static | dynamic | weighted | fake."""

    @property
    def name(self) -> str:
        return f"{self.algorithm}:{self.dispatch}"

    @classmethod
    def parse(cls, text: str, default_dispatch: str) -> RunSpec:
        """``"scipy"`` or ``"scipy:weighted"``; the dispatch defaults to ``default_dispatch``."""
        algorithm, _, dispatch = text.partition(":")
        dispatch = dispatch or default_dispatch
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r} in {text!r}; choose from {ALGORITHMS}")
        if dispatch not in DISPATCH_ALGORITHMS:
            raise ValueError(
                f"unknown dispatch mode {dispatch!r} in {text!r}; choose from {DISPATCH_ALGORITHMS}"
            )
        return cls(algorithm, dispatch)


def parse_runs(texts: Sequence[str], default_dispatch: str) -> list[RunSpec]:
    """Parse ``--algorithms`` entries, refusing duplicates."""
    runs = [RunSpec.parse(t, default_dispatch) for t in texts]
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise ValueError(f"--algorithms lists a configuration twice: {names}")
    if not runs:
        raise ValueError("--algorithms needs at least one entry")
    return runs


class PastView:
    """Read access to the recorded steps before ``now``; anything later is an AssertionError."""

    def __init__(self, trace: Trace, recorded_F: np.ndarray) -> None:
        self._counts_FLE = trace.counts_FLE
        self._recorded_steps = np.flatnonzero(recorded_F)
        self.now = 0
        """The first step that will run on the plan being made."""

    def recorded_steps(self) -> np.ndarray:
        """int64 [k]: indices of the recorded steps before ``now``, oldest first."""
        return self._recorded_steps[: np.searchsorted(self._recorded_steps, self.now)]

    def counts(self, steps: np.ndarray) -> np.ndarray:
        """int32 [k, L, E]: the counts of ``steps``, all of which must lie before ``now``."""
        steps = np.asarray(steps, dtype=np.int64)
        latest = int(steps.max(initial=-1))
        assert latest < self.now, (
            f"planning looked at step {latest}, but its plan is used from step {self.now}: "
            "the placement used at step t must be computed from steps before t"
        )
        return self._counts_FLE[steps]

    def window(self, size: int) -> np.ndarray:
        """int32 [W, L, E]: the last ``size`` recorded steps before ``now`` (fewer at the start)."""
        steps = self.recorded_steps()
        return self.counts(steps[max(len(steps) - size, 0) :])


def parse_solver_options(items: Sequence[str]) -> dict[str, Any]:
    """``["prediction=robust", "time_budget_s=0.2"]`` -> a dict; values are JSON when they parse as JSON."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--solver-option expects KEY=VALUE, got {item!r}")
        try:
            options[key] = json.loads(text)
        except json.JSONDecodeError:
            options[key] = text
    return options


def make_planner(run: RunSpec, config: SimulationConfig) -> Planner | None:
    """The planner of ``run`` under ``config``, as a server with its flags plans (the flags' move
    budget, the model's bytes per expert, the run's seed and ``--solver-option`` fields:
    eplb.solver.types.SolveOptions.from_config); None for "none" (the initial placement is kept
    throughout)."""
    if run.algorithm == "none":
        return None
    from eplb.solver.planner import SolverPlanner
    from eplb.solver.types import SolveOptions

    options = SolveOptions.from_config(
        config.eplb,
        algorithm=run.algorithm,
        dispatch=run.dispatch,
        bytes_per_expert=config.bytes_per_expert,
        seed=config.seed,
        fields=config.solver_options,
    )
    return SolverPlanner(options=options, num_groups=config.num_groups)
