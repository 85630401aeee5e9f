"""``solve``: one entry point from a recorded window to a checked plan.

Shape legend: W window (passes), L layers, E logical experts, P physical slots, G GPUs, N nodes,
R max replicas.

Steps: check the input, forecast the load (eplb.solver.predict), place replicas with the chosen
policy (eplb.policy registry) within the move budget, optionally split each expert's load over
its replicas (eplb.solver.split); then predict what the plan and the current placement will get
on the next window from held-out passes (eplb.solver.holdout) and decide whether the predicted
gain pays for the transfer.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import numpy as np

from eplb.placement.balance import balancedness, slot_share_LP
from eplb.placement.diff import PlacementDiff, diff_placements
from eplb.placement.model import Placement
from eplb.solver import holdout as ho
from eplb.solver.budget import budget_of, fit_layers
from eplb.solver.local_search import layer_scores
from eplb.solver.policies import PlacementRequest, Policy, load_policy
from eplb.solver.predict import Prediction, predict
from eplb.solver.split import lp_split
from eplb.solver.static_share import static_share_LP
from eplb.solver.types import Plan, SolveOptions, Topology, as_load_array, check_shapes

MIN_SHIFT_CALIBRATION = 4
"""Passes after a detected shift needed to calibrate the prediction on them (two blocks of two)."""


def solve(
    load: Any,
    topology: Topology,
    current: Placement | None = None,
    options: SolveOptions | None = None,
) -> Plan:
    """Plan a placement for the load a window predicts.

    Args:
        load: float/int [W, L, E] window of per-pass logical counts, or [L, E] already aggregated
            (numpy, torch or nested lists). NaN, inf or negative values raise ValueError.
        topology: GPUs, nodes, physical slots and expert groups.
        current: the live placement; enables migration-aware planning, the move budget and the
            apply/skip decision.
        options: see :class:`SolveOptions`.

    Returns:
        A :class:`Plan` whose placement has R = P - E + 1 replica columns.
    """
    options = options or SolveOptions()
    start = time.perf_counter()
    load_WLE = as_load_array(load)
    W, L, E = load_WLE.shape
    check_shapes(L, E, topology, current)
    policy = load_policy(options.algorithm)
    method = policy.prediction(options, W)
    stats: dict[str, float] = {}
    prediction = predict(load_WLE, options, method)
    base = None if current is None else _scored(current, None, options)
    held = ho.holdout_size(W, options.holdout_passes)
    blocks = ho.Blocks.of(load_WLE, held, base, topology.num_gpus) if held else None
    options = _shift_budget(options, blocks, stats)
    if stats.get("shift"):
        # The held-out correction assumes the load moves on as it did between the last two
        # hold-out blocks; across a shift it jumped once, and the correction would charge the jump
        # again (burst plans read 0.52 against 0.79 realized on the drifting workload). Calibrate
        # on the passes after the shift (halves of them), or not at all when they are too few.
        assert base is not None
        recent = min(2 * held, W)
        after = recent - ho.shift_start(load_WLE[W - recent :], base, topology.num_gpus)
        held = after // 2 if after >= MIN_SHIFT_CALIBRATION else 0
        blocks = ho.Blocks.of(load_WLE, held, base, topology.num_gpus) if held else None
        stats["passes_since_shift"] = float(after)
    stats["holdout_passes"] = float(held)
    placement, weights_LER = _plan(policy, prediction, topology, current, options, stats)
    scored = _scored(placement, weights_LER, options, base)
    forecast = _balancedness(prediction.point_LE, scored, topology.num_gpus)
    stats["forecast_balancedness"] = forecast
    if blocks is not None:
        # The older plan only calibrates: its MILP polish would change the scores by < 0.001.
        older_options = replace(options, milp_max_solves=0)
        older_prediction = predict(load_WLE[: W - held], older_options, method)
        older, older_weights = _plan(policy, older_prediction, topology, current, older_options, {})
        scores = ho.held_out_scores(
            blocks,
            scored,
            _scored(older, older_weights, options, base),
            base,
            topology.num_gpus,
        )
        # Balancedness lies in (0, 1]; the held-out correction can step past 1 on tiny windows.
        predicted = min(scores["predicted"], 1.0)
        now = None if current is None else min(scores["current"], 1.0)
        stats.update({k: v for k, v in scores.items() if k not in ("predicted", "current", "gain")})
    else:
        predicted = forecast
        now = None if base is None else _balancedness(prediction.point_LE, base, topology.num_gpus)
    diff = None if current is None else diff_placements(current, placement, options.bytes_per_expert)
    apply, reason = _decide(policy, predicted, now, current, diff, options, stats)
    stats["solve_seconds"] = time.perf_counter() - start
    stats["algorithm_scipy"] = float(policy.name == "scipy")
    stats["prediction_robust"] = float(method == "robust")
    return Plan(
        placement=placement,
        dispatch_weights_LER=weights_LER,
        diff=diff,
        predicted_balancedness=predicted,
        apply=apply,
        reason=reason,
        stats=stats,
    )


def _shift_budget(options: SolveOptions, blocks: ho.Blocks | None, stats: dict[str, float]) -> SolveOptions:
    """``options`` with ``shift_max_moved_experts`` as the move budget when the window shows a
    domain shift: the current placement's score on the newest hold-out block fell by more than
    ``shift_decline`` from the block before it (its decline of the held-out scores)."""
    shift_budget = options.shift_max_moved_experts
    if blocks is None or blocks.current_held_L is None or shift_budget is None:
        return options
    if options.max_moved_experts is None:
        return options
    decline = blocks.current_decline()
    stats["current_decline"] = decline
    shifted = decline > options.shift_decline
    stats["shift"] = float(shifted)
    if not shifted:
        return options
    return replace(options, max_moved_experts=max(options.max_moved_experts, shift_budget))


def _plan(
    policy: Policy,
    prediction: Prediction,
    topology: Topology,
    current: Placement | None,
    options: SolveOptions,
    stats: dict[str, float],
) -> tuple[Placement, np.ndarray | None]:
    """The policy's placement for ``prediction``, cut to the move budget, and its dispatch weights."""
    phy2log_LP = policy.place(PlacementRequest(prediction, topology, current, options, stats))
    searched_within_budget = policy.name == "scipy" and options.incremental
    if current is not None and options.budgeted and not searched_within_budget:
        # Plans that did not search within the budget keep the whole layers that pay best per copy.
        scenarios_KLE, weights_K = prediction.scenarios_KLE, prediction.scenario_weights_K
        static_nodes = topology.num_nodes if options.static_dispatch else None

        def score_L(p2l_LP: np.ndarray) -> np.ndarray:
            return layer_scores(p2l_LP, scenarios_KLE, weights_K, topology.num_gpus, static_nodes)

        gain_L = score_L(phy2log_LP) - score_L(current.phy2log_LP)
        fitted_LP = fit_layers(phy2log_LP, current, gain_L, budget_of(options))
        stats["budget_dropped_layers"] = float((fitted_LP != phy2log_LP).any(axis=1).sum())
        phy2log_LP = fitted_LP
    max_replicas = topology.num_physical - prediction.point_LE.shape[1] + 1
    placement = Placement.from_phy2log(
        phy2log_LP, topology.num_gpus, topology.num_nodes, max_replicas=max_replicas
    )
    weights_LER = lp_split(prediction.point_LE, placement) if options.weighted else None
    return placement, weights_LER


