"""The ``lp`` dispatch rule: split each replicated expert's tokens of this batch over its GPUs.

Shape legend: L layers, E logical experts, P physical slots, G GPUs, S slots per GPU, X replicated
experts (capacity ``max(1, P - E)``; also the colours' rows, at most one per replicated expert), D
GPUs holding one replicated expert (capacity ``min(G, P - E + 1)``), n passes (the batches the rule
splits), x any leading dimensions.

Per layer, from the batch's global counts ``c[E]`` (summed over the EP ranks):

1. An expert with one replica sends everything there; these fix each GPU's base load.
2. Each replicated expert starts split evenly over the distinct GPUs holding it (each GPU's first
   replica of the expert; ``c // D`` each, one more for the first ``c % D`` GPUs by ascending id),
   then :data:`LP_SCALE_ROUNDS` times (none by default) every replicated expert at once rescales its split towards
   the room its GPUs leave below the layer's water level: ``W`` is the level the replicated
   experts' total tokens would reach poured over the base loads of the GPUs holding any of them
   (the largest integer ``w`` with ``sum_g max(0, w - b_g) <= sum_x c_x``), ``room_g = max(0, W -
   b_g) + 1``; each round scales ``q_xg`` by ``room_g / demand_g`` (``demand_g`` the replicated
   tokens on GPU g now), then rescales the row to ``c_x`` by cumulative floors along ascending GPU
   id (``floor(C_j c / C)`` minus the same at the column before; a row scaled to nothing keeps
   its split). A proportional fitting: no dependent chain, integers only, so every backend and
   rank computes the same quotas, and the re-fills of step 3 start near the level.
3. :data:`LP_PASSES` times, colour by colour, the replicated experts of one colour take their
   tokens back and water-fill them over their GPUs against the loads of all the others: with
   levels ``b_d``, the level reached is the largest integer ``w`` with ``sum_d max(0, w - b_d) <=
   c``; GPU ``d`` gets ``max(0, w - b_d)``, and the remainder goes one token each to the first GPUs
   (ascending id) whose level was at most ``w``. Colours come from the placement alone (greedy, in
   ascending expert id: the lowest colour no earlier expert sharing a GPU has), so the experts of
   one colour share no GPU and re-fill at once, in parallel, exactly as one after another would. A
   re-fill never raises the highest of its GPUs, so each pass keeps or lowers the layer's peak (a
   block coordinate descent on the min-max split that SGLang solves as an LP). An expert on one
   GPU, or on more than :data:`LP_FILL_WIDTH` GPUs, keeps its start (no colour): spread that
   wide, the even split is close to level already (on the solved plans measured, capping the width
   at 8 changed no batch's busiest GPU), and the bound keeps a colour's rounds small.
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

LP_SCALE_ROUNDS = 0
"""Rounds of the proportional start (step 2); 0: the even split alone. Each round is a few
reductions over every replicated expert at once, where a re-fill pass is a chain of one sorted
round per colour. The busiest GPU's mean excess over the exact optimum (benchmarks/bench_lp_optimum.py,
docs/benchmarks.md "Balance against the exact optimum"): 8 rounds and 2 passes beat 0 and 4 on
every solved plan's mean, p90 and worst batch; the default stays 0 until the kernel's rounds are
timed on a GPU (an 8-round start replaces two of the four passes only if it costs less)."""
LP_PASSES = 4
"""Re-fill passes over the colours (step 3). Mean excess over the optimum on prefill batches of
scipy's plans at EP32 with the even start: deepseek-v3 0.78% / 0.51% / 0.38% with two, three and
four passes, qwen3-235b-a22b 0.93% / 0.74% / 0.63%; the kernel pays about 5 µs per pass
(docs/benchmarks.md, "lp on 58 solved layers")."""
LP_FILL_WIDTH = 8
"""Most GPUs an expert may span and still re-fill (step 3); wider ones keep the even split."""


class LpTables(NamedTuple):
    """What the rule needs from a placement, int32 with fixed shapes (so device copies update in place)."""

    expert_LX: np.ndarray
    """int32 [L, X]: the replicated experts of each layer in ascending id, padded with -1."""
    slot_LXD: np.ndarray
    """int32 [L, X, D]: each replicated expert's first replica on each GPU holding it, by ascending
    GPU, padded with -1."""
    index_LE: np.ndarray
    """int32 [L, E]: the expert's row in ``expert_LX``, -1 where it has one replica."""
    single_slot_LE: np.ndarray
    """int32 [L, E]: the one slot of an expert with one replica, -1 for replicated experts."""
    slot_LXG: np.ndarray
    """int32 [L, X, G]: ``slot_LXD`` by GPU: the expert's first replica on GPU g, -1 where g holds none."""
    color_LX: np.ndarray
    """int32 [L, X]: each replicated expert's colour (step 3), -1 for padding and for experts on
    more than :data:`LP_FILL_WIDTH` GPUs."""
    colors_L: np.ndarray
    """int32 [L]: colours per layer (0 when no expert re-fills)."""
    slots_per_gpu: int
    """S: slot ``p`` lives on GPU ``p // S``."""
    num_gpus: int
    """G."""


