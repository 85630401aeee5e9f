"""Every rebalance decision, in one place: the path every caller takes (screen the window, plan,
judge, record), the first plan, the move allowance and its shift burst, and apply or skip.

Shape legend: W window (passes), L layers, E logical experts, P physical slots, G GPUs, R max
replicas.

The manager, the simulator (periodic, continuous, lost ranks), ``eplb solve`` and the engine
adapters each hold one :class:`Decider` and go through it at every rebalance, nothing else:
:meth:`Decider.rebalance` in one call, or step by step through the :class:`Rebalance` that
:meth:`Decider.open` returns (the manager screens on every rank, plans on rank 0's thread and
records on every rank once the swap ended); the manager's recovery from a lost rank, between
rebalances, plans and judges its degraded plan with :func:`plan_and_judge`. :meth:`Rebalance.screen` (an
empty window, one GPU, SGLang's ``--eplb-min-rebalancing-utilization-threshold``), then
:meth:`Rebalance.plan` (the first plan since start-up moves without the move budget, the
allowance's budgets, the :class:`Pricing` the plan is judged by; planning reads what
:meth:`Decider.open` took from the Decider and changes nothing), then :meth:`Rebalance.close`
(what the rebalance moved: the only step that changes the Decider). The typed :class:`Outcome`
says what was decided.

Apply or skip is :func:`judge`'s answer on a plan's :class:`Facts`, for every case:
``eplb.solver.solve`` computes the facts of its plans (the gate in seconds, one GPU, no current
placement, a budget that dropped every changed layer, a degraded plan) and the planning step those
of the rest (a transfer still in flight, a rank lost, a hand-written planner's own verdict). A
priced plan is applied when the modeled MoE time it saves over the passes it serves (its
calibrated prediction against the current placement's, through the pass-time model of
eplb.policy.cost_model) exceeds the modeled cost of its transfer at the configured rate (a stall
in periodic mode; the passes' interference, and a stall only past their time, when the swap runs
beside them), as the simulator charges it. :func:`copy_price` turns one expert copy into the
balancedness it must buy, so the search and the judge agree on what pays. Every input is a count
every rank agrees on: the ranks decide alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np

from eplb.config import SHIFT_BURST, EplbConfig
from eplb.placement.degraded import DegradedPlacement, ReloadReport, reload_report
from eplb.placement.diff import PlacementDiff, diff_placements
from eplb.placement.model import Placement
from eplb.policy.base import LoadHistory, PlanLike, Planner
from eplb.policy.cost_model import CostModel, PassTimes, TransferCost, transfer_cost
from eplb.policy.plan_check import SHAPE, plan_problems, shape_reason

PERSISTENCE_PASSES = 1000
"""Passes a migration-aware plan's moves are valued over, when the interval is shorter: the next
plan starts from this one, so a move keeps serving until the load drifts away from it (on the
drifting workloads a fitted placement still holds about half of its gain over the unbalanced one
850 passes after its data ended, docs/solver.md)."""
ONE_GPU = "one GPU holds every expert: every placement is perfectly balanced, there is nothing to plan"
"""Why a one-GPU (one-rank) setup plans nothing: mean / max GPU load is 1 for any placement."""
FALLBACK_COPY_PRICE = 0.002
"""Balancedness of its layer one expert copy must buy when the bytes of an expert are unknown
(``bytes_per_expert`` 0, as in the engine adapters): the price the solver used before plans were
priced in seconds."""


@dataclass(frozen=True, kw_only=True)
class Pricing:
    """What a plan's passes are worth and what its transfer costs (eplb.policy.cost_model)."""

    horizon_passes: int | None = None
    """Passes the plan serves until the next rebalance (the interval); None: the window's length."""
    current_age_passes: int | None = None
    """Passes since the data the current placement was fitted to ended (at the window's end); None:
    nobody fitted it (the trivial placement), so it does not decline as the load drifts."""
    beside_passes: bool = False
    """The swap runs beside the following passes (continuous mode): it costs interference, and a
    stall only for the part the passes before the next rebalance do not cover. False: serving
    stalls for the whole transfer (periodic mode)."""
    transfer_gbps: float | None = None
    """Pace of a swap beside the passes, GB/s into one GPU (None: link speed)."""
    cost: CostModel = field(default_factory=CostModel)
    """The pass-time and transfer model."""

    def __post_init__(self) -> None:
        if self.horizon_passes is not None and self.horizon_passes < 1:
            raise ValueError(f"horizon_passes must be None or >= 1, got {self.horizon_passes}")
        if self.current_age_passes is not None and self.current_age_passes < 0:
            raise ValueError(f"current_age_passes must be None or >= 0, got {self.current_age_passes}")
        if self.transfer_gbps is not None and not (
            np.isfinite(self.transfer_gbps) and self.transfer_gbps > 0
        ):
            raise ValueError(f"transfer_gbps must be None or a finite number > 0, got {self.transfer_gbps}")

    def transfer(self, diff: PlacementDiff, *, horizon: int, pass_seconds: float) -> TransferCost:
        """What ``diff`` costs here (eplb.policy.cost_model.transfer_cost)."""
        return transfer_cost(
            self.cost,
            diff,
            beside_passes=self.beside_passes,
            gbps=self.transfer_gbps,
            horizon=horizon,
            pass_seconds=pass_seconds,
        )


