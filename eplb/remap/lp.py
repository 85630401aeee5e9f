"""The torch reference of the ``lp`` dispatch mode: the rule's quotas and each token's replica.

Shape legend: T tokens, K top-k, E logical experts, P physical slots, G GPUs (EP ranks), X
replicated experts, D GPUs holding one replicated expert (the capacities: eplb.remap.lp_rule, which
states the rule).

:func:`remap_record_lp_torch` counts the rank's tokens, exchanges the counts
(eplb.remap.exchange.LpExchange) and maps every token; the Triton kernels (eplb.kernels.remap_lp)
match it bit for bit. Plain tensor ops, no value read back to the host, so it runs on any device
and inside a CUDA graph.
"""

from __future__ import annotations

import torch

from eplb.remap.call import RemapCall
from eplb.remap.lp_rule import LP_PASSES, LP_SCALE_ROUNDS, fill_columns
from eplb.remap.tables import DispatchTables
from eplb.remap.torch_backend import count_elements, valid_elements


def water_level_torch(
    amount_x: torch.Tensor, levels_xD: torch.Tensor, valid_xD: torch.Tensor
) -> torch.Tensor:
    """int64 [x]: the level each row's ``amount`` reaches over its valid columns (eplb.remap.lp_rule).

    Pairwise form: with ``I_j`` the valid columns at or below column j's level, the level reached
    is the smallest ``floor((amount + sum_{I_j} level) / |I_j|)`` that reaches ``level_j``.
    """
    big = torch.iinfo(torch.int64).max
    inc_xDD = valid_xD[:, :, None] & (levels_xD[:, :, None] <= levels_xD[:, None, :])
    n_xD = inc_xDD.sum(dim=1)
    s_xD = torch.where(inc_xDD, levels_xD[:, :, None], 0).sum(dim=1)
    cand_xD = (amount_x[:, None] + s_xD) // n_xD.clamp(min=1)
    feasible = valid_xD & (cand_xD >= levels_xD)
    return torch.where(feasible.any(dim=1), torch.where(feasible, cand_xD, big).min(dim=1).values, 0)


def water_fill_torch(amount_x: torch.Tensor, levels_xD: torch.Tensor, valid_xD: torch.Tensor) -> torch.Tensor:
    """int64 [x, D]: each row's ``amount`` over its valid columns by the rule's water-filling."""
    level_x = water_level_torch(amount_x, levels_xD, valid_xD)
    quota_xD = torch.where(valid_xD, (level_x[:, None] - levels_xD).clamp(min=0), 0)
    rest_x = amount_x - quota_xD.sum(dim=1)
    eligible = valid_xD & (levels_xD <= level_x[:, None])
    first = torch.cumsum(eligible.to(torch.int64), 1) <= rest_x[:, None]
    return quota_xD + (eligible & first).to(torch.int64)


