"""Continuous rebalancing in the simulator: swaps beside the passes, interference, budgets, the gate."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from eplb.placement.balance import model_balancedness
from eplb.placement.diff import diff_placements
from eplb.placement.model import Placement
from eplb.policy import Proposal
from eplb.simulate import (
    CostModel,
    PastView,
    RunSpec,
    SimulationConfig,
    parse_runs,
    simulate,
    swap_beside_passes,
)
from eplb.traces import Trace
from tests.helpers.simulation import server


def _loop_reference(link_s: float, pass_us: list[float], slowdown: float) -> tuple[int, float, float]:
    """(passes beside the swap, link time left, interference s), one pass at a time."""
    if link_s == 0:
        return 0, 0.0, 0.0
    left, lost = link_s, 0.0
    for i, us in enumerate(pass_us):
        wall = us * 1e-6 * (1 + slowdown)
        if wall >= left:  # arrives during this pass: it lost the slowed share of the time overlapped
            lost += left * slowdown / (1 + slowdown)
            return i + 1, 0.0, lost
        left -= wall
        lost += us * 1e-6 * slowdown
    return len(pass_us), left, lost


def test_swap_costs_no_stall_until_it_needs_more_link_time_than_the_passes_leave() -> None:
    passes = np.array([1000.0, 1000.0, 1000.0])  # three 1 ms passes
    got = swap_beside_passes(2.5e-3, passes, 0.0)
    assert (got.passes, got.remaining_seconds, got.interference_seconds) == (3, 0.0, 0.0)
    exact = swap_beside_passes(2e-3, passes, 0.0)  # arrives at the end of the second pass
    assert exact.passes == 2 and exact.remaining_seconds == 0.0
    over = swap_beside_passes(5e-3, passes, 0.0)
    assert over.passes == 3 and over.remaining_seconds == pytest.approx(2e-3)
    # 25% slower passes: 1.25 ms each, so 2.5 ms of link time fits in two, which lost 0.25 ms each.
    slowed = swap_beside_passes(2.5e-3, passes, 0.25)
    assert slowed.passes == 2 and slowed.interference_seconds == pytest.approx(0.5e-3)
    assert swap_beside_passes(0.0, passes, 0.25).passes == 0
    rng = np.random.default_rng(0)
    for _ in range(200):
        pass_us = rng.uniform(0, 3000, size=int(rng.integers(0, 8)))
        link, slowdown = float(rng.uniform(0, 0.02)), float(rng.choice([0.0, 0.03, 1.05]))
        got = swap_beside_passes(link, pass_us, slowdown)
        want = _loop_reference(link, pass_us.tolist(), slowdown)
        assert got.passes == want[0]
        assert got.remaining_seconds == pytest.approx(want[1], abs=1e-12)
        assert got.interference_seconds == pytest.approx(want[2], abs=1e-12)


def test_interference_follows_the_h200_figures_by_kind_and_pace() -> None:
    ce, sm = CostModel(), CostModel(transfer_kind="sm")
    # Paced copy-engine copies: about 2-3% at 78-500 GB/s.
    assert ce.interference_slowdown(78.0) == pytest.approx(0.02)
    assert ce.interference_slowdown(500.0) == pytest.approx(0.03)
    assert 0.02 < ce.interference_slowdown(200.0) < 0.03
    assert ce.interference_slowdown(10.0) == pytest.approx(0.02)
    assert ce.interference_slowdown(900.0) == pytest.approx(0.03)
    # Unpaced copy-engine copies: 46-164%; SM copy kernels: 22-76% on one CTA (53 GB/s), up to 90%.
    assert 0.46 <= ce.interference_slowdown(None) <= 1.64
    assert 0.22 <= sm.interference_slowdown(53.0) <= 0.76
    assert (
        sm.interference_slowdown(53.0)
        < sm.interference_slowdown(200.0)
        <= sm.interference_slowdown(None)
        <= 0.9
    )
    assert CostModel(interference=0.1).interference_slowdown(None) == 0.1
    with pytest.raises(ValueError, match="transfer kind"):
        CostModel(transfer_kind="dma")
    with pytest.raises(ValueError, match="interference"):
        CostModel(interference=-0.5)


def test_a_pace_caps_each_link() -> None:
    # GPU 1 pulls expert 0 from its node and expert 4 from the other node (1 GB each).
    old = Placement.from_phy2log(np.array([[0, 1, 2, 3, 4, 5, 6, 7]]), num_gpus=4, num_nodes=2)
    new = Placement.from_phy2log(np.array([[1, 2, 0, 4, 3, 5, 6, 7]]), num_gpus=4, num_nodes=2)
    diff = diff_placements(old, new, bytes_per_expert=10**9)
    cost = CostModel(nvlink_gbps=100.0, internode_gbps=10.0)
    assert cost.transfer_seconds(diff) == pytest.approx(1 / 100 + 1 / 10)
    assert cost.transfer_seconds(diff, gbps=20.0) == pytest.approx(1 / 20 + 1 / 10)
    assert cost.transfer_seconds(diff, gbps=5.0) == pytest.approx(2 / 5)


class _OneMove:
    """Proposes ``target`` at its first call and keeps it after; predicts its exact balancedness."""

    def __init__(self, target: Placement, load_LE: np.ndarray) -> None:
        self.target, self.load_LE, self.windows = target, load_LE, []

    def __call__(self, window_WLE: np.ndarray, current: Placement, past: PastView | None = None) -> Proposal:
        self.windows.append(window_WLE.shape[0])
        if current.same_slots(self.target):
            return Proposal(current, apply=False, reason="converged")
        predicted = float(model_balancedness(self.load_LE, self.target))
        return Proposal(self.target, predicted_balancedness=predicted)


def _constant_setup(
    link_passes: float, mode: str, interference: float = 0.1
) -> tuple[Trace, SimulationConfig, Placement]:
    """Constant load; every pass takes 2 layers x 1 ms; one move whose link time is ``link_passes`` passes."""
    # Layer 0: GPU 0 holds both hot experts (0, 1) and GPU 1 both cold ones (2, 3) until the move.
    load_LE = np.array([[100, 100, 1, 1, 50, 50, 50, 50], [5, 9, 30, 2, 7, 7, 12, 40]], dtype=np.int32)
    trace = Trace.from_counts(np.broadcast_to(load_LE, (60, 2, 8)).copy())
    target = Placement.from_phy2log(
        np.array([[2, 1, 0, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, 7]]), num_gpus=4
    )
    # Experts 0 and 2 trade GPUs 0 and 1 in layer 0: each of them receives one expert over NVLink.
    cost = CostModel(
        base_us=1000.0, per_expert_us=0.0, per_token_us=0.0, nvlink_gbps=100.0, interference=interference
    )
    pass_s = 2e-3
    # No dispatch kernels charged: a pass is exactly the cost model's 2 ms.
    flags = server(
        ep_size=4,
        nnodes=1,
        eplb_rebalance_num_iterations=10,
        eplb_rebalance_mode=mode,
        eplb_dispatch_cost="none",
    )
    config = SimulationConfig(eplb=flags, bytes_per_expert=int(link_passes * pass_s * 100e9), cost=cost)
    return trace, config, target


def test_continuous_swap_switches_after_it_arrives_and_pays_only_interference() -> None:
    trace, config, target = _constant_setup(link_passes=2.5, mode="continuous")
    planner = _OneMove(target, trace.counts_FLE[0])
    result = simulate(trace, [RunSpec("one", "dynamic")], config, planners={"one:dynamic": planner})
    run, event = result.runs[0], result.runs[0].events[0]
    # 2.5 passes of link time at 10% slower passes (2.2 ms each): it arrives during the third pass.
    assert event.applied and event.step == 10 and event.switch_step == 13
    assert event.transfer_seconds == pytest.approx(5e-3)
    assert event.stall_seconds == 0.0
    assert event.interference_seconds == pytest.approx(5e-3 * 0.1 / 1.1)
    before = model_balancedness(trace.counts_FLE[0], Placement.trivial(2, 8, num_gpus=4, num_redundant=0))
    after = model_balancedness(trace.counts_FLE[0], target)
    np.testing.assert_allclose(run.balancedness_F[:13], before)
    np.testing.assert_allclose(run.balancedness_F[13:], after)
    # The plan served exactly the load it predicted for: no prediction error.
    assert event.realized_balancedness == pytest.approx(event.predicted_balancedness)
    summary = result.summaries()[0]
    assert summary["prediction_error_mean"] == pytest.approx(0.0, abs=1e-12)
    assert summary["switch_delay_steps_mean"] == 3
    assert run.total_seconds(result.scored_from) == pytest.approx(50 * 2e-3 + 5e-3 * 0.1 / 1.1)
    assert all(not e.applied for e in run.events[1:])


def test_continuous_swap_stalls_for_the_link_time_the_passes_do_not_leave() -> None:
    trace, config, target = _constant_setup(link_passes=13.0, mode="continuous")
    planner = _OneMove(target, trace.counts_FLE[0])
    run = simulate(trace, [RunSpec("one", "dynamic")], config, planners={"one:dynamic": planner}).runs[0]
    event = run.events[0]
    # 10 passes of 2.2 ms before the next rebalance at step 20 cover 22 of the 26 ms; 4 ms stall.
    assert event.switch_step == 20
    assert event.stall_seconds == pytest.approx(26e-3 - 22e-3)
    assert event.interference_seconds == pytest.approx(10 * 2e-3 * 0.1)
    after = model_balancedness(trace.counts_FLE[0], target)
    np.testing.assert_allclose(run.balancedness_F[20:], after)
    assert not np.allclose(run.balancedness_F[10:20], after)


def test_periodic_mode_stalls_for_the_whole_transfer() -> None:
    trace, config, target = _constant_setup(link_passes=2.5, mode="periodic")
    planner = _OneMove(target, trace.counts_FLE[0])
    result = simulate(trace, [RunSpec("one", "dynamic")], config, planners={"one:dynamic": planner})
    event = result.runs[0].events[0]
    assert event.switch_step == event.step == 10
    assert event.stall_seconds == event.transfer_seconds == pytest.approx(5e-3)
    assert event.interference_seconds == 0.0
    assert result.summaries()[0]["stall_seconds"] == pytest.approx(5e-3)


def test_the_window_may_exceed_the_interval_only_in_continuous_mode() -> None:
    trace, config, target = _constant_setup(link_passes=0.0, mode="continuous")
    planner = _OneMove(target, trace.counts_FLE[0])
    longer = replace(config, eplb=replace(config.eplb, expert_distribution_recorder_buffer_size=25))
    simulate(trace, [RunSpec("one", "dynamic")], longer, planners={"one:dynamic": planner})
    assert planner.windows == [10, 20, 25, 25, 25]
    with pytest.raises(ValueError, match="periodic mode"):
        server(ep_size=4, eplb_rebalance_num_iterations=10, expert_distribution_recorder_buffer_size=25)
    with pytest.raises(ValueError, match="rebalance-mode"):
        server(ep_size=4, eplb_rebalance_mode="sometimes")


def _drifting_trace(seed: int, T: int = 240, L: int = 4, E: int = 16) -> Trace:
    rng = np.random.default_rng(seed)
    popularity = rng.lognormal(0.0, 1.0, size=(L, E))
    drift = np.cumsum(rng.normal(0.0, 0.05, size=(T, L, E)), axis=0)
    prob = popularity * np.exp(drift)
    prob /= prob.sum(axis=2, keepdims=True)
    counts = np.stack([[rng.multinomial(2000, prob[t, layer]) for layer in range(L)] for t in range(T)])
    return Trace.from_counts(counts.astype(np.int32))


@pytest.mark.parametrize("budget", [0, 3, 10])
@pytest.mark.parametrize("initial_full_plan", [False, True])
def test_the_budget_reaches_the_solver_and_is_never_exceeded(budget: int, initial_full_plan: bool) -> None:
    """Every plan keeps the budget (no shift burst: ``shift_burst=1``; bursts are tested below);
    with the initial full plan (the default) all but the first do."""
    trace = _drifting_trace(seed=budget)
    config = SimulationConfig(
        eplb=server(
            ep_size=4, nnodes=2, ep_num_redundant_experts=4, eplb_rebalance_num_iterations=20,
            eplb_rebalance_mode="continuous", eplb_max_moved_experts=budget, eplb_transfer_gbps=100.0,
            eplb_initial_full_plan=initial_full_plan, eplb_shift_burst=1,
        ),
        bytes_per_expert=1000,
    )  # fmt: skip
    result = simulate(trace, parse_runs(["scipy"], "static"), config)
    applied = [e for e in result.runs[0].events if e.applied]
    assert result.config["move_budget"] == budget and len(result.runs[0].events) == 11
    kept = applied[1:] if initial_full_plan and budget > 0 else applied
    assert all(e.experts_moved_across_gpus <= budget for e in kept)
    if budget == 0:
        assert sum(e.experts_moved_across_gpus for e in applied) == 0
    else:
        assert applied and max(e.experts_moved_across_gpus for e in applied) > 0
        assert result.summaries()[0]["balancedness_mean"] > result.baseline.balancedness_F[20:].mean()


def _shifted_trace(seed: int, T: int = 300, L: int = 4, E: int = 16) -> Trace:
    """A skewed load whose hot experts change once, at step 2T/3 (a domain shift)."""
    rng = np.random.default_rng(seed)
    prob_LE = rng.lognormal(0.0, 1.2, size=(L, E))
    prob_LE /= prob_LE.sum(axis=1, keepdims=True)
    shifted_LE = prob_LE[:, rng.permutation(E)]
    counts = [
        [rng.multinomial(4000, (prob_LE if t < 2 * T // 3 else shifted_LE)[layer]) for layer in range(L)]
        for t in range(T)
    ]
    return Trace.from_counts(np.asarray(counts, dtype=np.int32))


@pytest.mark.parametrize("burst", [1, 4])
def test_a_shift_may_spend_a_burst_that_the_next_budgets_repay(burst: int) -> None:
    budget = 3
    config = SimulationConfig(
        eplb=server(
            ep_size=8, nnodes=4, ep_num_redundant_experts=8, eplb_rebalance_num_iterations=20,
            expert_distribution_recorder_buffer_size=80, eplb_rebalance_mode="continuous",
            eplb_max_moved_experts=budget, eplb_shift_burst=burst, eplb_transfer_gbps=100.0,
        ),
        bytes_per_expert=1000,
    )  # fmt: skip
    events = simulate(_shifted_trace(seed=1), parse_runs(["scipy"], "static"), config).runs[0].events
    counted = [e.experts_moved_across_gpus if e.applied else 0 for e in events[1:]]  # the first is exempt
    for n in range(1, len(counted) + 1):  # never more than the rate plus one burst, over any prefix
        assert sum(counted[:n]) <= budget * n + budget * (burst - 1)
    if burst == 1:
        assert max(counted) <= budget
    else:
        assert max(counted) > budget  # the shift got more than one budget


def test_on_stationary_load_continuous_mode_stops_moving() -> None:
    rng = np.random.default_rng(7)
    step_LE = (rng.lognormal(0, 1.0, size=(4, 16)) * 100).astype(np.int32)
    trace = Trace.from_counts(np.broadcast_to(step_LE, (400, 4, 16)).copy())
    config = SimulationConfig(
        eplb=server(
            ep_size=4, nnodes=2, ep_num_redundant_experts=4, eplb_rebalance_num_iterations=10,
            eplb_rebalance_mode="continuous", eplb_max_moved_experts=2,
        ),
        bytes_per_expert=1000,
    )  # fmt: skip
    events = simulate(trace, parse_runs(["scipy"], "static"), config).runs[0].events
    applied = [i for i, e in enumerate(events) if e.applied and e.experts_moved_across_gpus > 0]
    assert applied, "a skewed load should be rebalanced at first"
    # Once converged the gate skips every plan: nothing moves in the second half of the trace.
    assert max(applied) < len(events) // 2
    assert all(e.experts_moved_across_gpus == 0 for e in events[len(events) // 2 :])


def test_score_from_sets_the_scored_steps_and_counts_only_their_rebalances() -> None:
    trace, config, target = _constant_setup(link_passes=1.0, mode="periodic")
    planner = _OneMove(target, trace.counts_FLE[0])
    cfg = replace(config, score_from=30)
    result = simulate(trace, [RunSpec("one", "dynamic")], cfg, planners={"one:dynamic": planner})
    summary = result.summaries()[0]
    assert result.scored_from == 30
    # The one applied move happened at step 10, before the scored steps: it costs nothing here.
    assert summary["rebalances_applied"] == 0 and summary["stall_seconds"] == 0.0
    assert summary["bytes_moved_per_1000_passes"] == 0.0
    with pytest.raises(ValueError, match="score_from"):
        simulate(trace, [RunSpec("none", "dynamic")], replace(config, score_from=60))


class _EveryOther:
    """Moves every expert to the next GPU at every other call; keeps the placement at the rest."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, window_WLE: np.ndarray, current: Placement, past: PastView | None = None) -> Proposal:
        self.calls += 1
        if self.calls % 2 == 0:
            return Proposal(current, apply=False, reason="every other")
        rolled_LP = np.roll(current.phy2log_LP, current.slots_per_gpu, axis=1)
        return Proposal(
            Placement.from_phy2log(rolled_LP, num_gpus=current.num_gpus, num_nodes=current.num_nodes)
        )


