"""The ``lp`` dispatch mode in simulation: each batch's replicated-expert tokens water-filled over GPUs.

Shape legend: L layers, n passes (steps), E logical experts, R max replicas, G GPUs.

The other modes turn logical load into GPU load by one fixed matrix per layer
(``load_LnE @ share_LEG``). Under ``lp`` the split depends on the batch itself (the rule in
eplb.remap.lp_rule, the same the kernel applies), so :class:`PerBatchShare` stands where that
matrix stands: an array holding the even split (what the rule gives on average, for anything that
reads the matrix itself), whose product with a load evaluates the rule on every step and layer.
Active replicas are counted as under ``dynamic`` (every replica of a loaded expert): the rule may
leave a replica without tokens on a small batch, so this slightly overstates decode cost.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from eplb.placement.model import Placement
from eplb.placement.share import ShareModel, lp_gpu_load
from eplb.remap.lp_rule import LpTables, lp_tables


class PerBatchShare(np.ndarray):
    """float32 [L, E, G] even split; ``np.matmul(load_LnE, share)`` applies the ``lp`` rule per step."""

    lp: LpTables | None

    def __new__(cls, placement: Placement) -> PerBatchShare:
        model = ShareModel("lp", placement.num_nodes)
        share = np.asarray(model.gpu_share_LEG(placement), dtype=np.float32).view(cls)
        share.lp = lp_tables(placement)
        return share

    def __array_finalize__(self, obj: Any) -> None:
        self.lp = getattr(obj, "lp", None)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if ufunc is np.matmul and method == "__call__" and len(inputs) == 2 and inputs[1] is self:
            if self.lp is None or kwargs:
                raise TypeError("an lp share multiplies a load [L, n, E] only, without out= or axes=")
            load_LnE = np.asarray(inputs[0])
            if load_LnE.ndim != 3:
                raise ValueError(f"lp dispatch needs a load [L, n, E], got shape {load_LnE.shape}")
            return lp_gpu_load(load_LnE, self.lp)
        plain = [np.asarray(x).view(np.ndarray) if isinstance(x, PerBatchShare) else x for x in inputs]
        return getattr(ufunc, method)(*plain, **kwargs)


def lp_matrices_parts(placement: Placement) -> tuple[PerBatchShare, np.ndarray]:
    """(share, active replicas float32 [L, E, G]) of ``placement`` under ``lp``."""
    share = PerBatchShare(placement)
    L, E, G = placement.num_layers, placement.num_logical, placement.num_gpus
    replicas_LEG = np.zeros((L, E, G), dtype=np.float32)
    layer_LP = np.broadcast_to(np.arange(L)[:, None], placement.phy2log_LP.shape)
    gpu_LP = np.broadcast_to(placement.gpu_of_slot()[None, :], placement.phy2log_LP.shape)
    np.add.at(replicas_LEG, (layer_LP, placement.phy2log_LP, gpu_LP), 1.0)
    return share, replicas_LEG


__all__ = ["PerBatchShare", "lp_matrices_parts"]
