"""Per-rank static dispatch maps: which replica each rank sends a logical expert's tokens to.

Shape legend: L layers, E logical experts, R max replicas, G GPUs (EP ranks), N nodes, X replicated
experts ((layer, expert) pairs).

The rule, written once here (:func:`static_choice_XG`): rank r sends expert e's tokens to a
replica on r's own GPU (its first there); else to one on r's node; else to any. The ranks that
choose from the same pool (a node's replicas, or all of them) are dealt over it round-robin, in
rank order: the j-th takes candidate ``(j + l*E + e) mod count``, so holders receive an even
share and the choice is a pure function of the placement (every rank computes the same maps).
When every replica sits on one node, that node's remote ranks continue the count of the ranks of
the other nodes (one pool). What a replica receives under these maps, the fraction of ranks
mapped to it (:func:`static_ranks_XR`), is what every share of static dispatch derives from
(eplb.placement.share).
"""

from __future__ import annotations

import numpy as np

from eplb.placement.model import INT32, Placement


def static_choice_XG(
    gpu_XR: np.ndarray, count_X: np.ndarray, offset_X: np.ndarray, num_gpus: int, num_nodes: int
) -> np.ndarray:
    """int64 [X, G]: for each pair, the replica (index into its row) each rank sends its tokens to.

    ``gpu_XR``: the GPU of each of the pair's replicas, in the maps' order (log2phy's), any value
    past ``count_X``; ``offset_X``: the pair's rotation, ``layer * E + expert``.
    """
    gpu_XR = np.asarray(gpu_XR, dtype=np.int64)
    count_X = np.asarray(count_X, dtype=np.int64)
    X, R = gpu_XR.shape
    G, N = num_gpus, num_nodes
    gpn = G // N
    rows_X1 = np.arange(X)[:, None]
    # Padding: GPU G, on node N (past the last of each). Array methods, not np functions: the
    # search asks for one or two experts after each move, where call overhead is the cost.
    gpu_XR = np.where(np.arange(R) < count_X[:, None], gpu_XR, G)
    node_XR = gpu_XR // gpn
    # Own GPU: the first of its replicas there (the first of each GPU's run in a stable sort).
    by_gpu_XR = gpu_XR.argsort(axis=1, kind="stable")
    sorted_XR = gpu_XR[rows_X1, by_gpu_XR]
    first_XR = sorted_XR < G
    first_XR[:, 1:] &= sorted_XR[:, 1:] != sorted_XR[:, :-1]
    own_XG = np.full((X, G), -1, dtype=np.int64)
    at_x, at_r = first_XR.nonzero()
    own_XG[at_x, sorted_XR[at_x, at_r]] = by_gpu_XR[at_x, at_r]
    local_XG = own_XG >= 0
    # Own node: its replicas in the maps' order, dealt to the node's ranks without a local one.
    node_cnt_XN = np.bincount((rows_X1 * (N + 1) + node_XR).ravel(), minlength=X * (N + 1)).reshape(X, N + 1)
    node_first_XN = node_cnt_XN.cumsum(axis=1) - node_cnt_XN
    by_node_XR = node_XR.argsort(axis=1, kind="stable")
    node_G = np.arange(G) // gpn
    at_node_XG = node_cnt_XN[:, node_G]
    remote_XG = ~local_XG
    same_node_XG = remote_XG & (at_node_XG > 0)
    anywhere_XG = remote_XG ^ same_node_XG
    # j: the rank's position among the ranks of its pool.
    anywhere_j_XG = anywhere_XG.cumsum(axis=1) - 1
    same_node_j_XG = same_node_XG.reshape(X, N, gpn).cumsum(axis=2).reshape(X, G) - 1
    whole_pool_XG = at_node_XG == count_X[:, None]
    same_node_j_XG += whole_pool_XG * anywhere_XG.sum(axis=1, keepdims=True)
    offset_X1 = np.asarray(offset_X, dtype=np.int64)[:, None]
    k_node_XG = (same_node_j_XG + offset_X1) % np.maximum(at_node_XG, 1)
    node_pick_XG = by_node_XR[rows_X1, np.minimum(node_first_XN[:, node_G] + k_node_XG, R - 1)]
    anywhere_pick_XG = (anywhere_j_XG + offset_X1) % np.maximum(count_X, 1)[:, None]
    return np.where(local_XG, own_XG, np.where(same_node_XG, node_pick_XG, anywhere_pick_XG))


def static_ranks_XR(
    gpu_XR: np.ndarray, count_X: np.ndarray, offset_X: np.ndarray, num_gpus: int, num_nodes: int
) -> np.ndarray:
    """int64 [X, R]: how many ranks send each pair's tokens to each of its replicas (arguments as
    :func:`static_choice_XG`; 0 past ``count_X``)."""
    return _count_choices(
        static_choice_XG(gpu_XR, count_X, offset_X, num_gpus, num_nodes), np.shape(gpu_XR)[1]
    )


def static_dispatch_maps(placement: Placement) -> np.ndarray:
    """int32 [G, L, E]: for every rank, the physical slot it dispatches each logical expert to."""
    l2p_XR, choice_XG = _placement_choice(placement)
    maps_XG = np.take_along_axis(l2p_XR, choice_XG, axis=1)
    G, L, E = placement.num_gpus, placement.num_layers, placement.num_logical
    return np.ascontiguousarray(maps_XG.reshape(L, E, G).transpose(2, 0, 1), dtype=INT32)


def static_ranks_LER(placement: Placement) -> np.ndarray:
    """int64 [L, E, R]: how many ranks' maps send each expert's tokens to each of its replicas (in
    log2phy's order; R the largest replica count, 0 past an expert's count)."""
    l2p_XR, choice_XG = _placement_choice(placement)
    R = l2p_XR.shape[1]
    return _count_choices(choice_XG, R).reshape(placement.num_layers, placement.num_logical, R)


def _placement_choice(placement: Placement) -> tuple[np.ndarray, np.ndarray]:
    """(int64 [L*E, R] log2phy's used columns, int64 [L*E, G] :func:`static_choice_XG` of every pair)."""
    pl = placement
    L, E = pl.num_layers, pl.num_logical
    # Only the used replica columns matter; log2phy is often padded far past the largest count.
    R = int(pl.logcnt_LE.max())
    l2p_XR = pl.log2phy_LER[:, :, :R].reshape(L * E, R).astype(np.int64)
    count_X = pl.logcnt_LE.reshape(L * E)
    gpu_XR = l2p_XR // pl.slots_per_gpu
    return l2p_XR, static_choice_XG(gpu_XR, count_X, np.arange(L * E), pl.num_gpus, pl.num_nodes)


def static_dispatch_map(placement: Placement, rank: int) -> np.ndarray:
    """int32 [L, E]: the static dispatch map of one rank (see :func:`static_dispatch_maps`)."""
    if not 0 <= rank < placement.num_gpus:
        raise ValueError(f"rank {rank} outside [0, {placement.num_gpus})")
    return static_dispatch_maps(placement)[rank]


def _count_choices(choice_XG: np.ndarray, num_replicas: int) -> np.ndarray:
    """int64 [X, R]: how many ranks chose each replica."""
    X, R = choice_XG.shape[0], num_replicas
    return np.bincount((np.arange(X)[:, None] * R + choice_XG).ravel(), minlength=X * R).reshape(X, R)
