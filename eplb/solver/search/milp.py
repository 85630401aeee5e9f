"""Exact repacking of a layer's critical GPUs with ``scipy.optimize.milp`` (HiGHS), within a solve count.

Shape legend: Z scenarios, L layers, E logical experts, P physical slots, G GPUs, S slots per GPU, U
items to pack (the replicas on the bins), B bins (the chosen GPUs).

Single swaps (local_search) stop at a local optimum; a MILP over the items of the critical GPU and
the least loaded GPUs (chosen as every swap search chooses them, eplb.solver.search.swap) finds
exchanges of several items at once: another algorithm than a swap search, not a second one. Per subproblem: binary x[i, b]
(item i on chosen GPU b), every item on one GPU, S items per GPU, and z_k >= load of every chosen
GPU in scenario k (z_k is bounded below by the busiest unchosen GPU). The objective is
sum_k pi_k z_k / mean_k, the busiest GPU in balancedness units. HiGHS has no warm start here, so a
solution is kept only when its exact expected balancedness beats the incumbent: never worse.
Layers are visited worst first until ``max_solves`` subproblems are solved. The limits are
counts (solves, and HiGHS branch-and-bound nodes per solve), not seconds, so the same input gives
the same plan on every machine; an optional wall-clock cap is for offline use only.
"""

from __future__ import annotations

import time

import numpy as np
import scipy.sparse as sp
from scipy.optimize import Bounds, LinearConstraint, milp

from eplb.solver.predict import Prediction
from eplb.solver.scoring.served import expected_balancedness
from eplb.solver.search.swap import critical_gpu, lightest_partners

NODE_LIMIT = 50
"""HiGHS branch-and-bound nodes per subproblem (its best solution so far is used past that)."""


def milp_polish(
    phy2log_LP: np.ndarray,
    cnt_LE: np.ndarray,
    prediction: Prediction,
    num_gpus: int,
    max_solves: int,
    stats: dict[str, float],
    gpus_per_subproblem: int = 4,
    time_budget_s: float | None = None,
) -> np.ndarray:
    """int64 [L, P]: ``phy2log_LP`` with critical GPUs repacked exactly where that helps.

    At most ``max_solves`` subproblems; ``time_budget_s`` (seconds, optional) also stops it, at
    the price of plans that depend on the machine's speed.
    """
    start = time.perf_counter()
    deadline = np.inf if time_budget_s is None else start + time_budget_s
    G = num_gpus
    L, P = phy2log_LP.shape
    S = P // G
    weights_Z = prediction.scenario_weights_Z
    out = phy2log_LP.copy()
    layer_idx = np.arange(L)[:, None]
    item_ZLP = prediction.scenarios_ZLE[:, layer_idx, out] / cnt_LE[layer_idx, out]
    score_L = expected_balancedness(item_ZLP.reshape(-1, L, G, S).sum(axis=-1), weights_Z)
    improved_layers = 0
    solves = 0
    for layer in np.argsort(score_L, kind="stable") if G > 1 else ():
        if score_L[layer] >= 1.0 - 1e-9:
            break
        layer_improved = False
        for _ in range(G):
            if solves >= max_solves or time.perf_counter() > deadline:
                break
            items_ZP = item_ZLP[:, layer]
            gpu_ZG = items_ZP.reshape(-1, G, S).sum(axis=-1)
            chosen = _choose_gpus(gpu_ZG, weights_Z, min(gpus_per_subproblem, G))
            perm = _solve_subproblem(items_ZP, gpu_ZG, chosen, S, weights_Z, deadline)
            solves += 1
            if perm is None:
                break
            slots = (chosen[:, None] * S + np.arange(S)).ravel()
            trial = items_ZP.copy()
            trial[:, slots] = items_ZP[:, slots[perm]]
            new_score = expected_balancedness(trial.reshape(-1, 1, G, S).sum(axis=-1), weights_Z)[0]
            if new_score <= score_L[layer] + 1e-12:
                break
            out[layer, slots] = out[layer, slots[perm]]
            item_ZLP[:, layer] = trial
            score_L[layer] = new_score
            layer_improved = True
        improved_layers += int(layer_improved)
        if solves >= max_solves or time.perf_counter() > deadline:
            break
    stats["milp_improved_layers"] = float(improved_layers)
    stats["milp_solves"] = float(solves)
    stats["milp_seconds"] = time.perf_counter() - start
    return out


