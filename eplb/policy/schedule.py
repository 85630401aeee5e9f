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


def is_first_plan(*, initial_full_plan: bool, fitted: bool) -> bool:
    """Whether the next plan is the unbudgeted first one: the rule is on (``initial_full_plan_on``)
    and the placement is not ``fitted`` yet (no plan was applied since start-up, and it did not
    start from a given placement)."""
    return initial_full_plan and not fitted


def plan_with(
    planner: Planner,
    *,
    initial_full_plan: bool,
    fitted: bool,
    allowance: MoveAllowance | None = None,
) -> Planner:
    """The planner of the next rebalance: its ``for_unfitted_placement()`` (no move budget, no
    copy price) for the first plan (``is_first_plan``), else ``planner`` with the budgets of
    ``allowance`` (``with_allowance``; as it is without one).

    Planners without those methods are returned as they are.
    """
    if is_first_plan(initial_full_plan=initial_full_plan, fitted=fitted):
        drop = getattr(planner, "for_unfitted_placement", None)
        return planner if drop is None else drop()
    return with_allowance(planner, allowance)


SHIFT_BURST = 8
"""Default of ``--eplb-shift-burst``: a domain shift may spend up to 8 rebalances' budgets at once."""


class MoveAllowance:
    """Continuous mode's move budget as a rate: ``rate`` copies per rebalance on average.

    A plan may move at most ``budget()`` copies, or ``shift_budget()`` when the solver sees a
    domain shift in the window (``SolveOptions.shift_decline``): up to ``burst`` rebalances'
    budgets at once. What a plan moves over ``rate`` is a debt that the following budgets repay
    (``record``), so the copies moved over any run stay within ``rate`` per rebalance plus one
    burst. Load after a shift has moved far from the placement and every copy buys much more
    then than in steady state, where the budget binds at every rebalance (docs/solver.md). The
    state changes only with the plans every rank applies, so every rank computes the same
    budgets. The first plan from an unfitted placement (``plan_with``) is not counted.
    """

    def __init__(self, rate: int, burst: int = SHIFT_BURST) -> None:
        if rate < 0 or burst < 1:
            raise ValueError(f"move allowance needs rate >= 0 and burst >= 1, got {rate} and {burst}")
        self.rate, self.burst = rate, burst
        self.debt = 0.0
        """Copies moved beyond ``rate`` per rebalance, not yet repaid."""

    def budget(self) -> int:
        """Copies the next plan may move."""
        return max(0, int(self.rate - self.debt))

    def shift_budget(self) -> int:
        """Copies the next plan may move when the window shows a shift."""
        return max(self.budget(), int(self.rate * self.burst - self.debt))

    def record(self, copies: float) -> None:
        """One rebalance ended having moved ``copies`` (0: skipped)."""
        self.debt = max(0.0, self.debt + copies - self.rate)


def with_allowance(planner: Planner, allowance: MoveAllowance | None) -> Planner:
    """``planner`` with the allowance's budgets for its next plan (``with_move_budget``), or as it
    is without an allowance or without that method."""
    if allowance is None:
        return planner
    set_budget = getattr(planner, "with_move_budget", None)
    if set_budget is None:
        return planner
    return set_budget(allowance.budget(), allowance.shift_budget() if allowance.burst > 1 else None)
