"""The swap polish of a fresh plan, on the expected balancedness over the forecast's scenarios.

Shape legend: Z scenarios, L layers, E logical experts, P physical slots, G GPUs, S slots per GPU, l
layers (being searched), B bins (the partner GPUs of the critical one), Q partner slots.

A layer's score is the expected balancedness ``sum_k pi_k mean_k / max_k`` of its GPU loads over
the scenarios (eplb.solver.scoring.served.layer_scores; one scenario: the plain balancedness). The
polish (:func:`swap_search`) improves a fresh placement, where moves cost nothing: replica counts
are fixed, so an item's load (expert load / replicas) is fixed and a move exchanges the contents of
two slots on different GPUs. Each round, every layer takes its best swap between its critical GPU
(the one that is the busiest in the most weight of scenarios) and any slot of a lighter GPU: the
swap step every search takes (eplb.solver.search.swap), scored here by the exact expected
balancedness with nothing to pay. Rounds are numpy operations over all layers; a layer leaves the
search when no swap gains. Plans from a live placement, where copies cost, are searched by
eplb.solver.search.budget (the same step scored by soft balancedness per copy, one copy ledger,
eplb.solver.search.copies).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eplb.solver.scoring.served import expectation
from eplb.solver.search.copies import holds_per_gpu
from eplb.solver.search.swap import SwapCandidates, critical_gpu, lightest_partners, pair_peak, swap_slots

_TOL = 1e-12


@dataclass
class SwapState:
    """The swap polish's state (all arrays are updated in place)."""

    phy2log_LP: np.ndarray
    """int64 [L, P]: expert in each slot."""
    item_ZLP: np.ndarray
    """float64 [Z, L, P]: load each slot carries in each scenario."""
    holds_LGE: np.ndarray
    """int64 [L, G, E]: replicas of expert e on GPU g."""


def make_swap_state(
    phy2log_LP: np.ndarray,
    scenarios_ZLE: np.ndarray,
    logcnt_LE: np.ndarray,
    num_gpus: int,
) -> SwapState:
    """The swap polish's state for a placement ``phy2log_LP`` with replica counts ``logcnt_LE``."""
    L = phy2log_LP.shape[0]
    E = logcnt_LE.shape[1]
    layer = np.arange(L)[:, None]
    item_ZLP = scenarios_ZLE[:, layer, phy2log_LP] / logcnt_LE[layer, phy2log_LP]
    return SwapState(phy2log_LP.astype(np.int64), item_ZLP, holds_per_gpu(phy2log_LP, num_gpus, E))


def swap_search(
    state: SwapState,
    weights_Z: np.ndarray,
    num_gpus: int,
    max_rounds: int = 10_000,
    min_gain: float = 1e-5,
) -> int:
    """Improve ``state`` in place by single swaps on the expected balancedness (the busiest GPU);
    returns the number of swaps made. ``max_rounds`` caps the rounds (a count, so every rank finds
    the same swaps); a swap must gain more than ``min_gain``."""
    _, L, P = state.item_ZLP.shape
    G, S = num_gpus, P // num_gpus
    active = np.ones(L, dtype=bool)
    swaps = 0
    for _ in range(max_rounds):
        layers = np.flatnonzero(active)
        if layers.size == 0:
            break
        found, slot_a, slot_b = _best_swaps(state, layers, weights_Z, G, S, min_gain)
        active[layers[~found]] = False
        for layer, a, b in zip(layers[found], slot_a[found], slot_b[found], strict=True):
            swap_slots(
                state.phy2log_LP[layer],
                state.item_ZLP[:, layer],
                state.holds_LGE[layer],
                a,
                b,
                a // S,
                b // S,
            )
            swaps += 1
    return swaps


