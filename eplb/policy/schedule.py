"""Continuous mode's start-up rule, one function for the manager and the simulator.

A server starts on a placement nobody fitted to its load (SGLang's trivial one, unless
``--init-expert-location`` gives one). Budgeted plans then need dozens of rebalances to get
anywhere good (160 copies every 50 passes against the 1,500-4,000 an unbudgeted incremental plan
moves from there), and the placement they reach is worse than the one an unbudgeted plan gives:
on the deepseek-v3 preset at EP32, 0.873 against 0.881 prefill balancedness over passes 1000-3999
(docs/benchmarks.md, "Continuous rebalancing"). So, with ``--eplb-initial-full-plan`` (on by
default), the first plan since start-up moves without the move budget; it still passes the gate
(it must pay for its copies). Whether a plan is the first is a fact every rank agrees on (the
ranks apply the same broadcast plans), so every rank takes the same decision.
"""

from __future__ import annotations

from eplb.policy.base import Planner


def initial_full_plan_on(*, continuous: bool, enabled: bool, budget: int | None) -> bool:
    """Whether the rule applies at all: continuous mode, ``--eplb-initial-full-plan``, and a move
    budget above 0 (a budget of 0 means nothing moves, the first plan included)."""
    return continuous and enabled and budget is not None and budget > 0


def plan_with(planner: Planner, *, initial_full_plan: bool, fitted: bool) -> Planner:
    """The planner of the next rebalance: ``planner``, or the same planner without its move
    budget when ``initial_full_plan`` is on and the placement is not ``fitted`` yet (no plan was
    applied since start-up, and it did not start from a given placement).

    Planners that have no move budget to drop (no ``without_move_budget`` method) are returned as
    they are.
    """
    if not initial_full_plan or fitted:
        return planner
    drop = getattr(planner, "without_move_budget", None)
    return planner if drop is None else drop()
