"""One rebalance for an engine: its live map and its load in, a full placement out.

Shape legend: W window (passes or windows), L layers, E logical experts, P physical slots, G GPUs
(EP ranks), N nodes.

vLLM and SGLang run their EPLB planner on every rank and trust each rank to reach the same map,
so everything here is a function of its inputs: no clocks, no randomness (the solver's budgets
are counts; wall time is measured only for the metrics). Engine maps arrive as int64 torch
tensors and may hold -1 for a slot that holds nothing (vLLM's elastic EP); :func:`engine_placement`
turns one into a :class:`Placement` the solver can plan from, :func:`plan_for_engine` (and
:func:`plan_degraded`, ranks lost) runs one rebalance of a :class:`SolverPlanner` through the
process's Decider, and :class:`EngineDecisions` keeps a process's rebalance decisions
(eplb.policy.decision) and its own history of the windows the engine handed over, which in
continuous mode (``EPLB_REBALANCE_MODE=continuous``, eplb.integrations.engine_env) is longer
than one engine window.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from eplb.config import even_nodes
from eplb.integrations.engine_env import SOLVER_OPTIONS_ENV, EngineEnv, solver_options_from_env
from eplb.integrations.engine_metrics import EngineMetrics, RebalanceReport
from eplb.placement.balance import model_balancedness
from eplb.placement.degraded import DegradedPlacement, ReloadReport, check_alive
from eplb.placement.model import Placement
from eplb.policy import check_policy_name
from eplb.policy.clock import RebalanceClock
from eplb.policy.decision import Decider, Outcome, RankLoss, Request
from eplb.policy.plan_check import SHAPE
from eplb.solver.planner import SolverPlanner
from eplb.solver.types import SolveOptions, Topology, as_load_array

__all__ = [
    "CONTINUOUS_COPY_COST",
    "ENGINE_COPY_COST",
    "ENGINE_DISPATCH",
    "SOLVER_OPTIONS_ENV",
    "EngineDecisions",
    "EnginePlan",
    "engine_placement",
    "make_planner",
    "plan_degraded",
    "plan_for_engine",
    "solver_options_from_env",
]


@dataclass(frozen=True, kw_only=True)
class EnginePlan:
    """What one rebalance gives the engine."""

    placement: Placement
    """The placement to run: the new plan, or the current one when the plan does not pay."""
    applied: bool
    """Whether ``placement`` is a new plan (False: the current placement is kept)."""
    reason: str
    """Why, in words (the solver's reason, or why no plan was made)."""
    copies: int = 0
    """Expert copies across GPUs the plan moves from the live placement (0 when kept)."""
    predicted: float | None = None
    """Predicted balancedness of ``placement`` over the passes before the next rebalance (the
    plan's when applied, the kept placement's otherwise; None: no prediction was made)."""
    solve_seconds: float = 0.0
    """Wall time of the solve (for the metrics only: nothing decides on it)."""
    degraded: DegradedPlacement | None = None
    """With ranks lost (:func:`plan_degraded`): the plan in the full slot numbering (dead slots
    -1); ``placement`` is then the survivors' placement (live GPU i = the i-th live rank)."""
    reload: ReloadReport | None = None
    """With ranks lost: the experts to reload (none of their replicas survived) and the copies."""
    failed: bool = False
    """Whether the rebalance failed rather than chose to keep ``placement`` (a plan that does not
    fit the model: eplb.policy.plan_check); the metrics count it as failed, not skipped."""

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


ENGINE_COPY_COST = 0.0
"""The copy cost every adapter plans with in periodic mode. An engine's planner is not told what
an expert's weights weigh, so eplb cannot price a copy in seconds there; with ``copy_cost`` 0 it
plans as balanced as it can from the live placement, keeping every expert it cannot improve on
(on the tests' drifting input through vLLM's and SGLang's own code it moves about 60% of the
copies their DeepSeek repack moves; with the former price of 0.002 a copy, about 25%, at
0.005-0.01 less balancedness on the next window). ``EPLB_SOLVER_OPTIONS`` overrides it, e.g.
``{"bytes_per_expert": 44040192}`` to price copies in seconds, or ``{"copy_cost": 0.002}``."""
CONTINUOUS_COPY_COST: float | None = None
"""The copy cost of continuous mode, as eplb's manager plans there: every copy priced (in seconds
with ``bytes_per_expert``, else eplb.policy.decision's fallback price) and against the forecast's
noise, so the move budget is spent only where it buys balance; the move budget itself comes from
the :class:`~eplb.policy.decision.Decider`'s allowance at each rebalance."""
ENGINE_DISPATCH = "dynamic"
"""The dispatch mode the adapters plan for: an engine's planner is not told how the engine splits
an expert's tokens over its replicas, so its plans are scored for an even split."""


def make_planner(
    algorithm: str,
    flag: str,
    defaults: Mapping[str, Any] | None = None,
    settings: EngineEnv | None = None,
) -> SolverPlanner:
    """The planner an adapter runs: ``algorithm`` as a server with the adapter's settings plans
    (eplb.solver.types.SolveOptions.from_config), with :data:`ENGINE_COPY_COST` (continuous mode:
    :data:`CONTINUOUS_COPY_COST`) and :data:`ENGINE_DISPATCH`, then ``defaults``, then the options of
    ``EPLB_SOLVER_OPTIONS`` (``settings``'s, else read from the environment now).

    Unknown algorithms or options raise ValueError naming ``flag`` or the variable, so a typo stops
    the engine at start-up instead of at its first rebalance.
    """
    check_policy_name(algorithm, flag)
    env = settings or EngineEnv()
    fields = (
        solver_options_from_env(defaults) if settings is None else {**(defaults or {}), **env.solver_options}
    )
    # The options read the flags' algorithm and mode, nothing of the topology (the Decider's).
    config = env.decision_config(num_gpus=1, num_nodes=1, interval=1, num_layers=None)
    try:
        options = SolveOptions.from_config(
            config,
            algorithm=algorithm,
            dispatch=ENGINE_DISPATCH,
            copy_cost=CONTINUOUS_COPY_COST if env.continuous else ENGINE_COPY_COST,
            # An engine's move budget is its Decider's allowance alone (continuous mode): a plan
            # made as the planner is (a degraded one) is not budgeted, the repair is not optional.
            move_budget=False,
            fields=fields,
        )
    except ValueError as exc:
        raise ValueError(f"{SOLVER_OPTIONS_ENV}: {exc}") from None
    return SolverPlanner(options=options)


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
    """One engine process's rebalance decisions for one model shape (eplb.policy.decision), and its
    own history of the windows the engine handed over.

    The engine calls its planner on every rank with the same inputs, so a :class:`Decider` kept
    per process decides alike on every rank: the first plan from an unfitted placement is a
    fresh one, later plans are migration-aware and priced, and the current placement's age
    counts in the engine's passes (``passes_per_rebalance`` per call: SGLang's window; for vLLM,
    whose policy sees one summed window per call, one). In continuous mode (``settings``) the
    Decider also holds the move allowance (the budget, the first unbudgeted plan, the shift
    burst), and each plan is made from the last ``history_rows`` rows the engine handed over
    (passes for SGLang, windows for vLLM), not only the newest window. Windows with no load (a
    profile run, an idle server) say nothing about the future and are not kept.
    """

    def __init__(
        self,
        *,
        num_gpus: int,
        num_nodes: int,
        num_layers: int,
        passes_per_rebalance: int,
        settings: EngineEnv | None = None,
        history_rows: int = 1,
        metrics: EngineMetrics | None = None,
    ) -> None:
        if history_rows < 1:
            raise ValueError(f"history_rows must be >= 1, got {history_rows}")
        self.settings = settings or EngineEnv()
        config = self.settings.decision_config(
            num_gpus=num_gpus, num_nodes=num_nodes, interval=passes_per_rebalance, num_layers=num_layers
        )
        self.decider = Decider(config)
        self.clock = RebalanceClock(config.rebalance_interval)
        """Passes counted so far: one call's window (``passes_per_rebalance``) each, each call a rebalance."""
        self.history_rows = history_rows
        self.metrics = metrics
        self._rows: list[np.ndarray] = []
        self.last_plan: EnginePlan | None = None

    def remember(self, window: Any) -> np.ndarray:
        """Add the engine's newest window ([W, L, E] or [L, E]) to the history; return the history
        [rows, L, E] the plan is made from (the window alone when it holds no load and nothing is kept)."""
        window_WLE = as_load_array(window)
        if window_WLE.any():
            self._rows.extend(window_WLE)
            del self._rows[: -self.history_rows]
        if not self._rows:
            return window_WLE
        return np.stack(self._rows)

    @property
    def kept_rows(self) -> int:
        """Rows of load in the history now."""
        return len(self._rows)

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
        alive: Any = None,
    ) -> EnginePlan:
        """One rebalance (:func:`plan_for_engine`) from the history with this process's decisions,
        reported to the metrics (rank 0 with ``EPLB_METRICS_PORT``). ``alive``: one flag per rank
        of ``current``; with a rank marked lost the plan is :func:`plan_degraded`'s, made whatever
        the decisions' screen says (the live placement uses a dead rank)."""
        newest_WLE = as_load_array(window)
        history_WLE = self.remember(newest_WLE)
        self.clock.count(self.clock.interval)
        counted = self.clock.begin()
        started = time.monotonic()
        if self.metrics is not None:
            self.metrics.solving(started)
        if alive is not None and not np.asarray(alive).astype(bool).all():
            if current is None:
                raise ValueError("a degraded plan (ranks lost) needs the live placement; none was given")
            plan = plan_degraded(
                history_WLE,
                alive=alive,
                num_physical=num_physical,
                num_groups=num_groups,
                planner=planner,
                current=current,
                decider=self.decider,
                counted_pass=counted,
            )
        else:
            plan = plan_for_engine(
                history_WLE,
                num_physical=num_physical,
                num_gpus=num_gpus,
                num_nodes=num_nodes,
                num_groups=num_groups,
                planner=planner,
                current=current,
                decider=self.decider,
                counted_pass=counted,
            )
        self.last_plan = plan
        if self.metrics is not None:
            live = current if current is not None and current.num_physical == num_physical else None
            self.metrics.report(
                RebalanceReport(
                    load_LE=newest_WLE.sum(axis=0),
                    live=live
                    or _trivial(newest_WLE.shape[1], newest_WLE.shape[2], num_gpus, num_physical, num_nodes),
                    placement=plan.placement,
                    applied=plan.applied,
                    failed=plan.failed,
                    reason=plan.reason,
                    solve_seconds=time.monotonic() - started,
                    copies=plan.copies,
                    bytes_per_expert=planner.options.bytes_per_expert,
                    predicted=plan.predicted,
                )
            )
        return plan