def value_horizon(horizon: int, migration_aware: bool) -> int:
    """Passes a plan's gain is counted over: its ``horizon``, or for a migration-aware policy at
    least :data:`PERSISTENCE_PASSES` (its moves outlive the next rebalance)."""
    return max(horizon, PERSISTENCE_PASSES) if migration_aware else horizon


def copy_price(
    times: PassTimes,
    pricing: Pricing,
    *,
    balancedness: float,
    num_layers: int,
    bytes_per_expert: int,
    num_gpus: int,
    num_nodes: int,
    horizon: int,
) -> float:
    """The balancedness of its layer one expert copy across GPUs must buy to pay for itself.

    One copy costs its share of the busiest receiver's link time (an expert's bytes over the
    links into one of ``num_gpus`` GPUs, a copy from a random other GPU crossing nodes with
    probability (N - 1) / N), or the interference of that time beside the passes. A layer's
    balancedness gain ``x`` saves ``horizon * seconds_per_balancedness * x / L`` seconds
    (``horizon``: the passes the gain is counted over, :func:`value_horizon`).
    """
    if bytes_per_expert <= 0:
        return FALLBACK_COPY_PRICE
    cost = pricing.cost
    cross = (num_nodes - 1) / num_nodes
    pace = np.inf if pricing.transfer_gbps is None or not pricing.beside_passes else pricing.transfer_gbps
    seconds_per_byte = cross / (min(cost.internode_gbps, pace) * 1e9) + (1 - cross) / (
        min(cost.nvlink_gbps, pace) * 1e9
    )
    seconds = bytes_per_expert * seconds_per_byte / num_gpus
    if pricing.beside_passes:
        slowdown = cost.interference_slowdown(pricing.transfer_gbps)
        seconds *= slowdown / (1.0 + slowdown)
    value = horizon * times.seconds_per_balancedness(balancedness) / num_layers
    return float(seconds / value) if value > 0 else FALLBACK_COPY_PRICE


VLLM_IN_FLIGHT = "vLLM's asynchronous rearrangement of the previous plan is still moving layers"
"""Why a rebalance is skipped under vLLM's swap: its ``EplbState.step`` does not rearrange while one runs."""
NO_CURRENT = "no current placement"
"""Why a plan made without a live placement (a fresh one) is applied: there is nothing to keep."""


@dataclass(frozen=True)
class Verdict:
    """:func:`judge`'s answer: apply the plan or keep the current placement, and why."""

    apply: bool
    reason: str
    saved_seconds: float | None = None
    """Modeled MoE seconds the plan saves over the passes it serves (after any delay); None: not
    priced (a case decided before the gate in seconds)."""
    cost_seconds: float | None = None
    """Modeled cost of its transfer (None: not priced)."""