def _scored(
    placement: Placement,
    weights_LER: np.ndarray | None,
    options: SolveOptions,
    base: ho.Scored | None = None,
) -> ho.Scored:
    """``placement`` with the share of its expert's tokens each slot gets as the server dispatches.

    ``base``: the current placement scored; static shares are computed again only for the layers
    that differ from it.
    """
    if weights_LER is not None:
        share_LP = slot_share_LP(placement, weights_LER)
    elif options.static_dispatch:
        E, G, N = placement.num_logical, placement.num_gpus, placement.num_nodes
        if base is None:
            share_LP = static_share_LP(placement.phy2log_LP, E, G, N)
        else:
            changed = np.flatnonzero((placement.phy2log_LP != base.phy2log_LP).any(axis=1))
            share_LP = base.share_LP.copy()
            share_LP[changed] = static_share_LP(placement.phy2log_LP, E, G, N, changed)
    else:
        share_LP = ho.even_share_LP(placement.phy2log_LP, placement.logcnt_LE)
    return ho.Scored(placement.phy2log_LP, share_LP)


def served_balancedness(
    load_LE: np.ndarray,
    placement: Placement,
    weights_LER: np.ndarray | None = None,
    *,
    static_dispatch: bool = False,
) -> float:
    """Model balancedness of logical load [L, E] on ``placement`` as the server splits an expert's
    tokens: by ``weights_LER`` where given, by the static maps' shares with ``static_dispatch``,
    else evenly over its replicas (the score the solver's plans are made for; the manager reports
    its before/after with it)."""
    options = SolveOptions(static_dispatch=static_dispatch and weights_LER is None)
    return _balancedness(
        np.asarray(load_LE, dtype=np.float64), _scored(placement, weights_LER, options), placement.num_gpus
    )


