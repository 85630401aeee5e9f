"""Budgeted plans: the moves that buy the most balance per expert copy, within a move budget.

Shape legend: Z scenarios, L layers, E logical experts, P physical slots, G GPUs, N nodes.

From the current placement, every layer proposes its best move (eplb.solver.search.moves): a swap (a
slot of the layer's hot GPU trades its expert with a slot of one of the lightest GPUs: a replica
moves, or two trade places) or a replica change (a slot whose expert has another replica is given
to one of the hot GPU's heaviest experts: one expert gains a replica, another loses one; a replica
stacked on the hot GPU may go to an expert the hot GPU lacks), or, where an expert is stacked on
several GPUs, a composite unstack (eplb.solver.search.moves.best_unstack). A move's
gain is the change of the layer's soft balancedness (a smooth maximum of the GPU loads, so that
lowering one of several equally busy GPUs counts); its cost is exact: the expert copies across
GPUs it adds to the transfer from ``current``, a copy to a node that held no replica of the
expert counting ``cross_node_weight``, a move back being free or a refund. A move must gain more
than ``copy_cost`` per copy.

Rounds: the layers whose state changed propose again; proposals are taken best gain per copy
first, at most half of the remaining budget per round (later proposals can still outbid the
rest), until the budget is spent or nothing pays. No clocks, ties broken by layer index: the same
input gives the same plan on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eplb.placement.model import Placement
from eplb.placement.share import ShareModel
from eplb.solver.search import moves
from eplb.solver.search.copies import arrival_costs, holds_per_gpu
from eplb.solver.types import SolveOptions

MAX_ROUNDS = 1000
"""Deterministic cap on search rounds (each takes at least one move or retires layers)."""
MIN_STEP_GAIN = 1e-9
"""A move must gain more than this after its copy cost: strict progress, so no cycles."""
_TOL = 1e-9


@dataclass(frozen=True, kw_only=True)
class Budget:
    """What a plan may move, and the price of a copy."""

    weighted: float
    """Copies across GPUs, cross-node ones counting ``cross_node_weight`` (inf: no limit)."""
    plain: float
    """Copies across GPUs, unweighted (from a byte budget; inf: no limit)."""
    cross_node_weight: float
    """What a copy to a node that holds no replica of the expert counts."""
    copy_cost: float
    """Soft balancedness of its layer a move must buy per weighted copy."""


def budget_of(options: SolveOptions) -> Budget:
    """The :class:`Budget` of ``options`` (inf where a limit is not set)."""
    weighted = np.inf if options.max_moved_experts is None else float(options.max_moved_experts)
    plain = np.inf if options.max_copies is None else float(options.max_copies)
    return Budget(
        weighted=weighted,
        plain=plain,
        cross_node_weight=options.cross_node_weight,
        copy_cost=options.copy_cost or 0.0,
    )


def fit_layers(target_LP: np.ndarray, current: Placement, gain_L: np.ndarray, budget: Budget) -> np.ndarray:
    """int64 [L, P]: ``current`` with whole layers of ``target_LP`` adopted within ``budget``.

    For plans that do not search within a budget themselves (DeepSeek's, fresh scipy plans):
    layers with a positive ``gain_L`` are taken best gain per weighted copy first, while they fit.
    A layer's copies do not depend on the other layers, so the taken layers' copies add up.
    """
    out = current.phy2log_LP.astype(np.int64)
    weighted_LGE, plain_LGE = arrival_costs(current, budget.cross_node_weight)
    present_LGE = holds_per_gpu(target_LP, current.num_gpus, current.num_logical) > 0
    weighted_L = (present_LGE * weighted_LGE).sum(axis=(1, 2))
    plain_L = (present_LGE * plain_LGE).sum(axis=(1, 2))
    changed_L = (target_LP != current.phy2log_LP).any(axis=1)
    ratio_L = gain_L / np.maximum(weighted_L, _TOL)
    left_w, left_p = budget.weighted, budget.plain
    for layer in np.lexsort((np.arange(ratio_L.size), -ratio_L)):
        if not changed_L[layer] or gain_L[layer] <= 0:
            continue
        if weighted_L[layer] <= left_w + _TOL and plain_L[layer] <= left_p + _TOL:
            out[layer] = target_LP[layer]
            left_w -= weighted_L[layer]
            left_p -= plain_L[layer]
    return out


def budgeted_phy2log(
    scenarios_ZLE: np.ndarray,
    weights_Z: np.ndarray,
    current: Placement,
    budget: Budget,
    stats: dict[str, float],
    dispatch: ShareModel | None = None,
    start_LP: np.ndarray | None = None,
    *,
    current_share_LP: np.ndarray | None = None,
) -> np.ndarray:
    """int64 [L, P]: ``current`` changed by the best-paying moves within ``budget``; fills ``stats``.

    ``dispatch``: how the server splits an expert's tokens (eplb.placement.share; where shares
    follow the replicas' nodes, static maps, every move is checked exactly); None: an even split.
    ``start_LP``: search from this placement instead (its copies from ``current`` priced like
    the search's own; only without a budget, which would not count them).
    ``current_share_LP``: ``current``'s slot shares under ``dispatch`` (float64 [L, P]), where the
    caller has them (a search from ``current`` starts from them; a warm start computes its own).
    """
    assert start_LP is None or not np.isfinite(budget.weighted), "a warm start needs no budget"
    if budget.weighted <= 0 or budget.plain <= 0:
        # A budget of 0 moves nothing, not even slots refilled from a replica on the same GPU.
        stats["budget_copies"] = 0.0
        return current.phy2log_LP.astype(np.int64)
    weighted_LGE, plain_LGE = arrival_costs(current, budget.cross_node_weight)
    separate_plain = np.isfinite(budget.plain) and budget.cross_node_weight != 1.0
    start = current.phy2log_LP if start_LP is None else start_LP
    cnt_LE = (
        current.logcnt_LE
        if start_LP is None
        else holds_per_gpu(start_LP, current.num_gpus, current.num_logical).sum(axis=1)
    )
    state = moves.make_move_state(
        scenarios_ZLE,
        start,
        cnt_LE,
        weighted_LGE,
        plain_LGE if separate_plain else None,
        dispatch,
        at_origin=start_LP is None,
        share_LP=current_share_LP if start_LP is None else None,
    )
    L = current.num_layers
    active_L = (scenarios_ZLE.sum(axis=-1) > 0).all(axis=0) & (current.num_gpus > 1)
    dirty_L = np.ones(L, dtype=bool)
    net_L, gain_L = np.full(L, -np.inf), np.zeros(L)
    weighted_L, plain_L = np.zeros(L), np.zeros(L)
    replica_L = np.zeros(L, dtype=bool)
    slot_a_L, slot_b_L, expert_L = (np.zeros(L, dtype=np.int64) for _ in range(3))
    left_w, left_p = budget.weighted, budget.plain
    counts = {"swaps": 0, "replica_changes": 0, "unstacks": 0, "rounds": 0, "undone": 0}
    checked = state.dispatch.follows_nodes
    # Static dispatch: layers whose replica change failed its check search swaps only from then on.
    swaps_only_L = np.zeros(L, dtype=bool)
    # Static dispatch: each layer's exact soft balancedness, to check every move against.
    soft_L = np.zeros(L)
    if checked:
        soft_L[:] = [moves.soft_balancedness(state, layer, weights_Z) for layer in range(L)]
    spent_total = 0.0
    # Layers where an expert is stacked on several GPUs also weigh a composite unstack (no single
    # move may pay there), kept where it buys more per copy than the layer's best move.
    stacked_L = np.zeros(L, dtype=bool)
    stacked_L[moves.stacked_layers(state)] = True
    unstack_L: list[moves.Unstack | None] = [None] * L
    for _ in range(MAX_ROUNDS):
        stale_L = active_L & (dirty_L | (weighted_L > left_w + _TOL) | (plain_L > left_p + _TOL))
        if stale_L.any():
            layers = np.flatnonzero(stale_L)
            p = moves.propose(
                state, layers, weights_Z, budget.copy_cost, left_w, left_p, swaps_only_L[layers]
            )
            net_L[layers], gain_L[layers] = p.net_l, p.gain_l
            weighted_L[layers], plain_L[layers] = p.weighted_l, p.plain_l
            replica_L[layers] = p.replica_l
            slot_a_L[layers], slot_b_L[layers], expert_L[layers] = p.slot_a_l, p.slot_b_l, p.expert_l
            for layer in layers[stacked_L[layers]].tolist():
                unstack_L[layer] = _unstack_if_better(
                    moves.best_unstack(state, layer, weights_Z),
                    float(gain_L[layer]) / max(float(weighted_L[layer]), _TOL)
                    if net_L[layer] > -np.inf
                    else -np.inf,
                    budget.copy_cost,
                    left_w,
                    left_p,
                )
                if (u := unstack_L[layer]) is not None:
                    net_L[layer], gain_L[layer] = u.gain - budget.copy_cost * u.weighted, u.gain
                    weighted_L[layer], plain_L[layer] = u.weighted, u.plain
            dirty_L[layers] = False
            active_L[layers] &= net_L[layers] > MIN_STEP_GAIN
        layers = np.flatnonzero(active_L)
        if layers.size == 0:
            break
        counts["rounds"] += 1
        cost_l = weighted_L[layers]
        ratio_l = np.where(cost_l > _TOL, gain_L[layers] / np.maximum(cost_l, _TOL), np.inf)
        round_cap = left_w / 2
        spent = 0.0
        if checked:
            moves.warm_shares(
                state, layers, replica_L[layers], slot_a_L[layers], slot_b_L[layers], expert_L[layers]
            )
        for layer in layers[np.lexsort((layers, -ratio_l))].tolist():
            cw, cp = float(weighted_L[layer]), float(plain_L[layer])
            if cw > left_w + _TOL or cp > left_p + _TOL:
                continue
            if cw > _TOL and spent > 0 and spent + cw > round_cap + _TOL:
                continue
            if (u := unstack_L[layer]) is not None:
                # Its gain was measured on the state (under the server's shares): nothing to undo.
                moves.apply_unstack(state, u)
                if checked:
                    soft_L[layer] = moves.soft_balancedness(state, layer, weights_Z)
                counts["replica_changes"] += len(u.changes)
                counts["unstacks"] += 1
                left_w -= cw
                left_p -= cp
                spent += max(cw, 0.0)
                spent_total += cw
                dirty_L[layer] = True
                unstack_L[layer] = None
                continue
            slot_a, slot_b, giver = int(slot_a_L[layer]), int(slot_b_L[layer]), -1
            before = float(soft_L[layer]) if checked else 0.0
            if replica_L[layer]:
                giver = int(state.phy2log_LP[layer, slot_b])
                moves.apply_replica_change(state, layer, slot_b, int(expert_L[layer]))
            else:
                moves.apply_swap(state, layer, slot_a, slot_b)
            after = moves.soft_balancedness(state, layer, weights_Z) if checked else 0.0
            if checked and after - before <= MIN_STEP_GAIN:
                # The proposal's even-split estimate did not hold under the static maps' shares:
                # undo it. A failed replica change leaves the layer to swaps (whose gains are
                # exact there, eplb.solver.search.moves); a failed swap ends the layer's search. Each
                # layer fails at most twice: strict progress, no cycles.
                counts["undone"] += 1
                if replica_L[layer]:
                    moves.apply_replica_change(state, layer, slot_b, giver)
                    if not swaps_only_L[layer]:
                        swaps_only_L[layer] = True
                        dirty_L[layer] = True
                        continue
                else:
                    moves.apply_swap(state, layer, slot_a, slot_b)
                active_L[layer] = False
                continue
            soft_L[layer] = after
            counts["replica_changes" if replica_L[layer] else "swaps"] += 1
            left_w -= cw
            left_p -= cp
            spent += max(cw, 0.0)
            spent_total += cw
            dirty_L[layer] = True
    stats["budget_swaps"] = float(counts["swaps"])
    stats["budget_replica_changes"] = float(counts["replica_changes"])
    stats["budget_rounds"] = float(counts["rounds"])
    stats["budget_undone"] = float(counts["undone"])
    stats["budget_unstacks"] = float(counts["unstacks"])
    stats["budget_copies"] = float(spent_total)
    return state.phy2log_LP


def _unstack_if_better(
    unstack: moves.Unstack | None, ratio: float, copy_cost: float, left_w: float, left_p: float
) -> moves.Unstack | None:
    """``unstack`` where it fits the budget left, pays its copies and buys more soft balancedness
    per weighted copy than ``ratio`` (the layer's best single move's; -inf: none), else None."""
    if unstack is None or unstack.weighted > left_w + _TOL or unstack.plain > left_p + _TOL:
        return None
    if unstack.gain - copy_cost * unstack.weighted <= MIN_STEP_GAIN:
        return None
    own = unstack.gain / max(unstack.weighted, _TOL)
    return unstack if own > ratio else None
