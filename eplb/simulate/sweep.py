"""Sweeps: the fewest redundant experts, then the longest interval, that reach a target balancedness.

Each point is one simulation of one run (and the no-balancing baseline) on the same trace.
Redundant counts are tried from the smallest up and intervals from the longest down, so the
first point that reaches the target answers the question without assuming monotonicity beyond it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from eplb.simulate.config import SimulationConfig
from eplb.simulate.engine import simulate
from eplb.simulate.planners import RunSpec
from eplb.traces import Trace

METRICS = {
    "prefill": "balancedness_prefill_mean",
    "mean": "balancedness_mean",
    "p5": "balancedness_p5",
}


@dataclass(frozen=True)
class SweepPoint:
    """One simulated setting and its summary figures."""

    num_redundant: int
    interval: int
    value: float
    """The swept metric (balancedness) of the run."""
    reached: bool
    summary: dict[str, Any]


def redundant_candidates(num_experts: int, num_gpus: int, max_redundant: int) -> list[int]:
    """Redundant counts in [0, max_redundant] whose slots divide evenly over the GPUs, ascending."""
    first = (-num_experts) % num_gpus
    return list(range(first, max_redundant + 1, num_gpus))


def sweep(
    trace: Trace,
    run: RunSpec,
    config: SimulationConfig,
    *,
    target: float,
    redundant: Sequence[int],
    intervals: Sequence[int],
    metric: str = "prefill",
    on_point: Callable[[SweepPoint], None] | None = None,
) -> dict[str, Any]:
    """Smallest redundant count reaching ``target`` at the flags' interval, then the longest interval.

    Returns ``{"redundant": int | None, "interval": int | None, "points": [SweepPoint...]}``;
    None where no candidate reaches the target (the interval sweep then uses the largest count).
    """
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; choose from {sorted(METRICS)}")
    if not redundant or not intervals:
        raise ValueError("the sweep needs at least one redundant count and one interval")
    points: list[SweepPoint] = []
    flags = config.eplb

    def measure(num_redundant: int, interval: int) -> SweepPoint:
        # Periodic windows never reach past the last rebalance; continuous ones may.
        window = flags.expert_distribution_recorder_buffer_size
        if window is not None and not flags.continuous:
            window = min(window, interval)
        point_flags = replace(
            flags,
            ep_num_redundant_experts=num_redundant,
            eplb_rebalance_num_iterations=interval,
            expert_distribution_recorder_buffer_size=window,
        )
        cfg = replace(config, eplb=point_flags)
        summary = simulate(trace, [run], cfg).summaries()[0]
        value = float(summary[METRICS[metric]])
        point = SweepPoint(num_redundant, interval, value, value >= target, summary)
        points.append(point)
        if on_point is not None:
            on_point(point)
        return point

    at = flags.rebalance_interval
    best_redundant = next((r for r in sorted(redundant) if measure(r, at).reached), None)
    chosen = best_redundant if best_redundant is not None else max(redundant)
    longest = None
    for interval in sorted(set(intervals), reverse=True):
        done = next((p for p in points if (p.num_redundant, p.interval) == (chosen, interval)), None)
        if (done or measure(chosen, interval)).reached:
            longest = interval
            break
    return {
        "redundant": best_redundant,
        "interval": longest,
        "redundant_used_for_intervals": chosen,
        "points": points,
    }
