"""Render the dashboard's panels to a PNG from real query results (docs/img/observability-dashboard.png).

Starts ``eplb demo --metrics-port 0`` and a local Prometheus scraping it (dashboards/promstack.py),
lets them run, then evaluates every panel's PromQL of the generated dashboard through Prometheus'
HTTP API and draws each panel with matplotlib the way Grafana shows it: time series as lines with
the rebalance annotations as vertical lines, the (layer x rank) table as a heatmap, bar gauges as
bars, stats as numbers. No Grafana needed; the numbers are the ones Grafana would show.

    python dashboards/snapshot.py --seconds 150 --out docs/img/observability-dashboard.png
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import panels
import promstack

REPO = Path(__file__).resolve().parents[1]


def _legend(fmt: str, labels: dict[str, str]) -> str:
    if fmt in ("", "__auto"):
        return ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "__name__") or "value"
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)


def fetch(prom: promstack.LocalPrometheus, dashboard: dict, start: float, end: float, step: float) -> dict:
    """Every panel's query results (range or instant, as the panel asks), plus the annotation times."""
    rate = f"{round(4 * step)}s"
    chosen = prom.variables(dashboard)
    panels = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        results = []
        for target in panel["targets"]:
            expr = promstack.expand(target["expr"], rate_interval=rate, **chosen)
            if target["instant"]:
                data = prom.api("query", query=expr, time=end)
            else:
                data = prom.api("query_range", query=expr, start=start, end=end, step=step)
            results.append({"legend": target["legendFormat"], "expr": expr, "result": data["result"]})
        panels.append(
            {"title": panel["title"], "type": panel["type"], "unit": _unit(panel), "targets": results}
        )
    annotations = []
    for ann in dashboard["annotations"]["list"]:
        if "expr" in ann:
            expr = promstack.expand(ann["expr"], rate_interval=rate, **chosen)
            data = prom.api("query_range", query=expr, start=start, end=end, step=step)
            for series in data["result"]:
                stamps = {float(v) / 1000 for _, v in series["values"]}
                annotations += [(t, series["metric"].get("outcome", "")) for t in sorted(stamps)]
    return {"start": start, "end": end, "panels": panels, "annotations": annotations}


UNITS = {"percentunit": "ratio", "short": "", "Bps": "bytes/s", "s": "seconds", "none": ""}


def _unit(panel: dict) -> str:
    unit = str(panel.get("fieldConfig", {}).get("defaults", {}).get("unit", ""))
    return UNITS.get(unit, unit)


