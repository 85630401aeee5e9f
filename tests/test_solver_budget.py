"""The move budget of eplb.solver.solve: never exceeded, 0 moves nothing, copies counted exactly."""

from __future__ import annotations

import numpy as np
import pytest

from eplb.placement.balance import model_balancedness
from eplb.placement.diff import diff_placements
from eplb.placement.model import Placement
from eplb.policy.cost_model import DEEPSEEK_V3_BYTES_PER_EXPERT, CostModel
from eplb.policy.decision import PERSISTENCE_PASSES
from eplb.solver import Plan, SolveOptions, Topology, solve
from tests.helpers.placements import random_phy2log

TOPOLOGIES = [
    Topology(num_gpus=4, num_nodes=2, num_physical=24, num_groups=4),
    Topology(num_gpus=8, num_nodes=4, num_physical=40, num_groups=4),
    Topology(num_gpus=16, num_nodes=4, num_physical=48, num_groups=4),
]
PLANNERS = {
    "scipy": {},
    "scipy robust": {"prediction": "robust", "num_scenarios": 3},
    "scipy fresh": {"incremental": False, "milp_max_solves": 2},
    # Static dispatch's shares: moves re-scored exactly after each step (undone when they lose).
    "scipy static": {"dispatch": "static"},
    "deepseek": {"algorithm": "deepseek"},
}
BYTES_PER_EXPERT = DEEPSEEK_V3_BYTES_PER_EXPERT


def _weighted_copies(current: Placement, plan_placement: Placement, cross_node_weight: float) -> float:
    """Copies across GPUs from placement_diff, those across nodes counting ``cross_node_weight``."""
    diff = diff_placements(current, plan_placement)
    across_nodes = diff.experts_moved_across_nodes
    return (diff.experts_moved_across_gpus - across_nodes) + cross_node_weight * across_nodes


def _case(seed: int) -> tuple[np.ndarray, Topology, Placement]:
    rng = np.random.default_rng(seed)
    topology = TOPOLOGIES[seed % len(TOPOLOGIES)]
    E = topology.num_physical - int(rng.integers(0, topology.num_gpus + 1))
    L = int(rng.integers(1, 5))
    current = Placement.from_phy2log(
        random_phy2log(rng, L, E, topology.num_physical), topology.num_gpus, topology.num_nodes
    )
    W = int(rng.integers(1, 13))
    load = rng.lognormal(0.0, float(rng.uniform(0.3, 1.5)), size=(W, L, E)) * rng.integers(1, 200)
    return load, topology, current


@pytest.mark.parametrize("seed", range(24))
def test_the_budget_is_never_exceeded(seed: int) -> None:
    load, topology, current = _case(seed)
    rng = np.random.default_rng(1000 + seed)
    for name, fields in PLANNERS.items():
        for _ in range(3):
            budget = int(rng.choice([1, 2, 3, 5, 8, 13, 40, 400]))
            weight = float(rng.choice([1.0, 2.5]))
            byte_cap = None if rng.random() < 0.5 else int(rng.integers(0, 30)) * 7
            options = SolveOptions(
                max_moved_experts=budget,
                cross_node_weight=weight,
                bytes_per_expert=7,
                max_bytes_moved=byte_cap,
                **fields,  # type: ignore[arg-type]
            )
            plan = solve(load, topology, current, options)
            plan.placement.validate()
            copies = _weighted_copies(current, plan.placement, weight)
            assert copies <= budget + 1e-9, (name, budget, weight)
            assert plan.stats["weighted_copies_moved"] == pytest.approx(copies)
            if byte_cap is not None:
                assert diff_placements(current, plan.placement, 7).bytes_across_gpus <= byte_cap, name
            if "budget_copies" in plan.stats:  # the search's own count is exact
                assert plan.stats["budget_copies"] == pytest.approx(copies)


@pytest.mark.parametrize("name", list(PLANNERS))
def test_a_budget_of_zero_moves_nothing(name: str) -> None:
    for seed in range(6):
        load, topology, current = _case(seed)
        for options in (
            SolveOptions(max_moved_experts=0, **PLANNERS[name]),  # type: ignore[arg-type]
            SolveOptions(bytes_per_expert=10, max_bytes_moved=9, **PLANNERS[name]),  # type: ignore[arg-type]
        ):
            plan = solve(load, topology, current, options)
            assert plan.diff is not None and plan.diff.num_changed_slots == 0
            assert not plan.apply


def test_the_budget_goes_where_it_buys_most_per_copy() -> None:
    """Two layers, one far from balanced: a small budget is spent on that one only."""
    topology = Topology(num_gpus=4, num_physical=16)
    current = Placement.trivial(2, 16, 4)
    load_LE = np.ones((2, 16))
    load_LE[0, :4] = 6.0  # layer 0: GPU 0 holds the four hot experts
    load_LE[1, 0] = 1.3  # layer 1: slightly uneven
    plan = solve(load_LE, topology, current, SolveOptions(max_moved_experts=2))
    assert plan.diff is not None
    changed = plan.diff.changed_layers().tolist()
    assert changed == [0]
    assert plan.diff.experts_moved_across_gpus <= 2
    # One swap of a hot expert (6) with a cold one (1): GPU 0 goes from 24 to 19 of a mean of 9.
    layer0 = model_balancedness(load_LE[:1], Placement.from_phy2log(plan.placement.phy2log_LP[:1], 4))
    assert layer0 == pytest.approx(9 / 19)


