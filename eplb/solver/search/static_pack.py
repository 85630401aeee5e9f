"""Fresh placements for static dispatch: replica counts the static maps split evenly, spread over nodes.

Shape legend: L layers, E logical experts, P physical slots, G GPUs, N nodes, S slots per GPU, R max
replicas (tables over replica counts), U items to pack (a layer's replicas).

Under static dispatch a replica receives the fraction of ranks mapped to it
(eplb.placement.share), and that fraction depends on how the expert's replicas sit on nodes:
on R distinct nodes, or k on each of several nodes, the ranks split (nearly) evenly; five replicas
on four nodes give two of them an eighth of the ranks and three a quarter. A plan packed for an
even split over replicas (DeepSeek's counts and packing) therefore lands up to 2.5 times an
expert's intended share on one GPU: on the deepseek-v3 preset at EP32 such a plan balances its own
forecast to 0.997 under an even split and to 0.89 under the static maps' shares. Here:

- counts: DeepSeek's largest-load-per-replica greedy, with the largest share a replica can get
  (the share model's ``max_share_R``, the maps' own rule on the canonical spread) in place of ``1 / R``: a
  count is raised to the next count that lowers that share, so counts that the maps split unevenly
  (5, 6, 7 on four nodes) are skipped;
- packing: replicas heaviest first (load times that share) onto the lightest node that holds fewer
  than ``ceil(R / N)`` of the expert's replicas, then onto the lightest GPU of that node that has
  a free slot and no replica of the expert; the nodes' slot counts are respected throughout.

On the deepseek-v3 preset at EP32 the plan scores 0.993 on its forecast under static shares, and
0.933 on the next 50 prefill passes (0.878 for the even-split packing), docs/solver.md.
"""

from __future__ import annotations

import numpy as np

from eplb.placement.share import ShareModel


def static_replica_counts(
    load_LE: np.ndarray, num_physical: int, num_gpus: int, num_nodes: int
) -> tuple[np.ndarray, np.ndarray]:
    """(counts int64 [L, E] summing to P per layer, max_share float64 [R + 1]): the greedy above."""
    L, E = load_LE.shape
    max_replicas = num_physical - E + 1
    share_R = ShareModel("static", num_nodes).max_share_R(max_replicas, num_gpus, num_physical // num_gpus)
    # The next count that lowers the largest share (beyond max_replicas where none does).
    next_R = np.full(max_replicas + 1, 2 * num_physical, dtype=np.int64)
    for count in range(1, max_replicas + 1):
        lower = np.flatnonzero(share_R[count + 1 :] < share_R[count] - 1e-12)
        if lower.size:
            next_R[count] = count + 1 + lower[0]
    cnt_LE = np.ones((L, E), dtype=np.int64)
    left_L = np.full(L, num_physical - E, dtype=np.int64)
    rows = np.arange(L)
    # Each round raises one count per layer; a count that cannot be raised within the slots left
    # is passed over, and count 1 -> 2 always fits, so every slot is used.
    while (left_L > 0).any():
        step_LE = next_R[cnt_LE] - cnt_LE
        value_LE = np.where(
            (step_LE <= left_L[:, None]) & (left_L[:, None] > 0), load_LE * share_R[cnt_LE], -np.inf
        )
        best_L = value_LE.argmax(axis=1)
        ok = np.isfinite(value_LE[rows, best_L])
        assert ok[left_L > 0].all(), "a layer has slots left that no count change can use"
        layers, experts = rows[ok], best_L[ok]
        step = step_LE[layers, experts]
        cnt_LE[layers, experts] += step
        left_L[layers] -= step
    return cnt_LE, share_R


def static_spread_phy2log(
    load_LE: np.ndarray, cnt_LE: np.ndarray, share_R: np.ndarray, num_gpus: int, num_nodes: int
) -> np.ndarray:
    """int64 [L, P]: replicas of ``cnt_LE`` packed as described above (every layer at once)."""
    L, E = load_LE.shape
    P = int(cnt_LE[0].sum())
    G, N = num_gpus, num_nodes
    S, gpn = P // G, G // N
    rows = np.arange(L)
    expert_LU = np.stack([np.repeat(np.arange(E), row) for row in cnt_LE])
    item_LU = load_LE[rows[:, None], expert_LU] * share_R[cnt_LE[rows[:, None], expert_LU]]
    order_LU = np.argsort(-item_LU, axis=1, kind="stable")
    per_node_LE = -(-cnt_LE // N)
    node_load_LN, node_free_LN = np.zeros((L, N)), np.full((L, N), gpn * S)
    gpu_load_LG, gpu_fill_LG = np.zeros((L, G)), np.zeros((L, G), dtype=np.int64)
    node_cnt_LNE = np.zeros((L, N, E), dtype=np.int64)
    gpu_has_LGE = np.zeros((L, G, E), dtype=bool)
    out_LP = np.full((L, P), -1, dtype=np.int64)
    gpu_of_node_NG = np.arange(N)[:, None] * gpn + np.arange(gpn)
    for m in range(P):
        idx = order_LU[:, m]
        e, w = expert_LU[rows, idx], item_LU[rows, idx]
        # A node with room; among those, prefer one below the expert's per-node count (always
        # exists unless capacity forces a doubling), then the lightest.
        crowded_LN = node_cnt_LNE[rows, :, e] >= per_node_LE[rows, e][:, None]
        node_key = np.where(node_free_LN > 0, node_load_LN + np.where(crowded_LN, 1e300, 0.0), np.inf)
        n = node_key.argmin(axis=1)
        g_ids = gpu_of_node_NG[n]
        # A GPU holding the expert already is a last resort (only when the node has no other room).
        holds = np.where(gpu_has_LGE[rows[:, None], g_ids, e[:, None]], 1e300, 0.0)
        full = gpu_fill_LG[rows[:, None], g_ids] >= S
        gpu_key = np.where(full, np.inf, gpu_load_LG[rows[:, None], g_ids] + holds)
        g = g_ids[rows, gpu_key.argmin(axis=1)]
        node_load_LN[rows, n] += w
        node_free_LN[rows, n] -= 1
        node_cnt_LNE[rows, n, e] += 1
        gpu_load_LG[rows, g] += w
        gpu_has_LGE[rows, g, e] = True
        out_LP[rows, g * S + gpu_fill_LG[rows, g]] = e
        gpu_fill_LG[rows, g] += 1
    assert (out_LP >= 0).all()
    return out_LP


def static_fresh_phy2log(
    load_LE: np.ndarray, num_physical: int, num_gpus: int, num_nodes: int
) -> tuple[np.ndarray, np.ndarray]:
    """(phy2log int64 [L, P], counts int64 [L, E]): a fresh placement for static dispatch of ``load_LE``."""
    cnt_LE, share_R = static_replica_counts(load_LE, num_physical, num_gpus, num_nodes)
    return static_spread_phy2log(load_LE, cnt_LE, share_R, num_gpus, num_nodes), cnt_LE
