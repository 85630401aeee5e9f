"""The ``lp`` dispatch mode in simulation: each batch's replicated-expert tokens water-filled over GPUs.

Shape legend: L layers, n passes (steps), E logical experts, R max replicas, G GPUs.

The other modes turn logical load into GPU load by one fixed matrix per layer
(``load_LnE @ share_LEG``). Under ``lp`` the split depends on the batch itself (the rule in
eplb.remap.lp_rule, the same the kernel applies), so :class:`PerBatchShare` stands where that
matrix stands: an array holding the even split (what the rule gives on average, for anything that
reads the matrix itself), whose product with a load evaluates the rule on every step and layer.
Active replicas are counted as under ``dynamic`` (every replica of a loaded expert): the rule may
leave a replica without tokens on a small batch, so this slightly overstates decode cost.

A lost rank's columns are cut with :func:`take_gpus` (and the lost ones gathered with
:func:`join_gpus`): the rule still runs over the whole placement the batch is routed by, and the
share reports only the GPU columns it kept, so a replay that does not replan stays in step.
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
    gpus_G: np.ndarray | None
    """int64 [G'] columns of the routed placement's GPUs this share reports; None: all of them."""

    def __new__(cls, placement: Placement) -> PerBatchShare:
        model = ShareModel("lp", placement.num_nodes)
        share = np.asarray(model.gpu_share_LEG(placement), dtype=np.float32).view(cls)
        share.lp = lp_tables(placement)
        share.gpus_G = None
        return share

    def __array_finalize__(self, obj: Any) -> None:
        self.lp = getattr(obj, "lp", None)
        self.gpus_G = getattr(obj, "gpus_G", None)

    def __getitem__(self, key: Any) -> Any:
        # An index may drop GPU columns the rule still fills: a slice is a plain even split, and
        # the columns a product keeps are taken with take_gpus.
        return np.asarray(self).view(np.ndarray)[key]

    def _with_columns(self, share_LEG: np.ndarray, gpus_G: np.ndarray) -> PerBatchShare:
        out = np.ascontiguousarray(share_LEG).view(PerBatchShare)
        out.lp, out.gpus_G = self.lp, gpus_G
        return out

    def columns_G(self) -> np.ndarray:
        """int64 [G']: the routed placement's GPU columns this share reports."""
        return np.arange(self.shape[2]) if self.gpus_G is None else self.gpus_G

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if ufunc is np.matmul and method == "__call__" and len(inputs) == 2 and inputs[1] is self:
            if self.lp is None or kwargs:
                raise TypeError("an lp share multiplies a load [L, n, E] only, without out= or axes=")
            load_LnE = np.asarray(inputs[0])
            if load_LnE.ndim != 3:
                raise ValueError(f"lp dispatch needs a load [L, n, E], got shape {load_LnE.shape}")
            gpu_LnG = lp_gpu_load(load_LnE, self.lp)
            return gpu_LnG if self.gpus_G is None else gpu_LnG[:, :, self.gpus_G]
        plain = [np.asarray(x).view(np.ndarray) if isinstance(x, PerBatchShare) else x for x in inputs]
        return getattr(ufunc, method)(*plain, **kwargs)


def take_gpus(share_LEG: np.ndarray, keep_G: np.ndarray) -> np.ndarray:
    """``share_LEG``'s GPU columns ``keep_G`` (a bool mask or indices over its last axis)."""
    if isinstance(share_LEG, PerBatchShare):
        return share_LEG._with_columns(share_LEG[:, :, keep_G], share_LEG.columns_G()[keep_G])
    return share_LEG[:, :, keep_G]


def join_gpus(first_LEG: np.ndarray, second_LEG: np.ndarray) -> np.ndarray:
    """The GPU columns of two shares of one routed placement side by side (the second's after)."""
    if isinstance(first_LEG, PerBatchShare) != isinstance(second_LEG, PerBatchShare):
        raise TypeError("join_gpus joins two lp shares or two fixed shares, not one of each")
    joined = np.concatenate([np.asarray(first_LEG), np.asarray(second_LEG)], axis=2)
    if not isinstance(first_LEG, PerBatchShare):
        return joined
    assert isinstance(second_LEG, PerBatchShare)
    if first_LEG.lp is not second_LEG.lp:
        raise ValueError("join_gpus joins columns of one routed placement")
    return first_LEG._with_columns(joined, np.concatenate([first_LEG.columns_G(), second_LEG.columns_G()]))


def lp_matrices_parts(placement: Placement) -> tuple[PerBatchShare, np.ndarray]:
    """(share, active replicas float32 [L, E, G]) of ``placement`` under ``lp``."""
    share = PerBatchShare(placement)
    L, E, G = placement.num_layers, placement.num_logical, placement.num_gpus
    replicas_LEG = np.zeros((L, E, G), dtype=np.float32)
    layer_LP = np.broadcast_to(np.arange(L)[:, None], placement.phy2log_LP.shape)
    gpu_LP = np.broadcast_to(placement.gpu_of_slot()[None, :], placement.phy2log_LP.shape)
    np.add.at(replicas_LEG, (layer_LP, placement.phy2log_LP, gpu_LP), 1.0)
    return share, replicas_LEG


__all__ = ["PerBatchShare", "join_gpus", "lp_matrices_parts", "take_gpus"]
