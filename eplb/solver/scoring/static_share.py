"""Replica shares under static dispatch: what each slot receives when ranks use fixed maps.

Shape legend: L layers, l layers (computed), E logical experts, P physical slots, G GPUs (ranks), N
nodes, X replicated experts ((layer, expert) pairs), R max replicas (of the most replicated pair).

With static dispatch (SGLang's with EPLB on) every rank sends all its tokens of an expert to the
one replica its static map picks (the rule, eplb.placement.dispatch_map.static_choice_XG). Tokens
come from every rank alike, so a replica receives the fraction of ranks mapped to it, which is not
``1 / count``: an expert with two replicas on one node and one elsewhere gives the lone one the
ranks of its node and a third of the rest. A plan scored with an even split misjudges exactly the
hot, replicated experts, so the solver scores with these shares when the server dispatches
statically. They are the maps' own counts, for the replicated experts only (single replicas
receive everything), from phy2log alone (each expert's slots ascending, the order
``Placement.from_phy2log`` gives log2phy), so that one layer or one expert can be recomputed after
each move of the budgeted search.
"""

from __future__ import annotations

import numpy as np

from eplb.placement.dispatch_map import static_ranks_XR
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
    E, G = num_logical, num_gpus
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
    offset_X = layer_l[row_X] * E + expert_X
    ranks_XR = static_ranks_XR(slot_XR // (P // G), cnt_X, offset_X, G, num_nodes)
    share_lP[row_X[:, None].repeat(R, axis=1)[valid_XR], slot_XR[valid_XR]] = ranks_XR[valid_XR] / G
    return share_lP


def expert_static_shares(
    slots: list[int], offset: int, num_gpus: int, slots_per_gpu: int, num_nodes: int
) -> list[float]:
    """The shares of one expert's replicas at ``slots`` (ascending) under static dispatch.

    ``offset`` is the maps' rotation of the expert, ``layer * num_logical + expert``.
    """
    if len(slots) == 1:
        return [1.0]
    gpu_XR = np.asarray([slots]) // slots_per_gpu
    ranks_R = static_ranks_XR(gpu_XR, np.asarray([len(slots)]), np.asarray([offset]), num_gpus, num_nodes)[0]
    return (ranks_R / num_gpus).tolist()