@dataclass(frozen=True, kw_only=True)
class LostRanks:
    """What a degraded plan (ranks lost, eplb.solver.degraded) reloads and copies."""

    ranks: tuple[int, ...]
    """The lost ranks (GPUs of the live placement)."""
    reloads: int
    """Expert replicas reloaded (every replica of the expert was on a lost rank)."""
    reload_source: str
    """Where they are reloaded from (peer | host | checkpoint)."""
    survivor_copies: int
    """Expert copies between survivors."""
    rebalanced: bool | None = None
    """Whether the survivors' plan beyond the repair passed its own verdict (eplb's solver: the
    degraded plan's words say so); None: the planner worded its degraded plan itself
    (:attr:`Facts.proposed`)."""
    repair_reason: str = ""
    """Why the survivors' plan did not pass (the repair alone is applied)."""


@dataclass(frozen=True, kw_only=True)
class Facts:
    """What :func:`judge` decides on: the cases that decide a rebalance without pricing, and what
    the plan is worth and costs (the gate in seconds). Each field's default is "not the case"."""

    in_flight: bool = False
    """A transfer of the previous plan is still moving (vLLM's asynchronous swap): skipped, no plan made."""
    lost: LostRanks | None = None
    """Ranks lost: the plan is the degraded plan, always applied (the live placement uses a dead rank)."""
    proposed: Verdict | None = None
    """The verdict the planner gave its plan: a hand-written planner's own, or eplb's solver's
    (which :func:`judge` gave). It stands, but for a degraded plan, always applied."""
    one_gpu: bool = False
    """One GPU holds every expert: every placement is perfectly balanced (:data:`ONE_GPU`)."""
    no_current: bool = False
    """No current placement: the plan is a fresh one, applied (:data:`NO_CURRENT`)."""
    diff: PlacementDiff | None = None
    """The transfer from the current placement."""
    budget_dropped_layers: int = 0
    """Layers of the policy's plan the move budget dropped (eplb.solver.search.budget.fit_layers):
    with every changed layer dropped the plan is skipped, naming the budget."""
    policy: str = ""
    """The policy's name, for the words of a plan the budget emptied."""
    max_moved_experts: int | None = None
    """The move budgets that emptied it (``SolveOptions.max_moved_experts``, ``max_bytes_moved``)."""
    max_bytes_moved: int | None = None
    predicted: float = 0.0
    """The calibrated prediction of the plan over the next ``pricing.horizon_passes``
    (eplb.solver.scoring.horizon)."""
    current: float = 0.0
    """... and of the current placement."""
    gain_passes: int = 1
    """Passes the plan's gain is counted over (:func:`value_horizon`)."""
    pricing: Pricing = field(default_factory=Pricing)
    """The horizon it serves (``horizon_passes``) and the transfer model."""
    times: PassTimes | None = None
    """The pass-time model of the window."""
    priced: bool = True
    """False: the policy's plans are applied whenever they change something (DeepSeek's, as SGLang applies it)."""
    min_gain: float = 0.0
    """A priced plan whose predicted gain is below this is skipped, whatever it saves."""
    noise_price: float = 0.0
    """Balancedness of one of the ``num_layers`` layers the search charged each copy
    (eplb.solver.types.SolveOptions.noise_price_passes over the horizon)."""
    num_layers: int = 1


def judge(facts: Facts) -> Verdict:
    """Apply or skip, for every rebalance, in this order: a transfer in flight skips; a degraded
    plan is applied; a planner's own verdict stands; one GPU skips; a fresh plan (no current
    placement) is applied; a plan the move budget emptied skips; the rest go to the gate in
    seconds.

    The gate: ``facts.predicted`` and ``facts.current`` are the calibrated predictions
    (eplb.solver.scoring.horizon) of the plan and of the current placement over the next
    ``pricing.horizon_passes``. The plan saves what the pass-time model gives for that difference
    on each of the ``gain_passes`` it is counted over (:func:`value_horizon`), less the passes
    served on the old placement while its swap runs beside them. Moving costs its transfer
    (eplb.policy.cost_model.transfer_cost), or, when larger, the ``noise_price`` the search
    charged each copy in the same seconds: a move that chases the forecast's noise is moved back
    later, so the gate and the search agree on what pays. An unpriced policy (DeepSeek's, applied
    as SGLang applies it) is applied whenever it changes something.
    """
    if facts.in_flight:
        return Verdict(False, VLLM_IN_FLIGHT)
    if facts.lost is not None:
        return Verdict(True, _degraded_words(facts.lost, facts.proposed))
    if facts.proposed is not None:
        return facts.proposed
    if facts.one_gpu:
        return Verdict(False, ONE_GPU)
    if facts.no_current:
        return Verdict(True, NO_CURRENT)
    diff, times = facts.diff, facts.times
    assert diff is not None and times is not None, "a plan from a current placement has a diff and pass times"
    if diff.num_changed_slots == 0 and facts.budget_dropped_layers > 0:
        return Verdict(
            False,
            f"no changed layer of the {facts.policy} plan fits within the budget "
            f"(max_moved_experts={facts.max_moved_experts}, max_bytes_moved={facts.max_bytes_moved})",
        )
    return _gate(facts, diff, times)


