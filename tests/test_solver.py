"""eplb.solver.solve: every plan validates, bad input is refused, migration behaves."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eplb.placement.balance import model_balancedness
from eplb.placement.diff import diff_placements
from eplb.placement.model import Placement
from eplb.policy import policy_names
from eplb.solver import PREDICTIONS, Plan, SolveOptions, Topology, solve
from tests.helpers.horizon_reference import horizon_reference

ALGORITHMS = policy_names()

TOPOLOGIES = [
    Topology(num_gpus=4, num_nodes=2, num_physical=20, num_groups=4),
    Topology(num_gpus=8, num_nodes=1, num_physical=40, num_groups=1),
    Topology(num_gpus=1, num_physical=16),
    Topology(num_gpus=16, num_nodes=4, num_physical=16, num_groups=4),  # no redundant slot
]


def _loads(rng: np.random.Generator, W: int, L: int, E: int) -> dict[str, np.ndarray]:
    one_hot = np.zeros((W, L, E))
    one_hot[:, :, rng.integers(E)] = 1000.0
    return {
        "lognormal": rng.lognormal(0.0, 1.0, size=(W, L, E)),
        "integer": rng.integers(0, 50, size=(W, L, E)).astype(np.int32),
        "zeros": np.zeros((W, L, E)),
        "one expert takes everything": one_hot,
    }


def _check_plan(plan: Plan, load_LE: np.ndarray, topology: Topology, E: int) -> None:
    pl = plan.placement.validate()
    R = topology.num_physical - E + 1
    assert pl.phy2log_LP.dtype == np.int32 and pl.log2phy_LER.shape[1:] == (E, R)
    assert (pl.num_gpus, pl.num_nodes, pl.num_physical) == (
        topology.num_gpus,
        topology.num_nodes,
        topology.num_physical,
    )
    weights = plan.dispatch_weights_LER
    if weights is not None:
        assert weights.dtype == np.float32 and weights.shape == pl.log2phy_LER.shape
        assert (weights >= 0).all() and (weights[pl.log2phy_LER < 0] == 0).all()
        np.testing.assert_allclose(weights.sum(axis=-1), 1.0, atol=1e-5)
    assert plan.stats["forecast_balancedness"] == pytest.approx(
        float(model_balancedness(load_LE, pl, weights))
    )
    assert 0.0 < plan.stats["forecast_balancedness"] <= 1.0
    assert plan.stats["solve_seconds"] >= 0


@pytest.mark.parametrize(
    "topology", TOPOLOGIES, ids=lambda t: f"G{t.num_gpus}N{t.num_nodes}P{t.num_physical}"
)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_plan_validates(topology: Topology, algorithm: str) -> None:
    rng = np.random.default_rng(topology.num_physical)
    E = 16
    for name, load in _loads(rng, 6, 3, E).items():
        for dispatch in ("dynamic", "weighted"):
            options = SolveOptions(algorithm=algorithm, dispatch=dispatch, milp_max_solves=2)
            plan = solve(load, topology, None, options)
            # The deepseek planners plan on the plain sum; scipy on the forecast.
            forecast = load.sum(axis=0) if algorithm.startswith("deepseek") else None
            if forecast is not None:
                _check_plan(plan, forecast, topology, E)
            else:
                plan.placement.validate()
            # Calibrated on the window's newer half (float32 products inside solve).
            reference = horizon_reference(np.asarray(load, dtype=np.float64), topology, options, plan)
            assert plan.predicted_balancedness == pytest.approx(reference, abs=1e-5), name
            assert plan.apply and plan.diff is None


@pytest.mark.parametrize("prediction", PREDICTIONS)
def test_plans_validate_for_every_prediction_with_current(prediction: str) -> None:
    rng = np.random.default_rng(5)
    topology = Topology(num_gpus=8, num_nodes=2, num_physical=40, num_groups=4)
    load = rng.lognormal(0.0, 1.0, size=(20, 3, 32))
    current = Placement.trivial(3, 32, 8, 8, num_nodes=2)
    plan = solve(
        load, topology, current, SolveOptions(prediction=prediction, dispatch="weighted", bytes_per_expert=10)
    )
    plan.placement.validate()
    assert plan.diff is not None
    reference = diff_placements(current, plan.placement, 10)
    assert plan.diff.summary() == reference.summary()
    assert plan.stats["copies_moved"] == reference.experts_moved_across_gpus


def test_aggregated_and_window_input_agree_for_sum() -> None:
    rng = np.random.default_rng(1)
    load = rng.random((10, 4, 24))
    topology = Topology(num_gpus=4, num_physical=28)
    options = SolveOptions(
        prediction="sum", time_budget_s=0
    )  # the MILP's wall-clock budget is not reproducible
    a = solve(load, topology, None, options).placement
    b = solve(load.sum(axis=0), topology, None, options).placement
    c = solve(torch.from_numpy(load), topology, None, options).placement
    assert a == b == c


def test_all_zero_load_gives_a_valid_placement() -> None:
    topology = Topology(num_gpus=4, num_nodes=2, num_physical=24, num_groups=2)
    for algorithm in ALGORITHMS:
        plan = solve(
            np.zeros((2, 16)), topology, None, SolveOptions(algorithm=algorithm, dispatch="weighted")
        )
        plan.placement.validate()
        assert plan.predicted_balancedness == 1.0


@pytest.mark.parametrize(
    ("load", "topology", "message"),
    [
        (np.full((2, 8), np.nan), Topology(num_gpus=2, num_physical=8), "NaN"),
        (np.full((2, 8), np.inf), Topology(num_gpus=2, num_physical=8), "inf"),
        (-np.ones((2, 8)), Topology(num_gpus=2, num_physical=8), "negative"),
        (np.ones(8), Topology(num_gpus=2, num_physical=8), "shape"),
        (np.ones((1, 2, 3, 8)), Topology(num_gpus=2, num_physical=8), "shape"),
        (np.ones((0, 2, 8)), Topology(num_gpus=2, num_physical=8), "empty"),
        (np.ones((2, 0)), Topology(num_gpus=2, num_physical=8), "empty"),
        (np.array([["a", "b"]]), Topology(num_gpus=1, num_physical=2), "numeric"),
        (np.ones((2, 8)), Topology(num_gpus=2, num_physical=6), "fewer physical slots"),
    ],
)
def test_bad_load_raises_value_error(load: np.ndarray, topology: Topology, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        solve(load, topology)


def test_bad_topology_and_options_raise_value_error() -> None:
    with pytest.raises(ValueError, match="divisible by num_gpus"):
        Topology(num_gpus=4, num_physical=10)
    with pytest.raises(ValueError, match="divide num_gpus"):
        Topology(num_gpus=4, num_nodes=3, num_physical=12)
    with pytest.raises(ValueError, match="num_gpus"):
        Topology(num_gpus=0, num_physical=12)
    with pytest.raises(ValueError, match="unknown algorithm"):
        SolveOptions(algorithm="greedy")
    with pytest.raises(ValueError, match="unknown prediction"):
        SolveOptions(prediction="oracle")
    with pytest.raises(ValueError, match="max_bytes_moved"):
        SolveOptions(max_bytes_moved=10)
    with pytest.raises(ValueError, match="deepseek_hierarchical"):
        solve(np.ones((2, 12)), Topology(num_gpus=4, num_nodes=2, num_physical=16, num_groups=3),
              options=SolveOptions(algorithm="deepseek_hierarchical"))  # fmt: skip
    current = Placement.trivial(2, 8, 2, 2)
    with pytest.raises(ValueError, match="current placement"):
        solve(np.ones((3, 8)), Topology(num_gpus=2, num_physical=10), current)
    with pytest.raises(ValueError, match="current placement spans"):
        solve(np.ones((2, 8)), Topology(num_gpus=5, num_physical=10), current)


def test_already_optimal_current_moves_nothing() -> None:
    """Uniform load on an even placement: nothing can improve, so nothing moves."""
    topology = Topology(num_gpus=4, num_nodes=2, num_physical=16)
    current = Placement.trivial(3, 16, 4, 0, num_nodes=2)
    for algorithm in ("scipy", "auto"):
        for incremental in (True, False):
            options = SolveOptions(algorithm=algorithm, incremental=incremental)
            plan = solve(np.ones((5, 3, 16)), topology, current, options)
            assert plan.diff is not None and plan.diff.num_changed_slots == 0
            assert not plan.apply and "equals the current" in plan.reason


def test_own_plan_as_current_moves_nothing() -> None:
    rng = np.random.default_rng(2)
    topology = Topology(num_gpus=8, num_nodes=2, num_physical=72)
    load = rng.lognormal(0.0, 1.0, size=(30, 4, 64))
    first = solve(load, topology)
    again = solve(load, topology, first.placement)
    assert again.diff is not None and again.diff.num_changed_slots == 0
    assert not again.apply


def test_incremental_moves_far_less_than_a_fresh_plan() -> None:
    rng = np.random.default_rng(4)
    topology = Topology(num_gpus=16, num_nodes=2, num_physical=144)
    base = rng.lognormal(0.0, 1.0, size=(6, 128))
    first = solve(base, topology)
    drifted = base * rng.lognormal(0.0, 0.15, size=base.shape)
    fresh = solve(drifted, topology, first.placement, SolveOptions(incremental=False))
    incremental = solve(drifted, topology, first.placement)
    assert incremental.diff is not None and fresh.diff is not None
    assert incremental.diff.experts_moved_across_gpus * 3 < fresh.diff.experts_moved_across_gpus
    stale = float(model_balancedness(drifted, first.placement))
    assert incremental.predicted_balancedness > stale + 0.5 * (fresh.predicted_balancedness - stale)
    assert incremental.apply


def test_copy_cap_and_min_gain() -> None:
    rng = np.random.default_rng(6)
    topology = Topology(num_gpus=8, num_physical=72)
    load = rng.lognormal(0.0, 1.0, size=(4, 64))
    current = Placement.trivial(4, 64, 8, 8)
    capped = solve(load, topology, current, SolveOptions(bytes_per_expert=100, max_bytes_moved=2000))
    assert capped.diff is not None and capped.diff.experts_moved_across_gpus <= 20
    assert capped.apply
    greedy_capped = solve(
        load,
        topology,
        current,
        SolveOptions(algorithm="deepseek", bytes_per_expert=100, max_bytes_moved=2000),
    )
    assert not greedy_capped.apply and "max_bytes_moved" in greedy_capped.reason
    picky = solve(load, topology, current, SolveOptions(min_gain=1.0))
    assert not picky.apply and "min_gain" in picky.reason
    assert picky.stats["current_balancedness"] < picky.predicted_balancedness


def test_auto_prediction_is_robust_on_long_windows_only() -> None:
    rng = np.random.default_rng(8)
    topology = Topology(num_gpus=4, num_physical=20)
    options = SolveOptions(robust_from_passes=50)
    short = solve(rng.random((49, 2, 16)), topology, None, options)
    long = solve(rng.random((50, 2, 16)), topology, None, options)
    assert short.stats["prediction_robust"] == 0.0 and long.stats["prediction_robust"] == 1.0
    assert SolveOptions().resolved_prediction("deepseek", 10_000) == "sum"
    assert SolveOptions(prediction="recent").resolved_prediction("scipy", 10) == "recent"


@pytest.mark.parametrize("algorithm", ["deepseek", "deepseek_hierarchical", "scipy"])
@pytest.mark.parametrize("scale", [3.5e38, 1e300])
def test_huge_loads_plan_like_their_ratios(algorithm: str, scale: float) -> None:
    """Loads near float32's or float64's max plan as the same ratios at a sane scale."""
    rng = np.random.default_rng(5)
    load_LE = rng.random((2, 16)) + 0.01
    topology = Topology(num_gpus=4, num_nodes=2, num_physical=24, num_groups=4)
    options = SolveOptions(algorithm=algorithm)
    huge = solve(load_LE / load_LE.max() * scale, topology, None, options)
    plain = solve(load_LE / load_LE.max() * 2.0**40, topology, None, options)
    huge.placement.validate()
    assert (huge.placement.logcnt_LE >= 1).all()
    assert np.isfinite(huge.predicted_balancedness)
    if algorithm.startswith("deepseek"):
        np.testing.assert_array_equal(huge.placement.phy2log_LP, plain.placement.phy2log_LP)
    else:  # the scaled loads differ from the plain ones in the last bits: ties may fall otherwise
        assert huge.predicted_balancedness == pytest.approx(plain.predicted_balancedness, abs=0.02)
