"""Replica counts chosen with the placement, where a fresh plan's counts left a layer unbalanced.

Shape legend: Z scenarios, L layers, E logical experts, P physical slots, G GPUs, N nodes, S
slots per GPU, x any leading dimensions (count vectors, tried side by side as rows), c candidate
moves.

A fresh plan fixes its replica counts first (the largest-load-per-replica greedy) and then packs
them. An expert given more replicas than it can usefully spread ends with two on one GPU, which
under an even split carries twice a replica's share there (vLLM's ``extreme_weight_imbalance``
test input: one expert at 1000 and seven at 1 on twelve slots of four GPUs; five replicas put
401 on one GPU against a mean of 252, where four, one per GPU, give 252). :func:`recount_phy2log`
searches counts and placement together on the layers whose busiest GPU is over
:data:`SEARCH_FROM` times the mean and has few count vectors (:data:`MAX_COUNT_VECTORS`), or
is over :data:`STACKED_FROM` times the mean and stacks two replicas of one expert on its hot
GPU (eplb.solver.search.swap.critical_gpu):

- a local search from two starts, the layer as given and a fresh packing of the greedy's counts
  capped at one replica per GPU. Moves: the hot GPU's slot swaps with another GPU's; a *recount*
  gives one replica of an expert held twice or more (on the hot GPU, or stacked on any) to
  another expert, every replica of both then carrying its new share; an *unstack* takes one
  replica off every GPU that stacks an expert at once (one at a time, each raises the other
  stacked GPUs), each freed slot going to the expert that gains most. Each step takes the move
  that gains the most soft balancedness (the expected ``1 / (sum_g x_g**32)**(1/32)`` of loads
  in units of the mean, as eplb.solver.search.moves scores: it sees past ties at the peak);
- on the small layers, every count vector, each packed heaviest first and polished by the fresh
  plan's swap search (eplb.solver.search.local_search), all at once as rows.

A layer keeps the best row by the exact expected balancedness and only where it beats the row
given: never worse, and a layer within those bounds is left exactly as it was (so are
ordinary plans). :func:`spread_over_nodes` then orders a changed layer's GPUs over the nodes
(whole GPUs: every load stays) so that its replicated experts spread across them.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from eplb.solver.policies.deepseek import balanced_packing
from eplb.solver.scoring.served import expectation, expected_balancedness
from eplb.solver.search.copies import holds_per_gpu
from eplb.solver.search.swap import critical_gpu

MAX_MOVES_PER_LAYER = 64
"""Deterministic cap on the moves one start of one layer's search may take."""
SEARCH_FROM = 1.02
"""max/mean GPU load (expected over the scenarios) above which a layer is searched: below it the
plan is within 2% of even and stays exactly as the greedy and its polish made it."""
STACKED_FROM = 1.05
"""The same bound for a large layer (more count vectors than :data:`MAX_COUNT_VECTORS`) whose hot
GPU stacks an expert: its local search costs about a second at DeepSeek-V3's shape, paid where
the stacking costs 5% of the layer or more (a 1000x expert: 59%), not for a few tenths of one."""
MAX_COUNT_VECTORS = 2048
"""Layers with at most this many replica count vectors (``comb(P - 1, E - 1)``) try every one,
each packed and polished, and are searched whether or not their busiest GPU stacks replicas."""
_MIN_GAIN = 1e-12


def stacked_layers(
    phy2log_LP: np.ndarray, scenarios_ZLE: np.ndarray, weights_Z: np.ndarray, G: int
) -> np.ndarray:
    """int [l]: the layers whose hot GPU holds two replicas or more of one expert."""
    L = phy2log_LP.shape[0]
    E = scenarios_ZLE.shape[2]
    holds_LGE = holds_per_gpu(phy2log_LP, G, E)
    gpu_ZLG = _gpu_loads(phy2log_LP, scenarios_ZLE, holds_LGE.sum(axis=1), G)
    mean_ZL = np.maximum(gpu_ZLG.mean(axis=-1), 1e-300)
    hot_L = critical_gpu(gpu_ZLG, mean_ZL, weights_Z)
    return np.flatnonzero(holds_LGE[np.arange(L), hot_L].max(axis=1) >= 2)