def _degraded_words(lost: LostRanks, proposed: Verdict | None) -> str:
    """Why a degraded plan is applied: what it reloads and copies and whether the survivors'
    plan went beyond the repair, or its planner's own words."""
    if lost.rebalanced is None:
        assert proposed is not None, "a degraded plan is worded by its planner or by what it moves"
        return proposed.reason
    return (
        f"degraded: rank(s) {list(lost.ranks)} lost; {lost.reloads} expert replicas reloaded from "
        f"{lost.reload_source}, {lost.survivor_copies} copied from survivors; "
        + ("rebalanced beyond the repair" if lost.rebalanced else f"repair only ({lost.repair_reason})")
    )


def _gate(facts: Facts, diff: PlacementDiff, times: PassTimes) -> Verdict:
    """The gate in seconds (:func:`judge`)."""
    predicted, current, pricing = facts.predicted, facts.current, facts.pricing
    gain = predicted - current
    if diff.num_changed_slots == 0:
        return Verdict(False, "the plan equals the current placement", 0.0, 0.0)
    move = pricing.transfer(
        diff, horizon=pricing.horizon_passes or 1, pass_seconds=times.pass_seconds(current)
    )
    served = max(facts.gain_passes - move.delay_passes, 0)
    saved = served * (times.token_seconds(current) - times.token_seconds(predicted))
    noise = (
        diff.experts_moved_across_gpus
        * facts.noise_price
        / max(facts.num_layers, 1)
        * served
        * times.seconds_per_balancedness(current)
    )
    cost = max(move.seconds, noise)
    words = (
        f"predicted next {pricing.horizon_passes} passes {current:.4f} -> {predicted:.4f} ({gain:+.4f}); "
        f"over {served} passes it saves {saved * 1e3:.1f} ms of MoE time, moving "
        f"{diff.experts_moved_across_gpus} expert copies costs {cost * 1e3:.1f} ms"
        + (" (their noise price)" if noise > move.seconds else "")
    )
    if not facts.priced:
        return Verdict(True, words + " (the policy's plans are applied unpriced)", saved, cost)
    if gain < facts.min_gain:
        return Verdict(False, words + f"; gain below min_gain {facts.min_gain}", saved, cost)
    if saved <= cost:
        return Verdict(False, words + "; it does not pay", saved, cost)
    return Verdict(True, words, saved, cost)


class MoveAllowance:
    """Continuous mode's move budget as a rate: ``rate`` copies per rebalance on average.

    A plan may move at most ``budget()`` copies, or ``shift_budget()`` when the solver sees a
    domain shift in the window (``SolveOptions.shift_decline``): up to ``burst`` rebalances'
    budgets at once. What a plan moves over ``rate`` is a debt that the following budgets repay
    (``record``), so the copies moved over any run stay within ``rate`` per rebalance plus one
    burst. Load after a shift has moved far from the placement and every copy buys much more
    then than in steady state, where the budget binds at every rebalance (docs/solver.md). The
    state changes only with the plans every rank applies, so every rank computes the same
    budgets. The first plan from an unfitted placement is not counted.
    """

    def __init__(self, rate: int, burst: int = SHIFT_BURST) -> None:
        if rate < 0 or burst < 1:
            raise ValueError(f"move allowance needs rate >= 0 and burst >= 1, got {rate} and {burst}")
        self.rate, self.burst = rate, burst
        self.debt = 0.0
        """Copies moved beyond ``rate`` per rebalance, not yet repaid."""

    def budget(self) -> int:
        """Copies the next plan may move."""
        return max(0, int(self.rate - self.debt))

    def shift_budget(self) -> int:
        """Copies the next plan may move when the window shows a shift."""
        return max(self.budget(), int(self.rate * self.burst - self.debt))

    def record(self, copies: float) -> None:
        """One rebalance ended having moved ``copies`` (0: skipped)."""
        self.debt = max(0.0, self.debt + copies - self.rate)


