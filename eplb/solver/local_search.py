"""Swap local search on the expected balancedness over load scenarios, all layers at once.

Shape legend: K scenarios, L layers, E logical experts, P physical slots, G GPUs, S slots per GPU.

A layer's score is the expected balancedness ``sum_k pi_k mean_k / max_k`` of its GPU loads over
the scenarios (one scenario: the plain balancedness). Replica counts are fixed here, so an item's
load (expert load / replicas) is fixed and a move exchanges the contents of two slots on different
GPUs. Each round, every layer takes its best swap between its critical GPU (the one that is the
busiest in the most weight of scenarios) and any slot of another GPU, if the score gain exceeds
``copy_cost`` times the expert copies across GPUs it adds relative to ``origin``. Rounds are numpy
operations over all layers; a layer leaves the search when no swap pays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eplb.solver.holdout import even_share_LP
from eplb.solver.static_share import static_share_LP

_TOL = 1e-12


@dataclass
class SearchState:
    """Mutable search state (all arrays are updated in place)."""

    phy2log_LP: np.ndarray
    """int64 [L, P]: expert in each slot."""
    item_KLP: np.ndarray
    """float64 [K, L, P]: load each slot carries in each scenario."""
    holds_LGE: np.ndarray
    """int64 [L, G, E]: replicas of expert e on GPU g."""
    origin_LGE: np.ndarray | None
    """bool [L, G, E]: GPU g held expert e before the rebalance (None: moves are free)."""
    copies_L: np.ndarray
    """int64 [L]: expert copies across GPUs so far, relative to ``origin``."""


def make_state(
    phy2log_LP: np.ndarray,
    scenarios_KLE: np.ndarray,
    logcnt_LE: np.ndarray,
    num_gpus: int,
    origin_LGE: np.ndarray | None,
) -> SearchState:
    """Search state for a placement ``phy2log_LP`` with replica counts ``logcnt_LE``."""
    L = phy2log_LP.shape[0]
    E = logcnt_LE.shape[1]
    layer = np.arange(L)[:, None]
    item_KLP = scenarios_KLE[:, layer, phy2log_LP] / logcnt_LE[layer, phy2log_LP]
    holds_LGE = holds_per_gpu(phy2log_LP, num_gpus, E)
    copies_L = np.zeros(L, dtype=np.int64) if origin_LGE is None else arrivals_L(holds_LGE, origin_LGE)
    return SearchState(phy2log_LP.astype(np.int64), item_KLP, holds_LGE, origin_LGE, copies_L)


def holds_per_gpu(phy2log_LP: np.ndarray, num_gpus: int, num_logical: int) -> np.ndarray:
    """int64 [L, G, E]: number of replicas of each expert on each GPU."""
    L, P = phy2log_LP.shape
    gpu_P = np.arange(P) // (P // num_gpus)
    flat = (np.arange(L)[:, None] * num_gpus + gpu_P[None, :]) * num_logical + phy2log_LP
    return np.bincount(flat.ravel(), minlength=L * num_gpus * num_logical).reshape(L, num_gpus, num_logical)


def arrivals_L(holds_LGE: np.ndarray, origin_LGE: np.ndarray) -> np.ndarray:
    """int64 [L]: expert copies across GPUs from ``origin`` (bool [L, G, E]) to ``holds`` (counts
    [L, G, E]): the (GPU, expert) pairs held now that were not held there before."""
    return np.asarray(((holds_LGE > 0) & ~origin_LGE).sum(axis=(1, 2)))


def expected_balancedness(gpu_KLG: np.ndarray, weights_K: np.ndarray) -> np.ndarray:
    """float64 [L]: sum_k pi_k mean_k / max_k (1 where a scenario has no load)."""
    peak = gpu_KLG.max(axis=-1)
    mean = gpu_KLG.mean(axis=-1)
    ratio = np.where(peak > 0, mean / np.where(peak > 0, peak, 1.0), 1.0)
    return np.tensordot(weights_K, ratio, axes=1)


def layer_scores(
    phy2log_LP: np.ndarray,
    scenarios_KLE: np.ndarray,
    weights_K: np.ndarray,
    num_gpus: int,
    static_nodes: int | None,
) -> np.ndarray:
    """float64 [L]: expected balancedness of each layer over the scenarios, each slot carrying its
    expert's load times its share: the static maps' (``static_nodes``: the topology's nodes) or
    ``1 / count`` (None)."""
    K, L, E = scenarios_KLE.shape
    layer = np.arange(L)[:, None]
    if static_nodes is None:
        share_LP = even_share_LP(phy2log_LP, np.stack([np.bincount(row, minlength=E) for row in phy2log_LP]))
    else:
        share_LP = static_share_LP(phy2log_LP, E, num_gpus, static_nodes)
    item_KLP = scenarios_KLE[:, layer, phy2log_LP] * share_LP
    return expected_balancedness(item_KLP.reshape(K, L, num_gpus, -1).sum(axis=-1), weights_K)


def swap_search(
    state: SearchState,
    weights_K: np.ndarray,
    num_gpus: int,
    copy_cost: float = 0.0,
    max_copies: int | None = None,
    max_rounds: int = 10_000,
    min_gain: float = 1e-5,
    target_KL: np.ndarray | None = None,
) -> int:
    """Improve ``state`` in place by single swaps; returns the number of swaps made.

    Objective: without ``target_KL``, the expected balancedness (the busiest GPU); with it, the
    expected excess of every GPU over its target load ``target_KL`` [K, L] (relative to the mean),
    which credits fixing any overloaded GPU, not only the busiest (the incremental search's
    objective: after drift several GPUs are overloaded at once, and fixing one alone barely moves
    the maximum). ``max_copies`` caps the total copies across GPUs (all layers); ``max_rounds``
    caps the rounds (a count, so every rank finds the same swaps); a swap must gain more than
    ``min_gain`` after its copy cost.
    """
    _, L, P = state.item_KLP.shape
    G, S = num_gpus, P // num_gpus
    active = np.ones(L, dtype=bool)
    swaps = 0
    for _ in range(max_rounds):
        layers = np.flatnonzero(active)
        if layers.size == 0:
            break
        target = None if target_KL is None else target_KL[:, layers]
        found, gain, slot_a, slot_b, dcost = _best_swaps(
            state, layers, weights_K, G, S, copy_cost, min_gain, target
        )
        if max_copies is not None:
            found &= _within_cap(state, layers, found, gain, dcost, max_copies)
        active[layers[~found]] = False
        for layer, a, b, dc in zip(layers[found], slot_a[found], slot_b[found], dcost[found], strict=True):
            _apply_swap(state, int(layer), int(a), int(b), int(dc), S)
            swaps += 1
    return swaps


def _best_swaps(
    state: SearchState,
    layers: np.ndarray,
    weights_K: np.ndarray,
    G: int,
    S: int,
    copy_cost: float,
    min_gain: float,
    target_Kl: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For each layer in ``layers``: whether a paying swap exists, its gain, slots and copy delta.

    Partners are the slots of the lighter GPUs only (the lightest half, at least four GPUs): a
    swap with a GPU near the top cannot lower the top, and halving the candidates halves the work.
    """
    item = state.item_KLP[:, layers]  # [K, l, P]
    K, nl, _ = item.shape
    rows = np.arange(nl)
    if G == 1:
        nothing = np.zeros(nl, dtype=np.int64)
        return np.zeros(nl, dtype=bool), np.zeros(nl), nothing, nothing, nothing
    gpu_KlG = item.reshape(K, nl, G, S).sum(axis=-1)
    mean_Kl = np.maximum(gpu_KlG.mean(axis=-1), 1e-300)
    if target_Kl is None:
        hot_l = _critical_gpu(gpu_KlG, mean_Kl, weights_K)
    else:
        excess_KlG = np.maximum(gpu_KlG - target_Kl[..., None], 0.0) / mean_Kl[..., None]
        hot_l = _expect(weights_K, excess_KlG).argmax(axis=1)
    expected_lG = _expect(weights_K, gpu_KlG / mean_Kl[..., None])
    expected_lG[rows, hot_l] = np.inf
    num_partners = max(1, min(G - 1, max(4, G // 2)))
    partner_gpu_lB = np.argsort(expected_lG, axis=1, kind="stable")[:, :num_partners]
    partner_lQ = (partner_gpu_lB[:, :, None] * S + np.arange(S)).reshape(nl, -1)
    gpu_lQ = partner_lQ // S
    Q = partner_lQ.shape[1]

    hot_slots_lS = hot_l[:, None] * S + np.arange(S)
    a_KlS = np.take_along_axis(item, np.broadcast_to(hot_slots_lS, (K, nl, S)), axis=-1)
    b_KlQ = np.take_along_axis(item, np.broadcast_to(partner_lQ, (K, nl, Q)), axis=-1)
    hot_load_Kl = gpu_KlG[:, rows, hot_l]
    other_load_KlQ = np.take_along_axis(gpu_KlG, np.broadcast_to(gpu_lQ, (K, nl, Q)), axis=-1)
    new_hot = hot_load_Kl[:, :, None, None] - a_KlS[..., None] + b_KlQ[:, :, None, :]
    new_other = other_load_KlQ[:, :, None, :] - b_KlQ[:, :, None, :] + a_KlS[..., None]
    if target_Kl is None:
        gain_lSQ = _peak_gain(gpu_KlG, mean_Kl, hot_l, gpu_lQ, new_hot, new_other, weights_K)
    else:
        t = target_Kl[..., None, None]
        before = np.maximum(hot_load_Kl[..., None, None] - t, 0) + np.maximum(
            other_load_KlQ[:, :, None, :] - t, 0
        )
        after = np.maximum(new_hot - t, 0) + np.maximum(new_other - t, 0)
        gain_lSQ = _expect(weights_K, (before - after) / mean_Kl[..., None, None])

    p2l = state.phy2log_LP[layers]
    expert_a_lS = np.take_along_axis(p2l, hot_slots_lS, axis=1)
    expert_b_lQ = np.take_along_axis(p2l, partner_lQ, axis=1)
    invalid = expert_a_lS[:, :, None] == expert_b_lQ[:, None, :]
    dcost = _copy_delta(state, layers, hot_l, expert_a_lS, expert_b_lQ, gpu_lQ)
    net = np.where(invalid, -np.inf, gain_lSQ - copy_cost * dcost)
    flat = net.reshape(nl, -1).argmax(axis=1)
    best = net.reshape(nl, -1)[rows, flat]
    s_idx, q_idx = np.divmod(flat, Q)
    found = best > max(min_gain, _TOL)
    return (
        found,
        gain_lSQ.reshape(nl, -1)[rows, flat],
        hot_slots_lS[rows, s_idx],
        partner_lQ[rows, q_idx],
        dcost.reshape(nl, -1)[rows, flat],
    )


def _critical_gpu(gpu_KlG: np.ndarray, mean_Kl: np.ndarray, weights_K: np.ndarray) -> np.ndarray:
    """int [l]: the GPU whose reduction gains the most expected balancedness to first order.

    d(mean/peak)/d(peak) = -mean/peak**2; scaled by the mean (scenarios share one total per layer)
    that is (mean/peak)**2, credited to each scenario's busiest GPU.
    """
    K, nl, G = gpu_KlG.shape
    peak_Kl = gpu_KlG.max(axis=-1)
    ratio_Kl = np.where(peak_Kl > 0, mean_Kl / np.where(peak_Kl > 0, peak_Kl, 1.0), 0.0)
    urgency_lG = np.zeros((nl, G))
    np.add.at(
        urgency_lG,
        (np.broadcast_to(np.arange(nl), (K, nl)), gpu_KlG.argmax(axis=-1)),
        weights_K[:, None] * ratio_Kl**2,
    )
    return np.asarray(urgency_lG.argmax(axis=1))


def _peak_gain(
    gpu_KlG: np.ndarray,
    mean_Kl: np.ndarray,
    hot_l: np.ndarray,
    gpu_lQ: np.ndarray,
    new_hot: np.ndarray,
    new_other: np.ndarray,
    weights_K: np.ndarray,
) -> np.ndarray:
    """float64 [l, S, Q]: change in expected balancedness of each candidate swap."""
    G = gpu_KlG.shape[-1]
    order = np.argsort(-gpu_KlG, axis=-1)[..., : min(3, G)]
    top_val = np.take_along_axis(gpu_KlG, order, axis=-1)
    peak_Kl = top_val[..., 0]
    # Busiest GPU other than the hot one and the partner's GPU, per partner slot.
    other_max_KlQ = _max_excluding(top_val, order, hot_l, gpu_lQ)
    new_peak = np.maximum(np.maximum(new_hot, new_other), other_max_KlQ[:, :, None, :])
    ratio_new = np.where(new_peak > 0, mean_Kl[..., None, None] / np.where(new_peak > 0, new_peak, 1.0), 1.0)
    ratio_old = np.where(peak_Kl > 0, mean_Kl / np.where(peak_Kl > 0, peak_Kl, 1.0), 1.0)
    return _expect(weights_K, ratio_new - ratio_old[..., None, None])


def _expect(weights_K: np.ndarray, values_K: np.ndarray) -> np.ndarray:
    """sum_k pi_k values[k] (no tensordot copy for the one-scenario case)."""
    if weights_K.shape[0] == 1:
        return np.asarray(values_K[0] * weights_K[0])
    return np.tensordot(weights_K, values_K, axes=1)


def _max_excluding(
    top_val: np.ndarray, order: np.ndarray, hot_l: np.ndarray, gpu_lQ: np.ndarray
) -> np.ndarray:
    """float64 [K, l, Q]: largest GPU load among GPUs other than the hot GPU and partner q's GPU."""
    K, nl, T = top_val.shape
    Q = gpu_lQ.shape[1]
    result = np.zeros((K, nl, Q))
    done = np.zeros((K, nl, Q), dtype=bool)
    for t in range(T):
        idx = order[..., t][..., None]
        ok = (idx != hot_l[None, :, None]) & (idx != gpu_lQ[None]) & ~done
        result = np.where(ok, top_val[..., t][..., None], result)
        done |= ok
    return result


def _copy_delta(
    state: SearchState,
    layers: np.ndarray,
    hot_l: np.ndarray,
    expert_a_lS: np.ndarray,
    expert_b_lQ: np.ndarray,
    gpu_lQ: np.ndarray,
) -> np.ndarray:
    """int64 [l, S, Q]: change in expert copies across GPUs (vs origin) if hot slot s and partner q swap.

    Arrivals created: b on the hot GPU and a on q's GPU, unless already there; arrivals removed: the
    last a leaving the hot GPU and the last b leaving q's GPU, when those were arrivals themselves.
    """
    nl, S = expert_a_lS.shape
    Q = expert_b_lQ.shape[1]
    if state.origin_LGE is None:
        return np.zeros((nl, S, Q), dtype=np.int64)
    rows = np.arange(nl)
    holds = state.holds_LGE[layers]
    stranger = ~state.origin_LGE[layers]
    hot_holds_lE = holds[rows, hot_l]
    hot_stranger_lE = stranger[rows, hot_l]
    ea, eb = expert_a_lS, expert_b_lQ
    add_hot_lQ = (np.take_along_axis(hot_holds_lE, eb, 1) == 0) & np.take_along_axis(hot_stranger_lE, eb, 1)
    rem_hot_lS = (np.take_along_axis(hot_holds_lE, ea, 1) == 1) & np.take_along_axis(hot_stranger_lE, ea, 1)
    # a arriving on GPU g: [l, S, G], then read at each partner's GPU.
    idx_lGS = np.broadcast_to(ea[:, None, :], (nl, holds.shape[1], S))
    add_a_lSG = (
        (np.take_along_axis(holds, idx_lGS, 2) == 0) & np.take_along_axis(stranger, idx_lGS, 2)
    ).transpose(0, 2, 1)
    add_other_lSQ = np.take_along_axis(add_a_lSG, np.broadcast_to(gpu_lQ[:, None, :], (nl, S, Q)), axis=2)
    own_lQ = holds[rows[:, None], gpu_lQ, eb]
    rem_other_lQ = (own_lQ == 1) & stranger[rows[:, None], gpu_lQ, eb]
    delta = add_other_lSQ.astype(np.int64)
    delta += (add_hot_lQ.astype(np.int64) - rem_other_lQ)[:, None, :]
    delta -= rem_hot_lS[:, :, None]
    return delta


def _within_cap(
    state: SearchState,
    layers: np.ndarray,
    found: np.ndarray,
    gain: np.ndarray,
    dcost: np.ndarray,
    max_copies: int,
) -> np.ndarray:
    """bool [l]: the found swaps that fit under the copy cap, best gain per copy first."""
    room = max_copies - int(state.copies_L.sum())
    keep = np.zeros_like(found)
    for i in np.argsort(-gain / np.maximum(dcost, 0.5)):
        if not found[i]:
            continue
        if dcost[i] <= room:
            keep[i] = True
            room -= max(int(dcost[i]), 0)
    return keep


def swap_slots(
    phy2log_P: np.ndarray, item_KP: np.ndarray, holds_GE: np.ndarray, a: int, b: int, S: int
) -> tuple[int, int, int, int]:
    """Slots ``a`` and ``b`` of one layer trade experts, loads and GPU counts (in place).

    Returns (expert that was in a, expert that was in b, a's GPU, b's GPU).
    """
    ea, eb = int(phy2log_P[a]), int(phy2log_P[b])
    ga, gb = a // S, b // S
    phy2log_P[a], phy2log_P[b] = eb, ea
    item_KP[:, [a, b]] = item_KP[:, [b, a]]
    holds_GE[ga, ea] -= 1
    holds_GE[ga, eb] += 1
    holds_GE[gb, eb] -= 1
    holds_GE[gb, ea] += 1
    return ea, eb, ga, gb


def _apply_swap(state: SearchState, layer: int, a: int, b: int, dcost: int, S: int) -> None:
    swap_slots(state.phy2log_LP[layer], state.item_KLP[:, layer], state.holds_LGE[layer], a, b, S)
    state.copies_L[layer] += dcost
