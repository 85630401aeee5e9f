"""eplb.solver in continuous rebalancing: deterministic plans, calibrated predictions, a gate that converges.

Plans are made on window i of a seeded synthetic workload (eplb.workloads) and scored on the passes
that follow, as a server would see them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from eplb.placement.balance import model_balancedness
from eplb.placement.dispatch_map import static_dispatch_maps
from eplb.placement.model import Placement
from eplb.policy.decision import Pricing
from eplb.solver import SolveOptions, Topology, solve
from eplb.traces import Trace
from eplb.workloads import WorkloadConfig, generate

ROOT = Path(__file__).resolve().parent.parent
INTERVAL, WINDOW, BUDGET = 50, 200, 256

_PLAN_SCRIPT = """
import hashlib, json, sys
import numpy as np
from eplb.placement.model import Placement
from eplb.solver import SolveOptions, Topology, solve
rng = np.random.default_rng(7)
topology = Topology(num_gpus=8, num_nodes=2, num_physical=72)
load = rng.poisson(rng.lognormal(0.0, 1.0, size=(1, 3, 64)) * 40, size=(60, 3, 64))
first = solve(load[:30], topology)  # fresh: swap search and MILP with their default limits
current = first.placement
out = {"fresh": hashlib.sha256(current.phy2log_LP.tobytes()).hexdigest(), "fresh_pred": first.predicted_balancedness}
out["milp_solves"] = first.stats["milp_solves"]
for name, options in (
    ("budgeted", SolveOptions(max_moved_experts=40)),
    ("static", SolveOptions(max_moved_experts=40, dispatch="static")),
    ("incremental", SolveOptions()),
):
    plan = solve(load[30:], topology, current, options)
    out[name] = hashlib.sha256(plan.placement.phy2log_LP.tobytes()).hexdigest()
    out[name + "_pred"] = plan.predicted_balancedness
    out[name + "_apply"] = plan.apply