def lp_capacity(num_logical: int, num_physical: int, num_gpus: int) -> tuple[int, int]:
    """(X, D): rows for replicated experts and columns for the GPUs holding one of them."""
    redundant = num_physical - num_logical
    return max(1, redundant), max(1, min(num_gpus, redundant + 1))


def fill_columns(num_columns: int) -> int:
    """F: the columns a re-fill reads, ``min(D, LP_FILL_WIDTH)``."""
    return min(num_columns, LP_FILL_WIDTH)


def _colors(slot_XD: np.ndarray, slots_per_gpu: int, num_gpus: int) -> np.ndarray:
    """int32 [X]: one layer's colours, greedy in ascending row (expert id) order."""
    X = slot_XD.shape[0]
    color_X = np.full(X, -1, dtype=np.int32)
    taken_XG = np.zeros((X + 1, num_gpus), dtype=bool)  # colour c holds GPU g
    for x in range(X):
        held = slot_XD[x] >= 0
        width = int(held.sum())
        if width < 2 or width > LP_FILL_WIDTH:
            continue
        gpus = slot_XD[x, held] // slots_per_gpu
        c = int(np.flatnonzero(~taken_XG[:, gpus].any(axis=1))[0])
        color_X[x] = c
        taken_XG[c, gpus] = True
    return color_X