def recount_phy2log(
    phy2log_LP: np.ndarray,
    scenarios_ZLE: np.ndarray,
    weights_Z: np.ndarray,
    num_gpus: int,
    stats: dict[str, float],
) -> np.ndarray:
    """int64 [L, P]: ``phy2log_LP`` with the layers of :func:`stacked_layers` searched over replica
    counts and placement (module docstring); the other layers unchanged. ``stats``: ``recount_layers`` (layers searched) and ``recounted_layers``
    (layers changed)."""
    G = num_gpus
    out = np.asarray(phy2log_LP, dtype=np.int64).copy()
    P = out.shape[1]
    E = scenarios_ZLE.shape[2]
    small = math.comb(P - 1, E - 1) <= MAX_COUNT_VECTORS
    # Only where the busiest GPU is over SEARCH_FROM times the mean (STACKED_FROM for a large
    # layer's local search): a plan within it stays as it is.
    if small:
        layers = _imbalanced_layers(out, scenarios_ZLE, weights_Z, G, SEARCH_FROM)
    else:
        layers = np.intersect1d(
            _imbalanced_layers(out, scenarios_ZLE, weights_Z, G, STACKED_FROM),
            stacked_layers(out, scenarios_ZLE, weights_Z, G),
        )
    changed = 0
    for layer in layers.tolist():
        load_ZE = scenarios_ZLE[:, layer]
        given = out[layer]
        best, best_score = given, _exact(given, load_ZE, weights_Z, G)
        candidates = [
            _search(start, load_ZE, weights_Z, G)
            for start in (given, _capped_start(given, load_ZE, weights_Z, G))
        ]
        if small:
            candidates.append(_best_of_counts(load_ZE, weights_Z, G, _all_counts(E, P)))
        for row, score in candidates:
            if score > best_score + 1e-9:
                best, best_score = row, score
        if best is not given:
            out[layer] = best
            changed += 1
    stats["recount_layers"] = float(layers.size)
    stats["recounted_layers"] = float(changed)
    return out


