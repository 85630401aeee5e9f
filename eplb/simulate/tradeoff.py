"""Balance and speed-up against bytes moved: periodic repacking vs continuous budgeted moves.

Each setting is one run under one schedule (mode, interval, window, budget: the schedule flags of
an ``EplbConfig``), simulated on the same trace and scored on the same steps (``--score-from``,
by default the first rebalance of the slowest schedule), so the points compare: prefill
balancedness and modeled MoE speed-up net of stalls and interference, against the bytes of
expert weights moved across GPUs per 1000 passes. ``eplb sweep --tradeoff`` prints the table and
plots it (``eplb.simulate.plots.write_tradeoff_plot``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from eplb.policy import Planner
from eplb.simulate.config import SimulationConfig
from eplb.simulate.engine import simulate
from eplb.simulate.planners import RunSpec
from eplb.simulate.results import format_bytes, format_table
from eplb.traces import Trace

PERIODIC_INTERVALS = (1000, 200, 50)
"""Periodic settings compared by default: SGLang's default interval and two shorter ones."""
CONTINUOUS_BUDGETS = (64, 128, 256, 512, 1024)
"""Continuous budgets (expert copies per rebalance) compared by default."""


@dataclass(frozen=True, kw_only=True)
class Setting:
    """One point: a run under one schedule."""

    label: str
    """Its name in the table and the plot."""
    run: RunSpec
    """The algorithm and dispatch simulated."""
    mode: str
    """--eplb-rebalance-mode: periodic | continuous."""
    interval: int
    """--eplb-rebalance-num-iterations."""
    window: int | None = None
    """--expert-distribution-recorder-buffer-size, in recorded passes (None: the mode's default)."""
    max_moved_experts: int | None = None
    """--eplb-max-moved-experts: budget per rebalance (None: the mode's default)."""


def default_settings(
    *,
    periodic_algorithm: str = "deepseek",
    continuous_algorithm: str = "scipy",
    dispatch: str = "static",
    periodic_intervals: Sequence[int] = PERIODIC_INTERVALS,
    continuous_interval: int,
    continuous_window: int | None = None,
    budgets: Sequence[int] = CONTINUOUS_BUDGETS,
) -> list[Setting]:
    """Periodic ``periodic_algorithm`` at each interval, continuous ``continuous_algorithm`` at each budget."""
    periodic = [
        Setting(
            label=f"{periodic_algorithm} periodic {i}",
            run=RunSpec(periodic_algorithm, dispatch),
            mode="periodic",
            interval=i,
        )
        for i in periodic_intervals
    ]
    continuous = [
        Setting(
            label=f"{continuous_algorithm} continuous {continuous_interval} budget {b}",
            run=RunSpec(continuous_algorithm, dispatch),
            mode="continuous",
            interval=continuous_interval,
            window=continuous_window,
            max_moved_experts=b,
        )
        for b in budgets
    ]
    return [*periodic, *continuous]


def tradeoff(
    trace: Trace,
    settings: Sequence[Setting],
    base: SimulationConfig,
    *,
    planners: Mapping[str, Planner] | None = None,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """One row per setting: the run's summary with its schedule; all scored from one step.

    Each setting replaces the schedule flags of ``base.eplb``; every run is scored from
    ``base.score_from``, by default the longest interval among ``settings`` (the slowest
    schedule's first rebalance). ``planners`` replace built-in planners by run name, as in
    ``simulate``.
    """
    if not settings:
        raise ValueError("the trade-off needs at least one setting")
    base = base.on_layers_of(trace)
    start = base.score_from
    if start is None:
        start = max(s.interval for s in settings)
        if start >= trace.num_steps:
            raise ValueError(
                f"scoring from step {start} (the longest interval) leaves nothing of the "
                f"{trace.num_steps}-step trace: give more steps, shorter intervals or --score-from"
            )
    rows = []
    for setting in settings:
        continuous = setting.mode == "continuous"
        flags = replace(
            base.eplb,
            eplb_rebalance_mode=setting.mode,
            eplb_rebalance_num_iterations=setting.interval,
            expert_distribution_recorder_buffer_size=setting.window,
            eplb_max_moved_experts=setting.max_moved_experts,
            # Periodic swaps are never paced (SGLang's schedule: the transfer stalls serving).
            eplb_transfer_gbps=base.eplb.eplb_transfer_gbps if continuous else None,
        )
        config = replace(base, eplb=flags, score_from=start)
        result = simulate(trace, [setting.run], config, planners=planners)
        row = {
            "label": setting.label,
            "mode": setting.mode,
            "interval": setting.interval,
            "window": flags.recorder_buffer_size,
            "budget": flags.max_moved_experts,
            "scored_from": result.scored_from,
            **result.summaries()[0],
        }
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def tradeoff_table(rows: Sequence[dict[str, Any]]) -> str:
    """The terminal table of :func:`tradeoff` rows."""
    header = (
        "setting",
        "bal prefill",
        "speed-up",
        "moved / 1000 passes",
        "copies / rebal",
        "stall s",
        "interf. s",
        "pred. error",
        "solve s",
    )
    lines: list[tuple[str, ...]] = [header]
    for r in rows:
        error = r["prediction_error_mean"]
        lines.append(
            (
                r["label"],
                f"{r['balancedness_prefill_mean']:.3f}",
                f"{r['speedup_vs_none']:.3f}x",
                format_bytes(r["bytes_moved_per_1000_passes"]),
                f"{r['experts_moved_per_rebalance']:.0f}",
                f"{r['stall_seconds']:.2f}",
                f"{r['interference_seconds']:.3f}",
                "-" if error is None else f"{error:.3f}",
                f"{r['solve_seconds_mean']:.3f}",
            )
        )
    return format_table(lines)
