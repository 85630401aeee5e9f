"""Replica shares under static dispatch: what each slot receives when ranks use fixed maps.

Shape legend: L layers, l layers (computed), E logical experts, P physical slots, G GPUs (ranks), N
nodes, X replicated experts ((layer, expert) pairs), R max replicas (of the most replicated pair).

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

from eplb.placement.model import expert_order_LP


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
    E, G, N = num_logical, num_gpus, num_nodes
    S, gpn = P // G, G // N
    share_lP = np.ones((nl, P))
    rows = np.arange(nl)[:, None]
    cnt_lE = np.bincount((rows * E + p2l_lP).ravel(), minlength=nl * E).reshape(nl, E)
    row_X, expert_X = np.nonzero(cnt_lE >= 2)
    if row_X.size == 0:
        return share_lP
    # Each pair's slots in ascending order (log2phy's order, which the maps follow).
    order_lP = expert_order_LP(p2l_lP, E)
    first_lE = np.cumsum(cnt_lE, axis=1) - cnt_lE
    cnt_X = cnt_lE[row_X, expert_X]
    R = int(cnt_X.max())
    k_R = np.arange(R)
    valid_XR = k_R[None, :] < cnt_X[:, None]
    pos_XR = np.where(valid_XR, first_lE[row_X, expert_X][:, None] + k_R[None, :], 0)
    slot_XR = np.where(valid_XR, order_lP[row_X[:, None], pos_XR], -1)
    gpu_XR = np.where(valid_XR, slot_XR // S, -1)
    node_XR = np.where(valid_XR, gpu_XR // gpn, -1)
    offset_X = layer_l[row_X] * E + expert_X
    # A GPU's own first replica takes that rank.
    first_on_gpu_XR = valid_XR & ~(
        (gpu_XR[:, :, None] == gpu_XR[:, None, :]) & (k_R[None, None, :] < k_R[None, :, None])
    ).any(axis=2)
    ranks_XR = first_on_gpu_XR.astype(np.int64)
    on_node_XNR = node_XR[:, None, :] == np.arange(N)[None, :, None]
    reps_XN = on_node_XNR.sum(axis=2)
    gpus_XN = (on_node_XNR & first_on_gpu_XR[:, None, :]).sum(axis=2)
    # Ranks of nodes without a replica: round-robin over all replicas from the expert's offset.
    anywhere_X = gpn * (reps_XN == 0).sum(axis=1)
    ranks_XR += _round_robin(anywhere_X[:, None], cnt_X[:, None], offset_X[:, None], k_R[None, :])
    ranks_XR = np.where(valid_XR, ranks_XR, 0)
    # The other ranks of a node with replicas: round-robin over the node's, after the anywhere
    # ranks when the node holds every replica.
    rest_XN = np.where(reps_XN > 0, gpn - gpus_XN, 0)
    base_XN = np.where(reps_XN == cnt_X[:, None], anywhere_X[:, None], 0)
    index_XNR = np.cumsum(on_node_XNR, axis=2) - 1  # a replica's position among its node's
    extra_XNR = _round_robin(
        rest_XN[..., None],
        np.maximum(reps_XN, 1)[..., None],
        (base_XN + offset_X[:, None])[..., None],
        index_XNR,
    )
    ranks_XR += (extra_XNR * on_node_XNR).sum(axis=1)
    share_lP[row_X[:, None].repeat(R, axis=1)[valid_XR], slot_XR[valid_XR]] = ranks_XR[valid_XR] / G
    return share_lP


def _round_robin(count: np.ndarray, pool: np.ndarray, start: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Of ``count`` ranks dealt round-robin over ``pool`` candidates (the j-th to candidate
    ``(j + start) mod pool``), how many candidate ``index`` gets."""
    return count // pool + (np.mod(index - start, pool) < count % pool)


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
    ranks = [0] * c
    by_node: dict[int, list[int]] = {}
    seen: set[int] = set()
    for i, g in enumerate(gpus):
        by_node.setdefault(g // gpn, []).append(i)
        if g not in seen:  # a GPU's own first replica takes that rank
            seen.add(g)
            ranks[i] += 1
    anywhere = gpn * (num_nodes - len(by_node))
    for i in range(c):  # ranks of nodes without a replica, round-robin over all of them
        ranks[i] += anywhere // c + ((i - offset) % c < anywhere % c)
    for members in by_node.values():
        n = len(members)
        rest = gpn - len({gpus[i] for i in members})
        start = offset + (anywhere if n == c else 0)
        for q, i in enumerate(members):
            ranks[i] += rest // n + ((q - start) % n < rest % n)
    return [r / num_gpus for r in ranks]