def test_the_summary_counts_only_the_rebalances_within_the_scored_passes() -> None:
    trace = _drifting_trace(seed=3)
    flags = server(ep_size=4, nnodes=2, ep_num_redundant_experts=4, eplb_rebalance_num_iterations=20)
    config = SimulationConfig(eplb=flags, bytes_per_expert=1000, score_from=110)
    result = simulate(trace, [RunSpec("alt", "dynamic")], config, planners={"alt:dynamic": _EveryOther()})
    summary, events = result.summaries()[0], result.runs[0].events
    scored = [e for e in events if e.step >= 110]
    applied = [e for e in scored if e.applied]
    assert len(events) > len(scored) and 0 < len(applied) < len(scored)
    assert summary["rebalances_applied"] == len(applied)
    assert summary["rebalances_skipped"] == len(scored) - len(applied)
    moved = sum(e.bytes_moved for e in applied)
    assert moved > 0 and summary["bytes_moved"] == moved
    assert summary["bytes_moved_per_1000_passes"] == pytest.approx(moved * 1000 / (trace.num_steps - 110))
    assert f" {len(applied)}/{len(scored)} " in result.table()


def test_realized_balancedness_is_what_the_prediction_estimates() -> None:
    """The load-weighted mean over the recorded steps a plan served of their balancedness."""
    trace = _drifting_trace(seed=4)
    config = SimulationConfig(
        eplb=server(
            ep_size=4, nnodes=2, ep_num_redundant_experts=4, eplb_rebalance_num_iterations=20,
            eplb_rebalance_mode="continuous", eplb_max_moved_experts=6, eplb_transfer_gbps=100.0,
        ),
        bytes_per_expert=1000,
    )  # fmt: skip
    run = simulate(trace, parse_runs(["scipy"], "static"), config).runs[0]
    load_F = trace.counts_FLE.sum(axis=(1, 2)).astype(np.float64)
    # Each applied plan serves from its switch until the next rebalance (whatever that decides).
    starts = [e.step for e in run.events]
    checked = 0
    for event in run.events:
        if not event.applied or event.realized_balancedness is None:
            continue
        assert event.switch_step is not None
        stop = next(s for s in starts if s > event.step)
        served = slice(event.switch_step, stop)
        want = np.average(run.balancedness_F[served], weights=load_F[served])
        assert event.realized_balancedness == pytest.approx(want, rel=1e-6)
        assert event.realized_summed_balancedness is not None
        checked += 1
    assert checked >= 3


