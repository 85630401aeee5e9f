"""``judge`` decides every apply/skip case, and the Decider's path steps in order.

Shape legend: L layers, E logical experts, P physical slots, G GPUs.

The judge's cases against hand-computed expectations: the gate in seconds (on a pass-time model
whose token term is 1 ms per pass at balancedness 1 and an expert copy of 1 GB over 100 GB/s:
10 ms), one GPU, a budget that dropped every changed layer, no current placement, a transfer in
flight, a degraded plan, and a planner's own verdict; then the same cases through ``solve`` and
the Decider (hand-written planners that record what they are asked).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pytest

from eplb.config import EplbConfig
from eplb.placement.diff import PlacementDiff, diff_placements
from eplb.placement.model import Placement
from eplb.policy import Proposal
from eplb.policy.cost_model import CostModel, PassTimes
from eplb.policy.decision import (
    NO_CURRENT,
    ONE_GPU,
    VLLM_IN_FLIGHT,
    Decider,
    Facts,
    LostRanks,
    Pricing,
    RankLoss,
    Request,
    Verdict,
    judge,
)
from eplb.solver import SolveOptions, Topology, solve

COST = CostModel(base_us=0.0, per_expert_us=0.0, per_token_us=1.0, nvlink_gbps=100.0)
TIMES = PassTimes(np.array([[1000.0]]), np.array([[2.0]]), COST)
"""One pass of one layer, 1000 tokens per GPU at 1 us each: 1 ms / balancedness of token time."""
GB = 10**9


def _placements() -> tuple[Placement, Placement]:
    """[L=1, E=4, P=6] on 2 GPUs, and the same with expert 3 copied over GPU 0's replica of 1."""
    old = Placement.from_phy2log([[0, 1, 2, 3, 0, 1]], num_gpus=2)
    new = Placement.from_phy2log([[0, 3, 2, 3, 0, 1]], num_gpus=2)
    return old, new


def _moving_diff() -> PlacementDiff:
    old, new = _placements()
    return diff_placements(old, new, GB)


def _gate(**given: Any) -> Facts:
    fields: dict[str, Any] = {
        "diff": _moving_diff(),
        "predicted": 0.9,
        "current": 0.6,
        "gain_passes": 100,
        "pricing": Pricing(horizon_passes=100, cost=COST),
        "times": TIMES,
    }
    return Facts(**{**fields, **given})


WORDS = (
    "predicted next 100 passes 0.6000 -> 0.9000 (+0.3000); over {served} passes it saves {saved} ms "
    "of MoE time, moving 1 expert copies costs {cost} ms"
)


def test_the_gate_applies_a_plan_that_pays_for_its_copy() -> None:
    # 100 passes * (1/0.6 - 1/0.9) ms = 55.6 ms saved; one copy of 1 GB at 100 GB/s: 10 ms.
    verdict = judge(_gate())
    assert verdict.apply
    assert verdict.reason == WORDS.format(served=100, saved="55.6", cost="10.0")
    assert verdict.saved_seconds == pytest.approx(100 * (1e-3 / 0.6 - 1e-3 / 0.9))
    assert verdict.cost_seconds == pytest.approx(0.01)


def test_the_gate_skips_what_does_not_pay_or_gains_too_little() -> None:
    short = judge(_gate(gain_passes=10))  # 5.6 ms saved against 10 ms
    assert not short.apply
    assert short.reason == WORDS.format(served=10, saved="5.6", cost="10.0") + "; it does not pay"
    small = judge(_gate(min_gain=0.5))
    assert not small.apply and small.reason.endswith("; gain below min_gain 0.5")
    unpriced = judge(_gate(gain_passes=10, priced=False))
    assert unpriced.apply and unpriced.reason.endswith(" (the policy's plans are applied unpriced)")


def test_the_gate_charges_the_noise_price_when_it_is_larger() -> None:
    # 0.5 balancedness per copy over 100 passes at d(1 ms / b)/db = 1/0.36 ms at 0.6: 138.9 ms.
    verdict = judge(_gate(noise_price=0.5))
    assert not verdict.apply
    assert verdict.cost_seconds == pytest.approx(0.5 * 100 * 1e-3 / 0.36, rel=1e-4)
    assert verdict.reason == (
        WORDS.format(served=100, saved="55.6", cost="138.9") + " (their noise price); it does not pay"
    )


def test_the_gate_keeps_an_unchanged_plan() -> None:
    old, _ = _placements()
    verdict = judge(_gate(diff=diff_placements(old, old, GB)))
    assert verdict == Verdict(False, "the plan equals the current placement", 0.0, 0.0)


