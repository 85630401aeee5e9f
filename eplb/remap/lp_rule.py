"""The ``lp`` dispatch rule: split each replicated expert's tokens of this batch over its GPUs.

Shape legend: L layers, E logical experts, P physical slots, G GPUs, S slots per GPU, N replicated
experts (capacity ``max(1, P - E)``), D GPUs holding one expert (capacity ``min(G, P - E + 1)``),
B any leading batch shape.

Per layer, from the batch's global counts ``c[E]`` (summed over the EP ranks):

1. An expert with one replica sends everything there; these fix each GPU's base load.
2. Each replicated expert starts split evenly over the distinct GPUs holding it (each GPU's first
   replica of the expert; ``c // D`` each, one more for the first ``c % D`` GPUs by ascending id).
3. :data:`LP_PASSES` times, the replicated experts, heaviest first (ties: lower expert id first),
   each take their tokens back and water-fill them over their GPUs against the loads of all the
   others: with levels ``b_d``, the level reached is the largest integer ``w`` with
   ``sum_d max(0, w - b_d) <= c``; GPU ``d`` gets ``max(0, w - b_d)``, and the remainder goes one
   token each to the first GPUs (ascending id) whose level was at most ``w``. A re-fill never
   raises the highest of its GPUs, so each pass keeps or lowers the layer's peak (a coordinate
   descent on the min-max split that SGLang solves as an LP).
4. A token's global position among its expert's tokens orders ranks by rank, then the rank's
   valid elements in flat ``[T, K]`` order; positions ``[0, q_0)`` go to the first GPU's replica,
   ``[q_0, q_0 + q_1)`` to the second, and so on, so the quotas are met exactly and every rank
   computes the same split from the same all-gathered counts.

This module is numpy only (the simulator uses it; torch and the kernels implement the same rule):
:func:`lp_tables` builds the per-layer tables from a placement, :func:`lp_quotas` the quotas.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from eplb.placement.model import Placement

LP_PASSES = 2
"""Re-fill passes over the replicated experts. On one scipy plan of the deepseek-v3 preset the
next window's prefill balancedness read 0.854 with the even split alone, then 0.897, 0.909 and
0.913 after one, two and three passes: two keep most of the gain at two thirds of three's cost."""


class LpTables(NamedTuple):
    """What the rule needs from a placement, int32 with fixed shapes (so device copies update in place)."""

    expert_LN: np.ndarray
    """int32 [L, N]: the replicated experts of each layer in ascending id, padded with -1."""
    slot_LND: np.ndarray
    """int32 [L, N, D]: each replicated expert's first replica on each GPU holding it, by ascending
    GPU, padded with -1."""
    index_LE: np.ndarray
    """int32 [L, E]: the expert's row in ``expert_LN``, -1 where it has one replica."""
    single_slot_LE: np.ndarray
    """int32 [L, E]: the one slot of an expert with one replica, -1 for replicated experts."""
    slot_LNG: np.ndarray
    """int32 [L, N, G]: ``slot_LND`` by GPU: the expert's first replica on GPU g, -1 where g holds none."""
    slots_per_gpu: int
    """S: slot ``p`` lives on GPU ``p // S``."""
    num_gpus: int
    """G."""


def lp_capacity(num_logical: int, num_physical: int, num_gpus: int) -> tuple[int, int]:
    """(N, D): rows for replicated experts and columns for the GPUs holding one of them."""
    redundant = num_physical - num_logical
    return max(1, redundant), max(1, min(num_gpus, redundant + 1))


