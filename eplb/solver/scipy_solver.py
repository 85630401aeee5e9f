"""The ``scipy`` algorithm: replica counts, packing, polishing and migration-aware placement.

Shape legend: K scenarios, L layers, E logical experts, P physical slots, G GPUs, S slots per GPU.

Fresh plan under static dispatch (``static_dispatch``, no move budget): eplb.solver.static_pack's
    packing, kept per layer where it pays (see ``_static_phy2log``).
Fresh plan (no current placement, or ``incremental=False``):
    replica counts by the largest-load-per-replica greedy on the forecast; greedy packing of all
    replicas over all GPUs (no node constraint: groups-onto-nodes packing costs balance, see
    docs/solver.md); swap local search on the expected balancedness over the scenarios; MILP
    repacking of the worst layers' critical GPUs, a fixed number of solves (never worse); with a
    current placement, GPUs and slots relabelled to keep replicas in place.
Budgeted plan (current placement, ``incremental=True`` and a move budget): eplb.solver.budget.
Incremental plan (current placement given, ``incremental=True``, no budget):
    start from the current placement; change replica counts only where the pair (take a replica
    from one expert, give it to another) pays; then swaps that bring overloaded GPUs down towards
    the fresh plan's busiest GPU, each paying more than ``copy_cost`` per expert copy. Per layer,
    the fresh plan replaces the incremental one where its extra balancedness pays for its extra
    copies (so a placement far from good, such as the trivial one, is replaced outright).
"""

from __future__ import annotations

import numpy as np

from eplb.placement.model import Placement
from eplb.solver import local_search as ls
from eplb.solver.budget import budget_of, budgeted_phy2log
from eplb.solver.greedy import deepseek_rebalance
from eplb.solver.migration import relabel, retarget_replicas
from eplb.solver.predict import Prediction
from eplb.solver.static_pack import static_fresh_phy2log
from eplb.solver.types import SolveOptions, Topology


def scipy_phy2log(
    prediction: Prediction,
    topology: Topology,
    current: Placement | None,
    options: SolveOptions,
    stats: dict[str, float],
) -> np.ndarray:
    """int64 [L, P]: the placement the scipy algorithm proposes; fills ``stats``."""
    G, P = topology.num_gpus, topology.num_physical
    point_LE = prediction.point_LE
    weights_K = prediction.scenario_weights_K
    if current is not None and options.incremental and options.budgeted:
        static_nodes = topology.num_nodes if options.static_dispatch else None
        return budgeted_phy2log(
            prediction.scenarios_KLE, weights_K, current, budget_of(options), stats, static_nodes
        )

    if options.static_dispatch:
        return _static_phy2log(prediction, topology, current, options, stats)
    fresh_LP, _, fresh_cnt_LE = deepseek_rebalance(point_LE, P, 1, 1, G)
    state = ls.make_state(fresh_LP, prediction.scenarios_KLE, fresh_cnt_LE, G, None)
    stats["fresh_swaps"] = ls.swap_search(state, weights_K, G)
    fresh_LP = state.phy2log_LP
    if options.milp_max_solves > 0 and options.time_budget_s != 0:
        from eplb.solver.milp import milp_polish

        fresh_LP = milp_polish(
            fresh_LP,
            fresh_cnt_LE,
            prediction,
            G,
            options.milp_max_solves,
            stats,
            time_budget_s=options.time_budget_s,
        )
    if current is None:
        return fresh_LP
    fresh_LP = relabel(fresh_LP, current.phy2log_LP, G, topology.num_nodes)
    if not options.incremental:
        # Keep the current layers that the fresh plan does not beat on the forecast.
        kept = ls.make_state(current.phy2log_LP, prediction.scenarios_KLE, current.logcnt_LE, G, None)
        fresh = ls.make_state(fresh_LP, prediction.scenarios_KLE, fresh_cnt_LE, G, None)
        take_fresh_L = _score(fresh, weights_K, G) > _score(kept, weights_K, G) + 1e-12
        stats["fresh_layers"] = float(take_fresh_L.sum())
        return np.where(take_fresh_L[:, None], fresh_LP, kept.phy2log_LP)

    # Incremental without a budget: from the current placement, replica-count changes and swaps
    # that pay (with a budget, budgeted_phy2log above).
    origin_LGE = current.gpu_has_expert()
    cnt_LE = paying_counts(
        current.logcnt_LE.astype(np.int64), fresh_cnt_LE, point_LE, G, options.copy_cost, None
    )
    inc_LP = retarget_replicas(current.phy2log_LP, cnt_LE, point_LE, G)
    inc = ls.make_state(inc_LP, prediction.scenarios_KLE, cnt_LE, G, origin_LGE)
    stats["retarget_copies"] = float(inc.copies_L.sum())
    fresh = ls.make_state(fresh_LP, prediction.scenarios_KLE, fresh_cnt_LE, G, origin_LGE)
    # Target per GPU: the busiest GPU of the fresh plan, i.e. what repacking from scratch achieves.
    K, L = weights_K.shape[0], point_LE.shape[0]
    target_KL = fresh.item_KLP.reshape(K, L, G, -1).sum(axis=-1).max(axis=-1)
    stats["swaps"] = ls.swap_search(inc, weights_K, G, copy_cost=options.copy_cost, target_KL=target_KL)
    # Per layer, keep the best of: current, incremental, fresh, each charged copy_cost per copy.
    kept = ls.make_state(current.phy2log_LP, prediction.scenarios_KLE, current.logcnt_LE, G, origin_LGE)
    value_kept_L = _score(kept, weights_K, G)
    value_inc_L = _score(inc, weights_K, G) - options.copy_cost * inc.copies_L
    use_inc_L = value_inc_L > value_kept_L + 1e-12
    base_LP = np.where(use_inc_L[:, None], inc.phy2log_LP, kept.phy2log_LP)
    value_base_L = np.where(use_inc_L, value_inc_L, value_kept_L)
    value_fresh_L = _score(fresh, weights_K, G) - options.copy_cost * fresh.copies_L
    take_fresh_L = value_fresh_L > value_base_L + 1e-12
    stats["incremental_layers"] = float((use_inc_L & ~take_fresh_L).sum())
    stats["fresh_layers"] = float(take_fresh_L.sum())
    return np.where(take_fresh_L[:, None], fresh.phy2log_LP, base_LP)


