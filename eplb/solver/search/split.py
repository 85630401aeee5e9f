"""LP split of each expert's load over its replicas: per-replica weights for weighted dispatch.

Shape legend: L layers, E logical experts, P physical slots, G GPUs, S slots per GPU, R max replicas.

For a fixed placement, the split x[l, p] >= 0 of expert load over the slots holding it that
minimises the busiest GPU is a linear program. Many splits reach that optimum; the one furthest
from the even split overfits the window it was fitted on (docs/benchmarks.md, Solver), so a second LP picks,
among the optimal splits, the one closest to the even split in L1 distance. Both LPs cover all
layers at once (block-diagonal, one ``scipy.optimize.linprog`` call each, HiGHS).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from scipy.optimize import linprog

from eplb.placement.model import Placement


def lp_split(load_LE: np.ndarray, placement: Placement, tolerance: float = 1e-6) -> np.ndarray:
    """float32 [L, E, R]: per-replica dispatch weights (sum 1 per expert, 0 on padding).

    Args:
        load_LE: float [L, E] predicted load per logical expert (non-negative).
        placement: where the replicas are.
        tolerance: relative slack on the optimal busiest GPU allowed while moving towards the even split.
    """
    L, P, G = placement.num_layers, placement.num_physical, placement.num_gpus
    p2l_LP = placement.phy2log_LP
    layer_LP = np.arange(L)[:, None]
    cnt_LP = placement.logcnt_LE[layer_LP, p2l_LP].astype(np.float64)
    # Per-layer scale to O(1) numbers: the mean GPU load.
    scale_L = np.maximum(load_LE.sum(axis=1) / G, 1e-300)
    load_LE = load_LE / scale_L[:, None]
    even_LP = load_LE[layer_LP, p2l_LP] / cnt_LP

    multi_LP = cnt_LP > 1
    if not multi_LP.any():
        share_LP = np.ones((L, P))
    else:
        x_LP = _solve_split(load_LE, placement, even_LP, tolerance)
        with np.errstate(invalid="ignore", divide="ignore"):
            expert_load_LP = load_LE[layer_LP, p2l_LP]
            share_LP = np.where(expert_load_LP > 0, x_LP / np.where(expert_load_LP > 0, expert_load_LP, 1), 0)
        share_LP = np.where(expert_load_LP > 0, share_LP, 1.0 / cnt_LP)
        # Renormalise per expert (LP tolerances) so every expert's weights sum to exactly 1.
        share_LP = np.clip(share_LP, 0.0, None)
        totals_LE = np.zeros(placement.logcnt_LE.shape)
        np.add.at(totals_LE, (np.broadcast_to(layer_LP, (L, P)), p2l_LP), share_LP)
        share_LP = share_LP / totals_LE[layer_LP, p2l_LP]
    weights_LER = np.zeros(placement.log2phy_LER.shape, dtype=np.float32)
    used = placement.log2phy_LER >= 0
    layer_LER = np.broadcast_to(np.arange(L)[:, None, None], used.shape)
    weights_LER[used] = share_LP[layer_LER[used], placement.log2phy_LER[used]]
    return weights_LER


def _solve_split(
    load_LE: np.ndarray, placement: Placement, even_LP: np.ndarray, tolerance: float
) -> np.ndarray:
    """float64 [L, P]: tokens per slot (scaled), optimal busiest GPU, then closest to the even split."""
    L, P, G, E = placement.num_layers, placement.num_physical, placement.num_gpus, placement.num_logical
    S = placement.slots_per_gpu
    n_x = L * P
    slot = np.arange(n_x)
    layer_of = slot // P
    # Equalities: the replicas of expert (l, e) carry its whole load.
    expert_row = layer_of * E + placement.phy2log_LP.ravel()
    a_eq = sp.csr_matrix((np.ones(n_x), (expert_row, slot)), shape=(L * E, n_x))
    b_eq = load_LE.ravel()
    # GPU rows: sum of the GPU's slots.
    gpu_row = layer_of * G + (slot % P) // S
    a_gpu = sp.csr_matrix((np.ones(n_x), (gpu_row, slot)), shape=(L * G, n_x))
    z_of_gpu = sp.csr_matrix((-np.ones(L * G), (np.arange(L * G), np.arange(L * G) // G)), shape=(L * G, L))

    # Stage 1: min sum_l z_l s.t. gpu load <= z_l.
    cost = np.concatenate([np.zeros(n_x), np.ones(L)])
    res = linprog(
        cost,
        A_ub=sp.hstack([a_gpu, z_of_gpu]).tocsr(),
        b_ub=np.zeros(L * G),
        A_eq=sp.hstack([a_eq, sp.csr_matrix((L * E, L))]).tocsr(),
        b_eq=b_eq,
        bounds=(0, None),
        method="highs",
    )
    if res.status != 0:
        raise RuntimeError(f"LP split (stage 1) failed: {res.message}")
    z_L = res.x[n_x:]

    # Stage 2: min sum |x - even| s.t. gpu load <= z_l (1 + tolerance), with t >= |x - even|.
    eye = sp.identity(n_x, format="csr")
    a_ub = sp.vstack(
        [
            sp.hstack([a_gpu, sp.csr_matrix((L * G, n_x))]),
            sp.hstack([eye, -eye]),
            sp.hstack([-eye, -eye]),
        ]
    ).tocsr()
    even = even_LP.ravel()
    b_ub = np.concatenate([np.repeat(z_L * (1 + tolerance) + 1e-9, G), even, -even])
    res2 = linprog(
        np.concatenate([np.zeros(n_x), np.ones(n_x)]),
        A_ub=a_ub,
        b_ub=b_ub,
        A_eq=sp.hstack([a_eq, sp.csr_matrix((L * E, n_x))]).tocsr(),
        b_eq=b_eq,
        bounds=(0, None),
        method="highs",
    )
    x = res2.x[:n_x] if res2.status == 0 else res.x[:n_x]
    return np.asarray(x, dtype=np.float64).reshape(L, P)
