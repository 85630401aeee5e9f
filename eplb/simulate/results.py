"""What a simulation returns: per-run timelines, rebalance events, summaries, the terminal table.

Shape legend: T steps, L layers, G GPUs.
"""

from __future__ import annotations

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
    changed_slots: int = 0
    experts_moved_across_gpus: int = 0
    experts_moved_across_nodes: int = 0
    bytes_moved: int = 0
    """Bytes of expert weights that crossed GPUs."""
    window_balancedness: float = float("nan")
    """Balancedness of the window under the placement in use when the plan was made."""
    predicted_balancedness: float | None = None


@dataclass(kw_only=True)
class RunResult:
    """The timeline of one simulated configuration."""

    spec: RunSpec
    balancedness_T: np.ndarray
    """float64 [T]: model balancedness (mean over layers of mean/max GPU load) of each step."""
    moe_us_T: np.ndarray
    """float64 [T]: modeled MoE time of each step, µs (sum over layers of the busiest GPU)."""
    relative_load_LG: np.ndarray
    """float64 [L, G]: per-step GPU load / layer mean, averaged over the scored steps."""
    events: list[RebalanceEvent] = field(default_factory=list)
    final_placement: Placement | None = None
    eval_seconds: float = 0.0
    """Wall time spent evaluating load under placements (not planning)."""
    apply_seconds: float = 0.0
    """Wall time spent diffing applied plans and building their dispatch matrices (static maps)."""

    @property
    def transfer_seconds(self) -> float:
        return float(sum(e.transfer_seconds for e in self.events))

    def total_seconds(self, scored_from: int = 0) -> float:
        """Modeled MoE time of steps ``scored_from`` onwards plus every rebalance stall, seconds."""
        return float(self.moe_us_T[scored_from:].sum()) * 1e-6 + self.transfer_seconds

    def summary(self, baseline: RunResult, is_prefill_T: np.ndarray, scored_from: int = 0) -> dict[str, Any]:
        """Figures over the scored steps (from ``scored_from``), compared with ``baseline``."""
        applied = [e for e in self.events if e.applied]
        solve = np.array([e.solve_seconds for e in self.events], dtype=np.float64)
        bal = self.balancedness_T[scored_from:]
        prefill_bal = bal[is_prefill_T[scored_from:]]
        total = self.total_seconds(scored_from)
        return {
            "name": self.spec.name,
            "algorithm": self.spec.algorithm,
            "dispatch": self.spec.dispatch,
            "balancedness_mean": _mean(bal),
            "balancedness_p5": float(np.percentile(bal, 5)) if bal.size else float("nan"),
            "balancedness_prefill_mean": _mean(prefill_bal),
            "moe_seconds": float(self.moe_us_T[scored_from:].sum()) * 1e-6,
            "transfer_seconds": self.transfer_seconds,
            "total_seconds": total,
            "speedup_vs_none": baseline.total_seconds(scored_from) / total if total > 0 else float("nan"),
            "rebalances_applied": len(applied),
            "rebalances_skipped": len(self.events) - len(applied),
            "experts_moved": int(sum(e.experts_moved_across_gpus for e in applied)),
            "experts_moved_across_nodes": int(sum(e.experts_moved_across_nodes for e in applied)),
            "experts_moved_per_rebalance": (
                float(np.mean([e.experts_moved_across_gpus for e in applied])) if applied else 0.0
            ),
            "bytes_moved": int(sum(e.bytes_moved for e in applied)),
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


def _mean(values: np.ndarray) -> float:
    return float(values.mean()) if values.size else float("nan")


@dataclass(kw_only=True)
class SimulationResult:
    """All runs of one simulation, with the no-balancing baseline they are compared to."""

    config: dict[str, Any]
    runs: list[RunResult]
    baseline: RunResult
    is_prefill_T: np.ndarray
    """bool [T]: prefill steps of the simulated trace."""
    scored_from: int
    """First scored step: the first that can run on a rebalanced placement (0 when none can).

    Steps before it run on the initial placement in every run, so they are left out of the
    summaries, as in "plan on window i, score on window i+1"."""
    trace_meta: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def summaries(self) -> list[dict[str, Any]]:
        return [run.summary(self.baseline, self.is_prefill_T, self.scored_from) for run in self.runs]

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
            "steps": int(self.is_prefill_T.size),
            "prefill_steps": int(self.is_prefill_T.sum()),
            "scored_from": self.scored_from,
            "baseline": self.baseline.spec.name,
            "notes": list(self.notes),
            "runs": self.summaries(),
            "rebalances": {r.spec.name: [asdict(e) for e in r.events] for r in self.runs},
        }
        if timeline:
            out["timeline"] = {
                r.spec.name: {
                    "balancedness": np.round(r.balancedness_T, 5).tolist(),
                    "moe_us": np.round(r.moe_us_T, 1).tolist(),
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
                    f"{s['transfer_seconds']:.2f}",
                    f"{s['solve_seconds_mean']:.3f}",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = [
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
            for r in rows
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)