def test_a_plan_the_budget_emptied_is_skipped_naming_the_budget() -> None:
    old, _ = _placements()
    same = diff_placements(old, old, GB)
    facts = _gate(diff=same, budget_dropped_layers=2, policy="scipy", max_moved_experts=3)
    assert judge(facts) == Verdict(
        False,
        "no changed layer of the scipy plan fits within the budget (max_moved_experts=3, max_bytes_moved=None)",
    )
    # A budget that dropped layers of a plan that still moves goes to the gate.
    assert judge(_gate(budget_dropped_layers=2)).apply


def test_the_cases_decided_before_the_gate() -> None:
    assert judge(Facts(one_gpu=True)) == Verdict(False, ONE_GPU)
    assert judge(Facts(no_current=True)) == Verdict(True, NO_CURRENT)
    assert judge(Facts(in_flight=True)) == Verdict(False, VLLM_IN_FLIGHT)
    # A planner's own verdict stands, over what would price it.
    assert judge(_gate(proposed=Verdict(False, "gain too small"))) == Verdict(False, "gain too small")
    lost = LostRanks(ranks=(3, 5), reloads=2, reload_source="host", survivor_copies=7)
    # A degraded plan is applied, whatever its planner said (the live placement uses dead ranks).
    assert judge(Facts(lost=lost, proposed=Verdict(False, "elastic"))) == Verdict(True, "elastic")
    # A transfer in flight skips before anything else.
    assert judge(Facts(in_flight=True, lost=lost, proposed=Verdict(True, "x"))).reason == VLLM_IN_FLIGHT


@pytest.mark.parametrize(
    ("rebalanced", "tail"), [(True, "rebalanced beyond the repair"), (False, "repair only (it does not pay)")]
)
def test_a_degraded_plan_is_worded_by_what_it_reloads(rebalanced: bool, tail: str) -> None:
    lost = LostRanks(
        ranks=(3,),
        reloads=2,
        reload_source="host",
        survivor_copies=5,
        rebalanced=rebalanced,
        repair_reason="it does not pay",
    )
    assert judge(Facts(lost=lost)) == Verdict(
        True,
        "degraded: rank(s) [3] lost; 2 expert replicas reloaded from host, 5 copied from survivors; " + tail,
    )


# ---- the cases through solve ------------------------------------------------------------------------
def _window(seed: int = 0, L: int = 2, E: int = 8) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 40, size=(20, L, E)).astype(float) + 200 * (np.arange(E) == 0)


def test_solve_gets_the_one_gpu_and_the_no_current_verdicts_from_judge() -> None:
    window = _window()
    one = Placement.trivial(2, 8, num_gpus=1, num_redundant=2)
    kept = solve(window, Topology(num_gpus=1, num_physical=10), one)
    assert (kept.apply, kept.reason) == (False, ONE_GPU) and kept.placement is one
    fresh = solve(window, Topology(num_gpus=2, num_physical=10), None)
    assert (fresh.apply, fresh.reason) == (True, NO_CURRENT)
    with pytest.raises(TypeError):
        fresh.stats["solve_seconds"] = 0.0  # type: ignore[index]  # read-only: nothing decides on it


def test_solve_skips_a_plan_the_budget_emptied() -> None:
    # DeepSeek's plan repacks every layer; no layer fits a budget of one copy.
    current = Placement.trivial(2, 8, num_gpus=2, num_redundant=2)
    options = SolveOptions(algorithm="deepseek", max_moved_experts=1)
    plan = solve(_window(), Topology(num_gpus=2, num_physical=10), current, options)
    assert not plan.apply and plan.placement.same_slots(current)
    assert plan.reason == (
        "no changed layer of the deepseek plan fits within the budget (max_moved_experts=1, max_bytes_moved=None)"
    )


# ---- the Decider's path -----------------------------------------------------------------------------
@dataclass
class Recording:
    """A hand-written planner: proposes ``target`` with ``apply``; records every call."""

    target: Placement
    apply: bool = True
    calls: list[tuple[int, bool]] = field(default_factory=list)
    """(window passes, whether a history was passed) per call."""
    fresh_for: list[bool] = field(default_factory=list)

    def __call__(self, window_WLE: np.ndarray, current: Placement, history: Any = None) -> Proposal:
        self.calls.append((int(window_WLE.shape[0]), history is not None))
        return Proposal(placement=self.target, apply=self.apply, reason="mine", predicted_balancedness=0.9)

    def for_unfitted_placement(self, *, drop_budget: bool = True) -> Recording:
        self.fresh_for.append(drop_budget)
        return self


