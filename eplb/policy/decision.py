"""Every rebalance decision, in one place: when to plan, the first plan, the move allowance and
its shift burst, and apply or skip, in seconds.

Shape legend: W window (passes), L layers, E logical experts, P physical slots, G GPUs.

The manager, the simulator and the engine adapters each hold one :class:`Decider` and call it
at every rebalance: :meth:`Decider.screen` (an empty window, or SGLang's
``--eplb-min-rebalancing-utilization-threshold``), :meth:`Decider.planner` (the first plan since
start-up moves without the move budget, the allowance's budgets, and the :class:`Pricing` the
plan is judged by), :meth:`Decider.record` (what the rebalance moved). The apply/skip decision
itself is :func:`gate`, which ``eplb.solver.solve`` calls on every plan: a plan is applied when
the modeled MoE time it saves over the passes it serves (its calibrated prediction against the
current placement's, through the pass-time model of eplb.policy.cost_model) exceeds the modeled
cost of its transfer at the configured rate (a stall in periodic mode; the passes' interference,
and a stall only past their time, when the swap runs beside them), as the simulator charges it.
:func:`copy_price` turns one expert copy into the balancedness it must buy, so the search and the
gate agree on what pays. Every input is a count every rank agrees on: the ranks decide alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from eplb.config import SHIFT_BURST, EplbConfig
from eplb.placement.diff import PlacementDiff
from eplb.policy.base import Planner
from eplb.policy.cost_model import CostModel, PassTimes, TransferCost, transfer_cost

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


@dataclass(frozen=True)
class Verdict:
    """The gate's answer."""

    apply: bool
    reason: str
    saved_seconds: float
    """Modeled MoE seconds the plan saves over the passes it serves (after any delay)."""
    cost_seconds: float
    """Modeled cost of its transfer."""


def gate(
    *,
    predicted: float,
    current: float,
    gain_passes: int,
    diff: PlacementDiff,
    pricing: Pricing,
    times: PassTimes,
    priced: bool,
    min_gain: float = 0.0,
    noise_price: float = 0.0,
    num_layers: int = 1,
) -> Verdict:
    """Apply or skip, by the net modeled seconds (``priced``) or whenever it changes something.

    ``predicted`` and ``current``: the calibrated predictions (eplb.solver.scoring.horizon) of the plan
    and of the current placement over the next ``pricing.horizon_passes``. The plan saves what
    the pass-time model gives for that difference on each of the ``gain_passes`` it is counted
    over (:func:`value_horizon`), less the passes served on the old placement while its swap
    runs beside them. Moving costs its transfer (eplb.policy.cost_model.transfer_cost), or, when
    larger, the ``noise_price`` the search charged each copy (balancedness of one of the
    ``num_layers`` layers, eplb.solver.types.SolveOptions.noise_price_passes) in the same seconds:
    a move that chases the forecast's noise is moved back later, so the gate and the search agree
    on what pays. An unpriced policy (DeepSeek's, applied as SGLang applies it) is applied
    whenever it changes something.
    """
    gain = predicted - current
    if diff.num_changed_slots == 0:
        return Verdict(False, "the plan equals the current placement", 0.0, 0.0)
    move = pricing.transfer(
        diff, horizon=pricing.horizon_passes or 1, pass_seconds=times.pass_seconds(current)
    )
    served = max(gain_passes - move.delay_passes, 0)
    saved = served * (times.token_seconds(current) - times.token_seconds(predicted))
    noise = (
        diff.experts_moved_across_gpus
        * noise_price
        / max(num_layers, 1)
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
    if not priced:
        return Verdict(True, words + " (the policy's plans are applied unpriced)", saved, cost)
    if gain < min_gain:
        return Verdict(False, words + f"; gain below min_gain {min_gain}", saved, cost)
    if saved <= cost:
        return Verdict(False, words + "; it does not pay", saved, cost)
    return Verdict(True, words, saved, cost)


# ---- when to plan, the first plan, the move allowance --------------------------------------------


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
        (:data:`ONE_GPU`; eplb.solver.solve says the same to a caller that plans anyway)."""
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

    def planner(self, base: Planner, *, counted_pass: int) -> Planner:
        """The planner of the rebalance at ``counted_pass``: from a placement nobody fitted, a
        fresh plan (``base``'s ``for_unfitted_placement``, without the move budget for the first
        plan of :attr:`first_plan`); else with the allowance's budgets (its ``with_move_budget``);
        and with this rebalance's :class:`Pricing` (its ``with_pricing``). Planners without those
        methods are used as they are."""
        planner = base
        if not self.fitted:
            fresh = getattr(planner, "for_unfitted_placement", None)
            if fresh is not None:
                planner = fresh(drop_budget=self.first_plan)
        if not self.first_plan and self.allowance is not None:
            set_budget = getattr(planner, "with_move_budget", None)
            if set_budget is not None:
                allowance = self.allowance
                shift = allowance.shift_budget() if allowance.burst > 1 else None
                planner = set_budget(allowance.budget(), shift)
        set_pricing = getattr(planner, "with_pricing", None)
        return planner if set_pricing is None else set_pricing(self.pricing(counted_pass))

    def record(self, *, counted_pass: int, applied: bool, copies: float) -> None:
        """The rebalance planned at ``counted_pass`` ended: ``applied`` (all its layers swapped in)
        having moved ``copies`` expert copies across GPUs, or not (skipped or failed: 0)."""
        if self.allowance is not None:
            # The first plan is not counted against the allowance.
            self.allowance.record(copies if applied and not self.first_plan else 0.0)
        if applied:
            self.fitted = True
            self.fitted_at = counted_pass