print(json.dumps(out))
"""


def _plans_in_a_process(threads: str) -> dict[str, object]:
    env = {**os.environ, "OMP_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads}
    result = subprocess.run(
        [sys.executable, "-c", _PLAN_SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def test_same_inputs_give_the_same_plan_in_separate_processes() -> None:
    """No wall clock decides anything: two processes (with different thread counts) agree bit for bit."""
    one, two = _plans_in_a_process("1"), _plans_in_a_process("2")
    assert one == two
    assert {"fresh", "budgeted", "static", "incremental"} <= set(one)
    assert one["milp_solves"] > 0  # the MILP ran


def test_same_inputs_give_the_same_plan_in_one_process() -> None:
    rng = np.random.default_rng(3)
    topology = Topology(num_gpus=8, num_nodes=2, num_physical=72)
    load = rng.lognormal(0.0, 1.0, size=(30, 2, 64))
    current = Placement.trivial(2, 64, 8, 8, num_nodes=2)
    for options in (
        SolveOptions(max_moved_experts=24, cross_node_weight=2.0),
        SolveOptions(max_moved_experts=24, dispatch="static"),
        SolveOptions(incremental=False),
    ):
        a, b = solve(load, topology, current, options), solve(load, topology, current, options)
        assert a.placement == b.placement
        assert a.predicted_balancedness == b.predicted_balancedness and a.apply == b.apply


@lru_cache(maxsize=2)
def _trace(preset: str, steps: int, seed: int, stationary: bool) -> Trace:
    config = WorkloadConfig(preset=preset, num_steps=steps, seed=seed)
    if stationary:
        config = config.with_(drift_sigma=0.0, mean_steps_between_shifts=0.0)
    return generate(config)


def _realised(trace: Trace, placement: Placement, start: int, static: bool = False) -> tuple[float, float]:
    """(load-weighted mean over the next interval's passes, mean over its prefill passes).

    ``static``: tokens follow the ranks' static dispatch maps (eplb.placement.dispatch_map).
    """
    window = slice(start, start + INTERVAL)
    counts = trace.counts_FLE[window].astype(np.float64)
    per_pass = model_balancedness(counts, placement, _static_weights(placement) if static else None)
    weighted = float(np.average(per_pass, weights=counts.sum(axis=(1, 2))))
    return weighted, float(per_pass[trace.is_prefill_F[window]].mean())


def _static_weights(placement: Placement) -> np.ndarray:
    """float64 [L, E, R]: each replica's share of its expert's tokens, counted from the ranks' maps."""
    maps_GLE = static_dispatch_maps(placement)
    L, P, G = placement.num_layers, placement.num_physical, placement.num_gpus
    ranks_LP = np.zeros((L, P))
    for g in range(G):
        np.add.at(ranks_LP, (np.arange(L)[:, None], maps_GLE[g]), 1.0 / G)
    l2p_LER = placement.log2phy_LER
    return np.where(l2p_LER >= 0, np.take_along_axis(ranks_LP[:, None, :], np.maximum(l2p_LER, 0), 2), 0.0)


@pytest.mark.parametrize("static", [False, True])
def test_the_prediction_is_calibrated_on_a_drifting_workload(static: bool) -> None:
    """Predicted balancedness within 0.03 of what the next interval gets, on average over the plans
    whose interval no domain shift hits (measured ~0.008 either way; biased by under 0.02, measured
    ~+0.007), and those the shift hits reported apart: the trace shifts at step 955, which no window
    foresees, so the plan made at 950 is over-predicted by ~0.29 (counted with the others, it alone
    would put the mean at ~0.029-0.030, at the bound: the figure then depends on the last bits of
    numpy's sums).

    ``static``: the server dispatches by static maps, and the solver is told so.
    """
    trace = _trace("deepseek-v3", 1000, 4, False)
    shifts = np.asarray(trace.meta["domain_change_steps"])
    topology = Topology(num_gpus=32, num_nodes=4, num_physical=288, num_groups=8)
    current = Placement.trivial(58, 256, 32, 32, num_nodes=4)
    # Predicted over the next interval, as a server's rebalance asks (eplb.policy.decision.Decider).
    options = SolveOptions(
        max_moved_experts=BUDGET,
        dispatch="static" if static else "dynamic",
        pricing=Pricing(horizon_passes=INTERVAL),
    )
    errors: list[float] = []
    prefill_errors: list[float] = []
    hit_errors: list[float] = []
    gain_errors: list[float] = []
    forecast_errors: list[float] = []
    for i, t in enumerate(range(WINDOW, trace.num_steps - INTERVAL + 1, INTERVAL)):
        plan = solve(trace.counts_FLE[t - WINDOW : t], topology, current, options)
        realised, realised_prefill = _realised(trace, plan.placement, t, static)
        realised_current, _ = _realised(trace, current, t, static)
        if i >= 3:  # the first plans leave the trivial placement: not the regime of interest
            hit = bool(((shifts >= t) & (shifts < t + INTERVAL)).any())
            (hit_errors if hit else errors).append(plan.predicted_balancedness - realised)
            if not hit:
                prefill_errors.append(plan.predicted_balancedness - realised_prefill)
            gain_errors.append(plan.stats["predicted_gain"] - (realised - realised_current))
            forecast_errors.append(plan.stats["forecast_balancedness"] - realised)
        if plan.apply:
            current = plan.placement
    assert len(errors) >= 10
    assert np.mean(np.abs(errors)) <= 0.03, errors
    assert abs(np.mean(errors)) <= 0.02, errors
    assert np.mean(np.abs(prefill_errors)) <= 0.03, prefill_errors
    # The shift-hit plan: fitted to the old domain, it gets far less than predicted.
    assert len(hit_errors) == 1 and hit_errors[0] > 0.1, hit_errors
    assert np.mean(np.abs(gain_errors)) <= 0.01
    # What the calibration corrects: the plan scored on the load it was fitted to.
    assert np.mean(forecast_errors) > 0.03


@pytest.mark.parametrize("static", [False, True])
def test_repeated_solves_on_stationary_load_converge_and_then_move_little(static: bool) -> None:
    """The gate prices plans in seconds (eplb.policy.decision.gate, no min_gain): once converged,
    a plan is still applied where its small gain pays for its few copies, so the placement keeps
    moving a little, and what it moves gains on the passes that follow."""
    trace = _trace("qwen3-235b-a22b", 1500, 5, True)
    topology = Topology(num_gpus=16, num_nodes=2, num_physical=144)
    current = Placement.trivial(94, 128, 16, 16, num_nodes=2)
    options = SolveOptions(
        max_moved_experts=BUDGET,
        dispatch="static" if static else "dynamic",
        bytes_per_expert=int(trace.meta["bytes_per_expert"]),
        pricing=Pricing(horizon_passes=INTERVAL),
    )
    applied, copies, realised_gains, start = [], [], [], current
    for t in range(WINDOW, trace.num_steps + 1, INTERVAL):
        plan = solve(trace.counts_FLE[t - WINDOW : t], topology, current, options)
        applied.append(plan.apply)
        copies.append(plan.stats["copies_moved"] if plan.apply else 0.0)
        if plan.apply:
            if t < trace.num_steps:
                realised_gains.append(
                    _realised(trace, plan.placement, t, static)[0] - _realised(trace, current, t, static)[0]
                )
            current = plan.placement
    assert applied[0] and copies[0] == BUDGET
    # Converged within a dozen rebalances: no later plan moves more than an eighth of a budget ...
    assert max(copies[12:]) <= BUDGET // 8, copies
    # ... and the last ten together less than a quarter of one.
    assert sum(copies[-10:]) <= BUDGET // 4, copies
    # What the gate applies pays off in balance on the next interval, the small late plans too.
    assert min(realised_gains[:8]) > 0.005, realised_gains
    assert sum(realised_gains[8:]) > 0, realised_gains
    tail = trace.counts_FLE[-INTERVAL:].astype(np.float64)
    weights = (_static_weights(current), _static_weights(start)) if static else (None, None)
    assert (
        model_balancedness(tail, current, weights[0]).mean()
        > model_balancedness(tail, start, weights[1]).mean() + 0.2
    )
