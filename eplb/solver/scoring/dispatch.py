"""How the server splits a logical expert's tokens over its replicas: one object per dispatch mode.

Shape legend: L layers, l layers (scored), n passes, E logical experts, P physical slots, G GPUs, R
max replicas.

The solver scores placements as the server will dispatch on them: a slot carries its expert's
load times its *share*, and a pass's GPU loads follow. :class:`Dispatch` is built from the
``--ep-dispatch-algorithm`` name (eplb.policy.dispatch) and the topology's nodes:

- ``static``: the share of the ranks whose static map picks the replica (eplb.solver.scoring.static_share);
- ``weighted``: the rebalancer's per-replica weights;
- ``lp``: this batch's tokens water-filled over the expert's GPUs (eplb.remap.lp_rule): an even
  split on average (what the search plans with), the rule itself pass by pass (what the
  prediction scores with);
- ``dynamic``, ``dynamic_row``, ``fake``: an even split over replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eplb.policy.dispatch import dispatch_mode
from eplb.solver.scoring.static_share import static_share_LP


@dataclass(frozen=True)
class Dispatch:
    """A dispatch mode as the solver scores it."""

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

    def share_LP(
        self,
        phy2log_LP: np.ndarray,
        cnt_LE: np.ndarray,
        num_gpus: int,
        layers: np.ndarray | None = None,
    ) -> np.ndarray:
        """float64 [l, P]: each slot's mean share of its expert's tokens (weights aside: an even
        split where the mode has none of its own). ``layers``: rows of ``phy2log_LP`` (default all)."""
        rows = np.arange(phy2log_LP.shape[0]) if layers is None else np.asarray(layers, dtype=np.int64)
        if self.static:
            return static_share_LP(phy2log_LP, cnt_LE.shape[1], num_gpus, self.num_nodes, layers)
        p2l_lP = phy2log_LP[rows]
        return 1.0 / np.take_along_axis(cnt_LE[rows], p2l_lP, axis=1).astype(np.float64)

    def gpu_load(
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
            ruled = _lp_gpu_load(load_lnE[:, rule_n], phy2log_lP, num_gpus, self.num_nodes)
            if out is None:
                return ruled
            out[:, rule_n] = ruled
            return out
        return _share_load(load_lnE, phy2log_lP, share_lP, num_gpus)


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


def _lp_gpu_load(load_lnE: np.ndarray, phy2log_lP: np.ndarray, num_gpus: int, num_nodes: int) -> np.ndarray:
    """float32 [l, n, G]: the ``lp`` rule's GPU loads (eplb.remap.lp_rule) on the rows given."""
    from eplb.placement.model import Placement
    from eplb.remap.lp_rule import lp_quotas, lp_tables

    E, P = load_lnE.shape[2], phy2log_lP.shape[1]
    rows = Placement.from_phy2log(phy2log_lP, num_gpus, num_nodes, max_replicas=P - E + 1)
    _, loads_lnG = lp_quotas(np.rint(load_lnE).astype(np.int64), lp_tables(rows))
    return loads_lnG.astype(np.float32)
