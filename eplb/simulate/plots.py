"""PNG plots of a simulation (matplotlib, imported only here and only when plots are asked for).

Shape legend: F steps, L layers, G GPUs.

- ``balancedness.png``: balancedness of prefill steps over time per run (rolling mean), with
  the rebalance steps marked;
- ``load_heatmap.png``: (layer x GPU) load relative to the layer's mean, no balancing vs each run;
- ``balance_vs_migration.png``: balancedness against expert copies moved, one point per run;
- ``tradeoff.png`` (:func:`write_tradeoff_plot`, from ``eplb.simulate.tradeoff`` rows): prefill
  balancedness and modeled speed-up against bytes moved per 1000 passes, periodic vs continuous.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from eplb.fileio import atomic_path
from eplb.simulate.results import SimulationResult

MAX_HEATMAPS = 4
"""Runs shown next to the baseline in the heatmap figure (the first ones given)."""


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(result: SimulationResult, out_dir: str | Path) -> list[Path]:
    """Write the three PNGs into ``out_dir`` (created if needed); returns their paths."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [
        _balancedness_over_time(plt, result, out / "balancedness.png"),
        _load_heatmaps(plt, result, out / "load_heatmap.png"),
        _balance_vs_migration(plt, result, out / "balance_vs_migration.png"),
    ]
    plt.close("all")
    return paths


def rolling_mean(values_F: np.ndarray, width: int) -> np.ndarray:
    """float64 [F - width + 1]: mean of every ``width`` consecutive values (``width`` >= 1)."""
    cumsum = np.concatenate([[0.0], np.cumsum(values_F, dtype=np.float64)])
    return (cumsum[width:] - cumsum[:-width]) / width


def _runs_with_baseline(result: SimulationResult) -> list[Any]:
    return [result.baseline, *[r for r in result.runs if r is not result.baseline]]


def _balancedness_over_time(plt: Any, result: SimulationResult, path: Path) -> Path:
    prefill_F = result.is_prefill_F
    steps = np.flatnonzero(prefill_F) if prefill_F.any() else np.arange(prefill_F.size)
    width = int(np.clip(len(steps) // 60, 1, 50))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for run in _runs_with_baseline(result):
        smooth = rolling_mean(run.balancedness_F[steps], width)
        ax.plot(steps[width - 1 :], smooth, label=run.spec.name, linewidth=1.2)
    for run in result.runs:
        applied = [e.step for e in run.events if e.applied]
        if applied:
            for step in applied:
                ax.axvline(step, color="grey", linewidth=0.5, linestyle=":")
            break
    ax.set_xlabel("step (dotted: rebalances)")
    ax.set_ylabel("balancedness (mean/max GPU load)")
    kind = "prefill steps" if prefill_F.any() else "all steps"
    ax.set_title(f"Balancedness over time, {kind}, rolling mean of {width}")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    with atomic_path(path, parents=True) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    return path


def _load_heatmaps(plt: Any, result: SimulationResult, path: Path) -> Path:
    from matplotlib.ticker import MaxNLocator

    runs = _runs_with_baseline(result)[: MAX_HEATMAPS + 1]
    vmax = max(float(r.relative_load_LG.max()) for r in runs)
    fig, axes = plt.subplots(1, len(runs), figsize=(3.2 * len(runs) + 1, 4.5), squeeze=False)
    image = None
    for ax, run in zip(axes[0], runs, strict=True):
        image = ax.imshow(
            run.relative_load_LG, aspect="auto", cmap="magma", vmin=0.0, vmax=vmax, interpolation="nearest"
        )
        ax.set_title(run.spec.name, fontsize=9)
        ax.set_xlabel("GPU")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0][0].set_ylabel("MoE layer")
    fig.colorbar(image, ax=axes[0].tolist(), label="GPU load / layer mean (per step, averaged)")
    fig.suptitle(f"Load per layer and GPU, steps {result.scored_from}..{result.is_prefill_F.size - 1}")
    with atomic_path(path, parents=True) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    return path


def _balance_vs_migration(plt: Any, result: SimulationResult, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    summaries = {s["name"]: s for s in result.summaries()}
    baseline = result.baseline.summary(result.baseline, result.is_prefill_F, result.scored_from)
    summaries.setdefault(baseline["name"], baseline)
    for name, s in summaries.items():
        x, y = s["experts_moved_per_rebalance"], s["balancedness_prefill_mean"]
        ax.scatter([x], [y], s=45, label=f"{name}: {s['speedup_vs_none']:.3f}x")
    ax.set_xlabel("expert copies moved across GPUs per rebalance")
    ax.set_ylabel("balancedness, prefill steps (mean)")
    ax.set_title("Balance vs migration")
    ax.grid(alpha=0.3)
    ax.legend(title="modeled speed-up vs no balancing", fontsize=8, title_fontsize=8, loc="lower right")
    fig.tight_layout()
    with atomic_path(path, parents=True) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    return path


def write_tradeoff_plot(rows: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Two panels against bytes moved per 1000 passes (log scale): prefill balancedness, speed-up.

    One line per periodic algorithm (points labelled with their interval) and per continuous
    algorithm and interval (points labelled with their budget).
    """
    plt = _pyplot()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.4))
    series: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        name = f"{row['algorithm']}, {row['mode']}"
        if row["mode"] == "continuous":
            name += f" every {row['interval']}"
        series.setdefault(name, []).append(row)
    for name, group in series.items():
        mode = group[0]["mode"]
        group = sorted(group, key=lambda r: r["bytes_moved_per_1000_passes"])
        x = [max(r["bytes_moved_per_1000_passes"], 1.0) / 1e9 for r in group]
        marker = "o" if mode == "periodic" else "s"
        for ax, key in zip(axes, ("balancedness_prefill_mean", "speedup_vs_none"), strict=True):
            y = [r[key] for r in group]
            ax.plot(x, y, marker=marker, label=name)
            for xi, yi, r in zip(x, y, group, strict=True):
                tag = f"every {r['interval']}" if mode == "periodic" else f"{r['budget']} copies"
                ax.annotate(tag, (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
    for ax, ylabel in zip(
        axes, ("balancedness, prefill passes (mean)", "modeled MoE speed-up vs none"), strict=True
    ):
        ax.set_xscale("log")
        ax.set_xlabel("GB moved across GPUs per 1000 passes")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 3), fontsize=8)
    fig.suptitle(title or "Balance and speed-up against weight traffic")
    fig.tight_layout(rect=(0, 0.04 * (1 + (len(labels) - 1) // 3), 1, 1))
    with atomic_path(out, parents=True) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return out
