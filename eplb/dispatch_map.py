"""Per-rank static dispatch maps: which replica each rank sends a logical expert's tokens to.

Shape legend: L layers, E logical experts, R max replicas, G EP ranks, N nodes.

Preference for rank r and expert e: a replica on r's own GPU; else one on r's node; else any.
When several candidates qualify, ranks are spread over them round-robin (the j-th rank that needs
a remote replica takes candidate ``(j + l*E + e) mod count``), so holders receive an even share
and the choice is a pure function of the placement: every rank computes the same maps.
"""

from __future__ import annotations

import numpy as np

from eplb.placement import INT32, Placement


def static_dispatch_maps(placement: Placement) -> np.ndarray:
    """int32 [G, L, E]: for every rank, the physical slot it dispatches each logical expert to."""
    pl = placement
    L, E, R, G = pl.num_layers, pl.num_logical, pl.max_replicas, pl.num_gpus
    gpn = pl.gpus_per_node
    l2p_LER = pl.log2phy_LER
    valid_LER = np.arange(R)[None, None, :] < pl.logcnt_LE[:, :, None]
    gpu_LER = np.where(valid_LER, l2p_LER // pl.slots_per_gpu, -1)
    node_LER = np.where(valid_LER, gpu_LER // gpn, -1)

    has_gpu_LGE = pl.gpu_has_expert()
    has_node_LNE = pl.node_has_expert()
    node_of_rank_G = np.arange(G) // gpn
    local_LGE = has_gpu_LGE
    same_node_LGE = ~local_LGE & has_node_LNE[:, node_of_rank_G, :]
    anywhere_LGE = ~local_LGE & ~same_node_LGE
    # j: position of the rank among the ranks that choose from the same candidate pool.
    same_node_j = np.cumsum(same_node_LGE.reshape(L, pl.num_nodes, gpn, E), axis=2).reshape(L, G, E) - 1
    anywhere_j = np.cumsum(anywhere_LGE, axis=1) - 1
    # When every replica sits on one node, that node's remote ranks and the ranks of other nodes
    # draw from the same pool: continue the count instead of restarting it.
    node_cnt_LNE = np.stack([(node_LER == n).sum(axis=2) for n in range(pl.num_nodes)], axis=1)
    whole_pool_LGE = (node_cnt_LNE == pl.logcnt_LE[:, None, :])[:, node_of_rank_G, :]
    same_node_j = same_node_j + np.where(whole_pool_LGE, anywhere_LGE.sum(axis=1, keepdims=True), 0)
    offset_LE = (np.arange(L)[:, None] * E + np.arange(E)[None, :]).astype(np.int64)

    maps_GLE = np.empty((G, L, E), dtype=INT32)
    for rank in range(G):
        on_gpu_LER = gpu_LER == rank
        on_node_LER = node_LER == node_of_rank_G[rank]
        candidates_LER = np.where(
            local_LGE[:, rank, :, None],
            on_gpu_LER,
            np.where(same_node_LGE[:, rank, :, None], on_node_LER, valid_LER),
        )
        j_LE = np.where(
            local_LGE[:, rank], 0, np.where(same_node_LGE[:, rank], same_node_j[:, rank], anywhere_j[:, rank])
        )
        n_LE = candidates_LER.sum(axis=2)
        # Local replicas: always the first; remote: rotate by rank position and expert offset.
        k_LE = np.where(local_LGE[:, rank], 0, (j_LE + offset_LE) % n_LE)
        pick_LER = candidates_LER & (np.cumsum(candidates_LER, axis=2) == (k_LE + 1)[:, :, None])
        maps_GLE[rank] = np.take_along_axis(l2p_LER, pick_LER.argmax(axis=2)[:, :, None], axis=2)[:, :, 0]
    return maps_GLE


def static_dispatch_map(placement: Placement, rank: int) -> np.ndarray:
    """int32 [L, E]: the static dispatch map of one rank (see :func:`static_dispatch_maps`)."""
    if not 0 <= rank < placement.num_gpus:
        raise ValueError(f"rank {rank} outside [0, {placement.num_gpus})")
    return static_dispatch_maps(placement)[rank]