def _trivial(L: int, E: int, num_gpus: int, num_physical: int, num_nodes: int) -> Placement:
    return Placement.trivial(L, E, num_gpus, num_physical - E, even_nodes(num_gpus, num_nodes))


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
    """Plan from ``window`` ([W, L, E] or [L, E]) on the engine's topology, as the rebalance at
    ``counted_pass`` of ``decider`` (:class:`EngineDecisions`'; None: a fresh process's, of one
    window's passes): its screen (an empty window, one GPU), its planner (the first plan, the move
    allowance, the pricing), its verdict and its record (eplb.policy.decision).

    Nodes that do not divide the GPUs count as one node (vLLM does the same). With ``current``
    the plan is migration-aware and may keep ``current`` (``applied=False``) when moving does not
    pay; without one (or one of another shape) it is a fresh plan. A window with no load keeps
    ``current`` (or the trivial placement): there is nothing to plan from.
    """
    window_WLE = as_load_array(window)
    W, L, E = window_WLE.shape
    nodes = even_nodes(num_gpus, num_nodes)
    groups = num_groups if num_groups is not None and num_groups >= 1 else 1
    if current is not None and (current.num_physical, current.num_gpus, current.num_nodes) != (
        num_physical,
        num_gpus,
        nodes,
    ):
        current = None
    keep = current or _trivial(L, E, num_gpus, num_physical, nodes)
    topology = Topology(num_gpus=num_gpus, num_nodes=nodes, num_physical=num_physical, num_groups=groups)
    request = Request(
        window_WLE=window_WLE,
        current=current,
        planner=dataclasses.replace(planner, num_groups=groups, topology=topology),
    )
    load_LE = window_WLE.sum(axis=0)
    outcome = (decider or _fresh_decider(num_gpus, nodes, W, L)).rebalance(
        request,
        counted_pass=counted_pass,
        window_balancedness=float(model_balancedness(load_LE, keep)) if load_LE.any() else 1.0,
        num_gpus=num_gpus,
    )
    return _engine_plan(outcome, keep)