def _balancedness(load_LE: np.ndarray, scored: ho.Scored, num_gpus: int) -> float:
    """Model balancedness of summed load [L, E] under ``scored``'s placement and shares."""
    layer_LP = np.arange(load_LE.shape[0])[:, None]
    slot_LP = load_LE[layer_LP, scored.phy2log_LP] * scored.share_LP
    return float(balancedness(slot_LP.reshape(slot_LP.shape[0], num_gpus, -1).sum(axis=-1)).mean())


def _decide(
    policy: Policy,
    predicted: float,
    now: float | None,
    current: Placement | None,
    diff: PlacementDiff | None,
    options: SolveOptions,
    stats: dict[str, float],
) -> tuple[bool, str]:
    """Whether to apply the plan, and why."""
    if current is None or diff is None or now is None:
        return True, "no current placement"
    copies = diff.experts_moved_across_gpus
    across_nodes = diff.experts_moved_across_nodes
    weighted = (copies - across_nodes) + options.cross_node_weight * across_nodes
    stats["current_balancedness"] = now
    stats["predicted_gain"] = predicted - now
    stats["copies_moved"] = float(copies)
    stats["weighted_copies_moved"] = float(weighted)
    stats["changed_slots"] = float(diff.num_changed_slots)
    budget = budget_of(options)
    assert weighted <= budget.weighted + 1e-6 and copies <= budget.plain, "a plan over its move budget"
    if diff.num_changed_slots == 0:
        if stats.get("budget_dropped_layers", 0) > 0:
            return False, (
                f"no changed layer of the {policy.name} plan fits within the budget "
                f"(max_moved_experts={options.max_moved_experts}, max_bytes_moved={options.max_bytes_moved})"
            )
        return False, "the plan equals the current placement"
    # copy_cost prices the transfer for the migration-aware policy only: DeepSeek's repacks move
    # most slots every time and are applied as SGLang applies them, on min_gain alone.
    price = options.copy_cost * weighted / current.num_layers if policy.name == "scipy" else 0.0
    stats["transfer_price"] = price
    gain = predicted - now
    if gain < options.min_gain + price:
        return False, (
            f"predicted balancedness gain {gain:+.4f} ({now:.4f} -> {predicted:.4f}) < min_gain "
            f"{options.min_gain} + transfer price {price:.4f} ({weighted:g} copies x copy_cost / layers)"
        )
    return True, f"predicted balancedness {now:.4f} -> {predicted:.4f} for {copies} expert copies"
