"""Load per GPU under a placement, and balancedness (mean GPU load / max GPU load).

Shape legend: x any leading dimensions, L layers, E logical experts, P physical slots, R max
replicas, G GPUs, S slots per GPU.

Balancedness of a layer is mean/max over GPUs (1.0 is perfect; a layer with no load counts
as 1.0); a model's balancedness is the mean over its layers. These are the definitions SGLang
reports, and every part of eplb (solver, simulator, metrics) computes them here.
"""

from __future__ import annotations

import numpy as np

from eplb.placement.model import Placement
from eplb.placement.share import ShareModel, gpu_share_LEG


def slot_share_LP(placement: Placement, weights_LER: np.ndarray | None = None) -> np.ndarray:
    """float64 [L, P]: fraction of its logical expert's tokens that each slot receives.

    Without weights the load splits evenly over replicas (what dynamic dispatch gives on
    average); with per-replica weights [L, E, R] (sum 1 per expert) it follows them. Other
    splits (static maps, ``lp``): eplb.placement.share.ShareModel, whose even split this is.
    """
    return _EVEN.placement_share_LP(placement, weights_LER)


_EVEN = ShareModel("dynamic")


def gpu_load(load_xLE: np.ndarray, placement: Placement, weights_LER: np.ndarray | None = None) -> np.ndarray:
    """float64 [..., L, G]: tokens each GPU receives, for logical load [..., L, E] (any leading dims)."""
    load = np.asarray(load_xLE, dtype=np.float64)
    if load.shape[-2:] != (placement.num_layers, placement.num_logical):
        raise ValueError(
            f"load shape {load.shape} does not end in [L, E] = "
            f"[{placement.num_layers}, {placement.num_logical}]"
        )
    layer_LP = np.arange(placement.num_layers)[:, None]
    slot_load_xLP = load[..., layer_LP, placement.phy2log_LP] * slot_share_LP(placement, weights_LER)
    S = placement.slots_per_gpu
    return slot_load_xLP.reshape(*slot_load_xLP.shape[:-1], placement.num_gpus, S).sum(axis=-1)


def expert_gpu_share(placement: Placement, weights_LER: np.ndarray | None = None) -> np.ndarray:
    """float64 [L, E, G]: fraction of each logical expert's tokens that each GPU receives.

    ``load_xLE @ share_LEG`` (per layer) equals :func:`gpu_load`; a matrix product is what makes
    long traces cheap to evaluate (the simulator uses it).
    """
    return gpu_share_LEG(placement, slot_share_LP(placement, weights_LER))


def balancedness(gpu_load_xG: np.ndarray) -> np.ndarray:
    """float64 [...]: mean/max over the last axis; 1.0 where the max is 0. NaN loads give NaN."""
    g = np.asarray(gpu_load_xG, dtype=np.float64)
    peak = g.max(axis=-1)
    mean = g.mean(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(peak > 0, mean / np.where(peak > 0, peak, 1.0), np.where(np.isnan(peak), np.nan, 1.0))


def model_balancedness(
    load_xLE: np.ndarray, placement: Placement, weights_LER: np.ndarray | None = None
) -> np.ndarray:
    """float64 [...]: balancedness averaged over layers, for logical load [..., L, E]."""
    return balancedness(gpu_load(load_xLE, placement, weights_LER)).mean(axis=-1)


def imbalance_ratio(load_xLE: np.ndarray, placement: Placement) -> np.ndarray:
    """float64 [...]: max/mean GPU load averaged over layers (1.0 is perfect). The calibration figure."""
    g = gpu_load(load_xLE, placement)
    mean = g.mean(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(mean > 0, g.max(axis=-1) / np.where(mean > 0, mean, 1.0), 1.0)
    return ratio.mean(axis=-1)
