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
from eplb.remap.lp_rule import LP_PASSES
from eplb.remap.tables import DispatchTables
from eplb.remap.torch_backend import count_elements, valid_elements


def water_fill_torch(amount: torch.Tensor, levels_D: torch.Tensor, valid_D: torch.Tensor) -> torch.Tensor:
    """int64 [D]: ``amount`` (0-dim) over the valid columns by the rule's water-filling.

    Pairwise form: with ``I_j`` the valid columns at or below column j's level, the level reached
    is the smallest ``floor((amount + sum_{I_j} level) / |I_j|)`` that reaches ``level_j``.
    """
    big = torch.iinfo(torch.int64).max
    inc_DD = valid_D[:, None] & (levels_D[:, None] <= levels_D[None, :])
    n_D = inc_DD.sum(dim=0)
    s_D = torch.where(inc_DD, levels_D[:, None], 0).sum(dim=0)
    cand_D = (amount + s_D) // n_D.clamp(min=1)
    feasible = valid_D & (cand_D >= levels_D)
    level = torch.where(feasible, cand_D, big).min()
    quota_D = torch.where(valid_D, (level - levels_D).clamp(min=0), 0)
    rest = amount - quota_D.sum()
    eligible = valid_D & (levels_D <= level)
    return quota_D + (eligible & (torch.cumsum(eligible.to(torch.int64), 0) <= rest)).to(torch.int64)


def lp_quotas_torch(counts_E: torch.Tensor, tables: DispatchTables, layer: int) -> torch.Tensor:
    """int64 [X, D]: per-replica quotas of one layer for global counts ``counts_E`` (int64 [E])."""
    assert (
        tables.lp_expert_LX is not None and tables.lp_slot_LXD is not None and tables.lp_index_LE is not None
    )
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
    loads_G.scatter_add_(0, gpu_XD.reshape(-1), quota_XD.reshape(-1))
    # Heaviest first, ties by lower row; rows without an expert last (they hold nothing).
    order_X = torch.argsort(torch.where(has_X, -amount_X, 1), stable=True)
    for _ in range(LP_PASSES):
        for i in range(X):
            n = order_X[i]
            gpu_D, valid_D = gpu_XD[n], valid_XD[n]
            loads_G.scatter_add_(0, gpu_D, -quota_XD[n])
            new_D = water_fill_torch(amount_X[n], loads_G[gpu_D], valid_D)
            quota_XD[n] = new_D
            loads_G.scatter_add_(0, gpu_D, new_D)
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
    lp.exchange()
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


__all__ = ["lp_quotas_torch", "remap_record_lp_torch", "water_fill_torch"]
