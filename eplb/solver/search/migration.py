"""Migration awareness: keep experts where they are unless moving them pays.

Shape legend: L layers, E logical experts, P physical slots, G GPUs, N nodes, S slots per GPU.

:func:`relabel`: a fresh placement's GPUs are interchangeable, so map them onto the current GPUs
with ``scipy.optimize.linear_sum_assignment`` to copy the fewest experts across nodes, then across
GPUs, and give each expert that stays on a GPU its old slot.

:func:`retarget_replicas`: the current placement with the replica counts of another, in as few
slots as possible: the start of a search that needs large count changes (eplb.solver.policies.scipy_policy).
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import linear_sum_assignment

from eplb.solver.search.copies import holds_per_gpu


def relabel(
    new_phy2log_LP: np.ndarray,
    current_phy2log_LP: np.ndarray,
    num_gpus: int,
    num_nodes: int,
    *,
    keep_nodes: bool = False,
) -> np.ndarray:
    """int64 [L, P]: ``new_phy2log_LP`` with GPUs permuted and slots reordered to match the current one.

    GPU a of the new plan takes the place of current GPU b by a linear assignment whose cost counts,
    first, the experts of a that no GPU of b's node holds now (copies across nodes), then those b
    does not hold (copies across GPUs), then (a tie-break) the slots that would change. Both counts
    depend only on (a, b), so one assignment per layer minimises cross-node copies and, among
    those, cross-GPU copies. The GPU loads and replica counts are those of the new plan.

    ``keep_nodes``: the new plan's nodes move as wholes (a node's GPUs stay together), because
    static dispatch's shares depend on which replicas share a node (eplb.solver.search.static_pack);
    each new node goes to the current node whose best GPU assignment costs least, by a second
    assignment over nodes.
    """
    L, P = new_phy2log_LP.shape
    G, N = num_gpus, num_nodes
    S, gpn = P // G, G // N
    E = int(max(new_phy2log_LP.max(), current_phy2log_LP.max())) + 1
    new_holds = holds_per_gpu(new_phy2log_LP, G, E)
    cur_holds = holds_per_gpu(current_phy2log_LP, G, E)
    new_has = (new_holds > 0).astype(np.float64)
    cur_has = (cur_holds > 0).astype(np.float64)
    cur_node_has = (cur_holds.reshape(L, N, gpn, E).sum(axis=2) > 0).astype(np.float64)
    distinct_LG = new_has.sum(axis=-1)
    gpu_arrivals = distinct_LG[:, :, None] - np.einsum("lae,lbe->lab", new_has, cur_has)
    node_arrivals = distinct_LG[:, :, None] - np.einsum("lae,lne->lan", new_has, cur_node_has)
    kept_slots = np.einsum("lae,lbe->lab", new_holds.astype(np.float64), cur_has)
    node_of_gpu = np.arange(G) // gpn
    cost = (P + 1.0) * (S + 1.0) * node_arrivals[:, :, node_of_gpu] + (S + 1.0) * gpu_arrivals - kept_slots
    out = np.empty((L, P), dtype=np.int64)
    for layer in range(L):
        rows, cols = _node_blocks(cost[layer], N) if keep_nodes else linear_sum_assignment(cost[layer])
        for a, b in zip(rows, cols, strict=True):
            out[layer, b * S : (b + 1) * S] = _align_slots(
                new_phy2log_LP[layer, a * S : (a + 1) * S], current_phy2log_LP[layer, b * S : (b + 1) * S]
            )
    return out


def _node_blocks(cost_GG: np.ndarray, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """(new GPUs, current GPUs): the cheapest GPU assignment that maps whole nodes onto nodes."""
    G = cost_GG.shape[0]
    gpn = G // num_nodes
    blocks = cost_GG.reshape(num_nodes, gpn, num_nodes, gpn).transpose(0, 2, 1, 3)
    inner = [[linear_sum_assignment(blocks[a, b]) for b in range(num_nodes)] for a in range(num_nodes)]
    node_cost = np.array(
        [[blocks[a, b][inner[a][b]].sum() for b in range(num_nodes)] for a in range(num_nodes)]
    )
    rows, cols = [], []
    for a, b in zip(*linear_sum_assignment(node_cost), strict=True):
        r, c = inner[a][b]
        rows.extend((a * gpn + r).tolist())
        cols.extend((b * gpn + c).tolist())
    return np.asarray(rows), np.asarray(cols)


def _align_slots(new_experts_S: np.ndarray, current_S: np.ndarray) -> np.ndarray:
    """int64 [S]: the experts ``new_experts_S`` ordered so that those already present keep their slot."""
    remaining = list(new_experts_S.tolist())
    out = np.full(current_S.shape, -1, dtype=np.int64)
    for slot, expert in enumerate(current_S.tolist()):
        if expert in remaining:
            remaining.remove(expert)
            out[slot] = expert
    out[out < 0] = remaining
    return out


def retarget_replicas(
    phy2log_LP: np.ndarray, target_cnt_LE: np.ndarray, load_LE: np.ndarray, num_gpus: int
) -> np.ndarray:
    """int64 [L, P]: ``phy2log_LP`` rewritten in as few slots as possible to ``target_cnt_LE`` replicas.

    An expert with surplus replicas gives up those on its busiest GPUs (by ``load_LE`` split evenly
    over its replicas); experts short of replicas take the freed slots, the heaviest new replica
    first, each onto the least loaded GPU among the free slots. Every other slot keeps its expert.
    """
    P = phy2log_LP.shape[1]
    E = target_cnt_LE.shape[1]
    S = P // num_gpus
    out = phy2log_LP.astype(np.int64).copy()
    cur_LE = holds_per_gpu(out, num_gpus, E).sum(axis=1)
    delta_LE = target_cnt_LE.astype(np.int64) - cur_LE
    assert (delta_LE.sum(axis=1) == 0).all(), "the target counts must fill the same slots"
    for layer in np.flatnonzero((delta_LE != 0).any(axis=1)):
        row, delta_E, new_E = out[layer], delta_LE[layer], target_cnt_LE[layer]
        item_P = load_LE[layer, row] / cur_LE[layer, row]
        gpu_G = item_P.reshape(num_gpus, S).sum(axis=1)
        freed: list[int] = []
        for expert in np.flatnonzero(delta_E < 0):
            slots = np.flatnonzero(row == expert)
            busiest = slots[np.argsort(-gpu_G[slots // S], kind="stable")]
            freed.extend(busiest[: -delta_E[expert]].tolist())
        for slot in freed:
            gpu_G[slot // S] -= item_P[slot]
        takers = np.repeat(np.flatnonzero(delta_E > 0), delta_E[delta_E > 0])
        takers = takers[np.argsort(-load_LE[layer, takers] / new_E[takers], kind="stable")]
        free = np.asarray(freed, dtype=np.int64)
        open_ = np.ones(free.size, dtype=bool)
        for expert in takers:
            pick = np.flatnonzero(open_)[np.argmin(gpu_G[free[open_] // S])]
            row[free[pick]] = expert
            gpu_G[free[pick] // S] += load_LE[layer, expert] / new_E[expert]
            open_[pick] = False
    return out