# ---- the rebalance path: screen, plan, judge, record ----------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RankLoss:
    """Ranks lost: the rebalance is the degraded plan over the survivors (eplb.solver.degraded)."""

    alive_G: np.ndarray
    """bool [G]: the GPUs of the current placement still alive."""
    reload_source: str | None = None
    """Where experts lost with every replica are reloaded from (peer | host | checkpoint); None:
    the planner's own setting (a hand-written planner's report: checkpoint)."""
    prepared: bool = True
    """Plan it as this rebalance's plan, with the Decider's fresh plan, budgets and pricing
    (:meth:`Rebalance.prepared`), as the simulator's lost-rank runs do; False: with the planner
    as given, as the engine adapters and the manager's recovery plan the repair (between
    rebalances, with the options the planner was built with)."""


@dataclass(frozen=True, kw_only=True)
class Request:
    """What one rebalance plans from, and with which planner."""

    window_WLE: np.ndarray
    """float/int [W, L, E]: the window (summed over ranks), oldest pass first."""
    current: Placement | None
    """The live placement; None: none the engine can plan from, so the plan is a fresh one on
    the planner's own topology (its ``plan_fresh``: ``eplb.solver.SolverPlanner`` with a topology)."""
    planner: Planner
    """The caller's planner: eplb's solver (``eplb.solver.SolverPlanner``) or a hand-written one."""
    history: LoadHistory | None = None
    """Recorded passes before the window, where the caller has them (the simulator)."""
    loss: RankLoss | None = None
    """Ranks lost: plan the degraded plan (None: every rank serves)."""
    bytes_per_expert: int = 0
    """Bytes of one expert's weights in one layer: the bytes of the plan's diff, and of the
    reload report of a degraded plan whose planner makes none."""


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """What one rebalance decided, as every caller reads it."""

    applied: bool
    """Apply the plan (False: keep the current placement)."""
    reason: str
    """Why, in words (:func:`judge`'s reason, or the screen's)."""
    plan: PlanLike | None = None
    """The planner's plan; None: none was made (screened out, or a transfer in flight)."""
    planner: Planner | None = None
    """The planner as this rebalance prepared it (its options carry the budgets and pricing)."""
    diff: PlacementDiff | None = None
    """The transfer from the current placement, when an applied plan has one (bytes at
    ``Request.bytes_per_expert``)."""
    copies: int = 0
    """What the rebalance moves when applied, as the move allowance counts it: expert copies
    across GPUs; for a degraded plan, its reloads and its copies between survivors."""
    degraded: DegradedPlacement | None = None
    """A degraded plan in the live placement's slot numbering (dead slots -1)."""
    reload: ReloadReport | None = None
    """A degraded plan's reloads and copies."""
    solve_seconds: float = 0.0
    """Wall time of the planner (for reports only: nothing decides on it)."""
    cause: str | None = None
    """``shape`` (eplb.policy.plan_check.SHAPE) when the planner's plan does not fit the model:
    not applied, and ``plan`` None so that no caller acts on it; else None."""

    @property
    def placement(self) -> Placement | None:
        """The plan's placement (a degraded plan's: over the survivors); None: no plan."""
        return None if self.plan is None else self.plan.placement

    @property
    def weights_LER(self) -> np.ndarray | None:
        """float [L, E, R] dispatch weights of the plan, or None."""
        return None if self.plan is None else self.plan.dispatch_weights_LER

    @property
    def predicted(self) -> float | None:
        """The plan's predicted balancedness over the passes it serves (None: no plan, or none made)."""
        return None if self.plan is None else self.plan.predicted_balancedness