def lp_tables(placement: Placement) -> LpTables:
    """The placement's :class:`LpTables`."""
    pl = placement
    L, E, P, G = pl.num_layers, pl.num_logical, pl.num_physical, pl.num_gpus
    X, D = lp_capacity(E, P, G)
    S = pl.slots_per_gpu
    expert_LX = np.full((L, X), -1, dtype=np.int32)
    slot_LXD = np.full((L, X, D), -1, dtype=np.int32)
    index_LE = np.full((L, E), -1, dtype=np.int32)
    single_slot_LE = np.where(pl.logcnt_LE == 1, pl.log2phy_LER[:, :, 0], -1).astype(np.int32)
    for layer in range(L):
        replicated = np.flatnonzero(pl.logcnt_LE[layer] >= 2)
        assert replicated.size <= X, "more replicated experts than redundant slots"
        expert_LX[layer, : replicated.size] = replicated
        index_LE[layer, replicated] = np.arange(replicated.size, dtype=np.int32)
        for n, expert in enumerate(replicated):
            slots = np.sort(pl.log2phy_LER[layer, expert, : pl.logcnt_LE[layer, expert]])
            _, first = np.unique(slots // S, return_index=True)  # lowest slot on each GPU, by GPU
            slot_LXD[layer, n, : first.size] = slots[first]
    slot_LXG = np.full((L, X, G), -1, dtype=np.int32)
    layer_LXD, n_LXD = np.indices(slot_LXD.shape)[:2]
    held = slot_LXD >= 0
    slot_LXG[layer_LXD[held], n_LXD[held], slot_LXD[held] // S] = slot_LXD[held]
    color_LX = np.full((L, X), -1, dtype=np.int32)
    for layer in range(L):
        color_LX[layer] = _colors(slot_LXD[layer], S, G)
    colors_L = (color_LX.max(axis=1) + 1).astype(np.int32)
    return LpTables(
        expert_LX=expert_LX,
        slot_LXD=slot_LXD,
        index_LE=index_LE,
        single_slot_LE=single_slot_LE,
        slot_LXG=slot_LXG,
        color_LX=color_LX,
        colors_L=colors_L,
        slots_per_gpu=S,
        num_gpus=G,
    )


def water_level(amount_x: np.ndarray, levels_xD: np.ndarray, valid_xD: np.ndarray) -> np.ndarray:
    """int64 [x]: the level ``amount`` reaches poured over the valid columns' ``levels``.

    The largest integer ``w`` with ``sum_d max(0, w - level_d) <= amount``: the smallest candidate
    floor((c + sum of the k lowest levels) / k) that reaches the k-th lowest level (a prefix whose
    candidate stays below its own top overshoots). 0 where a row has no valid column.
    """
    amount = amount_x.astype(np.int64)
    levels = levels_xD.astype(np.int64)
    big = np.iinfo(np.int64).max
    sorted_xD = np.sort(np.where(valid_xD, levels, big), axis=-1)
    k_D = np.arange(1, levels.shape[-1] + 1)
    usable_xD = k_D <= valid_xD.sum(axis=-1, keepdims=True)
    prefix_xD = np.cumsum(np.where(usable_xD, sorted_xD, 0), axis=-1)
    cand_xD = (amount[..., None] + prefix_xD) // k_D
    feasible_xD = usable_xD & (cand_xD >= sorted_xD)
    return np.where(feasible_xD.any(axis=-1), np.min(np.where(feasible_xD, cand_xD, big), axis=-1), 0)


def water_fill(amount_x: np.ndarray, levels_xD: np.ndarray, valid_xD: np.ndarray) -> np.ndarray:
    """int64 [x, D]: ``amount`` split over the valid columns by the rule's water-filling (step 3).

    ``levels`` are the columns' current loads. Every row needs at least one valid column when its
    amount is positive.
    """
    amount = amount_x.astype(np.int64)
    levels = levels_xD.astype(np.int64)
    level_x = water_level(amount, levels, valid_xD)
    quota_xD = np.where(valid_xD, np.maximum(level_x[..., None] - levels, 0), 0)
    rest_x = amount - quota_xD.sum(axis=-1)
    eligible = valid_xD & (levels <= level_x[..., None])
    extra = eligible & (np.cumsum(eligible, axis=-1) <= rest_x[..., None])
    return quota_xD + extra


def scale_rows(
    quota_xD: np.ndarray, room_xD: np.ndarray, demand_xD: np.ndarray, amount_x: np.ndarray
) -> np.ndarray:
    """int64 [x, D]: one round of the proportional start (step 2).

    ``room`` and ``demand`` are those of each entry's GPU (0 on padding entries, whose quota is
    0); each entry scales to ``q * room // demand``, then the row is rescaled to ``amount`` by
    cumulative floors; a row scaled to nothing keeps ``quota``.
    """
    scaled_xD = quota_xD * room_xD // np.maximum(demand_xD, 1)
    cum_xD = np.cumsum(scaled_xD, axis=-1)
    total_x = cum_xD[..., -1:]
    floor_xD = cum_xD * amount_x[..., None] // np.maximum(total_x, 1)
    rescaled_xD = np.diff(floor_xD, axis=-1, prepend=0)
    return np.where(total_x > 0, rescaled_xD, quota_xD)


def lp_quotas(counts_LnE: np.ndarray, tables: LpTables) -> tuple[np.ndarray, np.ndarray]:
    """(quotas int64 [L, n, X, D], GPU loads int64 [L, n, G]) of global counts [L, n, E] (n: batches)."""
    counts = np.asarray(counts_LnE).astype(np.int64)
    L, n_batches, _ = counts.shape
    D = tables.slot_LXD.shape[2]
    G, S = tables.num_gpus, tables.slots_per_gpu
    expert_LX, slot_LXD = tables.expert_LX, tables.slot_LXD
    single_LE = tables.single_slot_LE >= 0
    onehot_LEG = single_LE[:, :, None] & (
        (tables.single_slot_LE // S)[:, :, None] == np.arange(G)[None, None, :]
    )
    # One spare column past the last GPU takes the padding entries' (zero) quotas, so every row's
    # GPU indices are distinct and plain fancy-index updates replace np.add.at in the loop.
    loads_LnG = np.zeros((L, n_batches, G + 1), dtype=np.int64)
    # float64 products are exact below 2**53 and take BLAS (numpy's int64 matmul does not).
    loads_LnG[:, :, :G] = np.rint(np.matmul(counts.astype(np.float64), onehot_LEG.astype(np.float64)))
    rep_LnX = np.where(
        expert_LX[:, None, :] >= 0,
        np.take_along_axis(counts, np.maximum(expert_LX, 0)[:, None, :].repeat(n_batches, axis=1), axis=2),
        -1,
    )
    valid_LXD = slot_LXD >= 0
    gpu_LXD = np.where(valid_LXD, slot_LXD // S, G)
    # Step 2: the even split.
    amount_LnX = np.maximum(rep_LnX, 0)
    width_LX = np.maximum(valid_LXD.sum(axis=2), 1)
    even_LnX = amount_LnX // width_LX[:, None, :]
    rest_LnX = amount_LnX - even_LnX * width_LX[:, None, :]
    quota_LnXD = np.where(
        valid_LXD[:, None], even_LnX[..., None] + (np.arange(D) < rest_LnX[..., None]), 0
    ).astype(np.int64)
    flat_LnXD = (
        np.arange(L * n_batches).reshape(L, n_batches)[..., None, None] * (G + 1) + gpu_LXD[:, None]
    ).ravel()

    def per_gpu(quota: np.ndarray) -> np.ndarray:  # int64 [L, n, G + 1]: quotas summed by GPU
        total = np.bincount(flat_LnXD, weights=quota.ravel(), minlength=L * n_batches * (G + 1))
        return total.reshape(L, n_batches, G + 1).astype(np.int64)

    gather_LnQ = np.broadcast_to(gpu_LXD.reshape(L, 1, -1), (L, n_batches, gpu_LXD[0].size))

    def at_gpu(value_LnG: np.ndarray) -> np.ndarray:  # [L, n, X, D]: each entry's GPU's value
        return np.take_along_axis(value_LnG, gather_LnQ, axis=2).reshape(quota_LnXD.shape)

    if LP_SCALE_ROUNDS:
        used_LG = np.zeros((L, G + 1), dtype=bool)
        used_LG[np.nonzero(valid_LXD)[0], gpu_LXD[valid_LXD]] = True
        level_Ln = water_level(amount_LnX.sum(axis=2), loads_LnG[..., :G], used_LG[:, None, :G])
        room_LnXD = at_gpu(np.maximum(level_Ln[..., None] - loads_LnG, 0) + 1)
        for _ in range(LP_SCALE_ROUNDS):
            demand_LnXD = at_gpu(per_gpu(quota_LnXD))
            quota_LnXD = np.where(
                valid_LXD[:, None], scale_rows(quota_LnXD, room_LnXD, demand_LnXD, amount_LnX), 0
            )
    loads_LnG += per_gpu(quota_LnXD)
    # Step 3: re-fill passes, colour by colour; one colour's experts share no GPU, so their
    # updates land on distinct columns of each (layer, batch) row.
    F = fill_columns(D)
    gpu_LXF, color_LX = gpu_LXD[:, :, :F], tables.color_LX
    row_Ln = np.arange(L * n_batches).reshape(L, n_batches) * (G + 1)
    for _ in range(LP_PASSES):
        for c in range(int(tables.colors_L.max(initial=0))):
            pick_LX = color_LX == c
            if not pick_LX.any():
                continue
            layer_x, n_x = np.nonzero(pick_LX)
            gpu_xF, valid_xF = gpu_LXF[layer_x, n_x], valid_LXD[layer_x, n_x, :F]
            levels_xnF = loads_LnG[
                layer_x[:, None, None], np.arange(n_batches)[None, :, None], gpu_xF[:, None]
            ]
            old_xnF = quota_LnXD[layer_x, :, n_x, :F]
            new_xnF = water_fill(amount_LnX[layer_x, :, n_x], levels_xnF - old_xnF, valid_xF[:, None])
            quota_LnXD[layer_x, :, n_x, :F] = new_xnF
            flat = (row_Ln[layer_x][:, :, None] + gpu_xF[:, None, :]).ravel()
            loads_LnG.reshape(-1)[flat] += (new_xnF - old_xnF).ravel()
    return quota_LnXD, loads_LnG[:, :, :G]


__all__ = [
    "LP_FILL_WIDTH",
    "LP_PASSES",
    "LP_SCALE_ROUNDS",
    "LpTables",
    "fill_columns",
    "lp_capacity",
    "lp_quotas",
    "lp_tables",
    "scale_rows",
    "water_fill",
    "water_level",
]