def lp_tables(placement: Placement) -> LpTables:
    """The placement's :class:`LpTables`."""
    pl = placement
    L, E, P, G = pl.num_layers, pl.num_logical, pl.num_physical, pl.num_gpus
    N, D = lp_capacity(E, P, G)
    S = pl.slots_per_gpu
    expert_LN = np.full((L, N), -1, dtype=np.int32)
    slot_LND = np.full((L, N, D), -1, dtype=np.int32)
    index_LE = np.full((L, E), -1, dtype=np.int32)
    single_slot_LE = np.where(pl.logcnt_LE == 1, pl.log2phy_LER[:, :, 0], -1).astype(np.int32)
    for layer in range(L):
        replicated = np.flatnonzero(pl.logcnt_LE[layer] >= 2)
        assert replicated.size <= N, "more replicated experts than redundant slots"
        expert_LN[layer, : replicated.size] = replicated
        index_LE[layer, replicated] = np.arange(replicated.size, dtype=np.int32)
        for n, expert in enumerate(replicated):
            slots = np.sort(pl.log2phy_LER[layer, expert, : pl.logcnt_LE[layer, expert]])
            _, first = np.unique(slots // S, return_index=True)  # lowest slot on each GPU, by GPU
            slot_LND[layer, n, : first.size] = slots[first]
    slot_LNG = np.full((L, N, G), -1, dtype=np.int32)
    layer_LND, n_LND = np.indices(slot_LND.shape)[:2]
    held = slot_LND >= 0
    slot_LNG[layer_LND[held], n_LND[held], slot_LND[held] // S] = slot_LND[held]
    return LpTables(expert_LN, slot_LND, index_LE, single_slot_LE, slot_LNG, S, G)


def water_fill(amount_B: np.ndarray, levels_BD: np.ndarray, valid_BD: np.ndarray) -> np.ndarray:
    """int64 [B, D]: ``amount`` split over the valid columns by the rule's water-filling (step 2).

    ``levels`` are the columns' current loads. Every row needs at least one valid column when its
    amount is positive.
    """
    amount = amount_B.astype(np.int64)
    levels = levels_BD.astype(np.int64)
    big = np.iinfo(np.int64).max
    # Level reached: the smallest candidate floor((c + sum of the k lowest levels) / k) that
    # reaches the k-th lowest level (a prefix whose candidate stays below its own top overshoots).
    sorted_BD = np.sort(np.where(valid_BD, levels, big), axis=-1)
    k_D = np.arange(1, levels.shape[-1] + 1)
    usable_BD = k_D <= valid_BD.sum(axis=-1, keepdims=True)
    prefix_BD = np.cumsum(np.where(usable_BD, sorted_BD, 0), axis=-1)
    cand_BD = (amount[..., None] + prefix_BD) // k_D
    feasible_BD = usable_BD & (cand_BD >= sorted_BD)
    level_B = np.where(feasible_BD.any(axis=-1), np.min(np.where(feasible_BD, cand_BD, big), axis=-1), 0)
    quota_BD = np.where(valid_BD, np.maximum(level_B[..., None] - levels, 0), 0)
    rest_B = amount - quota_BD.sum(axis=-1)
    eligible = valid_BD & (levels <= level_B[..., None])
    extra = eligible & (np.cumsum(eligible, axis=-1) <= rest_B[..., None])
    return quota_BD + extra


def lp_quotas(counts_LBE: np.ndarray, tables: LpTables) -> tuple[np.ndarray, np.ndarray]:
    """(quotas int64 [L, B, N, D], GPU loads int64 [L, B, G]) of global counts [L, B, E] (B: batches)."""
    counts = np.asarray(counts_LBE).astype(np.int64)
    L, Bn, _ = counts.shape
    N, D = tables.slot_LND.shape[1:]
    G, S = tables.num_gpus, tables.slots_per_gpu
    expert_LN, slot_LND = tables.expert_LN, tables.slot_LND
    single_LE = tables.single_slot_LE >= 0
    onehot_LEG = single_LE[:, :, None] & (
        (tables.single_slot_LE // S)[:, :, None] == np.arange(G)[None, None, :]
    )
    # One spare column past the last GPU takes the padding entries' (zero) quotas, so every row's
    # GPU indices are distinct and plain fancy-index updates replace np.add.at in the loop.
    loads_LBG = np.zeros((L, Bn, G + 1), dtype=np.int64)
    # float64 products are exact below 2**53 and take BLAS (numpy's int64 matmul does not).
    loads_LBG[:, :, :G] = np.rint(np.matmul(counts.astype(np.float64), onehot_LEG.astype(np.float64)))
    rep_LBN = np.where(
        expert_LN[:, None, :] >= 0,
        np.take_along_axis(counts, np.maximum(expert_LN, 0)[:, None, :].repeat(Bn, axis=1), axis=2),
        -1,
    )
    # Heaviest first; ties by lower row (lower expert id); padding rows (-1) last.
    order_LBN = np.argsort(-rep_LBN, axis=2, kind="stable")
    layer_LB = np.broadcast_to(np.arange(L)[:, None], (L, Bn))
    batch_LB = np.broadcast_to(np.arange(Bn)[None, :], (L, Bn))
    valid_LND = slot_LND >= 0
    gpu_LND = np.where(valid_LND, slot_LND // S, G)
    # Step 2: the even split.
    amount_LBN = np.maximum(rep_LBN, 0)
    width_LN = np.maximum(valid_LND.sum(axis=2), 1)
    even_LBN = amount_LBN // width_LN[:, None, :]
    rest_LBN = amount_LBN - even_LBN * width_LN[:, None, :]
    quota_LBND = np.where(
        valid_LND[:, None], even_LBN[..., None] + (np.arange(D) < rest_LBN[..., None]), 0
    ).astype(np.int64)
    flat_LBND = (np.arange(L * Bn).reshape(L, Bn)[..., None, None] * (G + 1) + gpu_LND[:, None]).ravel()
    loads_LBG += (
        np.bincount(flat_LBND, weights=quota_LBND.ravel(), minlength=L * Bn * (G + 1))
        .reshape(L, Bn, G + 1)
        .astype(np.int64)
    )
    # Step 3: re-fill passes.
    for _ in range(LP_PASSES):
        for i in range(N):
            n_LB = order_LBN[:, :, i]
            gpu_LBD, valid_LBD = gpu_LND[layer_LB, n_LB], valid_LND[layer_LB, n_LB]
            where = (layer_LB[..., None], batch_LB[..., None], gpu_LBD)
            loads_LBG[where] -= quota_LBND[layer_LB, batch_LB, n_LB]
            q_LBD = water_fill(amount_LBN[layer_LB, batch_LB, n_LB], loads_LBG[where], valid_LBD)
            quota_LBND[layer_LB, batch_LB, n_LB] = q_LBD
            loads_LBG[where] += q_LBD
    return quota_LBND, loads_LBG[:, :, :G]


__all__ = ["LP_PASSES", "LpTables", "lp_capacity", "lp_quotas", "lp_tables", "water_fill"]