def _fresh_model(planner: object, window_WLE: np.ndarray) -> Placement | None:
    """The model a fresh plan must fit: the window's layers and experts on the planner's topology
    (None where the planner has none, or it cannot hold the experts: its plan then fails itself)."""
    topology = getattr(planner, "topology", None)
    if topology is None or np.ndim(window_WLE) != 3:
        return None
    _, L, E = np.shape(window_WLE)
    try:
        return Placement.trivial(L, E, topology.num_gpus, topology.num_physical - E, topology.num_nodes)
    except ValueError:
        return None


def plan_and_judge(request: Request) -> Outcome:
    """The plan and judge steps of one rebalance with ``request``'s planner as it is.

    From a current placement, ``planner(window, current[, history])``; without one, the
    planner's fresh plan on its topology; with ranks lost, the planner's degraded plan (its
    ``for_lost_ranks``; a planner without it is asked as it is, set up for the loss by its
    caller). The verdict is :func:`judge`'s on the plan's own verdict (and the loss); a plan
    that does not fit the model (the live placement's, or a fresh plan's window on the planner's
    topology; eplb.policy.plan_check) is not applied, with cause ``shape`` and no plan. Changes nothing but what it returns: it may run on a
    thread of its own.
    """
    planner, current, loss = request.planner, request.current, request.loss
    if loss is not None:
        if current is None:
            raise ValueError("a degraded plan (ranks lost) needs the live placement; none was given")
        lose = getattr(planner, "for_lost_ranks", None)
        if lose is not None:
            planner = lose(tuple(bool(a) for a in loss.alive_G), loss.reload_source)
    started = time.perf_counter()
    if current is None:
        fresh = getattr(planner, "plan_fresh", None)
        if fresh is None:
            raise ValueError(
                "no current placement: the planner must plan fresh on a topology of its own "
                "(plan_fresh, e.g. eplb.solver.SolverPlanner with a topology)"
            )
        plan: PlanLike = fresh(request.window_WLE)
    elif request.history is None:
        plan = planner(request.window_WLE, current)
    else:
        plan = planner(request.window_WLE, current, request.history)
    seconds = time.perf_counter() - started
    model = current if current is not None else _fresh_model(planner, request.window_WLE)
    if loss is None and model is not None:
        problems = plan_problems(plan.placement, plan.dispatch_weights_LER, model)
        if problems:  # never applied, never diffed: the caller's run goes on
            return Outcome(
                applied=False,
                reason=shape_reason(problems),
                planner=planner,
                cause=SHAPE,
                solve_seconds=seconds,
            )
    proposed = Verdict(plan.apply, plan.reason)
    if loss is None or current is None:
        verdict = judge(Facts(proposed=proposed))
        diff = None
        if verdict.apply and current is not None:
            diff = diff_placements(current, plan.placement, request.bytes_per_expert)
        copies = 0 if diff is None else diff.experts_moved_across_gpus
        return Outcome(
            applied=verdict.apply,
            reason=verdict.reason,
            plan=plan,
            planner=planner,
            diff=diff,
            copies=copies,
            solve_seconds=seconds,
        )
    degraded: DegradedPlacement | None = getattr(plan, "degraded", None)
    if degraded is None:
        degraded = DegradedPlacement.from_survivors(plan.placement, loss.alive_G, current.num_nodes)
    report: ReloadReport | None = getattr(plan, "reload", None)
    if report is None:
        source = loss.reload_source or "checkpoint"
        report = reload_report(current, degraded, source, request.bytes_per_expert)
    lost = LostRanks(
        ranks=tuple(np.flatnonzero(~np.asarray(loss.alive_G, dtype=bool)).tolist()),
        reloads=report.reloads,
        reload_source=report.source,
        survivor_copies=report.survivor_copies,
    )
    verdict = judge(Facts(lost=lost, proposed=proposed))
    return Outcome(
        applied=verdict.apply,
        reason=verdict.reason,
        plan=plan,
        planner=planner,
        copies=report.reloads + report.survivor_copies,
        degraded=degraded,
        reload=report,
        solve_seconds=seconds,
    )