def _best_swaps(
    state: SwapState,
    layers: np.ndarray,
    weights_Z: np.ndarray,
    G: int,
    S: int,
    min_gain: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each layer in ``layers``: whether a gaining swap exists, and its two slots.

    Partners are the slots of the lighter GPUs only (the lightest half, at least four GPUs): a
    swap with a GPU near the top cannot lower the top, and halving the candidates halves the work.
    """
    item = state.item_ZLP[:, layers]  # [Z, l, P]
    Z, nl, _ = item.shape
    rows = np.arange(nl)
    if G == 1:
        nothing = np.zeros(nl, dtype=np.int64)
        return np.zeros(nl, dtype=bool), nothing, nothing
    gpu_ZlG = item.reshape(Z, nl, G, S).sum(axis=-1)
    mean_Zl = np.maximum(gpu_ZlG.mean(axis=-1), 1e-300)
    hot_l = critical_gpu(gpu_ZlG, mean_Zl, weights_Z)
    expected_lG = expectation(weights_Z, gpu_ZlG / mean_Zl[..., None])
    num_partners = max(1, min(G - 1, max(4, G // 2)))
    cand = SwapCandidates.of(
        state.item_ZLP,
        state.phy2log_LP,
        layers,
        hot_l,
        lightest_partners(expected_lG, hot_l, num_partners),
        S,
    )
    Q = cand.num_partner_slots
    hot_load_Zl = gpu_ZlG[:, rows, hot_l]
    other_load_ZlQ = np.take_along_axis(gpu_ZlG, np.broadcast_to(cand.gpu_lQ, (Z, nl, Q)), axis=-1)
    peak_ZlSQ = pair_peak(hot_load_Zl[:, :, None, None], other_load_ZlQ[:, :, None, :], cand.delta_ZlSQ())
    gain_lSQ = _peak_gain(gpu_ZlG, mean_Zl, hot_l, cand.gpu_lQ, peak_ZlSQ, weights_Z)
    net = np.where(cand.distinct_lSQ(), gain_lSQ, -np.inf).reshape(nl, -1)
    flat = net.argmax(axis=1)
    found = net[rows, flat] > max(min_gain, _TOL)
    slot_a, slot_b = cand.slots(flat)
    return found, slot_a, slot_b


def _peak_gain(
    gpu_ZlG: np.ndarray,
    mean_Zl: np.ndarray,
    hot_l: np.ndarray,
    gpu_lQ: np.ndarray,
    pair_peak_ZlSQ: np.ndarray,
    weights_Z: np.ndarray,
) -> np.ndarray:
    """float64 [l, S, Q]: change in expected balancedness of each candidate swap, from the higher
    of its two GPUs' new loads."""
    G = gpu_ZlG.shape[-1]
    order = np.argsort(-gpu_ZlG, axis=-1)[..., : min(3, G)]
    top_val = np.take_along_axis(gpu_ZlG, order, axis=-1)
    peak_Zl = top_val[..., 0]
    # Busiest GPU other than the hot one and the partner's GPU, per partner slot.
    other_max_ZlQ = _max_excluding(top_val, order, hot_l, gpu_lQ)
    new_peak = np.maximum(pair_peak_ZlSQ, other_max_ZlQ[:, :, None, :])
    ratio_new = np.where(new_peak > 0, mean_Zl[..., None, None] / np.where(new_peak > 0, new_peak, 1.0), 1.0)
    ratio_old = np.where(peak_Zl > 0, mean_Zl / np.where(peak_Zl > 0, peak_Zl, 1.0), 1.0)
    return expectation(weights_Z, ratio_new - ratio_old[..., None, None])


def _max_excluding(
    top_val: np.ndarray, order: np.ndarray, hot_l: np.ndarray, gpu_lQ: np.ndarray
) -> np.ndarray:
    """float64 [Z, l, Q]: largest GPU load among GPUs other than the hot GPU and partner q's GPU."""
    Z, nl, top = top_val.shape
    Q = gpu_lQ.shape[1]
    result = np.zeros((Z, nl, Q))
    done = np.zeros((Z, nl, Q), dtype=bool)
    for t in range(top):
        idx = order[..., t][..., None]
        ok = (idx != hot_l[None, :, None]) & (idx != gpu_lQ[None]) & ~done
        result = np.where(ok, top_val[..., t][..., None], result)
        done |= ok
    return result