def test_more_budget_buys_more_balance_and_cross_node_copies_cost_more() -> None:
    rng = np.random.default_rng(11)
    topology = Topology(num_gpus=8, num_nodes=4, num_physical=72)
    current = Placement.trivial(3, 64, 8, 8, num_nodes=4)
    load = rng.lognormal(0.0, 1.0, size=(3, 64))
    scores = []
    for budget in (4, 16, 64):
        plan = solve(load, topology, current, SolveOptions(max_moved_experts=budget))
        scores.append(plan.stats["forecast_balancedness"])
    assert scores[0] < scores[1] < scores[2]
    # With cross-node copies counting 3, the same budget buys fewer of them.
    cheap = solve(load, topology, current, SolveOptions(max_moved_experts=24))
    dear = solve(load, topology, current, SolveOptions(max_moved_experts=24, cross_node_weight=3.0))
    assert cheap.diff is not None and dear.diff is not None
    assert dear.diff.experts_moved_across_nodes < cheap.diff.experts_moved_across_nodes
    assert _weighted_copies(current, dear.placement, 3.0) <= 24


def _gate_reference(
    window_WLE: np.ndarray, current: Placement, plan: Plan, bytes_per_expert: int, noise_price: float
) -> tuple[float, float]:
    """(saved, cost) seconds of a periodic plan, restated in plain numpy from the cost model's
    definition: every pass of the valued horizon saves the token term of the busiest GPU of every
    layer, ``per_token_us * mean tokens per GPU / balancedness``; moving costs the stall while the
    busiest receiving GPU pulls its arriving experts over NVLink (one node), or, when larger, the
    noise price of every copy (``noise_price`` balancedness of one layer) in those seconds."""
    cost = CostModel()
    G, L = current.num_gpus, current.num_layers
    arrivals_G = np.zeros(G)
    for old_P, new_P in zip(current.phy2log_LP, plan.placement.phy2log_LP, strict=True):
        for g, (old_S, new_S) in enumerate(zip(old_P.reshape(G, -1), new_P.reshape(G, -1), strict=True)):
            arrivals_G[g] += len(set(new_S.tolist()) - set(old_S.tolist()))
    transfer = arrivals_G.max() * bytes_per_expert / (cost.nvlink_gbps * 1e9)
    tokens_per_pass = (window_WLE.sum(axis=-1) / G).sum(axis=1).mean()  # summed over layers

    def token_seconds(balancedness: float) -> float:
        return cost.per_token_us * 1e-6 * tokens_per_pass / balancedness

    now, predicted = plan.stats["current_balancedness"], plan.predicted_balancedness
    # scipy plans are migration-aware: their moves are valued over PERSISTENCE_PASSES (> 40).
    saved = PERSISTENCE_PASSES * (token_seconds(now) - token_seconds(predicted))
    low, high = now - 1e-3, min(now + 1e-3, 1.0)  # the model's slope of seconds in balancedness
    per_balancedness = (token_seconds(low) - token_seconds(high)) / (high - low)
    noise = arrivals_G.sum() * noise_price / L * PERSISTENCE_PASSES * per_balancedness
    return float(saved), float(max(transfer, noise))


def test_the_gate_applies_a_plan_when_the_time_it_saves_beats_its_transfer() -> None:
    """Skewed load on the trivial placement pays; fresh noise of the same load on a fitted one
    does not. The gate's numbers (eplb.policy.decision.gate) match a plain restatement."""
    rng = np.random.default_rng(12)
    topology = Topology(num_gpus=8, num_physical=72)
    rate_LE = rng.lognormal(0.0, 1.0, size=(4, 64)) * 50
    current = Placement.trivial(4, 64, 8, 8)
    decisions = []
    for _ in range(6):
        window = rng.poisson(rate_LE, size=(40, 4, 64))
        options = SolveOptions(max_moved_experts=32, bytes_per_expert=BYTES_PER_EXPERT)
        plan = solve(window, topology, current, options)
        stats = plan.stats
        assert stats["predicted_gain"] == pytest.approx(
            plan.predicted_balancedness - stats["current_balancedness"]
        )
        if plan.diff is not None and plan.diff.num_changed_slots:
            # The solver prices copies (copy_cost None): at least the noise price 0.1 / max(40, 50).
            saved, transfer = _gate_reference(
                window.astype(np.float64), current, plan, BYTES_PER_EXPERT, 0.002
            )
            assert stats["saved_seconds"] == pytest.approx(saved, rel=1e-6, abs=1e-12)
            assert stats["transfer_seconds"] == pytest.approx(transfer, rel=1e-9, abs=1e-15)
            assert plan.apply == (stats["predicted_gain"] >= 0 and saved > transfer)
        else:
            assert not plan.apply and "equals the current placement" in plan.reason
        decisions.append(plan.apply)
        if plan.apply:
            current = plan.placement
    assert decisions[0] and not any(decisions[-2:]), decisions
    # Moving freely (copy_cost 0) on the fitted placement, experts ten times as large: the moves
    # gain balance on the forecast, but what they save does not pay for their transfer.
    skipped = 0
    for _ in range(3):
        window = rng.poisson(rate_LE, size=(40, 4, 64))
        options = SolveOptions(max_moved_experts=32, bytes_per_expert=10 * BYTES_PER_EXPERT, copy_cost=0.0)
        plan = solve(window, topology, current, options)
        assert plan.diff is not None and plan.diff.num_changed_slots > 0
        saved, transfer = _gate_reference(
            window.astype(np.float64), current, plan, 10 * BYTES_PER_EXPERT, 0.0
        )
        assert plan.stats["saved_seconds"] == pytest.approx(saved, rel=1e-6, abs=1e-12)
        assert plan.stats["transfer_seconds"] == pytest.approx(transfer, rel=1e-9, abs=1e-15)
        assert plan.apply == (saved > transfer and plan.stats["predicted_gain"] >= 0)
        if 0 < saved <= transfer:
            assert not plan.apply and "does not pay" in plan.reason
            skipped += 1
    assert skipped, "a plan that gains balance but does not pay for its transfer"
