"""The move budget of eplb.solver.solve: never exceeded, 0 moves nothing, copies counted exactly."""

from __future__ import annotations

import numpy as np
import pytest

from eplb.placement.balance import model_balancedness
from eplb.placement.diff import diff_placements
from eplb.placement.model import Placement
from eplb.solver import SolveOptions, Topology, solve
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
    "scipy static": {"static_dispatch": True},
    "deepseek": {"algorithm": "deepseek"},
}


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


def test_the_gate_skips_a_plan_whose_gain_does_not_pay_for_its_transfer() -> None:
    """Skewed load on the trivial placement pays; fresh noise of the same load on a good one does not."""
    rng = np.random.default_rng(12)
    topology = Topology(num_gpus=8, num_physical=72)
    rate_LE = rng.lognormal(0.0, 1.0, size=(4, 64)) * 50
    current = Placement.trivial(4, 64, 8, 8)
    decisions = []
    for _ in range(6):
        window = rng.poisson(rate_LE, size=(40, 4, 64))
        plan = solve(window, topology, current, SolveOptions(max_moved_experts=32))
        stats = plan.stats
        assert stats["predicted_gain"] == pytest.approx(
            plan.predicted_balancedness - stats["current_balancedness"]
        )
        if plan.diff is not None and plan.diff.num_changed_slots:
            price = 0.002 * stats["weighted_copies_moved"] / 4
            assert stats["transfer_price"] == pytest.approx(price)
            assert plan.apply == (stats["predicted_gain"] >= 0.002 + price)
            assert plan.apply or "transfer price" in plan.reason
        decisions.append(plan.apply)
        if plan.apply:
            current = plan.placement
    assert decisions[0] and not any(decisions[-2:]), decisions
