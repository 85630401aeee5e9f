"""Every plan checked against the model's shapes before any rank acts on it, across the ranks.

Shape legend: L layers, E logical experts, P physical slots, G GPUs (ranks), R max replicas.

The Decider already refuses a plan made from the live placement that does not fit the model
(eplb.policy.plan_check: its outcome has cause ``shape``, no plan). The manager adds what only
it needs: rank 0 checks whatever plan it would broadcast (:func:`check_plan`, in
eplb.manager.types.encode_plan: a degraded or fresh plan too) and counts the planning step's own
refusal of one (:func:`refused_by_the_diff`); the broadcast carries the verdict, and every rank
checks what it received alike. So every rank ends the rebalance failed with cause ``shape`` on
the same pass, nothing moved, and serving goes on, instead of rank 0 raising alone while the
others wait in the plan's broadcast. The error is the hot-swap's own
:class:`~eplb.hotswap.check.HotSwapShapeError` (a ``ValueError`` with cause ``shape`` and the
rank): the same refusal, found before the swap.
"""

from __future__ import annotations

from eplb.hotswap.check import HotSwapShapeError
from eplb.placement.diff import PlacementMismatch
from eplb.placement.model import Placement
from eplb.policy.base import PlanLike
from eplb.policy.plan_check import plan_problems, shape_reason

__all__ = ["check_plan", "plan_problems", "refused_by_the_diff"]


def check_plan(plan: PlanLike, current: Placement) -> None:
    """Raise HotSwapShapeError (cause ``shape``, rank 0: the planning rank) when ``plan`` does not
    fit the model served on ``current``."""
    problems = plan_problems(plan.placement, plan.dispatch_weights_LER, current)
    if problems:
        raise HotSwapShapeError(shape_reason(problems), rank=0)


def refused_by_the_diff(exc: BaseException) -> bool:
    """Whether the planning step (eplb.policy.decision) raised ``exc`` where it compares an applied
    plan with the live placement (eplb.placement.diff.diff_placements): a plan of another shape or
    topology than the model's, refused before anything used it. The planner's own errors stay the
    planner's, whatever their words."""
    return isinstance(exc, PlacementMismatch)