def scale_start_torch(
    quota_XD: torch.Tensor,
    base_G: torch.Tensor,
    gpu_XD: torch.Tensor,
    valid_XD: torch.Tensor,
    amount_X: torch.Tensor,
) -> torch.Tensor:
    """int64 [X, D]: the proportional start's rounds (eplb.remap.lp_rule, step 2) from the even split."""
    G = base_G.shape[0]
    flat = gpu_XD.reshape(-1)
    used_G = torch.zeros(G, dtype=torch.int64, device=base_G.device).scatter_add_(
        0, flat, valid_XD.reshape(-1).to(torch.int64)
    )
    level = water_level_torch(amount_X.sum().reshape(1), base_G[None, :], (used_G > 0)[None, :])
    room_XD = ((level - base_G).clamp(min=0) + 1)[gpu_XD]
    for _ in range(LP_SCALE_ROUNDS):
        demand_G = torch.zeros_like(base_G).scatter_add_(0, flat, quota_XD.reshape(-1))
        scaled_XD = torch.where(valid_XD, quota_XD * room_XD // demand_G[gpu_XD].clamp(min=1), 0)
        cum_XD = torch.cumsum(scaled_XD, dim=1)
        total_X1 = cum_XD[:, -1:]
        floor_XD = cum_XD * amount_X[:, None] // total_X1.clamp(min=1)
        rescaled_XD = floor_XD - torch.nn.functional.pad(floor_XD[:, :-1], (1, 0))
        quota_XD = torch.where(valid_XD & (total_X1 > 0), rescaled_XD, quota_XD)
    return quota_XD


def lp_quotas_torch(counts_E: torch.Tensor, tables: DispatchTables, layer: int) -> torch.Tensor:
    """int64 [X, D]: per-replica quotas of one layer for global counts ``counts_E`` (int64 [E])."""
    assert (
        tables.lp_expert_LX is not None and tables.lp_slot_LXD is not None and tables.lp_index_LE is not None
    )
    assert tables.lp_color_LX is not None and tables.lp_colors_L is not None
    G, S = tables.num_gpus, tables.slots_per_gpu
    device = counts_E.device
    expert_X = tables.lp_expert_LX[layer].to(torch.int64)
    slot_XD = tables.lp_slot_LXD[layer].to(torch.int64)
    X, D = slot_XD.shape
    single_E = tables.lp_index_LE[layer] < 0
    loads_G = torch.zeros(G, dtype=torch.int64, device=device)
    single_gpu_E = torch.where(single_E, tables.static_LE[layer].to(torch.int64) // S, 0)
    loads_G.scatter_add_(0, single_gpu_E, torch.where(single_E, counts_E, 0))
    has_X = expert_X >= 0
    amount_X = torch.where(has_X, counts_E[expert_X.clamp(min=0)], 0)
    valid_XD = slot_XD >= 0
    gpu_XD = torch.where(valid_XD, slot_XD // S, 0)
    width_X = valid_XD.sum(dim=1).clamp(min=1)
    d_D = torch.arange(D, device=device)
    quota_XD = torch.where(
        valid_XD, (amount_X // width_X)[:, None] + (d_D[None, :] < (amount_X % width_X)[:, None]), 0
    )
    if LP_SCALE_ROUNDS:
        quota_XD = scale_start_torch(quota_XD, loads_G, gpu_XD, valid_XD, amount_X)
    loads_G.scatter_add_(0, gpu_XD.reshape(-1), quota_XD.reshape(-1))
    # Colour by colour: one colour's experts share no GPU, so they re-fill at once.
    F = fill_columns(D)
    color_X = tables.lp_color_LX[layer]
    # Colours past the layer's last pick no expert (no-op rounds): on the CPU read the count,
    # elsewhere run all X so nothing is read back to the host (CUDA graphs).
    colors = int(tables.lp_colors_L[layer]) if device.type == "cpu" else X
    for _ in range(LP_PASSES):
        for c in range(colors):
            pick_XF = (color_X == c)[:, None] & valid_XD[:, :F]
            old_XF = torch.where(pick_XF, quota_XD[:, :F], 0)
            levels_XF = loads_G[gpu_XD[:, :F]] - old_XF
            new_XF = water_fill_torch(amount_X, levels_XF, pick_XF)
            quota_XD[:, :F] = torch.where(pick_XF, new_XF, quota_XD[:, :F])
            loads_G.scatter_add_(0, gpu_XD[:, :F].reshape(-1), (new_XF - old_XF).reshape(-1))
    return quota_XD


def remap_record_lp_torch(call: RemapCall) -> None:
    """``lp`` dispatch of one call, with counting as in every mode (semantics: eplb.remap.api)."""
    tables, layer, lp = call.tables, call.layer, call.lp
    assert lp is not None and tables.lp_slot_LXD is not None and tables.lp_index_LE is not None
    T, K = call.topk_ids_TK.shape
    E, P, rank = tables.num_logical, tables.num_physical, tables.rank
    device = call.topk_ids_TK.device
    ids, _, valid, safe = valid_elements(call)
    local_E = torch.zeros(E, dtype=torch.int64, device=device)
    local_E.scatter_add_(0, safe.reshape(-1), valid.reshape(-1).to(torch.int64))
    lp.local_E.copy_(local_E)
    try:
        lp.exchange()
    finally:
        lp.local_E.zero_()  # zero between calls, as the Triton kernels keep it
    gathered_GE = lp.gathered_GE.to(torch.int64)
    quota_XD = lp_quotas_torch(gathered_GE.sum(dim=0), tables, layer)
    X = quota_XD.shape[0]
    start_XD = torch.cumsum(quota_XD, dim=1) - quota_XD
    valid_XD = tables.lp_slot_LXD[layer] >= 0
    start_XD = torch.where(valid_XD, start_XD, torch.iinfo(torch.int64).max)
    # A token's position: earlier ranks' tokens of its expert, then this rank's in flat order.
    n_TK = torch.where(valid, tables.lp_index_LE[layer].to(torch.int64)[safe], -1)
    replicated = n_TK >= 0
    key = torch.where(replicated, n_TK, X).reshape(-1)
    order = torch.argsort(key, stable=True)
    group_sizes = torch.zeros(X + 1, dtype=torch.int64, device=device)
    group_sizes.scatter_add_(0, key, torch.ones_like(key))
    first = torch.cumsum(group_sizes, 0) - group_sizes
    within = torch.empty_like(key)
    within[order] = torch.arange(key.numel(), device=device) - first[key[order]]
    offset_E = gathered_GE[:rank].sum(dim=0)
    position = (offset_E[safe].reshape(-1) + within).reshape(T, K)
    n_safe = n_TK.clamp(min=0)
    entry = (start_XD[n_safe] <= position[..., None]).sum(dim=-1) - 1
    slot = tables.lp_slot_LXD[layer].to(torch.int64)[n_safe, entry.clamp(min=0)]
    phys = torch.where(replicated, slot, tables.static_LE[layer].to(torch.int64)[safe])
    call.out_TK.copy_(torch.where(valid, phys, ids).to(torch.int32))
    count_elements(call, valid & (phys >= 0) & (phys < P), phys, safe)


__all__ = [
    "lp_quotas_torch",
    "remap_record_lp_torch",
    "scale_start_torch",
    "water_fill_torch",
    "water_level_torch",
]
