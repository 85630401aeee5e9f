"""``solve``: one entry point from a recorded window to a checked, priced plan.

Shape legend: W window (passes), L layers, E logical experts, P physical slots, G GPUs, N nodes,
R max replicas.

Steps: check the input; forecast the load (eplb.solver.predict); score the current placement on
every pass as the server dispatches (eplb.solver.scoring.dispatch) and look for a domain shift in the
window (eplb.solver.scoring.horizon.find_shift: a shift may spend the burst budget, and calibration
starts after it); price one expert copy in balancedness from the pass-time model
(eplb.policy.decision.copy_price) unless ``copy_cost`` is given; place replicas with the policy
(eplb.policy registry), within the move budget; optionally split each expert's load over its
replicas (eplb.solver.search.split); optionally spread replicas over failure domains
(eplb.solver.search.spread); predict what the plan and the current placement will get over the
passes the plan serves (eplb.solver.scoring.horizon.calibrate); apply it when the time it saves pays for
its transfer: these facts (eplb.policy.decision.Facts) get their verdict from eplb.policy.decision.judge,
as every other case does (one GPU, no current placement, a budget that dropped every changed layer). With ``alive_ranks`` (a rank lost), the same steps run over
the survivors from the live placement repaired (eplb.solver.degraded).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import numpy as np

from eplb.placement.diff import diff_placements
from eplb.placement.model import Placement
from eplb.policy.cost_model import PassTimes
from eplb.policy.decision import Facts, LostRanks, copy_price, judge, value_horizon
from eplb.solver.degraded import finish, survivors
from eplb.solver.policies.protocol import PlacementRequest, Policy, load_policy
from eplb.solver.predict import Prediction, predict
from eplb.solver.scoring.dispatch import Dispatch
from eplb.solver.scoring.horizon import Cuts, PassScores, calibrate, find_shift
from eplb.solver.scoring.served import layer_scores, scored_balancedness, scored_placement
from eplb.solver.search.budget import budget_of, fit_layers
from eplb.solver.search.split import lp_split
from eplb.solver.search.spread import failure_aware_phy2log
from eplb.solver.types import Plan, SolveOptions, Topology, check_shapes, load_window

NOISE_HORIZON_FLOOR = 50
"""Passes below which the noise price stops growing (continuous mode's default interval)."""
NOISE_HORIZON_CEIL = 250
"""Passes above which it stops falling: on bench_periodic's drifting workloads at interval 1000,
plans moved 25-29% of the bytes SGLang's DeepSeek moves without this cap, 15-18% with it, at the
same balancedness and a slightly better modeled speed-up (fewer, larger moves that pay)."""


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
    window = load_window(load)
    load_WLE = window.load_WLE
    W, L, E = load_WLE.shape
    G = topology.num_gpus
    check_shapes(L, E, topology, current)
    if options.alive_ranks is not None:
        # A rank lost: plan over the survivors from the live placement repaired (eplb.solver.degraded).
        loss = survivors(load_WLE, topology, current, options)
        inner = solve(load_WLE, loss.topology, loss.repaired, replace(options, alive_ranks=None))
        plan = finish(loss, inner, options)
        assert plan.reload is not None
        lost = LostRanks(
            ranks=tuple(np.flatnonzero(~loss.alive_G).tolist()),
            reloads=plan.reload.reloads,
            reload_source=plan.reload.source,
            survivor_copies=plan.reload.survivor_copies,
            rebalanced=inner.apply,
            repair_reason=inner.reason,
        )
        verdict = judge(Facts(lost=lost))
        return replace(plan, apply=verdict.apply, reason=verdict.reason, repaired=loss.repaired)
    if G == 1 and current is not None:
        # Nothing to balance: one GPU serves every token whatever the placement; keep it.
        verdict = judge(Facts(one_gpu=True))
        return Plan(
            placement=current,
            dispatch_weights_LER=lp_split(load_WLE.sum(axis=0), current) if options.weighted else None,
            diff=diff_placements(current, current, options.bytes_per_expert),
            predicted_balancedness=1.0,
            apply=verdict.apply,
            reason=verdict.reason,
            stats={"solve_seconds": time.perf_counter() - start},
        )
    if G == 1 and options.dispatch == "static":
        # One rank's static map is an even split's worth of balance on one GPU (always 1.0); the
        # static packing has no second GPU to spread replicas over.
        options = replace(options, dispatch="dynamic")
    policy = load_policy(options.algorithm)
    method = policy.prediction(options, W)
    dispatch = Dispatch(options.dispatch, topology.num_nodes)
    pricing = options.pricing
    horizon = pricing.horizon_passes or W
    stats: dict[str, float] = {"horizon_passes": float(horizon)}
    prediction = predict(load_WLE, options, method)
    passes = PassScores(window, dispatch, G)
    times = PassTimes.of(window.layer_load_WL, window.loaded_WL, E, G, topology.num_physical, pricing.cost)
    base = None if current is None else scored_placement(current, None, dispatch)
    base_LW = None if base is None else passes.layer_pass(base, np.arange(L), 0, W)
    shift_at = None
    if base_LW is not None:
        shift = find_shift(base_LW.mean(axis=0), passes)
        if shift is not None:
            stats["shift_drop"] = shift.drop
            if abs(shift.drop) > options.shift_decline:
                # A jump (down: a shift the placement has not seen; up: one it was refitted
                # after): calibrate on the passes after it, across it the decline would charge
                # the jump to the plans made after it.
                shift_at = shift.at
                stats["passes_since_shift"] = float(W - shift_at)
        shifted = shift is not None and shift.drop > options.shift_decline
        stats["shift"] = float(shifted)
        if shifted and options.shift_max_moved_experts is not None and options.max_moved_experts is not None:
            options = replace(
                options, max_moved_experts=max(options.max_moved_experts, options.shift_max_moved_experts)
            )
    valued = value_horizon(horizon, policy.migration_aware)
    level = passes.mean(base_LW.mean(axis=0), 0, W) if base_LW is not None else 1.0
    noise_price = 0.0
    if options.copy_cost is None:
        price = copy_price(
            times,
            pricing,
            balancedness=level,
            num_layers=L,
            bytes_per_expert=options.bytes_per_expert,
            num_gpus=G,
            num_nodes=topology.num_nodes,
            horizon=valued,
        )
        noise_price = options.noise_price_passes / min(max(horizon, NOISE_HORIZON_FLOOR), NOISE_HORIZON_CEIL)
        options = replace(options, copy_cost=max(price, noise_price))
    stats["copy_price"] = float(options.copy_cost or 0.0)
    cuts = Cuts.of(W, shift_at, options.holdout_passes)
    stats["calibration_passes"] = 0.0 if cuts is None else float(cuts.stop - cuts.cut)
    current_share_LP = None if base is None else base.share_LP
    placement, weights_LER, dropped = _plan(
        policy, prediction, topology, current, options, stats, current_share_LP
    )
    scored = scored_placement(placement, weights_LER, dispatch, base)
    forecast = scored_balancedness(prediction.point_LE, scored, G)
    stats["forecast_balancedness"] = forecast
    diff = None if current is None else diff_placements(current, placement, options.bytes_per_expert)
    delay = (
        0
        if diff is None
        else pricing.transfer(diff, horizon=horizon, pass_seconds=times.pass_seconds(level)).delay_passes
    )
    if cuts is not None:
        # The older plan only calibrates: its MILP polish would change the scores by < 0.001.
        older_options = replace(options, milp_max_solves=0)
        older_prediction = predict(load_WLE[: cuts.cut], older_options, method)
        older, older_weights, _ = _plan(
            policy, older_prediction, topology, current, older_options, {}, current_share_LP
        )
        older_scored = scored_placement(older, older_weights, dispatch, base)
        calibrated = calibrate(passes, scored, older_scored, base, base_LW, cuts, pricing.current_age_passes)
        stats.update(calibrated.stats())
        predicted, now = calibrated.plan(delay, horizon), calibrated.current(delay, horizon)
    else:
        predicted = forecast
        now = None if base is None else scored_balancedness(prediction.point_LE, base, G)
    stats["algorithm_scipy"] = float(policy.name == "scipy")
    stats["prediction_robust"] = float(method == "robust")
    if current is None or diff is None or now is None:
        facts = Facts(no_current=True)
    else:
        copies = diff.experts_moved_across_gpus
        across_nodes = diff.experts_moved_across_nodes
        weighted = (copies - across_nodes) + options.cross_node_weight * across_nodes
        stats.update(
            current_balancedness=now,
            predicted_gain=predicted - now,
            copies_moved=float(copies),
            weighted_copies_moved=float(weighted),
            changed_slots=float(diff.num_changed_slots),
        )
        budget = budget_of(options)
        assert weighted <= budget.weighted + 1e-6 and copies <= budget.plain, "a plan over its move budget"
        facts = Facts(
            diff=diff,
            budget_dropped_layers=dropped,
            policy=policy.name,
            max_moved_experts=options.max_moved_experts,
            max_bytes_moved=options.max_bytes_moved,
            predicted=predicted,
            current=now,
            gain_passes=valued,
            pricing=replace(pricing, horizon_passes=horizon),
            times=times,
            priced=policy.priced,
            min_gain=options.min_gain,
            noise_price=noise_price,
            num_layers=L,
        )
    verdict = judge(facts)
    if verdict.saved_seconds is not None and verdict.cost_seconds is not None:
        stats["saved_seconds"] = verdict.saved_seconds
        stats["transfer_seconds"] = verdict.cost_seconds
    stats["solve_seconds"] = time.perf_counter() - start
    return Plan(
        placement=placement,
        dispatch_weights_LER=weights_LER,
        diff=diff,
        predicted_balancedness=predicted,
        apply=verdict.apply,
        reason=verdict.reason,
        stats=stats,
    )


def _plan(
    policy: Policy,
    prediction: Prediction,
    topology: Topology,
    current: Placement | None,
    options: SolveOptions,
    stats: dict[str, float],
    current_share_LP: np.ndarray | None = None,
) -> tuple[Placement, np.ndarray | None, int]:
    """The policy's placement for ``prediction``, cut to the move budget, its dispatch weights,
    and how many of its changed layers the budget dropped (``stats`` reports it too).

    ``current_share_LP``: ``current``'s slot shares under ``options.dispatch`` (weights aside)."""
    request = PlacementRequest(prediction, topology, current, options, stats, current_share_LP)
    phy2log_LP = policy.place(request)
    dropped = 0
    if current is not None and options.budgeted and not (policy.budget_aware and options.incremental):
        # Plans that did not search within the budget keep the whole layers that pay best per copy.
        dispatch = Dispatch(options.dispatch, topology.num_nodes)
        scenarios_ZLE, weights_Z = prediction.scenarios_ZLE, prediction.scenario_weights_Z

        def score_L(p2l_LP: np.ndarray) -> np.ndarray:
            return layer_scores(p2l_LP, scenarios_ZLE, weights_Z, topology.num_gpus, dispatch)

        gain_L = score_L(phy2log_LP) - score_L(current.phy2log_LP)
        fitted_LP = fit_layers(phy2log_LP, current, gain_L, budget_of(options))
        dropped = int((fitted_LP != phy2log_LP).any(axis=1).sum())
        stats["budget_dropped_layers"] = float(dropped)
        phy2log_LP = fitted_LP
    if options.failure_domain != "none":
        phy2log_LP = failure_aware_phy2log(phy2log_LP, prediction, topology, current, options, stats)
    max_replicas = topology.num_physical - prediction.point_LE.shape[1] + 1
    placement = Placement.from_phy2log(
        phy2log_LP, topology.num_gpus, topology.num_nodes, max_replicas=max_replicas
    )
    weights_LER = lp_split(prediction.point_LE, placement) if options.weighted else None
    return placement, weights_LER, dropped