def test_a_screened_or_in_flight_rebalance_asks_no_planner() -> None:
    old, new = _placements()
    planner = Recording(new)
    decider = Decider(EplbConfig(ep_size=2, ep_num_redundant_experts=2))
    empty = decider.rebalance(
        Request(window_WLE=np.zeros((0, 1, 4)), current=old, planner=planner), counted_pass=10
    )
    assert (empty.applied, empty.reason, empty.plan) == (False, "the window holds no load", None)
    flight = decider.rebalance(
        Request(window_WLE=np.ones((3, 1, 4)), current=old, planner=planner), counted_pass=20, in_flight=True
    )
    assert (flight.applied, flight.reason, flight.plan) == (False, VLLM_IN_FLIGHT, None)
    assert planner.calls == [] and not decider.fitted


def test_a_plan_is_judged_and_recorded_with_its_copies() -> None:
    old, new = _placements()
    planner = Recording(new)
    decider = Decider(EplbConfig(ep_size=2, ep_num_redundant_experts=2))
    outcome = decider.rebalance(
        Request(window_WLE=np.ones((3, 1, 4)), current=old, planner=planner, bytes_per_expert=GB),
        counted_pass=30,
        window_balancedness=0.5,
    )
    assert outcome.applied and outcome.reason == "mine" and outcome.placement is new
    assert outcome.copies == 1 and outcome.diff is not None and outcome.diff.bytes_across_gpus == GB
    assert planner.calls == [(3, False)]  # no history: a planner of two arguments (the manager's)
    assert planner.fresh_for == [False]  # from the trivial placement, budget kept (periodic)
    assert decider.fitted and decider.fitted_at == 30
    skipped = decider.rebalance(
        Request(window_WLE=np.ones((3, 1, 4)), current=old, planner=replace(planner, apply=False)),
        counted_pass=40,
    )
    assert not skipped.applied and skipped.copies == 0 and skipped.diff is None and decider.fitted_at == 30


def test_planning_changes_nothing_and_plans_with_what_open_took() -> None:
    old, new = _placements()
    decider = Decider(EplbConfig(ep_size=2, ep_num_redundant_experts=2))
    rebalance = decider.open(counted_pass=5)
    decider.record(counted_pass=4, applied=True, copies=0.0)  # another rebalance ended meanwhile
    planner = Recording(new)
    outcome = rebalance.plan(Request(window_WLE=np.ones((2, 1, 4)), current=old, planner=planner))
    assert planner.fresh_for == [False]  # still the unfitted placement open saw
    assert decider.fitted_at == 4  # planning recorded nothing
    rebalance.close(applied=outcome.applied, copies=outcome.copies)
    assert decider.fitted_at == 5
    with pytest.raises(AssertionError, match="closed once"):
        rebalance.close(applied=False, copies=0.0)


def test_a_degraded_plan_is_applied_with_its_reloads_and_copies() -> None:
    # GPU 1 (slots 4-7: experts 3, 1, 2, 3) is lost; the planner puts expert 3 in GPU 0's slot 3.
    old = Placement.from_phy2log([[0, 1, 2, 0, 3, 1, 2, 3]], num_gpus=2)
    survivors = Placement.from_phy2log([[0, 1, 2, 3]], num_gpus=1)
    planner = Recording(survivors, apply=False)
    decider = Decider(EplbConfig(ep_size=2, ep_num_redundant_experts=4))
    loss = RankLoss(alive_G=np.array([True, False]), reload_source="host")
    outcome = decider.rebalance(
        Request(window_WLE=np.ones((2, 1, 4)), current=old, planner=planner, loss=loss), counted_pass=7
    )
    # Expert 3 lived on GPU 1 alone: reloaded once (from the host); no copy between survivors.
    assert outcome.applied and outcome.reason == "mine"
    assert outcome.reload is not None and outcome.reload.source == "host"
    assert (outcome.reload.reloads, outcome.reload.survivor_copies, outcome.copies) == (1, 0, 1)
    assert outcome.degraded is not None
    assert outcome.degraded.phy2log_LP.tolist() == [[0, 1, 2, 3, -1, -1, -1, -1]]
    assert planner.calls == [(2, False)] and decider.fitted_at == 7
    with pytest.raises(ValueError, match="live placement"):
        decider.rebalance(
            Request(window_WLE=np.ones((2, 1, 4)), current=None, planner=planner, loss=loss), counted_pass=8
        )


def test_no_current_placement_needs_a_planner_of_its_own_topology() -> None:
    _, new = _placements()
    decider = Decider(EplbConfig(ep_size=2, ep_num_redundant_experts=2))
    with pytest.raises(ValueError, match="plan_fresh"):
        decider.rebalance(
            Request(window_WLE=np.ones((2, 1, 4)), current=None, planner=Recording(new)),
            counted_pass=1,
            window_balancedness=0.5,
        )