def _static_phy2log(
    prediction: Prediction,
    topology: Topology,
    current: Placement | None,
    options: SolveOptions,
    stats: dict[str, float],
) -> np.ndarray:
    """The unbudgeted plan under static dispatch: the static-share packing (eplb.solver.static_pack)
    of the forecast, kept per layer where it beats the current layer by more than its copies cost.

    The even-split path's polish (swaps, MILP, retargeted counts) moves replicas one at a time
    between nodes, which breaks the spread the static maps need, so it is not run here; plans
    within a move budget are searched with the static shares (eplb.solver.budget).
    """
    G, N, P = topology.num_gpus, topology.num_nodes, topology.num_physical
    fresh_LP, _ = static_fresh_phy2log(prediction.point_LE, P, G, N)
    if current is None:
        return fresh_LP
    fresh_LP = relabel(fresh_LP, current.phy2log_LP, G, N, keep_nodes=True)
    weights_K = prediction.scenario_weights_K
    value_fresh_L = ls.layer_scores(fresh_LP, prediction.scenarios_KLE, weights_K, G, N)
    value_kept_L = ls.layer_scores(current.phy2log_LP, prediction.scenarios_KLE, weights_K, G, N)
    if options.incremental:
        holds_LGE = ls.holds_per_gpu(fresh_LP, G, current.num_logical)
        value_fresh_L = value_fresh_L - options.copy_cost * ls.arrivals_L(holds_LGE, current.gpu_has_expert())
    take_fresh_L = value_fresh_L > value_kept_L + 1e-12
    stats["fresh_layers"] = float(take_fresh_L.sum())
    return np.where(take_fresh_L[:, None], fresh_LP, current.phy2log_LP.astype(np.int64))


def _score(state: ls.SearchState, weights_K: np.ndarray, num_gpus: int) -> np.ndarray:
    """float64 [L]: expected balancedness of each layer of ``state``."""
    K, L, P = state.item_KLP.shape
    return ls.expected_balancedness(
        state.item_KLP.reshape(K, L, num_gpus, P // num_gpus).sum(axis=-1), weights_K
    )


def paying_counts(
    cur_cnt_LE: np.ndarray,
    target_cnt_LE: np.ndarray,
    load_LE: np.ndarray,
    num_gpus: int,
    copy_cost: float,
    max_copies: int | None,
) -> np.ndarray:
    """int64 [L, E]: the current replica counts moved towards the target by the changes that pay.

    One change moves a replica from an expert with a surplus to one with a deficit (one expert
    copy). Changes are ranked by how much they lower the larger of the two per-replica loads
    involved, relative to the layer's mean GPU load (a first-order balancedness gain), and taken
    while that gain exceeds ``copy_cost`` and the copy cap allows.
    """
    cnt = cur_cnt_LE.copy()
    mean_gpu_L = np.maximum(load_LE.sum(axis=1) / num_gpus, 1e-300)
    candidates: list[tuple[float, int, int, int]] = []
    for layer in np.flatnonzero((cur_cnt_LE != target_cnt_LE).any(axis=1)):
        w, c = load_LE[layer], cur_cnt_LE[layer]
        give = np.flatnonzero(c > target_cnt_LE[layer])
        take = np.flatnonzero(c < target_cnt_LE[layer])
        # Units in order: the takers' first extra replicas help most; the givers' last replicas cost least.
        take_units = sorted(
            (
                (w[e] / (c[e] + k) - w[e] / (c[e] + k + 1), int(e))
                for e in take
                for k in range(target_cnt_LE[layer, e] - c[e])
            ),
            reverse=True,
        )
        give_units = sorted(
            (w[e] / (c[e] - k - 1) - w[e] / (c[e] - k), int(e))
            for e in give
            for k in range(c[e] - target_cnt_LE[layer, e])
        )
        for (gain, taker), (loss, giver) in zip(take_units, give_units, strict=False):
            candidates.append(((gain - loss) / mean_gpu_L[layer], int(layer), taker, giver))
    budget = float("inf") if max_copies is None else float(max_copies)
    for value, row, taker, giver in sorted(candidates, reverse=True):
        if value <= copy_cost or budget < 1:
            break
        cnt[row, taker] += 1
        cnt[row, giver] -= 1
        budget -= 1
    return cnt
