"""``solve``: one entry point from a recorded window to a checked plan.

Shape legend: W window (passes), L layers, E logical experts, P physical slots, G GPUs, N nodes,
R max replicas.

Steps: check the input, forecast the load (eplb.solver.predict), place replicas with the chosen
policy (eplb.policy registry), optionally split each expert's load over its replicas (eplb.solver.split), then compare
with the current placement and decide whether the predicted gain pays for the transfer.
"""

from __future__ import annotations

import time
from typing import Any

from eplb.placement.balance import model_balancedness
from eplb.placement.diff import PlacementDiff, diff_placements
from eplb.placement.model import Placement
from eplb.solver.policies import load_policy
from eplb.solver.predict import Prediction, predict
from eplb.solver.split import lp_split
from eplb.solver.types import Plan, SolveOptions, Topology, as_load_array, check_shapes


def solve(
    load: Any,
    topology: Topology,
    current: Placement | None = None,
    options: SolveOptions | None = None,
) -> Plan:
    """Plan a placement for the load a window predicts.

    Args:
        load: float/int [W, L, E] window of per-pass logical counts, or [L, E] already aggregated
            (numpy, torch or nested lists). NaN, inf or negative values raise ValueError.
        topology: GPUs, nodes, physical slots and expert groups.
        current: the live placement; enables migration-aware planning and the apply/skip decision.
        options: see :class:`SolveOptions`.

    Returns:
        A :class:`Plan` whose placement has R = P - E + 1 replica columns.
    """
    options = options or SolveOptions()
    start = time.perf_counter()
    load_WLE = as_load_array(load)
    _, L, E = load_WLE.shape
    check_shapes(L, E, topology, current)
    policy = load_policy(options.algorithm)
    method = policy.prediction(options, load_WLE.shape[0])
    prediction = predict(load_WLE, options, method)
    stats: dict[str, float] = {}
    phy2log_LP = policy.place(prediction, topology, current, options, stats)
    placement = Placement.from_phy2log(
        phy2log_LP, topology.num_gpus, topology.num_nodes, max_replicas=topology.num_physical - E + 1
    )
    weights_LER = lp_split(prediction.point_LE, placement) if options.weighted else None
    predicted = float(model_balancedness(prediction.point_LE, placement, weights_LER))
    diff = None if current is None else diff_placements(current, placement, options.bytes_per_expert)
    apply, reason = _decide(prediction, predicted, current, diff, options, stats)
    stats["solve_seconds"] = time.perf_counter() - start
    stats["algorithm_scipy"] = float(policy.name == "scipy")
    stats["prediction_robust"] = float(method == "robust")
    return Plan(
        placement=placement,
        dispatch_weights_LER=weights_LER,
        diff=diff,
        predicted_balancedness=predicted,
        apply=apply,
        reason=reason,
        stats=stats,
    )


def _decide(
    prediction: Prediction,
    predicted: float,
    current: Placement | None,
    diff: PlacementDiff | None,
    options: SolveOptions,
    stats: dict[str, float],
) -> tuple[bool, str]:
    """Whether to apply the plan, and why."""
    if current is None or diff is None:
        return True, "no current placement"
    now = float(model_balancedness(prediction.point_LE, current))
    stats["current_balancedness"] = now
    stats["copies_moved"] = float(diff.experts_moved_across_gpus)
    stats["changed_slots"] = float(diff.num_changed_slots)
    if diff.num_changed_slots == 0:
        return False, "the plan equals the current placement"
    cap = options.max_copies
    if cap is not None and diff.experts_moved_across_gpus > cap:
        return False, (
            f"moves {diff.experts_moved_across_gpus} expert copies ({diff.bytes_across_gpus} bytes), "
            f"over max_bytes_moved={options.max_bytes_moved}"
        )
    gain = predicted - now
    if gain < options.min_gain:
        return (
            False,
            f"predicted balancedness gain {gain:+.4f} ({now:.4f} -> {predicted:.4f}) < min_gain {options.min_gain}",
        )
    return True, (
        f"predicted balancedness {now:.4f} -> {predicted:.4f} for {diff.experts_moved_across_gpus} expert copies"
    )
