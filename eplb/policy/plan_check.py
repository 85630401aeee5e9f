"""A plan checked against the model it would be served on, in the one rebalance path.

Shape legend: L layers, E logical experts, P physical slots, G GPUs (ranks), R max replicas.

A planner (the caller's ``planner=`` may be anyone's) can hand back a plan of another shape: more
or fewer slots than the model has, another layer count, an expert id out of range, maps or
dispatch weights of another dtype or size. Acted on, such a plan raises wherever it first meets
the model (the diff, a broadcast's buffers, the swap, an engine's tensors), late and on one rank.
So the Decider (eplb.policy.decision.plan_and_judge) checks every plan made from a live
placement before judging it: one that does not fit is never applied, its outcome carries cause
:data:`SHAPE` (the name the manager's metric label ``failed_shape`` and the hot-swap's
:class:`~eplb.hotswap.check.HotSwapShapeError` use), and the caller's run goes on. The manager
checks again what every rank received (eplb.manager.plan_check).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from eplb.placement.model import Placement

SHAPE = "shape"
"""The cause of a plan that does not fit the model (eplb.hotswap.control.Cause's ``shape``)."""


def plan_problems(placement: Any, weights_LER: Any, current: Placement) -> list[str]:
    """What makes a plan (``placement``, dispatch ``weights_LER`` or None) unfit for a model served
    on ``current``: empty when it fits. ``R`` is ``P - E + 1`` (the plan's broadcast buffer)."""
    L, P, E, G = current.num_layers, current.num_physical, current.num_logical, current.num_gpus
    R = P - E + 1
    if not isinstance(placement, Placement):
        return [f"the plan's placement is a {type(placement).__name__}, not an eplb Placement"]
    problems = []
    p2l = np.asarray(placement.phy2log_LP)
    got = tuple(p2l.shape)
    if got != (L, P):
        problems.append(f"phy2log [L, P] = {list(got)}, the model's [{L}, {P}]")
    if p2l.dtype.kind not in "iu":
        problems.append(f"phy2log of dtype {p2l.dtype}, not integer expert ids")
    elif p2l.size and (p2l.min() < 0 or p2l.max() >= E):
        problems.append(f"phy2log holds expert ids outside [0, {E})")
    if placement.num_logical != E:
        problems.append(f"E = {placement.num_logical} logical experts, the model's {E}")
    if placement.num_gpus != G:
        problems.append(f"G = {placement.num_gpus} GPUs, the model's {G}")
    if weights_LER is not None:
        w = np.shape(weights_LER)
        if len(w) != 3 or w[:2] != (L, E) or not 1 <= w[2] <= R:
            problems.append(f"dispatch weights [L, E, R] = {list(w)}, the model's [{L}, {E}, <= {R}]")
        kind = np.asarray(weights_LER).dtype.kind
        if kind != "f":
            problems.append(f"dispatch weights of dtype {np.asarray(weights_LER).dtype}, not floating point")
        elif not np.isfinite(weights_LER).all():
            problems.append("dispatch weights hold NaN or infinite values")
    return problems


def shape_reason(problems: Sequence[str]) -> str:
    """The words of a plan refused for its shape: the cause first, then each problem."""
    return f"{SHAPE}: the plan does not fit the model: " + "; ".join(problems)