def plan_degraded(
    window: Any,
    *,
    alive: Any,
    num_physical: int,
    num_groups: int | None,
    planner: SolverPlanner,
    current: Placement,
    decider: Decider | None = None,
    counted_pass: int = 0,
) -> EnginePlan:
    """The degraded plan (eplb.solver.degraded) over the ranks of ``current`` that ``alive`` marks
    live, as the rebalance at ``counted_pass`` of ``decider`` (as :func:`plan_for_engine`).

    ``alive`` holds one flag per rank of ``current``. ``num_physical`` is the engine's slot count
    after the loss: every slot for SGLang (it keeps dead ranks' slots), the survivors' for vLLM (its
    scale-down drops them). The plan keeps every survivor's replica that balance allows and serves
    every expert; it is always applied (the live placement uses dead ranks) and planned with the
    planner as given (the repair is not optional: not budgeted). ``copies`` counts copies between
    survivors, ``reload`` what must come from elsewhere. ValueError when the sizes disagree or the
    survivors cannot hold every expert.
    """
    alive_G = check_alive(alive, current.num_gpus)
    live_slots = int(alive_G.sum()) * current.slots_per_gpu
    if num_physical not in (current.num_physical, live_slots):
        raise ValueError(
            f"{num_physical} physical slots asked for, but {int(alive_G.sum())} live ranks of "
            f"{current.slots_per_gpu} slots hold {live_slots} (of {current.num_physical})"
        )
    groups = num_groups if num_groups is not None and num_groups >= 1 else 1
    window_WLE = as_load_array(window)
    request = Request(
        window_WLE=window_WLE,
        current=current,
        planner=dataclasses.replace(planner, num_groups=groups),
        loss=RankLoss(alive_G=alive_G, prepared=False),
    )
    decider = decider or _fresh_decider(
        current.num_gpus, current.num_nodes, window_WLE.shape[0], current.num_layers
    )
    return _engine_plan(decider.rebalance(request, counted_pass=counted_pass), current)


def _fresh_decider(num_gpus: int, num_nodes: int, passes: int, num_layers: int) -> Decider:
    """A fresh process's decisions, rebalancing every ``passes`` (one window's)."""
    config = EngineEnv().decision_config(
        num_gpus=num_gpus, num_nodes=num_nodes, interval=passes, num_layers=num_layers
    )
    return Decider(config)


def _engine_plan(outcome: Outcome, keep: Placement) -> EnginePlan:
    """What ``outcome`` gives the engine: its plan when applied, else ``keep``."""
    plan = outcome.plan
    if not outcome.applied or plan is None:
        kept = None if plan is None else getattr(plan, "stats", {}).get("current_balancedness")
        return EnginePlan(
            placement=keep,
            applied=False,
            reason=outcome.reason,
            predicted=None if kept is None else float(kept),
            solve_seconds=outcome.solve_seconds,
            failed=outcome.cause == SHAPE,
        )
    report = outcome.reload
    return EnginePlan(
        placement=plan.placement,
        applied=True,
        reason=outcome.reason,
        copies=outcome.copies if report is None else report.survivor_copies,
        predicted=plan.predicted_balancedness,
        solve_seconds=outcome.solve_seconds,
        degraded=outcome.degraded,
        reload=report,
    )
