"""Per-rank static dispatch maps: which replica each rank sends a logical expert's tokens to.

Shape legend: L layers, E logical experts, R max replicas, G GPUs (EP ranks), N nodes.

Preference for rank r and expert e: a replica on r's own GPU; else one on r's node; else any.
When several candidates qualify, ranks are spread over them round-robin (the j-th rank that needs
a remote replica takes candidate ``(j + l*E + e) mod count``), so holders receive an even share
and the choice is a pure function of the placement: every rank computes the same maps.
"""

from __future__ import annotations

import numpy as np

from eplb.placement.model import INT32, Placement


def static_dispatch_maps(placement: Placement) -> np.ndarray:
    """int32 [G, L, E]: for every rank, the physical slot it dispatches each logical expert to."""
    pl = placement
    L, E, G = pl.num_layers, pl.num_logical, pl.num_gpus
    gpn = pl.gpus_per_node
    # Only the used replica columns matter; log2phy is often padded far past the largest count.
    R = int(pl.logcnt_LE.max())
    l2p_LER = pl.log2phy_LER[:, :, :R]
    valid_LER = np.arange(R)[None, None, :] < pl.logcnt_LE[:, :, None]
    gpu_LER = np.where(valid_LER, l2p_LER // pl.slots_per_gpu, -1)
    node_LER = np.where(valid_LER, gpu_LER // gpn, -1)

    has_node_LNE = pl.node_has_expert()
    rank_G = np.arange(G)
    node_of_rank_G = rank_G // gpn
    local_GLE = pl.gpu_has_expert().transpose(1, 0, 2)
    same_node_GLE = ~local_GLE & has_node_LNE[:, node_of_rank_G, :].transpose(1, 0, 2)
    anywhere_GLE = ~local_GLE & ~same_node_GLE
    # j: position of the rank among the ranks that choose from the same candidate pool.
    same_node_j = np.cumsum(same_node_GLE.reshape(pl.num_nodes, gpn, L, E), axis=1).reshape(G, L, E) - 1
    anywhere_j = np.cumsum(anywhere_GLE, axis=0) - 1
    # When every replica sits on one node, that node's remote ranks and the ranks of other nodes
    # draw from the same pool: continue the count instead of restarting it.
    node_cnt_LNE = np.stack([(node_LER == n).sum(axis=2) for n in range(pl.num_nodes)], axis=1)
    whole_pool_GLE = (node_cnt_LNE == pl.logcnt_LE[:, None, :])[:, node_of_rank_G, :].transpose(1, 0, 2)
    same_node_j = same_node_j + np.where(whole_pool_GLE, anywhere_GLE.sum(axis=0, keepdims=True), 0)
    offset_LE = np.arange(L)[:, None] * E + np.arange(E)[None, :]

    on_gpu_GLER = gpu_LER[None] == rank_G[:, None, None, None]
    on_node_GLER = node_LER[None] == node_of_rank_G[:, None, None, None]
    candidates_GLER = np.where(
        local_GLE[..., None], on_gpu_GLER, np.where(same_node_GLE[..., None], on_node_GLER, valid_LER[None])
    )
    j_GLE = np.where(same_node_GLE, same_node_j, anywhere_j)
    n_GLE = candidates_GLER.sum(axis=3)
    # Local replicas: always the first; remote: rotate by rank position and expert offset.
    k_GLE = np.where(local_GLE, 0, (j_GLE + offset_LE[None]) % n_GLE)
    pick_GLER = candidates_GLER & (np.cumsum(candidates_GLER, axis=3) == (k_GLE + 1)[..., None])
    choice_GLE = pick_GLER.argmax(axis=3)
    maps_GLE = np.take_along_axis(np.broadcast_to(l2p_LER[None], (G, L, E, R)), choice_GLE[..., None], axis=3)
    return np.ascontiguousarray(maps_GLE[..., 0], dtype=INT32)


def static_dispatch_map(placement: Placement, rank: int) -> np.ndarray:
    """int32 [L, E]: the static dispatch map of one rank (see :func:`static_dispatch_maps`)."""
    if not 0 <= rank < placement.num_gpus:
        raise ValueError(f"rank {rank} outside [0, {placement.num_gpus})")
    return static_dispatch_maps(placement)[rank]
