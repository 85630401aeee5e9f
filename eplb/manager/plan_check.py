"""Every plan checked against the model's shapes before any rank acts on it.

Shape legend: L layers, E logical experts, P physical slots, G GPUs (ranks), R max replicas.

A planner (the caller's ``planner=`` may be anyone's) can hand back a plan of another shape: more
slots than the model has, an expert missing, dispatch weights of other sizes. Acted on, such a
plan raises wherever it first meets the model (the diff, the broadcast's buffers, the swap), on
rank 0 alone, while the other ranks wait in the plan's broadcast. So rank 0 checks each plan
where its planner returns it (:class:`ShapeChecked`, around every planner a rebalance uses), and
again before it broadcasts (eplb.manager.types.share_plan); the broadcast carries the verdict,
so every rank ends the rebalance failed with cause ``shape`` on the same pass, nothing moved, and
serving goes on. The error is the hot-swap's own :class:`~eplb.hotswap.check.HotSwapShapeError`
(a ``ValueError`` with cause ``shape`` and the rank): the same refusal, found before the swap.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from eplb.hotswap.check import HotSwapShapeError
from eplb.placement.model import Placement
from eplb.policy.base import LoadHistory, PlanLike, Planner

_TRANSFORMS = frozenset({"for_unfitted_placement", "with_move_budget", "with_pricing"})
"""The planner methods that return another planner for a rebalance (eplb.policy.decision's
``Decider.prepared``): the one they return is checked too. A lost rank's degraded plan spans
fewer slots by design and is planned apart (eplb.manager.recovery), never through this."""


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


class ShapeChecked:
    """``planner``, whose every plan is checked against the placement it was planned from
    (:func:`check_plan`). Other attributes are ``planner``'s; the planners its transforms return
    (a move budget, pricing, a fresh plan) are checked too, so the rebalance's prepared planner
    is."""

    def __init__(self, planner: Planner) -> None:
        self._planner = planner

    def __call__(
        self, window_WLE: np.ndarray, current: Placement, history: LoadHistory | None = None
    ) -> PlanLike:
        if history is None:
            plan = self._planner(window_WLE, current)
        else:
            plan = self._planner(window_WLE, current, history)
        check_plan(plan, current)
        return plan

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._planner, name)  # AttributeError: the planner has none, nor does this
        if name in _TRANSFORMS:
            return lambda *args, **kwargs: ShapeChecked(attr(*args, **kwargs))
        return attr
