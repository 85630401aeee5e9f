"""Replica shares under static dispatch: what each slot receives when ranks use fixed maps.

Shape legend: L layers, l layers computed, E logical experts, P physical slots, G GPUs (ranks),
N nodes, X replicated (layer, expert) pairs, R replicas of the most replicated one.

With static dispatch (SGLang's with EPLB on) every rank sends all its tokens of an expert to the
one replica its static map picks (``eplb.placement.dispatch_map``: a replica on its own GPU, else
on its node, else any, ranks spread round-robin). Tokens come from every rank alike, so a
replica receives the fraction of ranks mapped to it, which is not ``1 / count``: an expert with
two replicas on one node and one elsewhere gives the lone one the ranks of its node and a third
of the rest. A plan scored with an even split misjudges exactly the hot, replicated experts, so
the solver scores with these shares when the server dispatches statically. The rule is the one
``static_dispatch_maps`` applies, computed per replicated expert (single replicas receive
everything) so that one layer can be recomputed after each move of the budgeted search.
"""

from __future__ import annotations

import numpy as np


def static_share_LP(
    phy2log_LP: np.ndarray,
    num_logical: int,
    num_gpus: int,
    num_nodes: int,
    layers: np.ndarray | None = None,
) -> np.ndarray:
    """float64 [l, P]: each slot's share of its expert's tokens under static dispatch.

    ``layers`` picks rows of ``phy2log_LP`` (default: all); the round-robin depends on a row's
    layer index, so rows keep their index in the model.
    """
    if layers is None:
        # One solve scores the current placement several times (both searches, the held-out
        # scores): keep the last few whole-placement answers (a pure function of its inputs).
        key = (np.asarray(phy2log_LP).tobytes(), np.shape(phy2log_LP), num_logical, num_gpus, num_nodes)
        cached = _WHOLE.get(key)
        if cached is None:
            cached = _static_share(np.asarray(phy2log_LP), num_logical, num_gpus, num_nodes, None)
            _WHOLE[key] = cached
            while len(_WHOLE) > _WHOLE_SIZE:
                _WHOLE.pop(next(iter(_WHOLE)))
        return cached.copy()
    return _static_share(np.asarray(phy2log_LP), num_logical, num_gpus, num_nodes, layers)


_WHOLE_SIZE = 4
_WHOLE: dict[tuple[object, ...], np.ndarray] = {}


def _static_share(
    phy2log_LP: np.ndarray, num_logical: int, num_gpus: int, num_nodes: int, layers: np.ndarray | None
) -> np.ndarray:
    layer_l = np.arange(phy2log_LP.shape[0]) if layers is None else np.asarray(layers, dtype=np.int64)
    p2l_lP = phy2log_LP[layer_l].astype(np.int64)
    nl, P = p2l_lP.shape
    E, G = num_logical, num_gpus
    S, gpn = P // G, G // num_nodes
    share_lP = np.ones((nl, P))
    rows = np.arange(nl)[:, None]
    cnt_lE = np.bincount((rows * E + p2l_lP).ravel(), minlength=nl * E).reshape(nl, E)
    row_X, expert_X = np.nonzero(cnt_lE >= 2)
    if row_X.size == 0:
        return share_lP
    # Each pair's slots in ascending order (log2phy's order, which the maps follow).
    order_lP = np.argsort(p2l_lP, axis=1, kind="stable")
    first_lE = np.cumsum(cnt_lE, axis=1) - cnt_lE
    cnt_X = cnt_lE[row_X, expert_X]
    R = int(cnt_X.max())
    k_R = np.arange(R)
    valid_XR = k_R[None, :] < cnt_X[:, None]
    pos_XR = np.where(valid_XR, first_lE[row_X, expert_X][:, None] + k_R[None, :], 0)
    slot_XR = np.where(valid_XR, order_lP[row_X[:, None], pos_XR], -1)
    gpu_XR = np.where(valid_XR, slot_XR // S, -1)
    node_XR = np.where(valid_XR, gpu_XR // gpn, -1)

    rank_G = np.arange(G)
    node_G = rank_G // gpn
    on_gpu_XGR = gpu_XR[:, None, :] == rank_G[None, :, None]
    on_node_XGR = node_XR[:, None, :] == node_G[None, :, None]
    local_XG = on_gpu_XGR.any(axis=2)
    node_cnt_XG = on_node_XGR.sum(axis=2)
    same_node_XG = ~local_XG & (node_cnt_XG > 0)
    anywhere_XG = ~local_XG & ~same_node_XG
    X = row_X.size
    same_j_XG = np.cumsum(same_node_XG.reshape(X, num_nodes, gpn), axis=2).reshape(X, G) - 1
    # All replicas on the rank's node: that node's remote ranks continue the others' count.
    whole_pool_XG = node_cnt_XG == cnt_X[:, None]
    same_j_XG = same_j_XG + np.where(whole_pool_XG, anywhere_XG.sum(axis=1, keepdims=True), 0)
    anywhere_j_XG = np.cumsum(anywhere_XG, axis=1) - 1
    offset_X = layer_l[row_X] * E + expert_X

    candidates_XGR = np.where(
        local_XG[..., None], on_gpu_XGR, np.where(same_node_XG[..., None], on_node_XGR, valid_XR[:, None, :])
    )
    n_XG = candidates_XGR.sum(axis=2)
    j_XG = np.where(same_node_XG, same_j_XG, anywhere_j_XG)
    k_XG = np.where(local_XG, 0, (j_XG + offset_X[:, None]) % np.maximum(n_XG, 1))
    pick_XGR = candidates_XGR & (np.cumsum(candidates_XGR, axis=2) == (k_XG + 1)[..., None])
    ranks_XR = pick_XGR.sum(axis=1)
    share_lP[row_X[:, None].repeat(R, axis=1)[valid_XR], slot_XR[valid_XR]] = ranks_XR[valid_XR] / G
    return share_lP


def expert_static_shares(
    slots: list[int], offset: int, num_gpus: int, slots_per_gpu: int, num_nodes: int
) -> list[float]:
    """The shares of one expert's replicas at ``slots`` (ascending) under static dispatch.

    The rule of :func:`static_share_LP` for one expert, in plain Python: the budgeted search
    recomputes one or two experts after each move, where array set-up would cost more than this.
    ``offset`` is the maps' rotation of the expert, ``layer * num_logical + expert``.
    """
    c = len(slots)
    if c == 1:
        return [1.0]
    gpn = num_gpus // num_nodes
    gpus = [s // slots_per_gpu for s in slots]
    nodes = [g // gpn for g in gpus]
    held = set(nodes)
    anywhere_total = gpn * (num_nodes - len(held))
    ranks = [0] * c
    anywhere_j = 0
    for node in range(num_nodes):
        if node not in held:  # these ranks pick from every replica, round-robin in rank order
            for _ in range(gpn):
                ranks[(anywhere_j + offset) % c] += 1
                anywhere_j += 1
            continue
        on_node = [i for i in range(c) if nodes[i] == node]
        j = anywhere_total if len(on_node) == c else 0
        for rank in range(node * gpn, (node + 1) * gpn):
            local = next((i for i in on_node if gpus[i] == rank), -1)
            if local >= 0:
                ranks[local] += 1
            else:
                ranks[on_node[(j + offset) % len(on_node)]] += 1
                j += 1
    return [r / num_gpus for r in ranks]
