"""The ``scipy`` policy (:data:`SCIPY`): replica counts, packing, polishing, migration-aware placement.

Shape legend: Z scenarios, L layers, E logical experts, P physical slots, G GPUs, S slots per GPU.

Fresh plan (no current placement, or ``incremental=False``, and a candidate for every layer of an
incremental plan):
    static dispatch: eplb.solver.search.static_pack's packing for the static maps' shares; otherwise
    replica counts by the largest-load-per-replica greedy on the forecast, greedy packing of all
    replicas over all GPUs (no node constraint: groups-onto-nodes packing costs balance, see
    docs/solver.md), swap local search on the expected balancedness over the scenarios and MILP
    repacking of the worst layers' critical GPUs, a fixed number of solves (never worse); with a
    current placement, GPUs (static: whole nodes) relabelled to keep replicas in place.
Incremental plan (current placement given, ``incremental=True``): from the current placement,
    the moves that buy the most balance per expert copy (eplb.solver.search.budget: swaps and replica
    changes, each paying more than ``copy_cost`` per copy), within the move budget if there is one.
    Without a budget, per layer, the fresh plan replaces the searched one where its extra
    balancedness pays for its extra copies (so a placement far from good, such as the trivial one,
    is replaced outright, and a fitted one keeps what still serves).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eplb.placement.model import Placement
from eplb.placement.share import ShareModel
from eplb.solver.policies.deepseek import deepseek_rebalance
from eplb.solver.policies.protocol import PlacementRequest
from eplb.solver.predict import Prediction
from eplb.solver.scoring.served import layer_scores
from eplb.solver.search import local_search as ls
from eplb.solver.search.budget import budget_of, budgeted_phy2log
from eplb.solver.search.copies import arrivals_L, holds_per_gpu
from eplb.solver.search.migration import relabel, retarget_replicas
from eplb.solver.search.recount import recount_phy2log, spread_over_nodes
from eplb.solver.search.static_pack import static_fresh_phy2log
from eplb.solver.types import SolveOptions, Topology

WARM_PRICE_HORIZON = 50
"""Passes whose noise price (``noise_price_passes / WARM_PRICE_HORIZON`` per copy, continuous
mode's) the retargeted start's extra copies pay at least, whatever the horizon."""


@dataclass(frozen=True)
class ScipyPolicy:
    """Forecast, greedy packing refined by swap search and MILP, incremental migration-aware plans."""

    name: str = "scipy"
    migration_aware: bool = True
    budget_aware: bool = True
    priced: bool = True

    def prediction(self, options: SolveOptions, num_passes: int) -> str:
        if options.prediction != "auto":
            return options.prediction
        # Budgeted (continuous) plans: robust's scenarios cost 4x the search time for no gain.
        robust = num_passes >= options.robust_from_passes and not options.budgeted
        return "robust" if robust else "decay"

    def place(self, request: PlacementRequest) -> np.ndarray:
        r = request
        return scipy_phy2log(r.prediction, r.topology, r.current, r.options, r.stats, r.current_share_LP)


SCIPY = ScipyPolicy()


def scipy_phy2log(
    prediction: Prediction,
    topology: Topology,
    current: Placement | None,
    options: SolveOptions,
    stats: dict[str, float],
    current_share_LP: np.ndarray | None = None,
) -> np.ndarray:
    """int64 [L, P]: the placement the scipy algorithm proposes; fills ``stats``.

    ``current_share_LP``: ``current``'s slot shares under ``options.dispatch``, if the caller has them.
    """
    G, N = topology.num_gpus, topology.num_nodes
    dispatch = ShareModel(options.dispatch, N)
    scenarios_ZLE, weights_Z = prediction.scenarios_ZLE, prediction.scenario_weights_Z
    budget = budget_of(options)
    if current is not None and options.incremental and options.budgeted:
        return budgeted_phy2log(
            scenarios_ZLE, weights_Z, current, budget, stats, dispatch, current_share_LP=current_share_LP
        )
    fresh_LP = _fresh_phy2log(prediction, topology, options, dispatch, stats)
    if current is None:
        return fresh_LP
    fresh_LP = relabel(fresh_LP, current.phy2log_LP, G, N, keep_nodes=dispatch.follows_nodes)
    value_fresh_L = layer_scores(fresh_LP, scenarios_ZLE, weights_Z, G, dispatch)
    origin_LGE = current.gpu_has_expert()
    if not options.incremental:
        # Keep the current layers that the fresh plan does not beat on the forecast.
        base_LP = current.phy2log_LP.astype(np.int64)
        value_base_L = layer_scores(base_LP, scenarios_ZLE, weights_Z, G, dispatch)
    else:
        price = options.copy_cost or 0.0

        def copies_L(phy2log_LP: np.ndarray) -> np.ndarray:
            return arrivals_L(holds_per_gpu(phy2log_LP, G, current.num_logical), origin_LGE)

        base_LP = budgeted_phy2log(
            scenarios_ZLE, weights_Z, current, budget, stats, dispatch, current_share_LP=current_share_LP
        )
        base_copies_L = copies_L(base_LP)
        value_base_L = layer_scores(base_LP, scenarios_ZLE, weights_Z, G, dispatch) - price * base_copies_L
        # The same search from the current placement retargeted to the fresh plan's replica
        # counts: one move at a time, the search stops where no single swap or replica change
        # pays, short of the large count changes an unfitted or drifted placement needs.
        fresh_cnt_LE = holds_per_gpu(fresh_LP, G, current.num_logical).sum(axis=1)
        start_LP = retarget_replicas(current.phy2log_LP, fresh_cnt_LE, prediction.point_LE, G)
        warm_LP = budgeted_phy2log(scenarios_ZLE, weights_Z, current, budget, {}, dispatch, start_LP)
        warm_copies_L = copies_L(warm_LP)
        value_warm_L = layer_scores(warm_LP, scenarios_ZLE, weights_Z, G, dispatch) - price * warm_copies_L
        # Its extra copies pay at least the noise price of the shortest horizon: a fit to the
        # window's counts that only a long horizon's low price accepts chased domains that the
        # horizon leaves (bench_periodic at interval 1000 with a shift every ~250 passes: 0.563
        # prefill balancedness unpriced, 0.595 priced, 0.607 without this start).
        surcharge = max(options.noise_price_passes / WARM_PRICE_HORIZON - price, 0.0)
        extra_L = np.maximum(warm_copies_L - base_copies_L, 0)
        take_warm_L = value_warm_L - surcharge * extra_L > value_base_L + 1e-12
        stats["warm_layers"] = float(take_warm_L.sum())
        base_LP = np.where(take_warm_L[:, None], warm_LP, base_LP)
        value_base_L = np.where(take_warm_L, value_warm_L, value_base_L)
        value_fresh_L -= price * copies_L(fresh_LP)
    take_fresh_L = value_fresh_L > value_base_L + 1e-12
    stats["fresh_layers"] = float(take_fresh_L.sum())
    return np.where(take_fresh_L[:, None], fresh_LP, base_LP)


def _fresh_phy2log(
    prediction: Prediction,
    topology: Topology,
    options: SolveOptions,
    dispatch: ShareModel,
    stats: dict[str, float],
) -> np.ndarray:
    """int64 [L, P]: a fresh placement of the forecast (module docstring), before relabelling."""
    G, N, P = topology.num_gpus, topology.num_nodes, topology.num_physical
    point_LE = prediction.point_LE
    if dispatch.follows_nodes:
        # The even-split polish (swaps, MILP) moves replicas one at a time between nodes, which
        # breaks the spread the static maps need: the static packing stands as it is.
        return static_fresh_phy2log(point_LE, P, G, N)[0]
    fresh_LP, _, fresh_cnt_LE = deepseek_rebalance(point_LE, P, 1, 1, G)
    state = ls.make_swap_state(fresh_LP, prediction.scenarios_ZLE, fresh_cnt_LE, G)
    stats["fresh_swaps"] = ls.swap_search(state, prediction.scenario_weights_Z, G)
    # Layers whose busiest GPU stacks replicas of one expert: counts chosen with the placement.
    polished_LP = state.phy2log_LP
    fresh_LP = recount_phy2log(polished_LP, prediction.scenarios_ZLE, prediction.scenario_weights_Z, G, stats)
    recounted_L = (fresh_LP != polished_LP).any(axis=1)
    fresh_cnt_LE = holds_per_gpu(fresh_LP, G, point_LE.shape[1]).sum(axis=1)
    if options.milp_max_solves > 0 and options.time_budget_s != 0:
        from eplb.solver.search.milp import milp_polish

        fresh_LP = milp_polish(
            fresh_LP,
            fresh_cnt_LE,
            prediction,
            G,
            options.milp_max_solves,
            stats,
            time_budget_s=options.time_budget_s,
        )
    # The recounted layers' GPUs, whole, ordered over the nodes to spread their replicated
    # experts (every GPU's load stays; the other layers stay as they were).
    for layer in np.flatnonzero(recounted_L).tolist():
        fresh_LP[layer] = spread_over_nodes(fresh_LP[layer], point_LE[layer], G, N)
    return fresh_LP
