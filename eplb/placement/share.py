"""How a server splits a logical expert's tokens over its replicas: the share model of a dispatch mode.

Shape legend: L layers, l layers (some of them), n passes, E logical experts, P physical slots, G
GPUs, N nodes, R max replicas, X replicated experts ((layer, expert)
pairs).

A slot carries its expert's load times its *share*; GPU loads, and so balancedness, follow.
:class:`ShareModel` is built from a ``--ep-dispatch-algorithm`` name (eplb.policy.dispatch) and the
topology's nodes; the solver's search and scorer and the simulator all ask it:

- ``static``: the fraction of ranks whose static map picks the replica (the rule:
  eplb.placement.dispatch_map), so a replica's share follows where its expert's replicas sit;
- ``weighted``: the rebalancer's per-replica weights, where given;
- ``lp``: each batch's tokens water-filled over the expert's GPUs (eplb.remap.lp_rule): an even
  split on average (the mean shares), the rule itself pass by pass (:meth:`ShareModel.pass_gpu_load`);
- ``dynamic``, ``dynamic_row``, ``fake``: an even split over replicas.

Shares of a placement come two ways, with the same numbers where log2phy lists each expert's
slots ascending (as ``Placement.from_phy2log`` builds it): from a Placement (its log2phy order,
what the server's maps follow) or from phy2log alone (slots ascending), so that the search can
recompute one layer or one expert after a move.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

from eplb.placement.dispatch_map import static_ranks_LER, static_ranks_XR
from eplb.placement.model import Placement, expert_order_LP
from eplb.policy.dispatch import dispatch_mode

if TYPE_CHECKING:
    from eplb.remap.lp_rule import LpTables


@dataclass(frozen=True)
class ShareModel:
    """A dispatch mode as a split of each expert's tokens over its replicas."""

    mode: str
    """A dispatch mode name (eplb.policy.dispatch_mode_names())."""
    num_nodes: int = 1
    """Nodes of the topology (static maps prefer a replica on the rank's own node)."""

    def __post_init__(self) -> None:
        dispatch_mode(self.mode)  # ValueError listing the choices

    @property
    def static(self) -> bool:
        """Shares follow the ranks' static maps."""
        return dispatch_mode(self.mode).static_maps

    @property
    def weighted(self) -> bool:
        """Shares are the rebalancer's per-replica weights."""
        return dispatch_mode(self.mode).needs_weights

    @property
    def per_batch(self) -> bool:
        """Each batch is split by its own counts (``lp``)."""
        return dispatch_mode(self.mode).collective

    @property
    def follows_nodes(self) -> bool:
        """A replica's mean share depends on the GPUs and nodes of its expert's replicas, not only on
        their count (static maps): a move changes the moved experts' shares."""
        return self.static

    def share_LP(
        self,
        phy2log_LP: np.ndarray,
        cnt_LE: np.ndarray,
        num_gpus: int,
        layers: np.ndarray | None = None,
    ) -> np.ndarray:
        """float64 [l, P]: each slot's mean share of its expert's tokens from phy2log (weights
        aside: an even split where the mode has none of its own). ``layers``: rows of
        ``phy2log_LP`` (default all); a row keeps its layer index (the static maps' rotation)."""
        if self.static:
            return _static_share_lP(phy2log_LP, cnt_LE.shape[1], num_gpus, self.num_nodes, layers)
        rows = np.arange(phy2log_LP.shape[0]) if layers is None else np.asarray(layers, dtype=np.int64)
        return even_share_lP(np.take_along_axis(cnt_LE[rows], phy2log_LP[rows], axis=1))

    def placement_share_LP(self, placement: Placement, weights_LER: np.ndarray | None = None) -> np.ndarray:
        """float64 [L, P]: each slot's mean share of its expert's tokens on ``placement``: the
        per-replica weights [L, E, R] where given (sum 1 per expert), else the mode's split."""
        if weights_LER is None and self.static:
            weights_LER = static_weights(placement)
        if weights_LER is None:
            layer_LP = np.arange(placement.num_layers)[:, None]
            return even_share_lP(placement.logcnt_LE[layer_LP, placement.phy2log_LP])
        if weights_LER.shape != placement.log2phy_LER.shape:
            raise ValueError(
                f"weights shape {weights_LER.shape} != log2phy shape {placement.log2phy_LER.shape}"
            )
        share_LP = np.zeros(placement.phy2log_LP.shape, dtype=np.float64)
        used = placement.log2phy_LER >= 0
        layer_LER = np.broadcast_to(np.arange(placement.num_layers)[:, None, None], used.shape)
        share_LP[layer_LER[used], placement.log2phy_LER[used]] = weights_LER[used]
        return share_LP

    def gpu_share_LEG(self, placement: Placement, weights_LER: np.ndarray | None = None) -> np.ndarray:
        """float64 [L, E, G]: fraction of each expert's tokens each GPU receives (shares as
        :meth:`placement_share_LP`); ``load_xLE @ share_LEG`` per layer gives the GPU loads."""
        return gpu_share_LEG(placement, self.placement_share_LP(placement, weights_LER))

    def expert_shares(
        self, slots_X: Sequence[Sequence[int]], offset_X: Sequence[int], num_gpus: int, slots_per_gpu: int
    ) -> list[np.ndarray]:
        """float64 [count] per expert (read-only): the mean shares of the replicas of experts at
        ``slots_X`` (each ascending); ``offset_X``: the static maps' rotation of each, ``layer *
        num_logical + expert``. Several experts at once: the search recomputes the one or two a
        move touched."""
        if not self.static:
            return [np.full(len(slots), 1.0 / len(slots)) for slots in slots_X]
        # A pure function of the replicas' GPUs and the rotation: the search meets the same
        # experts again (a move undone, a replica moved back), and one call costs tens of numpy ops.
        keys = [
            (num_gpus, self.num_nodes, offset, tuple(p // slots_per_gpu for p in slots))
            for slots, offset in zip(slots_X, offset_X, strict=True)
        ]
        missing = [key for key in keys if key not in _EXPERT]
        if missing:
            count_X = np.asarray([len(key[3]) for key in missing])
            R = int(count_X.max())
            gpu_XR = np.asarray([key[3] + (0,) * (R - len(key[3])) for key in missing])
            offset_X1 = np.asarray([key[2] for key in missing])
            shares_XR = static_ranks_XR(gpu_XR, count_X, offset_X1, num_gpus, self.num_nodes) / num_gpus
            shares_XR.setflags(write=False)
            for row, key in enumerate(missing):
                _EXPERT[key] = shares_XR[row, : len(key[3])]
        out = [_EXPERT[key] for key in keys]
        while len(_EXPERT) > _EXPERT_SIZE:  # oldest first; after the lookup, which may want them
            _EXPERT.pop(next(iter(_EXPERT)))
        return out

    def max_share_R(self, max_replicas: int, num_gpus: int, slots_per_gpu: int) -> np.ndarray:
        """float64 [max_replicas + 1]: the largest share of its expert's tokens one of R replicas
        gets (entry 0 unused): ``1 / R`` for an even split; under static maps, on the canonical
        spread (:func:`canonical_slots`), over every rotation of the maps."""
        if self.static:
            return _static_max_share(max_replicas, num_gpus, self.num_nodes, slots_per_gpu)
        return 1.0 / np.maximum(np.arange(max_replicas + 1), 1)

    def pass_gpu_load(
        self,
        load_lnE: np.ndarray,
        phy2log_lP: np.ndarray,
        share_lP: np.ndarray,
        num_gpus: int,
        batch_n: np.ndarray | None = None,
    ) -> np.ndarray:
        """float32 [l, n, G]: the GPU loads of passes ``load_lnE`` (float32 [l, n, E]) on the rows
        ``phy2log_lP`` with slot shares ``share_lP``; ``lp``: the per-batch rule on the passes
        ``batch_n`` (bool [n], default all) picks, the mean shares on the others."""
        if self.per_batch and (batch_n is None or batch_n.any()):
            rule_n = np.ones(load_lnE.shape[1], dtype=bool) if batch_n is None else batch_n
            out = _share_load(load_lnE, phy2log_lP, share_lP, num_gpus) if not rule_n.all() else None
            from eplb.remap.lp_rule import lp_tables

            E, P = load_lnE.shape[2], phy2log_lP.shape[1]
            rows = Placement.from_phy2log(phy2log_lP, num_gpus, self.num_nodes, max_replicas=P - E + 1)
            ruled = lp_gpu_load(load_lnE[:, rule_n], lp_tables(rows))
            if out is None:
                return ruled
            out[:, rule_n] = ruled
            return out
        return _share_load(load_lnE, phy2log_lP, share_lP, num_gpus)


def static_weights(placement: Placement) -> np.ndarray:
    """float64 [L, E, R]: fraction of the ranks whose static map sends an expert to each replica."""
    ranks_LER = static_ranks_LER(placement)
    out_LER = np.zeros(placement.log2phy_LER.shape)
    out_LER[:, :, : ranks_LER.shape[2]] = ranks_LER / placement.num_gpus
    return out_LER


def even_share_lP(cnt_lP: np.ndarray) -> np.ndarray:
    """float64 [l, P]: an even split, from each slot's expert's replica count."""
    return 1.0 / cnt_lP.astype(np.float64)


def gpu_share_LEG(placement: Placement, share_LP: np.ndarray) -> np.ndarray:
    """float64 [L, E, G]: slot shares [L, P] summed per (expert, GPU)."""
    L, E, G = placement.num_layers, placement.num_logical, placement.num_gpus
    share_LEG = np.zeros((L, E, G), dtype=np.float64)
    layer_LP = np.broadcast_to(np.arange(L)[:, None], placement.phy2log_LP.shape)
    gpu_LP = np.broadcast_to(placement.gpu_of_slot()[None, :], placement.phy2log_LP.shape)
    np.add.at(share_LEG, (layer_LP, placement.phy2log_LP, gpu_LP), share_LP)
    return share_LEG


def lp_gpu_load(load_lnE: np.ndarray, tables: LpTables) -> np.ndarray:
    """float32 [l, n, G]: GPU tokens of global expert loads [l, n, E] under the ``lp`` rule."""
    from eplb.remap.lp_rule import lp_quotas

    _, loads_lnG = lp_quotas(np.rint(load_lnE).astype(np.int64), tables)
    return loads_lnG.astype(np.float32)


def _share_load(
    load_lnE: np.ndarray, phy2log_lP: np.ndarray, share_lP: np.ndarray, num_gpus: int
) -> np.ndarray:
    """float32 [l, n, G]: GPU loads with each slot carrying its expert's load times its share."""
    nl, E = phy2log_lP.shape[0], load_lnE.shape[2]
    gpu_P = np.arange(phy2log_lP.shape[1]) // (phy2log_lP.shape[1] // num_gpus)
    flat = ((np.arange(nl)[:, None] * E + phy2log_lP) * num_gpus + gpu_P).ravel()
    share_lEG = np.bincount(flat, share_lP.ravel(), minlength=nl * E * num_gpus)
    # float32 products are exact enough for a score and several times faster than a gather.
    return np.matmul(load_lnE, share_lEG.reshape(nl, E, num_gpus).astype(np.float32))


def _static_share_lP(
    phy2log_LP: np.ndarray, num_logical: int, num_gpus: int, num_nodes: int, layers: np.ndarray | None
) -> np.ndarray:
    """float64 [l, P]: static shares from phy2log (each expert's slots ascending)."""
    if layers is not None:
        return _static_share(np.asarray(phy2log_LP), num_logical, num_gpus, num_nodes, layers)
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


_WHOLE_SIZE = 4
_WHOLE: dict[tuple[object, ...], np.ndarray] = {}
_EXPERT_SIZE = 1 << 14
_EXPERT: dict[tuple[int, int, int, tuple[int, ...]], np.ndarray] = {}


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
    # Single replicas receive everything: only the replicated pairs are counted.
    row_X, expert_X = np.nonzero(cnt_lE >= 2)
    if row_X.size == 0:
        return share_lP
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


def canonical_slots(count: int, num_gpus: int, num_nodes: int, slots_per_gpu: int) -> list[int]:
    """Slots (ascending) of ``count`` replicas dealt round-robin over nodes, then over each node's GPUs."""
    gpn = num_gpus // num_nodes
    return sorted(
        ((i % num_nodes) * gpn + (i // num_nodes) % gpn) * slots_per_gpu + i // (num_nodes * gpn)
        for i in range(count)
    )


@lru_cache(maxsize=64)
def _static_max_share(max_replicas: int, num_gpus: int, num_nodes: int, slots_per_gpu: int) -> np.ndarray:
    counts = [count for count in range(2, max_replicas + 1) for _ in range(count)]
    offsets = [offset for count in range(2, max_replicas + 1) for offset in range(count)]
    slots_X = [canonical_slots(count, num_gpus, num_nodes, slots_per_gpu) for count in counts]
    shares_X = ShareModel("static", num_nodes).expert_shares(slots_X, offsets, num_gpus, slots_per_gpu)
    table = np.ones(max_replicas + 1)
    table[2:] = 0.0
    for count, shares in zip(counts, shares_X, strict=True):
        table[count] = max(table[count], float(shares.max()))
    table.setflags(write=False)
    return table
