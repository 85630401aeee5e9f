"""Failure-aware placement: the replicas of each replicated expert in different failure domains.

Shape legend: L layers, E logical experts, P physical slots, G GPUs, N nodes, S slots per GPU, c
candidate moves; a domain is a GPU or a node.

An expert whose replicas share one GPU (or node) loses all of them with it, and its load then
waits for a reload (eplb.solver.degraded). :func:`spread_replicas` visits the replicated experts
of each layer hottest first; while an expert has two replicas more in one domain than in another,
its replica on the busiest GPU of its fullest domain trades slots with a slot of one of its
emptiest domains. The partner is the slot whose GPU loads after the trade peak lowest (ties: the
lowest slot), among those whose expert does not end less evenly spread than before (a trade that
would undo a hotter expert's spread is never taken, so the pass ends) and that leave no domain
orphaning more load than the worst one did (the lost load never grows). What it costs in balance
and what a single domain's loss orphans, before and after, go to the solve's stats.
"""

from __future__ import annotations

import numpy as np

from eplb.placement.balance import balancedness
from eplb.solver.search.copies import holds_per_gpu

MAX_TRADES_PER_EXPERT = 64
"""Deterministic cap on the trades one expert's spread may take (each evens its domains by one)."""


def spread_replicas(
    phy2log_LP: np.ndarray,
    load_LE: np.ndarray,
    num_gpus: int,
    num_nodes: int,
    domain: str,
    stats: dict[str, float],
) -> np.ndarray:
    """int64 [L, P]: ``phy2log_LP`` with replicas traded into different ``domain``s (gpu | node)."""
    out = np.asarray(phy2log_LP, dtype=np.int64).copy()
    L, P = out.shape
    E = load_LE.shape[1]
    S = P // num_gpus
    width = S if domain == "gpu" else S * (num_gpus // num_nodes)
    D = P // width
    domain_P = np.arange(P) // width
    before = _scores(out, load_LE, num_gpus, domain_P, D)
    trades = 0
    for layer in range(L):
        trades += _spread_layer(out[layer], load_LE[layer], num_gpus, S, domain_P, D, E)
    after = _scores(out, load_LE, num_gpus, domain_P, D)
    stats["spread_swaps"] = float(trades)
    stats["spread_cost"] = before[0] - after[0]
    stats["lost_load_before"], stats["lost_load_after"] = before[1], after[1]
    return out


def _spread_layer(
    row_P: np.ndarray, load_E: np.ndarray, G: int, S: int, domain_P: np.ndarray, D: int, E: int
) -> int:
    """Trade replicas of one layer's row in place; returns the trades made."""
    count_E = np.bincount(row_P, minlength=E)
    item_P = load_E[row_P] / count_E[row_P]
    gpu_G = item_P.reshape(G, S).sum(axis=1)
    held_DE = np.zeros((D, E), dtype=np.int64)
    np.add.at(held_DE, (domain_P, row_P), 1)
    # Load of the experts whose every replica lies in each domain (what losing it orphans).
    lost_D = ((held_DE == count_E[None, :]) * load_E[None, :]).sum(axis=1)
    trades = 0
    hot = np.flatnonzero(count_E > 1)
    for expert in hot[np.lexsort((hot, -load_E[hot]))].tolist():
        for _ in range(MAX_TRADES_PER_EXPERT):
            col = held_DE[:, expert]
            if col.max() - col.min() < 2:
                break
            src_dom = int(np.argmax(col))
            mine = np.flatnonzero((row_P == expert) & (domain_P == src_dom))
            slot_a = int(mine[np.argmax(gpu_G[mine // S])])
            cand_c = np.flatnonzero(np.isin(domain_P, np.flatnonzero(col == col.min())) & (row_P != expert))
            if cand_c.size == 0:
                break
            partner_c = row_P[cand_c]
            # The partner's spread after the trade: one more replica in src_dom, one fewer in its own.
            rows_cD = held_DE[:, partner_c].T.copy()
            spread_before_c = rows_cD.max(axis=1) - rows_cD.min(axis=1)
            rows_cD[np.arange(cand_c.size), domain_P[cand_c]] -= 1
            rows_cD[:, src_dom] += 1
            ok_c = rows_cD.max(axis=1) - rows_cD.min(axis=1) <= spread_before_c
            # Nor may any domain's loss orphan more load than the worst one does now.
            lost_cD = np.broadcast_to(lost_D, (cand_c.size, D)).copy()
            dom_c = domain_P[cand_c]
            rows = np.arange(cand_c.size)
            if held_DE[src_dom, expert] == count_E[expert]:
                lost_cD[:, src_dom] -= load_E[expert]
            lost_cD[rows, dom_c] -= np.where(
                held_DE[dom_c, partner_c] == count_E[partner_c], load_E[partner_c], 0.0
            )
            lost_cD[:, src_dom] += np.where(rows_cD[:, src_dom] == count_E[partner_c], load_E[partner_c], 0.0)
            ok_c &= lost_cD.max(axis=1) <= lost_D.max() + 1e-12 * max(lost_D.max(), 1.0)
            if not ok_c.any():
                break
            cand_c, lost_cD = cand_c[ok_c], lost_cD[ok_c]
            gpu_a, gpu_b_c = slot_a // S, cand_c // S
            delta_c = item_P[cand_c] - item_P[slot_a]
            peak_c = np.maximum(gpu_G[gpu_a] + delta_c, gpu_G[gpu_b_c] - delta_c)
            pick = int(np.argmin(peak_c))  # argmin: the lowest slot among equal peaks
            slot_b = int(cand_c[pick])
            lost_D[:] = lost_cD[pick]
            partner = int(row_P[slot_b])
            gpu_G[gpu_a] += item_P[slot_b] - item_P[slot_a]
            gpu_G[slot_b // S] += item_P[slot_a] - item_P[slot_b]
            held_DE[src_dom, expert] -= 1
            held_DE[domain_P[slot_b], expert] += 1
            held_DE[domain_P[slot_b], partner] -= 1
            held_DE[src_dom, partner] += 1
            row_P[slot_a], row_P[slot_b] = partner, expert
            item_P[slot_a], item_P[slot_b] = item_P[slot_b], item_P[slot_a]
            trades += 1
    return trades


def _scores(
    phy2log_LP: np.ndarray, load_LE: np.ndarray, G: int, domain_P: np.ndarray, D: int
) -> tuple[float, float]:
    """(balancedness of ``load_LE`` under an even split, the mean over layers of the largest share of
    a layer's load whose every replica lies in one domain)."""
    L, E = load_LE.shape
    count_LE = holds_per_gpu(phy2log_LP, G, E).sum(axis=1)
    layer_LP = np.arange(L)[:, None]
    item_LP = load_LE[layer_LP, phy2log_LP] / count_LE[layer_LP, phy2log_LP]
    balance = float(balancedness(item_LP.reshape(L, G, -1).sum(axis=2)).mean())
    held_LDE = np.zeros((L, D, E), dtype=np.int64)
    np.add.at(held_LDE, (np.broadcast_to(layer_LP, phy2log_LP.shape), domain_P[None, :], phy2log_LP), 1)
    only_LDE = held_LDE == count_LE[:, None, :]
    total_L = np.maximum(load_LE.sum(axis=1), 1e-300)
    lost_LD = (only_LDE * load_LE[:, None, :]).sum(axis=2) / total_L[:, None]
    return balance, float(lost_LD.max(axis=1).mean())
