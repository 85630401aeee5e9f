"""One rebalance for an engine: its live map and its load in, a full placement out.

Shape legend: W window (passes or windows), L layers, E logical experts, P physical slots, G GPUs
(EP ranks), N nodes.

vLLM and SGLang run their EPLB planner on every rank and trust each rank to reach the same map,
so everything here is a function of its inputs: no clocks, no randomness (the solver's budgets
are counts). Engine maps arrive as int64 torch tensors and may hold -1 for a slot that holds
nothing (vLLM's elastic EP); :func:`engine_placement` turns one into a :class:`Placement` the
solver can plan from, :func:`plan_for_engine` runs one :class:`SolverPlanner`, and
:class:`EngineDecisions` keeps a process's rebalance decisions (eplb.policy.decision).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from eplb.config import EplbConfig
from eplb.placement.diff import diff_placements
from eplb.placement.model import Placement
from eplb.policy import Planner, check_policy_name
from eplb.policy.decision import Decider
from eplb.solver.planner import SolverPlanner
from eplb.solver.solve import solve
from eplb.solver.types import SolveOptions, Topology, as_load_array

SOLVER_OPTIONS_ENV = "EPLB_SOLVER_OPTIONS"
"""Environment variable: a JSON object of ``SolveOptions`` fields for the engine adapters."""


@dataclass(frozen=True, kw_only=True)
class EnginePlan:
    """What one rebalance gives the engine."""

    placement: Placement
    """The placement to run: the new plan, or the current one when the plan does not pay."""
    applied: bool
    """Whether ``placement`` is a new plan (False: the current placement is kept)."""
    reason: str
    """Why, in words (the solver's reason, or why no plan was made)."""

    def phy2log_int64(self) -> np.ndarray:
        """int64 [L, P]: the engine's layout of ``placement``."""
        return self.placement.phy2log_LP.astype(np.int64)

    def log2phy_int64(self) -> np.ndarray:
        """int64 [L, E, R]: each expert's slots, padded with -1; R = the most replicas of any expert
        (the layout of DeepSeek's ``rebalance_experts``, as SGLang returns it)."""
        width = int(self.placement.logcnt_LE.max())
        return self.placement.log2phy_LER[:, :, :width].astype(np.int64)

    def logcnt_int64(self) -> np.ndarray:
        """int64 [L, E]: replicas per expert."""
        return self.placement.logcnt_LE.astype(np.int64)


def solver_options_from_env(defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``defaults`` overridden by the JSON object in ``EPLB_SOLVER_OPTIONS`` (ValueError if malformed)."""
    merged = dict(defaults or {})
    raw = os.environ.get(SOLVER_OPTIONS_ENV, "").strip()
    if not raw:
        return merged
    try:
        user = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{SOLVER_OPTIONS_ENV} is not JSON: {exc}") from None
    if not isinstance(user, dict):
        raise ValueError(f"{SOLVER_OPTIONS_ENV} must be a JSON object of solver options, got {raw!r}")
    return {**merged, **user}


ENGINE_DEFAULTS: dict[str, Any] = {"copy_cost": 0.0}
"""Solver options every adapter starts from. An engine's planner is not told what an expert's
weights weigh, so eplb cannot price a copy in seconds there; with ``copy_cost`` 0 it plans as
balanced as it can from the live placement, keeping every expert it cannot improve on (on the
tests' drifting input through vLLM's and SGLang's own code it moves about 60% of the copies their
DeepSeek repack moves; with the former price of 0.002 a copy, about 25%, at 0.005-0.01 less
balancedness on the next window). ``EPLB_SOLVER_OPTIONS`` overrides it, e.g.
``{"bytes_per_expert": 44040192}`` to price copies in seconds, or ``{"copy_cost": 0.002}``."""


def make_planner(algorithm: str, flag: str, defaults: Mapping[str, Any] | None = None) -> SolverPlanner:
    """The planner an adapter runs: ``algorithm`` with :data:`ENGINE_DEFAULTS`, then ``defaults``,
    then the options of ``EPLB_SOLVER_OPTIONS``.

    Unknown algorithms or options raise ValueError naming ``flag``, so a typo stops the engine at
    start-up instead of at its first rebalance.
    """
    check_policy_name(algorithm, flag)
    return SolverPlanner(
        options=SolveOptions.from_mapping(
            solver_options_from_env({**ENGINE_DEFAULTS, **(defaults or {})}), algorithm=algorithm
        )
    )


def engine_placement(phy2log: Any, load_LE: np.ndarray, num_gpus: int, num_nodes: int) -> Placement | None:
    """The engine's live map [L, P] as a Placement, or None when it cannot serve as the current one.

    Slots holding -1 (empty) are filled first with the experts the layer lacks, then each with the
    expert of the highest load per replica (lowest id on ties), so the solver sees a full placement;
    whatever fills an empty slot must be copied there anyway. None when the map is not [L, P] with
    P divisible by ``num_gpus``, holds ids outside [-1, E), or lacks more experts than it has empty
    slots.
    """
    if hasattr(phy2log, "detach"):
        phy2log = phy2log.detach().cpu().numpy()
    arr = np.array(phy2log, dtype=np.int64)
    L, E = load_LE.shape
    if arr.ndim != 2 or arr.shape[0] != L or arr.shape[1] < E or arr.shape[1] % num_gpus:
        return None
    if arr.size and (arr.min() < -1 or arr.max() >= E):
        return None
    for layer in range(L):
        row = arr[layer]
        holes = np.flatnonzero(row < 0)
        counts_E = np.bincount(row[row >= 0], minlength=E)
        missing = np.flatnonzero(counts_E == 0)
        if len(missing) > len(holes):
            return None
        row[holes[: len(missing)]] = missing
        counts_E[missing] = 1
        for hole in holes[len(missing) :]:
            expert = int(np.argmax(load_LE[layer] / counts_E))
            row[hole] = expert
            counts_E[expert] += 1
    P = arr.shape[1]
    try:
        return Placement.from_phy2log(arr, num_gpus, num_nodes, max_replicas=P - E + 1)
    except ValueError:
        return None


class EngineDecisions:
    """One engine process's rebalance decisions for one model shape (eplb.policy.decision).

    The engine calls its planner on every rank with the same inputs, so a :class:`Decider` kept
    per process decides alike on every rank: the first plan from an unfitted placement is a
    fresh one, later plans are migration-aware and priced, and the current placement's age
    counts in the engine's passes (``passes_per_rebalance`` per call: SGLang's window; for vLLM,
    whose policy sees one summed window per call, one).
    """

    def __init__(self, *, num_gpus: int, num_nodes: int, passes_per_rebalance: int) -> None:
        config = EplbConfig(
            ep_size=max(num_gpus, 1),
            nnodes=num_nodes if num_nodes >= 1 and num_gpus % num_nodes == 0 else 1,
            eplb_rebalance_num_iterations=max(passes_per_rebalance, 1),
        )
        self.decider = Decider(config)
        self.counted = 0
        """Passes counted so far (one call's window each)."""

    def rebalance(
        self,
        window: Any,
        *,
        num_physical: int,
        num_gpus: int,
        num_nodes: int,
        num_groups: int | None,
        planner: SolverPlanner,
        current: Placement | None,
    ) -> EnginePlan:
        """One rebalance (:func:`plan_for_engine`) with this process's decisions."""
        self.counted += self.decider.config.rebalance_interval
        return plan_for_engine(
            window,
            num_physical=num_physical,
            num_gpus=num_gpus,
            num_nodes=num_nodes,
            num_groups=num_groups,
            planner=planner,
            current=current,
            decider=self.decider,
            counted_pass=self.counted,
        )


def plan_for_engine(
    window: Any,
    *,
    num_physical: int,
    num_gpus: int,
    num_nodes: int,
    num_groups: int | None,
    planner: SolverPlanner,
    current: Placement | None,
    decider: Decider | None = None,
    counted_pass: int = 0,
) -> EnginePlan:
    """Plan from ``window`` ([W, L, E] or [L, E]) on the engine's topology.

    Nodes that do not divide the GPUs count as one node (vLLM does the same). With ``current``
    the plan is migration-aware and may keep ``current`` (``applied=False``) when moving does not
    pay; without one it is a fresh plan. A window with no load keeps ``current`` (or the trivial
    placement): there is nothing to plan from. With a ``decider`` (:class:`EngineDecisions`), the
    rebalance at ``counted_pass`` goes through it (first plan, pricing, what it moved).
    """
    window_WLE = as_load_array(window)
    _, L, E = window_WLE.shape
    nodes = num_nodes if num_nodes >= 1 and num_gpus % num_nodes == 0 else 1
    groups = num_groups if num_groups is not None and num_groups >= 1 else 1
    if current is not None and (current.num_physical, current.num_gpus, current.num_nodes) != (
        num_physical,
        num_gpus,
        nodes,
    ):
        current = None
    if not window_WLE.any():
        keep = current or Placement.trivial(L, E, num_gpus, num_physical - E, nodes)
        return EnginePlan(placement=keep, applied=False, reason="no load recorded: placement kept")
    planner = dataclasses.replace(planner, num_groups=groups)
    if current is None:
        topology = Topology(num_gpus=num_gpus, num_nodes=nodes, num_physical=num_physical, num_groups=groups)
        fresh = solve(window_WLE, topology, None, planner.options)
        if decider is not None:
            decider.record(counted_pass=counted_pass, applied=True, copies=0.0)
        return EnginePlan(placement=fresh.placement, applied=True, reason=fresh.reason)
    chosen: Planner = planner if decider is None else decider.planner(planner, counted_pass=counted_pass)
    plan = chosen(window_WLE, current)
    if decider is not None:
        moved = diff_placements(current, plan.placement).experts_moved_across_gpus if plan.apply else 0
        decider.record(counted_pass=counted_pass, applied=plan.apply, copies=float(moved))
    if not plan.apply:
        return EnginePlan(placement=current, applied=False, reason=plan.reason)
    return EnginePlan(placement=plan.placement, applied=True, reason=plan.reason)
