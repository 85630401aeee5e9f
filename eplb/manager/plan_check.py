"""Every plan checked against the model's shapes before any rank acts on it.

Shape legend: L layers, E logical experts, P physical slots, G GPUs (ranks), R max replicas.

A planner (the caller's ``planner=`` may be anyone's) can hand back a plan of another shape: more
slots than the model has, an expert missing, dispatch weights of other sizes. Acted on, such a
plan raises wherever it first meets the model (the diff, the broadcast's buffers, the swap), on
rank 0 alone, while the other ranks wait in the plan's broadcast. So rank 0 checks each plan
before it broadcasts it (:func:`check_plan`, in eplb.manager.types.share_plan), and counts the
planning step's own refusal of one (:func:`refused_by_the_diff`: an applied plan is compared with
the live placement there, which raises first); the broadcast carries the verdict, and every rank
checks what it received alike. So every rank ends the rebalance failed with cause ``shape`` on
the same pass, nothing moved, and serving goes on. The error is the hot-swap's own :class:`~eplb.hotswap.check.HotSwapShapeError`
(a ``ValueError`` with cause ``shape`` and the rank): the same refusal, found before the swap.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from eplb.hotswap.check import HotSwapShapeError
from eplb.placement.diff import PlacementMismatch
from eplb.placement.model import Placement
from eplb.policy.base import PlanLike


def plan_problems(placement: Placement, weights_LER: Any, current: Placement) -> list[str]:
    """What makes a plan (``placement``, dispatch ``weights_LER`` or None) unfit for a model served
    on ``current``: empty when it fits. ``R`` is ``P - E + 1`` (the plan's broadcast buffer)."""
    L, P, E, G = current.num_layers, current.num_physical, current.num_logical, current.num_gpus
    R = P - E + 1
    problems = []
    got = tuple(np.shape(placement.phy2log_LP))
    if got != (L, P):
        problems.append(f"phy2log [L, P] = {list(got)}, the model's [{L}, {P}]")
    if placement.num_logical != E:
        problems.append(f"E = {placement.num_logical} logical experts, the model's {E}")
    if placement.num_gpus != G:
        problems.append(f"G = {placement.num_gpus} GPUs, the model's {G}")
    if weights_LER is not None:
        w = np.shape(weights_LER)
        if len(w) != 3 or w[:2] != (L, E) or not 1 <= w[2] <= R:
            problems.append(f"dispatch weights [L, E, R] = {list(w)}, the model's [{L}, {E}, <= {R}]")
    return problems


def check_plan(plan: PlanLike, current: Placement) -> None:
    """Raise HotSwapShapeError (cause ``shape``, rank 0: the planning rank) when ``plan`` does not
    fit the model served on ``current``."""
    problems = plan_problems(plan.placement, plan.dispatch_weights_LER, current)
    if problems:
        raise HotSwapShapeError("shape: rank 0's plan does not fit the model: " + "; ".join(problems), rank=0)


def refused_by_the_diff(exc: BaseException) -> bool:
    """Whether the planning step (eplb.policy.decision) raised ``exc`` where it compares an applied
    plan with the live placement (eplb.placement.diff.diff_placements): a plan of another shape or
    topology than the model's, refused before anything used it. The planner's own errors stay the
    planner's, whatever their words."""
    return isinstance(exc, PlacementMismatch)
