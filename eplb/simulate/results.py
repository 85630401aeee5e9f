"""What a simulation returns: per-run timelines, rebalance events, summaries, the terminal table.

Shape legend: F steps, L layers, G GPUs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from eplb.placement.model import Placement
from eplb.simulate.planners import RunSpec


@dataclass(frozen=True, kw_only=True)
class RebalanceEvent:
    """One rebalance decision of one run."""

    step: int
    """First step that runs on the new placement (the plan saw only steps before it)."""
    window_steps: int
    """Recorded steps the planner was given."""
    applied: bool
    reason: str
    solve_seconds: float
    transfer_seconds: float = 0.0
    """Link time of its transfer on the busiest receiving GPU (at the swap's pace in continuous mode)."""
    stall_seconds: float = 0.0
    """Serving stalled for it: all of the link time in periodic mode, the part the passes did not
    cover in continuous mode."""
    interference_seconds: float = 0.0
    """Time the passes lost while its swap ran beside them (continuous mode)."""
    longest_stall_seconds: float = 0.0
    """Longest single pause of serving in ``stall_seconds`` (SGLang's swap: its costliest chunk of layers)."""
    switch_step: int | None = None
    """First step on the new placement (periodic: ``step``; None: not applied, or still in flight at the end)."""
    changed_slots: int = 0
    experts_moved_across_gpus: int = 0
    experts_moved_across_nodes: int = 0
    bytes_moved: int = 0
    """Bytes of expert weights that crossed GPUs."""
    window_balancedness: float = float("nan")
    """Balancedness of the window under the placement in use when the plan was made."""
    predicted_balancedness: float | None = None
    realized_balancedness: float | None = None
    """What its prediction estimates: the mean over the recorded steps its plan served until the
    next rebalance of their model balancedness, each weighted by its load (None: not applied, or
    the trace ended first)."""
    realized_summed_balancedness: float | None = None
    """Balancedness of the load of those steps summed, as a window is (higher: summing smooths)."""


@dataclass(kw_only=True)
class RunResult:
    """The timeline of one simulated configuration."""

    spec: RunSpec
    balancedness_F: np.ndarray
    """float64 [F]: model balancedness (mean over layers of mean/max GPU load) of each step."""
    moe_us_F: np.ndarray
    """float64 [F]: modeled MoE time of each step, µs (sum over layers of the busiest GPU)."""
    dispatch_us_F: np.ndarray | None = None
    """float64 [F]: µs of each step's dispatch kernels (every layer; --eplb-dispatch-cost); None: none charged."""
    lp_F: np.ndarray | None = None
    """bool [F]: the steps that ran ``lp`` dispatch (``auto``'s choice; None: unknown)."""
    relative_load_LG: np.ndarray
    """float64 [L, G]: per-step GPU load / layer mean, averaged over the scored steps."""
    events: list[RebalanceEvent] = field(default_factory=list)
    final_placement: Placement | None = None
    eval_seconds: float = 0.0
    """Wall time spent evaluating load under placements (not planning)."""
    apply_seconds: float = 0.0
    """Wall time spent diffing applied plans and building their dispatch matrices (static maps)."""

    def scored_events(self, scored_from: int = 0) -> list[RebalanceEvent]:
        """The rebalances from step ``scored_from`` on (their costs count; earlier ones warm up)."""
        return [e for e in self.events if e.step >= scored_from]

    def dispatch_seconds(self, scored_from: int = 0) -> float:
        """Modeled time of the dispatch kernels of steps ``scored_from`` onwards."""
        return 0.0 if self.dispatch_us_F is None else float(self.dispatch_us_F[scored_from:].sum()) * 1e-6

    def total_seconds(self, scored_from: int = 0) -> float:
        """Modeled MoE time of steps ``scored_from`` onwards, their dispatch kernels, and those
        rebalances' stalls and interference."""
        events = self.scored_events(scored_from)
        overhead = sum(e.stall_seconds + e.interference_seconds for e in events)
        moe = float(self.moe_us_F[scored_from:].sum()) * 1e-6
        return moe + self.dispatch_seconds(scored_from) + float(overhead)

    def prediction_errors(self, shifts: Sequence[int], scored_from: int = 0) -> dict[str, dict[str, Any]]:
        """predicted − realized balancedness of the plans applied from ``scored_from`` on, split
        by whether one of ``shifts`` (the trace's ``domain_change_steps``) landed in the passes a
        plan served (from its rebalance to the next): no window foresees a shift to come, so the
        plans it hits are reported apart. Per group: ``plans``, ``mean_abs``, ``bias``,
        ``max_abs`` (None without plans)."""
        shifts_S = np.asarray(shifts, dtype=np.int64)
        events = self.scored_events(scored_from)
        end = self.balancedness_F.size
        groups: dict[str, list[float]] = {"no_shift": [], "shift_hit": []}
        for i, e in enumerate(events):
            if not e.applied or e.predicted_balancedness is None or e.realized_balancedness is None:
                continue
            stop = events[i + 1].step if i + 1 < len(events) else end
            hit = bool(((shifts_S >= e.step) & (shifts_S < stop)).any())
            groups["shift_hit" if hit else "no_shift"].append(
                e.predicted_balancedness - e.realized_balancedness
            )
        groups["all"] = groups["no_shift"] + groups["shift_hit"]

        def stats(errors: list[float]) -> dict[str, Any]:
            a = np.asarray(errors, dtype=np.float64)
            if not a.size:
                return {"plans": 0, "mean_abs": None, "bias": None, "max_abs": None}
            return {
                "plans": int(a.size),
                "mean_abs": float(np.abs(a).mean()),
                "bias": float(a.mean()),
                "max_abs": float(np.abs(a).max()),
            }

        return {name: stats(errors) for name, errors in groups.items()}

    def summary(
        self,
        baseline: RunResult,
        is_prefill_F: np.ndarray,
        scored_from: int = 0,
        shifts: Sequence[int] = (),
    ) -> dict[str, Any]:
        """Figures over the scored steps (from ``scored_from``), compared with ``baseline``: every
        count, cost and rate covers only the rebalances made within them (``scored_events``);
        ``shifts``: the trace's domain shifts, which split the prediction errors."""
        events = self.scored_events(scored_from)
        applied = [e for e in events if e.applied]
        solve = np.array([e.solve_seconds for e in events], dtype=np.float64)
        bal = self.balancedness_F[scored_from:]
        prefill_bal = bal[is_prefill_F[scored_from:]]
        lp_F = None if self.lp_F is None else self.lp_F[scored_from:]
        total = self.total_seconds(scored_from)
        bytes_moved = int(sum(e.bytes_moved for e in applied))
        errors = self.prediction_errors(shifts, scored_from)
        summed = [(e.predicted_balancedness, e.realized_summed_balancedness) for e in applied]
        error_summed = np.array([p - r for p, r in summed if p is not None and r is not None])
        delays = [e.switch_step - e.step for e in applied if e.switch_step is not None]
        return {
            "name": self.spec.name,
            "algorithm": self.spec.algorithm,
            "dispatch": self.spec.dispatch,
            "balancedness_mean": _mean(bal),
            "balancedness_p5": float(np.percentile(bal, 5)) if bal.size else float("nan"),
            "balancedness_prefill_mean": _mean(prefill_bal),
            "moe_seconds": float(self.moe_us_F[scored_from:].sum()) * 1e-6,
            "dispatch_seconds": self.dispatch_seconds(scored_from),
            # The share of passes (and of prefill passes) that ran lp dispatch.
            "lp_pass_fraction": _mean(lp_F.astype(np.float64)) if lp_F is not None else None,
            "lp_prefill_fraction": (
                _mean(lp_F[is_prefill_F[scored_from:]].astype(np.float64)) if lp_F is not None else None
            ),
            "transfer_seconds": float(sum(e.transfer_seconds for e in applied)),
            "stall_seconds": float(sum(e.stall_seconds for e in applied)),
            "interference_seconds": float(sum(e.interference_seconds for e in applied)),
            "total_seconds": total,
            "speedup_vs_none": baseline.total_seconds(scored_from) / total if total > 0 else float("nan"),
            "rebalances_applied": len(applied),
            "rebalances_skipped": len(events) - len(applied),
            "experts_moved": int(sum(e.experts_moved_across_gpus for e in applied)),
            "experts_moved_across_nodes": int(sum(e.experts_moved_across_nodes for e in applied)),
            "experts_moved_per_rebalance": (
                float(np.mean([e.experts_moved_across_gpus for e in applied])) if applied else 0.0
            ),
            "bytes_moved": bytes_moved,
            "bytes_moved_per_1000_passes": bytes_moved * 1000.0 / max(bal.size, 1),
            "switch_delay_steps_mean": float(np.mean(delays)) if delays else 0.0,
            # None when no applied plan served a whole window (NaN would not compare equal to itself).
            "prediction_error_mean": errors["all"]["mean_abs"],
            "prediction_bias_mean": errors["all"]["bias"],
            "prediction_error_summed_mean": float(np.abs(error_summed).mean()) if error_summed.size else None,
            "predictions_checked": errors["all"]["plans"],
            # The same over the plans no domain shift hit, and how many one hit (of the trace's
            # recorded shifts: a recorded trace has none, so every plan counts as not hit).
            "prediction_error_no_shift_mean": errors["no_shift"]["mean_abs"],
            "prediction_bias_no_shift_mean": errors["no_shift"]["bias"],
            "predictions_shift_hit": errors["shift_hit"]["plans"],
            "solve_seconds_total": float(solve.sum()),
            "solve_seconds_mean": _mean(solve) if solve.size else 0.0,
            "solve_seconds_max": float(solve.max(initial=0.0)),
            "eval_seconds": self.eval_seconds,
            "apply_seconds": self.apply_seconds,
        }


def format_bytes(num_bytes: float) -> str:
    """``1.2 TB``, ``340.0 GB``, ``12.3 MB``... (decimal units, as bandwidths are quoted)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{int(num_bytes)} B"


def format_table(rows: Sequence[Sequence[str]]) -> str:
    """Rows of cells (the first the header) as aligned text: first column left, others right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _mean(values: np.ndarray) -> float:
    return float(values.mean()) if values.size else float("nan")


@dataclass(kw_only=True)
class SimulationResult:
    """All runs of one simulation, with the no-balancing baseline they are compared to."""

    config: dict[str, Any]
    runs: list[RunResult]
    baseline: RunResult
    is_prefill_F: np.ndarray
    """bool [F]: prefill steps of the simulated trace."""
    scored_from: int
    """First scored step: the first that can run on a rebalanced placement (0 when none can).

    Steps before it run on the initial placement in every run, so they are left out of the
    summaries, as in "plan on window i, score on window i+1"."""
    trace_meta: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def summaries(self) -> list[dict[str, Any]]:
        shifts = self.trace_meta.get("domain_change_steps", ())
        return [run.summary(self.baseline, self.is_prefill_F, self.scored_from, shifts) for run in self.runs]

    def run(self, name: str) -> RunResult:
        for r in self.runs:
            if r.spec.name == name:
                return r
        raise KeyError(name)

    def to_dict(self, timeline: bool = True) -> dict[str, Any]:
        """JSON-ready results; ``timeline`` adds per-step balancedness and MoE time of every run."""
        out: dict[str, Any] = {
            "config": self.config,
            "trace": self.trace_meta,
            "steps": int(self.is_prefill_F.size),
            "prefill_steps": int(self.is_prefill_F.sum()),
            "scored_from": self.scored_from,
            "baseline": self.baseline.spec.name,
            "notes": list(self.notes),
            "runs": self.summaries(),
            "rebalances": {r.spec.name: [asdict(e) for e in r.events] for r in self.runs},
        }
        if timeline:
            out["timeline"] = {
                r.spec.name: {
                    "balancedness": np.round(r.balancedness_F, 5).tolist(),
                    "moe_us": np.round(r.moe_us_F, 1).tolist(),
                }
                for r in self.runs
            }
        return out

    def table(self) -> str:
        """The terminal table: one row per run."""
        header = (
            "run",
            "bal mean",
            "bal p5",
            "bal prefill",
            "speed-up",
            "rebal",
            "experts moved",
            "moved",
            "stall s",
            "interf. s",
            "dispatch s",
            "solve s/rebal",
        )
        rows = [header]
        for s in self.summaries():
            rows.append(
                (
                    s["name"],
                    f"{s['balancedness_mean']:.3f}",
                    f"{s['balancedness_p5']:.3f}",
                    f"{s['balancedness_prefill_mean']:.3f}",
                    f"{s['speedup_vs_none']:.3f}x",
                    f"{s['rebalances_applied']}/{s['rebalances_applied'] + s['rebalances_skipped']}",
                    f"{s['experts_moved']}",
                    format_bytes(s["bytes_moved"]),
                    f"{s['stall_seconds']:.2f}",
                    f"{s['interference_seconds']:.2f}",
                    f"{s['dispatch_seconds']:.2f}",
                    f"{s['solve_seconds_mean']:.3f}",
                )
            )
        return format_table(rows)