class Decider:
    """One server's rebalance decisions (build one per rank, or per simulated run, from its flags).

    Everything it keeps changes only with the rebalances every rank takes alike (the counted
    passes, the plans applied), so every rank decides the same on the same pass.
    """

    def __init__(self, config: EplbConfig, *, fitted: bool = False, cost: CostModel | None = None) -> None:
        self.config = config
        self.cost = cost or CostModel()
        self.fitted = fitted
        """A plan was applied since start-up, or the server started from a given placement."""
        self.fitted_at: int | None = None
        """Counted pass at which the data of the placement in use ended (its age's origin);
        None: nobody fitted it here (the trivial placement, or one given at start-up)."""
        budget = config.max_moved_experts
        self.allowance = (
            MoveAllowance(budget, config.eplb_shift_burst)
            if config.continuous and budget is not None
            else None
        )
        """Continuous mode's move budget as a rate, a burst on a shift (None: no allowance)."""

    @property
    def first_plan(self) -> bool:
        """Whether the next plan is the unbudgeted first one (eplb.config.initial_full_plan_on)."""
        return self.config.initial_full_plan and not self.fitted

    def screen(
        self,
        *,
        window_passes: int,
        window_load: float,
        window_balancedness: float,
        num_gpus: int | None = None,
    ) -> str | None:
        """Why no plan is made at this rebalance (None: plan). ``window_balancedness``: the summed
        window under the live placement, as the server dispatches. ``num_gpus``: the GPUs that
        placement spans, where the caller knows them: with one there is nothing to balance
        (:data:`ONE_GPU`; eplb.solver.solve's facts say the same to a caller that plans anyway)."""
        if num_gpus == 1:
            return ONE_GPU
        if window_passes == 0 or window_load <= 0:
            return "the window holds no load"
        threshold = self.config.eplb_min_rebalancing_utilization_threshold
        if window_balancedness > threshold:
            return f"window balancedness {window_balancedness:.4f} above threshold {threshold}"
        return None

    def pricing(self, counted_pass: int) -> Pricing:
        """The pricing of a plan made at ``counted_pass`` (its window ends there)."""
        config = self.config
        age = None if self.fitted_at is None else max(counted_pass - self.fitted_at, 0)
        return Pricing(
            horizon_passes=config.rebalance_interval,
            current_age_passes=age,
            beside_passes=config.continuous,
            transfer_gbps=config.eplb_transfer_gbps,
            cost=self.cost,
        )

    def open(self, *, counted_pass: int) -> Rebalance:
        """The rebalance whose window ends at ``counted_pass``, with what it takes from this
        Decider now (the first plan, the allowance's budgets, the pricing)."""
        return Rebalance(self, counted_pass)

    def planner(self, base: Planner, *, counted_pass: int) -> Planner:
        """``base`` as the rebalance at ``counted_pass`` would plan with it (:meth:`Rebalance.prepared`)."""
        return self.open(counted_pass=counted_pass).prepared(base)

    def rebalance(
        self,
        request: Request,
        *,
        counted_pass: int,
        window_balancedness: float = float("nan"),
        num_gpus: int | None = None,
        in_flight: bool = False,
    ) -> Outcome:
        """One whole rebalance at ``counted_pass``: with a transfer ``in_flight``, skipped; with
        ranks lost, the degraded plan whatever the screen says (the live placement uses a dead
        rank); else screened (``window_balancedness`` and ``num_gpus`` as :meth:`screen` takes
        them), planned and judged; then recorded."""
        rebalance = self.open(counted_pass=counted_pass)
        if in_flight:
            outcome = rebalance.in_flight()
        elif request.loss is not None:
            outcome = rebalance.plan(request)
        else:
            screened = rebalance.screen(
                request.window_WLE, window_balancedness=window_balancedness, num_gpus=num_gpus
            )
            outcome = screened or rebalance.plan(request)
        rebalance.close(applied=outcome.applied, copies=outcome.copies)
        return outcome

    def record(self, *, counted_pass: int, applied: bool, copies: float) -> None:
        """The rebalance planned at ``counted_pass`` ended: ``applied`` (all its layers swapped in)
        having moved ``copies`` expert copies across GPUs, or not (skipped or failed: 0)."""
        if self.allowance is not None:
            # The first plan is not counted against the allowance.
            self.allowance.record(copies if applied and not self.first_plan else 0.0)
        if applied:
            self.fitted = True
            self.fitted_at = counted_pass


