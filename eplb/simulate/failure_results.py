"""What a replay with lost ranks returns: per-run loss events and the figures after each loss.

Shape legend: F steps.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from eplb.simulate.results import RunResult, format_bytes, format_table


@dataclass(frozen=True)
class RankFailure:
    """Ranks lost together at one step (``--rank-failure STEP:RANK``)."""

    step: int
    """First step served without them."""
    ranks: tuple[int, ...]
    """Their EP ranks (start-up numbering), ascending."""


@dataclass(frozen=True, kw_only=True)
class LossEvent:
    """How one run answered one loss."""

    step: int
    ranks: tuple[int, ...]
    live_ranks: int
    """Ranks alive after it."""
    reload_experts: int = 0
    """(layer, expert) pairs whose every replica was on a lost rank."""
    reloads: int = 0
    """(layer, GPU, expert) loads from the reload source."""
    survivor_copies: int = 0
    """(layer, GPU, expert) copies across GPUs from a survivor's replica."""
    kept_slots: int = 0
    changed_slots: int = 0
    bytes_reloaded: int = 0
    bytes_moved: int = 0
    """Bytes copied between survivors."""
    orphaned_load: float = 0.0
    """Share of the window's load on the experts lost with every replica (served only once reloaded)."""
    solve_seconds: float = 0.0
    reason: str = ""


@dataclass(kw_only=True)
class FailureRun:
    """One run's timeline and its loss events."""

    name: str
    kind: str
    """eplb (solve's degraded plan), sglang (SGLang's elasticity_aware) or none (no replanning)."""
    result: RunResult
    losses: list[LossEvent] = field(default_factory=list)
    lost_tokens_F: np.ndarray | None = None
    """float64 [F]: tokens the maps sent to lost ranks at each step (no replanning only)."""


@dataclass(kw_only=True)
class FailureResult:
    """Every run of a replay with lost ranks."""

    config: dict[str, Any]
    failures: list[RankFailure]
    runs: list[FailureRun]
    rebalance_steps: np.ndarray
    """int64 [k]: steps from which a periodic plan serves."""
    tokens_F: np.ndarray
    """float64 [F]: routed tokens of each step."""
    is_prefill_F: np.ndarray
    notes: list[str] = field(default_factory=list)

    def segments(self) -> list[tuple[int, int, int]]:
        """(loss step, the next rebalance's step or the segment's end, the next loss or the trace's end)."""
        F = int(self.is_prefill_F.size)
        out = []
        for k, failure in enumerate(self.failures):
            stop = self.failures[k + 1].step if k + 1 < len(self.failures) else F
            later = self.rebalance_steps[self.rebalance_steps > failure.step]
            out.append((failure.step, int(min(later[0], stop)) if later.size else stop, stop))
        return out

    def summaries(self) -> list[dict[str, Any]]:
        """One row per run and loss: balance after it, bytes reloaded and moved, tokens lost."""
        rows = []
        for run in self.runs:
            bal_F = run.result.balancedness_F
            for (start, until, stop), loss in zip(self.segments(), run.losses, strict=True):
                prefill = self.is_prefill_F[start:stop]
                after = [e for e in run.result.events if start < e.step < stop and e.applied]
                lost = 0.0 if run.lost_tokens_F is None else float(run.lost_tokens_F[start:stop].sum())
                before = slice(self.rebalance_steps[0] if self.rebalance_steps.size else 0, start)
                rows.append(
                    {
                        "name": run.name,
                        "kind": run.kind,
                        "step": start,
                        "ranks": list(loss.ranks),
                        "live_ranks": loss.live_ranks,
                        "balancedness_before": _mean(bal_F[before]),
                        "balancedness_to_rebalance": _mean(bal_F[start:until]),
                        "balancedness_after": _mean(bal_F[start:stop]),
                        "balancedness_after_prefill": _mean(bal_F[start:stop][prefill]),
                        "reload_experts": loss.reload_experts,
                        "orphaned_load": loss.orphaned_load,
                        "bytes_reloaded": loss.bytes_reloaded,
                        "bytes_moved_at_loss": loss.bytes_moved,
                        "bytes_moved_after": int(sum(e.bytes_moved for e in after)),
                        "kept_slots": loss.kept_slots,
                        "tokens_lost_fraction": lost / max(float(self.tokens_F[start:stop].sum()), 1.0),
                        "solve_seconds": loss.solve_seconds,
                    }
                )
        return rows

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "failures": [asdict(f) for f in self.failures],
            "notes": list(self.notes),
            "losses": self.summaries(),
            "events": {r.name: [asdict(e) for e in r.losses] for r in self.runs},
            "rebalances": {r.name: [asdict(e) for e in r.result.events] for r in self.runs},
        }

    def table(self) -> str:
        header = (
            "run",
            "lost at",
            "live",
            "bal to rebal",
            "bal after",
            "bal prefill",
            "reloaded",
            "moved at loss",
            "moved after",
            "tokens lost",
        )
        rows = [header]
        for s in self.summaries():
            rows.append(
                (
                    s["name"],
                    f"{s['step']}:{_ranks_text(s['ranks'])}",
                    str(s["live_ranks"]),
                    f"{s['balancedness_to_rebalance']:.3f}",
                    f"{s['balancedness_after']:.3f}",
                    f"{s['balancedness_after_prefill']:.3f}",
                    format_bytes(s["bytes_reloaded"]),
                    format_bytes(s["bytes_moved_at_loss"]),
                    format_bytes(s["bytes_moved_after"]),
                    f"{100 * s['tokens_lost_fraction']:.1f}%",
                )
            )
        return format_table(rows)


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _mean(values: np.ndarray) -> float:
    return float(values.mean()) if values.size else float("nan")
