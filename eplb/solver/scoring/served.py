"""A placement as the server dispatches on it: its slot shares, and its balancedness on a load.

Shape legend: Z scenarios, L layers, E logical experts, P physical slots, G GPUs, R max replicas.

A slot carries its expert's load times its *share* (eplb.placement.share: static maps' shares,
weights, or an even split); GPU loads, and so balancedness, follow. The solver scores
plans with these, and the manager and ``eplb solve`` report before and after with
:func:`served_balancedness`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eplb.placement.balance import balancedness
from eplb.placement.model import Placement
from eplb.placement.share import ShareModel


@dataclass(frozen=True)
class Scored:
    """A placement as the scorer needs it."""

    phy2log_LP: np.ndarray
    """int [L, P]."""
    share_LP: np.ndarray
    """float64 [L, P]: mean share of its expert's tokens each slot receives."""


def scored_placement(
    placement: Placement,
    weights_LER: np.ndarray | None,
    dispatch: ShareModel,
    base: Scored | None = None,
) -> Scored:
    """``placement`` with the share of its expert's tokens each slot gets as the server dispatches.

    ``base``: the current placement scored; shares are computed again only for the layers that
    differ from it.
    """
    if weights_LER is not None:
        return Scored(placement.phy2log_LP, dispatch.placement_share_LP(placement, weights_LER))
    p2l_LP, cnt_LE, G = placement.phy2log_LP, placement.logcnt_LE, placement.num_gpus
    if base is None:
        return Scored(p2l_LP, dispatch.share_LP(p2l_LP, cnt_LE, G))
    changed = np.flatnonzero((p2l_LP != base.phy2log_LP).any(axis=1))
    share_LP = base.share_LP.copy()
    share_LP[changed] = dispatch.share_LP(p2l_LP, cnt_LE, G, changed)
    return Scored(p2l_LP, share_LP)


def served_balancedness(
    load_LE: np.ndarray,
    placement: Placement,
    weights_LER: np.ndarray | None = None,
    *,
    dispatch: str = "dynamic",
) -> float:
    """Model balancedness of logical load [L, E] on ``placement`` as the server splits an expert's
    tokens (``dispatch``, a dispatch mode name; ``weights_LER`` where given): the score the
    solver's plans are made for; the manager reports its before/after with it."""
    scored = scored_placement(placement, weights_LER, ShareModel(dispatch, placement.num_nodes))
    return scored_balancedness(np.asarray(load_LE, dtype=np.float64), scored, placement.num_gpus)


def scored_balancedness(load_LE: np.ndarray, scored: Scored, num_gpus: int) -> float:
    """Model balancedness of summed load [L, E] under ``scored``'s placement and shares."""
    layer_LP = np.arange(load_LE.shape[0])[:, None]
    slot_LP = load_LE[layer_LP, scored.phy2log_LP] * scored.share_LP
    return float(balancedness(slot_LP.reshape(slot_LP.shape[0], num_gpus, -1).sum(axis=-1)).mean())


def expected_balancedness(gpu_ZLG: np.ndarray, weights_Z: np.ndarray) -> np.ndarray:
    """float64 [L]: sum_k pi_k mean_k / max_k (1 where a scenario has no load)."""
    peak = gpu_ZLG.max(axis=-1)
    mean = gpu_ZLG.mean(axis=-1)
    ratio = np.where(peak > 0, mean / np.where(peak > 0, peak, 1.0), 1.0)
    return np.tensordot(weights_Z, ratio, axes=1)


def layer_scores(
    phy2log_LP: np.ndarray,
    scenarios_ZLE: np.ndarray,
    weights_Z: np.ndarray,
    num_gpus: int,
    dispatch: ShareModel,
) -> np.ndarray:
    """float64 [L]: expected balancedness of each layer over the scenarios, each slot carrying its
    expert's load times its share as ``dispatch`` splits it."""
    Z, L, E = scenarios_ZLE.shape
    layer = np.arange(L)[:, None]
    cnt_LE = np.stack([np.bincount(row, minlength=E) for row in phy2log_LP])
    share_LP = dispatch.share_LP(phy2log_LP, cnt_LE, num_gpus)
    item_ZLP = scenarios_ZLE[:, layer, phy2log_LP] * share_LP
    return expected_balancedness(item_ZLP.reshape(Z, L, num_gpus, -1).sum(axis=-1), weights_Z)


def expectation(weights_Z: np.ndarray, values_Z: np.ndarray) -> np.ndarray:
    """sum_k pi_k values[k] over the scenarios (no tensordot copy for the one-scenario case; with
    one scenario of weight 1, ``values_Z[0]`` itself, a view: the search's hottest arrays skip a
    pass, and ``x * 1.0`` is ``x`` bit for bit)."""
    if weights_Z.shape[0] == 1:
        if weights_Z[0] == 1.0:
            return np.asarray(values_Z[0])
        return np.asarray(values_Z[0] * weights_Z[0])
    return np.tensordot(weights_Z, values_Z, axes=1)