def _choose_gpus(gpu_ZG: np.ndarray, weights_Z: np.ndarray, count: int) -> np.ndarray:
    """int [B]: the critical GPU (busiest in the most scenario weight) and the least loaded others."""
    hot_1 = critical_gpu(gpu_ZG[:, None, :], gpu_ZG.mean(axis=1)[:, None], weights_Z, power=0)
    others_1B = lightest_partners((weights_Z @ gpu_ZG)[None], hot_1, count - 1)
    return np.concatenate([hot_1, others_1B[0]]).astype(np.int64)


def _solve_subproblem(
    items_ZP: np.ndarray,
    gpu_ZG: np.ndarray,
    chosen_B: np.ndarray,
    S: int,
    weights_Z: np.ndarray,
    deadline: float,
) -> np.ndarray | None:
    """int [U]: for each position of the chosen GPUs' slots, which of their items goes there; None if no solution."""
    Z = items_ZP.shape[0]
    B = chosen_B.shape[0]
    slots = (chosen_B[:, None] * S + np.arange(S)).ravel()
    # Loads in units of each scenario's mean GPU load: HiGHS sees O(1) numbers whatever the counts.
    mean_Z = np.maximum(gpu_ZG.mean(axis=1), 1e-300)
    a_ZU = items_ZP[:, slots] / mean_Z[:, None]
    num_items = slots.size
    rest = np.delete(gpu_ZG, chosen_B, axis=1)
    floor_Z = rest.max(axis=1) / mean_Z if rest.shape[1] else np.zeros(Z)
    # Variables: x[i, b] (U*B binaries, item-major), then z[k].
    n_x = num_items * B
    item_of = np.repeat(np.arange(num_items), B)
    gpu_of = np.tile(np.arange(B), num_items)
    one_gpu = sp.csr_matrix((np.ones(n_x), (item_of, np.arange(n_x))), shape=(num_items, n_x))
    s_per_gpu = sp.csr_matrix((np.ones(n_x), (gpu_of, np.arange(n_x))), shape=(B, n_x))
    rows = (np.arange(Z)[:, None] * B + gpu_of[None, :]).ravel()
    cols = np.tile(np.arange(n_x), Z)
    load = sp.csr_matrix((a_ZU[:, item_of].ravel(), (rows, cols)), shape=(Z * B, n_x))
    z_part = sp.csr_matrix(
        (-np.ones(Z * B), (np.arange(Z * B), np.repeat(np.arange(Z), B))), shape=(Z * B, Z)
    )
    constraints = [
        LinearConstraint(sp.hstack([one_gpu, sp.csr_matrix((num_items, Z))]), 1, 1),
        LinearConstraint(sp.hstack([s_per_gpu, sp.csr_matrix((B, Z))]), S, S),
        LinearConstraint(sp.hstack([load, z_part]), -np.inf, 0),
    ]
    cost = np.concatenate([np.zeros(n_x), weights_Z])
    integrality = np.concatenate([np.ones(n_x), np.zeros(Z)])
    bounds = Bounds(
        np.concatenate([np.zeros(n_x), floor_Z]), np.concatenate([np.ones(n_x), np.full(Z, np.inf)])
    )
    options: dict[str, float | bool] = {"node_limit": NODE_LIMIT, "disp": False}
    if np.isfinite(deadline):
        remaining = deadline - time.perf_counter()
        if remaining <= 0.001:
            return None
        options["time_limit"] = remaining
    res = milp(cost, constraints=constraints, integrality=integrality, bounds=bounds, options=options)
    if res.x is None:
        return None
    x_UB = np.asarray(res.x[:n_x]).reshape(num_items, B) > 0.5
    if not (x_UB.sum(axis=1) == 1).all() or not (x_UB.sum(axis=0) == S).all():
        return None
    # Position p (GPU p // S of the chosen ones) receives the items assigned to that GPU.
    return np.concatenate([np.flatnonzero(x_UB[:, b]) for b in range(B)])