def test_the_initial_full_plan_is_the_first_plan_of_a_run_from_the_trivial_placement() -> None:
    trace = _drifting_trace(seed=11)
    config = SimulationConfig(
        eplb=server(
            ep_size=4, nnodes=2, ep_num_redundant_experts=4, eplb_rebalance_num_iterations=20,
            eplb_rebalance_mode="continuous", eplb_max_moved_experts=1,
        ),
        bytes_per_expert=1000,
    )  # fmt: skip
    run = simulate(trace, parse_runs(["scipy"], "static"), config).runs[0]
    applied = [e for e in run.events if e.applied]
    assert applied[0].experts_moved_across_gpus > 1  # the trivial placement is far from the load
    assert all(e.experts_moved_across_gpus <= 1 for e in applied[1:])
    # From a given placement (--init-expert-location) the first plan keeps the budget too.
    start = run.final_placement
    assert start is not None
    given = simulate(trace, parse_runs(["scipy"], "static"), config, initial=start).runs[0]
    assert all(e.experts_moved_across_gpus <= 1 for e in given.events if e.applied)


def test_prediction_errors_are_split_by_the_shifts_that_hit_a_plan() -> None:
    """The summary's no-shift figures and shift-hit count equal a plain loop over the applied
    plans: a plan is hit when a recorded domain shift lands between its rebalance and the next."""
    from eplb.workloads import WorkloadConfig, generate

    trace = generate(
        WorkloadConfig(preset="tiny", num_steps=1200, seed=3, num_domains=3, mean_steps_between_shifts=150)
    )
    shifts = list(trace.meta["domain_change_steps"])
    assert len(shifts) >= 3
    config = SimulationConfig(
        eplb=server(ep_size=4, ep_num_redundant_experts=4, eplb_rebalance_num_iterations=50,
                    eplb_rebalance_mode="continuous", eplb_max_moved_experts=8),
    )  # fmt: skip
    result = simulate(trace, parse_runs(["scipy"], "static"), config)
    run, summary = result.runs[0], result.summaries()[0]
    events = [e for e in run.events if e.step >= result.scored_from]
    clean, hit = [], []
    for i, e in enumerate(events):
        if not e.applied or e.predicted_balancedness is None or e.realized_balancedness is None:
            continue
        stop = events[i + 1].step if i + 1 < len(events) else trace.num_steps
        error = e.predicted_balancedness - e.realized_balancedness
        (hit if any(e.step <= s < stop for s in shifts) else clean).append(error)
    assert clean and hit
    assert summary["predictions_shift_hit"] == len(hit)
    assert summary["predictions_checked"] == len(clean) + len(hit)
    assert summary["prediction_error_no_shift_mean"] == pytest.approx(np.mean(np.abs(clean)))
    assert summary["prediction_bias_no_shift_mean"] == pytest.approx(np.mean(clean))
    # No recorded shifts (a recorded trace): every plan counts as not hit.
    alone = run.prediction_errors([], result.scored_from)
    assert alone["shift_hit"]["plans"] == 0 and alone["no_shift"]["plans"] == len(clean) + len(hit)