def plot(snapshot: dict, out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = snapshot["panels"]
    cols = 3
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.4 * rows), squeeze=False)
    t0 = snapshot["start"]
    for ax, panel in zip(axes.ravel(), panels, strict=False):
        ax.set_title(panel["title"], fontsize=10, loc="left")
        kind = panel["type"]
        if kind == "timeseries":
            twin = ax.twinx() if panel.get("right") else None
            for n, target in enumerate(panel["targets"]):
                for series in target["result"]:
                    xs = [float(t) - t0 for t, _ in series["values"]]
                    ys = [float(v) for _, v in series["values"]]
                    label = _legend(target["legend"], series["metric"])
                    # Series Grafana puts on a right-hand axis (their own unit) go on a twin axis here.
                    on = twin if twin is not None and label in panel["right"] else ax
                    on.plot(xs, ys, lw=1, label=label, color=f"C{n}" if twin is not None else None)
            if twin is not None:
                twin.tick_params(labelsize=7)
                twin.set_ylabel(", ".join(panel["right"]), fontsize=7)
            for when, outcome in snapshot["annotations"]:
                ax.axvline(when - t0, color="orange" if outcome == "applied" else "grey", lw=0.6, alpha=0.6)
            handles, labels = ax.get_legend_handles_labels()
            if twin is not None:
                more = twin.get_legend_handles_labels()
                handles, labels = handles + more[0], labels + more[1]
            if 0 < len(handles) <= 8:
                ax.legend(handles, labels, fontsize=6, loc="best")
            ax.set_xlabel("seconds", fontsize=7)
            ax.set_ylabel(panel["unit"], fontsize=7)
        elif kind == "stat":
            values = [float(v) for t in panel["targets"] for s in t["result"] for _, v in s["values"]]
            text = f"{values[-1]:.3f}" if values else "no data"
            ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=28)
            ax.text(0.5, 0.15, panel["unit"], ha="center", fontsize=8)
            ax.set_axis_off()
        elif kind == "bargauge":
            (target,) = panel["targets"]
            labels = [_legend(target["legend"], s["metric"]) for s in target["result"]]
            values = [float(s["value"][1]) for s in target["result"]]
            ax.barh(
                range(len(values)), values, color="tab:red" if "Hottest" in panel["title"] else "tab:green"
            )
            ax.set_yticks(range(len(values)), labels, fontsize=6)
            ax.invert_yaxis()
        elif kind == "table" and "layer x rank" in panel["title"]:
            (target,) = panel["targets"]
            cells = {
                (s["metric"]["layer"], s["metric"]["rank"]): float(s["value"][1]) for s in target["result"]
            }
            layers = sorted({k[0] for k in cells}, key=int)
            ranks = sorted({k[1] for k in cells}, key=int)
            grid = np.array([[cells.get((layer, r), np.nan) for r in ranks] for layer in layers])
            image = ax.imshow(grid.T, aspect="auto", cmap="RdYlGn_r", vmin=0, vmax=2, interpolation="nearest")
            ax.set_xlabel("layer", fontsize=7)
            ax.set_ylabel("rank", fontsize=7)
            ax.set_yticks(range(len(ranks)), ranks, fontsize=6)
            fig.colorbar(image, ax=ax, fraction=0.04, label="tokens / layer mean")
        else:
            (target,) = panel["targets"]
            lines = [
                ", ".join(f"{k}={v}" for k, v in sorted(s["metric"].items()) if k != "__name__")
                for s in target["result"]
            ]
            ax.text(
                0.02, 0.9, "\n".join(lines) or "no data", va="top", fontsize=7, family="monospace", wrap=True
            )
            ax.set_axis_off()
        ax.tick_params(labelsize=7)
    for ax in axes.ravel()[len(panels) :]:
        ax.set_axis_off()
    fig.suptitle(title, fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)


def _title(demo_args: list[str]) -> str:
    return f"EPLB expert load: eplb demo {' '.join(demo_args)} (real Prometheus query results)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seconds", type=float, default=150.0, help="how long the demo runs before the queries"
    )
    parser.add_argument(
        "--scrape-interval", type=float, default=2.0, help="Prometheus scrape interval, seconds"
    )
    parser.add_argument("--out", type=Path, default=REPO / "docs/img/observability-dashboard.png")
    parser.add_argument("--json", type=Path, default=None, help="also write the fetched query results here")
    parser.add_argument("--from-json", type=Path, default=None, help="only redraw results written by --json")
    parser.add_argument(
        "--demo-args",
        default="--nproc 4 --preset mixtral-8x7b --steps 2000 --eplb-rebalance-num-iterations 30",
        help="arguments for eplb demo (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    if args.from_json is not None:
        snapshot = json.loads(args.from_json.read_text())
        plot(snapshot, args.out, _title(snapshot["demo_args"]))
        print(f"wrote {args.out}")
        return 0
    demo_args = [*args.demo_args.split(), "--duration-s", str(args.seconds + 120)]
    dashboard = panels.build_dashboard()
    with (
        promstack.LiveDemo(*demo_args) as demo,
        promstack.LocalPrometheus(f"127.0.0.1:{demo.port}", interval_s=args.scrape_interval) as prom,
    ):
        start = time.time()
        time.sleep(args.seconds)
        snapshot = fetch(prom, dashboard, start, time.time(), args.scrape_interval)
    snapshot["demo_args"] = demo_args
    if args.json is not None:
        args.json.write_text(json.dumps(snapshot) + "\n")
    plot(
        snapshot,
        args.out,
        f"EPLB expert load: eplb demo {' '.join(demo_args)} (real Prometheus query results)",
    )
    empty = [p["title"] for p in snapshot["panels"] if not any(t["result"] for t in p["targets"])]
    print(f"wrote {args.out}; panels without data: {empty or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