def spread_over_nodes(row_P: np.ndarray, load_E: np.ndarray, G: int, N: int) -> np.ndarray:
    """int64 [P]: ``row_P`` with its GPUs (whole, so every GPU's load stays) ordered over the nodes
    so that each replicated expert's replicas spread over them: GPUs holding the most replicated
    load first, each into the node with room where its replicas meet the least load of the
    same experts (ties: the lower node). Kept only where that spreads more than the row given
    (the sum over experts of load per replica times same-node replica pairs)."""
    if N <= 1:
        return row_P
    E = load_E.size
    S, gpn = row_P.size // G, G // N
    holds_GE = np.zeros((G, E), dtype=np.int64)
    np.add.at(holds_GE, (np.arange(row_P.size) // S, row_P), 1)
    cnt_E = holds_GE.sum(axis=0)
    weight_E = np.where(cnt_E >= 2, load_E / cnt_E, 0.0)

    def crowding(node_of_G: np.ndarray) -> float:
        node_NE = np.zeros((N, E))
        np.add.at(node_NE, node_of_G, holds_GE)
        return float((node_NE * (node_NE - 1) * weight_E).sum())

    node_NE = np.zeros((N, E))
    room_N = np.full(N, gpn)
    node_of_G = np.empty(G, dtype=np.int64)
    for g in np.argsort(-(holds_GE * weight_E).sum(axis=1), kind="stable").tolist():
        cost_N = np.where(room_N > 0, node_NE @ (holds_GE[g] * weight_E), np.inf)
        n = int(np.argmin(cost_N))
        node_of_G[g] = n
        node_NE[n] += holds_GE[g]
        room_N[n] -= 1
    if crowding(node_of_G) >= crowding(np.arange(G) // gpn) - 1e-12:
        return row_P
    # GPUs of node n, in their old order, fill its positions.
    order_G = np.argsort(node_of_G, kind="stable")
    return row_P.reshape(G, S)[order_G].reshape(-1).copy()


def _gpu_loads(phy2log_LP: np.ndarray, scenarios_ZLE: np.ndarray, cnt_LE: np.ndarray, G: int) -> np.ndarray:
    """float64 [Z, L, G]: GPU loads under an even split over replicas."""
    L, P = phy2log_LP.shape
    layer = np.arange(L)[:, None]
    item_ZLP = scenarios_ZLE[:, layer, phy2log_LP] / cnt_LE[layer, phy2log_LP]
    return item_ZLP.reshape(-1, L, G, P // G).sum(axis=-1)


def _exact(row_P: np.ndarray, load_ZE: np.ndarray, weights_Z: np.ndarray, G: int) -> float:
    """The row's expected balancedness (an even split over replicas)."""
    cnt_E = np.bincount(row_P, minlength=load_ZE.shape[1])
    gpu_ZG = (load_ZE[:, row_P] / cnt_E[row_P]).reshape(-1, G, row_P.size // G).sum(axis=-1)
    return float(expected_balancedness(gpu_ZG[:, None, :], weights_Z)[0])


def _capped_start(row_P: np.ndarray, load_ZE: np.ndarray, weights_Z: np.ndarray, G: int) -> np.ndarray:
    """int64 [P]: counts by the greedy on the expected load with at most one replica per GPU
    (while the slots allow), packed heaviest first into the lightest GPU that has room."""
    P, E = row_P.size, load_ZE.shape[1]
    load_E = expectation(weights_Z, load_ZE).astype(np.float64)
    cnt_E = np.ones(E, dtype=np.int64)
    for _ in range(P - E):
        per_E = load_E / cnt_E
        open_E = cnt_E < G
        best = int(np.argmax(np.where(open_E, per_E, -np.inf))) if open_E.any() else int(np.argmax(per_E))
        cnt_E[best] += 1
    experts_U = np.repeat(np.arange(E), cnt_E)
    bin_U, rank_U = balanced_packing((load_E / cnt_E)[experts_U][None, :], G)
    out = np.empty(P, dtype=np.int64)
    out[bin_U[0] * (P // G) + rank_U[0]] = experts_U
    return out


def _search(
    start_P: np.ndarray, load_ZE: np.ndarray, weights_Z: np.ndarray, G: int
) -> tuple[np.ndarray, float]:
    """(the best row met, its exact expected balancedness): steepest soft-balancedness steps from
    ``start_P``. Moves: a slot of the hot GPU (the largest expected share of the soft maximum)
    swaps with a slot of another GPU; a replica of an expert held twice or more, on the hot GPU
    or stacked on any GPU, is given to another expert."""
    P, E = start_P.size, load_ZE.shape[1]
    S = P // G
    mean_Z = load_ZE.sum(axis=1) / G
    w_ZE = load_ZE / np.where(mean_Z > 0, mean_Z, 1.0)[:, None]
    row = start_P.copy()
    gpu_P = np.arange(P) // S
    best, best_score = row.copy(), _exact(row, load_ZE, weights_Z, G)
    holds_GE = np.zeros((G, E), dtype=np.int64)
    np.add.at(holds_GE, (gpu_P, row), 1)
    for _ in range(MAX_MOVES_PER_LAYER):
        cnt_E = holds_GE.sum(axis=0)
        item_ZP = w_ZE[:, row] / cnt_E[row]
        gpu_ZG = item_ZP.reshape(-1, G, S).sum(axis=-1)
        pow_ZG = _pow32(gpu_ZG)
        base_Z = pow_ZG.sum(axis=-1)
        value = float(expectation(weights_Z, base_Z ** (-1 / 32)))
        hot = int(np.argmax(expectation(weights_Z, pow_ZG / base_Z[:, None])))
        hot_S = hot * S + np.arange(S)
        # Swaps: hot slot a and slot b of another GPU trade contents.
        d_ZSP = item_ZP[:, None, :] - item_ZP[:, hot_S, None]  # what the hot GPU gains
        rest_ZSP = (base_Z - pow_ZG[:, hot])[:, None, None] - pow_ZG[:, gpu_P][:, None, :]
        U_swap = (
            rest_ZSP
            + _pow32(gpu_ZG[:, hot, None, None] + d_ZSP)
            + _pow32(gpu_ZG[:, gpu_P][:, None, :] - d_ZSP)
        )
        swap_ok = (gpu_P[None, :] != hot) & (row[hot_S][:, None] != row[None, :])
        gain_swap = np.where(
            swap_ok, expectation(weights_Z, np.maximum(U_swap, 1e-300) ** (-1 / 32)) - value, -np.inf
        )
        # Recounts: one replica of e on GPU g given to expert f.
        giver_GE = (holds_GE >= 2) | ((np.arange(G) == hot)[:, None] & (holds_GE > 0))
        g_c, e_c = np.nonzero(giver_GE & (cnt_E[None, :] >= 2))
        gain_rec = np.full((g_c.size, E), -np.inf)
        if g_c.size:
            c_c = np.arange(g_c.size)
            ce_c = cnt_E[e_c]
            # e's replicas share its load over one fewer, f's over one more, and g trades one for the other.
            he_cG = holds_GE[:, e_c].T
            we_Zc = w_ZE[:, e_c]
            x_ZcG = gpu_ZG[:, None, :] + he_cG[None] * (we_Zc / (ce_c - 1) - we_Zc / ce_c)[..., None]
            x_ZcG[:, c_c, g_c] -= we_Zc / (ce_c - 1)
            x_ZcEG = (
                x_ZcG[:, :, None, :]
                + holds_GE.T[None, None] * (w_ZE / (cnt_E + 1) - w_ZE / cnt_E)[:, None, :, None]
            )
            x_ZcEG[:, c_c, :, g_c] += (w_ZE / (cnt_E + 1))[None]  # indexed: [c, Z, E]
            U_rec = np.maximum(_pow32(x_ZcEG).sum(axis=-1), 1e-300)
            gain = expectation(weights_Z, U_rec ** (-1 / 32)) - value
            gain_rec = np.where(np.arange(E)[None, :] != e_c[:, None], gain, -np.inf)
        best_swap = float(gain_swap.max())
        best_rec = float(gain_rec.max()) if g_c.size else -np.inf
        unstack, best_unstack = _best_unstack(row, holds_GE, w_ZE, weights_Z, G, value)
        if max(best_swap, best_rec, best_unstack) <= _MIN_GAIN:
            break
        if best_unstack > max(best_swap, best_rec):
            assert unstack is not None
            row[:] = unstack
            holds_GE[:] = 0
            np.add.at(holds_GE, (gpu_P, row), 1)
        elif best_rec > best_swap:
            c, f = np.unravel_index(int(np.argmax(gain_rec)), gain_rec.shape)
            g, e = int(g_c[c]), int(e_c[c])
            slot = int(np.flatnonzero((gpu_P == g) & (row == e))[0])
            row[slot] = int(f)
            holds_GE[g, e] -= 1
            holds_GE[g, int(f)] += 1
        else:
            s_hot, b = np.unravel_index(int(np.argmax(gain_swap)), gain_swap.shape)
            a = int(hot_S[s_hot])
            ea, eb = int(row[a]), int(row[b])
            row[a], row[b] = eb, ea
            holds_GE[hot, ea] -= 1
            holds_GE[hot, eb] += 1
            holds_GE[gpu_P[b], eb] -= 1
            holds_GE[gpu_P[b], ea] += 1
        score = _exact(row, load_ZE, weights_Z, G)
        if score > best_score + 1e-12:
            best, best_score = row.copy(), score
    return best, best_score


def _best_unstack(
    row_P: np.ndarray, holds_GE: np.ndarray, w_ZE: np.ndarray, weights_Z: np.ndarray, G: int, value: float
) -> tuple[np.ndarray | None, float]:
    """(the row, its soft-balancedness gain) of the best *unstack*: an expert stacked on several
    GPUs gives up one replica on each at once (one at a time, each lighter replica left would
    raise the other stacked GPUs: only together do they drop), each freed slot then going to the
    expert that leaves the most soft balancedness, slot by slot."""
    S = row_P.size // G
    gpu_P = np.arange(row_P.size) // S
    best: np.ndarray | None = None
    best_gain = -np.inf
    for e in np.flatnonzero((holds_GE >= 2).sum(axis=0) >= 2).tolist():
        trial, holds = row_P.copy(), holds_GE.copy()
        freed = [
            int(np.flatnonzero((gpu_P == g) & (row_P == e))[0]) for g in np.flatnonzero(holds[:, e] >= 2)
        ]
        for slot in freed:
            holds[gpu_P[slot], e] -= 1
        for slot in freed:
            g = int(gpu_P[slot])
            cnt_E = holds.sum(axis=0)
            item_ZP = np.where(
                np.isin(np.arange(row_P.size), freed), 0.0, w_ZE[:, trial] / np.maximum(cnt_E[trial], 1)
            )
            gpu_ZG = item_ZP.reshape(-1, G, S).sum(axis=-1)
            # Expert f takes the slot: its replicas share its load over one more.
            x_ZEG = (
                gpu_ZG[:, None, :]
                + holds.T[None] * (w_ZE / (cnt_E + 1) - w_ZE / np.maximum(cnt_E, 1))[..., None]
            )
            x_ZEG[:, :, g] += w_ZE / (cnt_E + 1)
            soft_E = expectation(weights_Z, np.maximum(_pow32(x_ZEG).sum(axis=-1), 1e-300) ** (-1 / 32))
            soft_E[e] = -np.inf
            f = int(np.argmax(soft_E))
            trial[slot] = f
            holds[g, f] += 1
            freed = [x for x in freed if x != slot]
        cnt_E = holds.sum(axis=0)
        gpu_ZG = (w_ZE[:, trial] / cnt_E[trial]).reshape(-1, G, S).sum(axis=-1)
        gain = (
            float(expectation(weights_Z, np.maximum(_pow32(gpu_ZG).sum(axis=-1), 1e-300) ** (-1 / 32)))
            - value
        )
        if gain > best_gain:
            best, best_gain = trial, gain
    return best, best_gain


def _pow32(x: np.ndarray) -> np.ndarray:
    """x**32 by five squarings (a new array)."""
    y = x * x
    for _ in range(4):
        y *= y
    return y


def _imbalanced_layers(
    phy2log_LP: np.ndarray, scenarios_ZLE: np.ndarray, weights_Z: np.ndarray, G: int, bound: float
) -> np.ndarray:
    """int [l]: the layers whose expected balancedness is below ``1 / bound``."""
    E = scenarios_ZLE.shape[2]
    gpu_ZLG = _gpu_loads(phy2log_LP, scenarios_ZLE, holds_per_gpu(phy2log_LP, G, E).sum(axis=1), G)
    return np.flatnonzero(expected_balancedness(gpu_ZLG, weights_Z) * bound < 1.0)


def _all_counts(E: int, P: int) -> np.ndarray:
    """int64 [x, E]: every way to give E experts P slots, each at least one (stars and bars)."""
    cuts_xK = np.array(list(itertools.combinations(range(1, P), E - 1)), dtype=np.int64).reshape(-1, E - 1)
    x = cuts_xK.shape[0]
    edges = np.concatenate([np.zeros((x, 1), np.int64), cuts_xK, np.full((x, 1), P, np.int64)], axis=1)
    return np.diff(edges, axis=1)


def _best_of_counts(
    load_ZE: np.ndarray, weights_Z: np.ndarray, G: int, cnt_xE: np.ndarray
) -> tuple[np.ndarray, float]:
    """(row [P], its exact score): each count vector packed heaviest first into the lightest GPU
    with room and polished by the fresh plan's swap search (its rows as layers), the best kept."""
    from eplb.solver.search import local_search as ls

    x, E = cnt_xE.shape
    P = int(cnt_xE[0].sum())
    load_E = expectation(weights_Z, load_ZE)
    experts_xP = np.stack([np.repeat(np.arange(E), row) for row in cnt_xE])
    items_xP = load_E[experts_xP] / np.take_along_axis(cnt_xE, experts_xP, axis=1)
    bin_xP, rank_xP = balanced_packing(items_xP, G)
    rows_xP = np.empty_like(experts_xP)
    np.put_along_axis(rows_xP, bin_xP * (P // G) + rank_xP, experts_xP, axis=1)
    scenarios_ZxE = np.broadcast_to(load_ZE[:, None, :], (load_ZE.shape[0], x, E))
    state = ls.make_swap_state(rows_xP, scenarios_ZxE, cnt_xE, G)
    ls.swap_search(state, weights_Z, G)
    gpu_ZxG = state.item_ZLP.reshape(-1, x, G, P // G).sum(axis=-1)
    score_x = expected_balancedness(gpu_ZxG, weights_Z)
    best = int(np.argmax(score_x))  # the first count vector among ties
    return state.phy2log_LP[best].copy(), float(score_x[best])