class Rebalance:
    """One rebalance of a :class:`Decider`, step by step: :meth:`screen` (on every rank),
    :meth:`plan` (possibly on a thread: it reads only what :meth:`Decider.open` took), then
    :meth:`close` once with what was applied (the only step that changes the Decider)."""

    def __init__(self, decider: Decider, counted_pass: int) -> None:
        self.decider = decider
        self.counted_pass = counted_pass
        """Counted pass at which the window ends."""
        self.fresh = not decider.fitted
        """From a placement nobody fitted: a fresh plan (the planner's ``for_unfitted_placement``)."""
        self.first_plan = decider.first_plan
        """The unbudgeted first plan since start-up."""
        allowance = decider.allowance
        self.budgets: tuple[int, int | None] | None = None
        """The allowance's (budget, shift budget) for this plan (None: no allowance applies)."""
        if not self.first_plan and allowance is not None:
            shift = allowance.shift_budget() if allowance.burst > 1 else None
            self.budgets = (allowance.budget(), shift)
        self.pricing = decider.pricing(counted_pass)
        self.closed = False

    def prepared(self, base: Planner) -> Planner:
        """The planner of this rebalance: from a placement nobody fitted, a fresh plan (``base``'s
        ``for_unfitted_placement``, without the move budget for the first plan); else with the
        allowance's budgets (its ``with_move_budget``); and with this rebalance's :class:`Pricing`
        (its ``with_pricing``). Planners without those methods are used as they are."""
        planner = base
        if self.fresh:
            fresh = getattr(planner, "for_unfitted_placement", None)
            if fresh is not None:
                planner = fresh(drop_budget=self.first_plan)
        if self.budgets is not None:
            set_budget = getattr(planner, "with_move_budget", None)
            if set_budget is not None:
                planner = set_budget(*self.budgets)
        set_pricing = getattr(planner, "with_pricing", None)
        return planner if set_pricing is None else set_pricing(self.pricing)

    def screen(
        self, window_WLE: np.ndarray, *, window_balancedness: float, num_gpus: int | None = None
    ) -> Outcome | None:
        """The skipped outcome when no plan is made on ``window_WLE`` (:meth:`Decider.screen`), or
        None: plan. Every rank screens the same agreed window alike."""
        why_not = self.decider.screen(
            window_passes=int(window_WLE.shape[0]),
            window_load=float(np.asarray(window_WLE).sum(dtype=np.float64)),
            window_balancedness=window_balancedness,
            num_gpus=num_gpus,
        )
        return None if why_not is None else Outcome(applied=False, reason=why_not)

    def in_flight(self) -> Outcome:
        """The previous plan's transfer still moves (vLLM's swap): skipped, no plan made."""
        verdict = judge(Facts(in_flight=True))
        return Outcome(applied=verdict.apply, reason=verdict.reason)

    def plan(self, request: Request) -> Outcome:
        """Plan and judge (:func:`plan_and_judge`) with this rebalance's planner (:meth:`prepared`;
        a loss planned as given, :attr:`RankLoss.prepared`). Changes nothing: it may run on a
        thread of its own while serving goes on."""
        if request.loss is None or request.loss.prepared:
            request = replace(request, planner=self.prepared(request.planner))
        return plan_and_judge(request)

    def close(self, *, applied: bool, copies: float) -> None:
        """The rebalance ended (:meth:`Decider.record`): ``applied`` having moved ``copies``
        (skipped or failed: not applied)."""
        assert not self.closed, "a rebalance is closed once"
        self.closed = True
        self.decider.record(counted_pass=self.counted_pass, applied=applied, copies=copies)
