"""The Grafana expert-load dashboard as a JSON-ready dict: panels, the layer variable, annotations.

Grafana's JSON model is verbose and a hand-edited file drifts from the metrics; building it here
from ``eplb.metrics.names`` keeps every query on the names the exporter uses, and the output is
deterministic (same code, same bytes), so CI can compare it with the committed file. The small
``_target``/``_panel``/``_timeseries``/``_stat``/``_row`` helpers hold Grafana's boilerplate;
the ``_*_panels`` functions lay out one dashboard row each. The datasource uid matches
dashboards/provisioning/datasources/eplb.yaml, so Grafana provisioned from this folder shows
the dashboard with no clicking.
"""

from __future__ import annotations

import json
from typing import Any

from eplb.metrics import names as m

DATASOURCE_UID = "eplb-prometheus"
DS = {"type": "prometheus", "uid": DATASOURCE_UID}
LAYER = 'layer=~"$layer"'
RATE = "$__rate_interval"


def _target(
    expr: str, legend: str = "", *, ref: str = "A", instant: bool = False, table: bool = False
) -> dict:
    target: dict[str, Any] = {
        "datasource": DS,
        "refId": ref,
        "expr": expr,
        "legendFormat": legend or "__auto",
    }
    target.update({"instant": instant, "range": not instant})
    if table:
        target["format"] = "table"
    return target


def _panel(
    kind: str, title: str, description: str, grid: tuple[int, int, int, int], targets: list[dict]
) -> dict:
    x, y, w, h = grid
    refs = "ABCDEFGH"
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "targets": [dict(t, refId=refs[i]) for i, t in enumerate(targets)],
        "fieldConfig": {"defaults": {}, "overrides": []},
        "options": {},
    }


def _timeseries(
    title: str, description: str, grid: tuple[int, int, int, int], targets: list[dict], **defaults: Any
) -> dict:
    panel = _panel("timeseries", title, description, grid, targets)
    bars = defaults.pop("bars", False)
    right_axis: dict[str, str] = defaults.pop("right_axis", {})
    # Series named here get their own unit on a right-hand axis.
    panel["fieldConfig"]["overrides"] = [
        {
            "matcher": {"id": "byName", "options": name},
            "properties": [{"id": "unit", "value": unit}, {"id": "custom.axisPlacement", "value": "right"}],
        }
        for name, unit in right_axis.items()
    ]
    panel["fieldConfig"]["defaults"] = {
        "custom": {
            "drawStyle": "bars" if bars else "line",
            "lineWidth": 1,
            "fillOpacity": 60 if bars else 10,
            "showPoints": "never",
            "spanNulls": True,
        },
        **defaults,
    }
    panel["options"] = {
        "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
        "tooltip": {"mode": "multi", "sort": "desc"},
    }
    return panel


def _stat(
    title: str, description: str, grid: tuple[int, int, int, int], target: dict, **defaults: Any
) -> dict:
    panel = _panel("stat", title, description, grid, [target])
    panel["fieldConfig"]["defaults"] = defaults
    panel["options"] = {
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        "colorMode": "value",
        "graphMode": "area",
    }
    return panel


def _row(title: str, y: int) -> dict:
    return {
        "type": "row",
        "title": title,
        "collapsed": False,
        "gridPos": {"x": 0, "y": y, "w": 24, "h": 1},
        "panels": [],
    }


def _balance_panels(y: int) -> list[dict]:
    ratio = {"unit": "percentunit", "min": 0, "max": 1, "decimals": 3}
    return [
        _row("Balance", y),
        _stat(
            "Model balancedness",
            "Mean over max GPU load, averaged over layers, over the last window (1 is perfect).",
            (0, y + 1, 6, 7),
            _target(m.MODEL_BALANCEDNESS, "model"),
            **ratio,
            thresholds={
                "mode": "absolute",
                "steps": [
                    {"color": "red", "value": None},
                    {"color": "orange", "value": 0.7},
                    {"color": "green", "value": 0.9},
                ],
            },
        ),
        _timeseries(
            "Balancedness per layer",
            "Mean over max GPU load of each selected layer over the last window, under the live placement.",
            (6, y + 1, 12, 7),
            [
                _target(f"{m.LAYER_BALANCEDNESS}{{{LAYER}}}", "layer {{layer}}"),
                _target(m.MODEL_BALANCEDNESS, "model"),
            ],
            **ratio,
        ),
        _timeseries(
            "Last rebalance: before / after",
            "Model balancedness the last rebalance started from and the one it expected or reached.",
            (18, y + 1, 6, 7),
            [_target(m.LAST_REBALANCE_BALANCEDNESS, "{{when}}")],
            **ratio,
        ),
    ]


def _load_panels(y: int) -> list[dict]:
    relative = (
        f"{m.RANK_TOKENS}{{{LAYER}}} / on (layer) group_left () avg by (layer) ({m.RANK_TOKENS}{{{LAYER}}})"
    )
    heatmap = _panel(
        "table",
        "Load per layer x rank (relative to the layer mean)",
        "Tokens each EP rank received in each layer over the last window, divided by the layer's mean; "
        "1.0 is fair share, the reddest cell is the rank every MoE layer waits for.",
        (0, y + 1, 24, 12),
        [_target(relative, ref="A", instant=True, table=True)],
    )
    heatmap["fieldConfig"]["defaults"] = {
        "unit": "none",
        "decimals": 2,
        "min": 0,
        "max": 2,
        "color": {"mode": "continuous-GrYlRd"},
        "custom": {"align": "center", "cellOptions": {"type": "color-background", "mode": "basic"}},
    }
    heatmap["options"] = {"showHeader": True, "cellHeight": "sm"}
    heatmap["transformations"] = [
        {"id": "sortBy", "options": {"sort": [{"field": "rank"}]}},
        {
            "id": "groupingToMatrix",
            "options": {"columnField": "rank", "rowField": "layer", "valueField": "Value"},
        },
        {"id": "sortBy", "options": {"sort": [{"field": "layer\\rank"}]}},
    ]
    hot = _panel(
        "bargauge",
        "Hottest experts",
        "Logical experts with the most tokens over the last window (top K per layer exported; the 16 largest shown).",
        (0, y + 13, 12, 10),
        [
            _target(
                f"sort_desc(topk(16, {m.HOT_EXPERT_TOKENS}{{{LAYER}}}))",
                "layer {{layer}} expert {{expert}}",
                instant=True,
            )
        ],
    )
    hot["fieldConfig"]["defaults"] = {"unit": "short", "min": 0, "color": {"mode": "continuous-BlYlRd"}}
    hot["options"] = {
        "orientation": "horizontal",
        "displayMode": "gradient",
        "showUnfilled": True,
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
    }
    worst = _panel(
        "bargauge",
        "Least balanced layers",
        "The 8 selected layers with the lowest balancedness over the last window.",
        (12, y + 13, 12, 10),
        [_target(f"sort(bottomk(8, {m.LAYER_BALANCEDNESS}{{{LAYER}}}))", "layer {{layer}}", instant=True)],
    )
    worst["fieldConfig"]["defaults"] = {
        "unit": "percentunit",
        "min": 0,
        "max": 1,
        "color": {"mode": "continuous-RdYlGr"},
    }
    worst["options"] = hot["options"]
    ranks = _timeseries(
        "Tokens per rank over time (selected layers)",
        "Tokens each EP rank received over the last window, summed over the selected layers.",
        (0, y + 23, 24, 8),
        [_target(f"sum by (rank) ({m.RANK_TOKENS}{{{LAYER}}})", "rank {{rank}}")],
        unit="short",
        min=0,
    )
    return [_row("Expert load", y), heatmap, hot, worst, ranks]


def _rebalance_panels(y: int) -> list[dict]:
    timing = [
        _target(f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket[{RATE}])))", f"{what} p{pct}")
        for what, metric in (("solve", m.SOLVE_SECONDS), ("transfer", m.TRANSFER_SECONDS))
        for q, pct in (("0.5", 50), ("0.99", 99))
    ]
    return [
        _row("Rebalancing", y),
        _timeseries(
            "Rebalances",
            "Rebalances decided per interval, by outcome (applied, skipped, failed).",
            (0, y + 1, 8, 8),
            [_target(f"sum by (outcome) (increase({m.REBALANCES}[{RATE}]))", "{{outcome}}")],
            unit="short",
            min=0,
            bars=True,
        ),
        _timeseries(
            "Expert weights moved",
            "Bytes per second of expert weights moved between GPUs, and experts moved per interval.",
            (8, y + 1, 8, 8),
            [
                _target(f"rate({m.MOVED_BYTES}[{RATE}])", "bytes/s"),
                _target(f"increase({m.EXPERTS_MOVED}[{RATE}])", "experts moved"),
            ],
            unit="Bps",
            min=0,
            right_axis={"experts moved": "short"},
        ),
        _timeseries(
            "Solve and transfer time",
            "Quantiles of the placement solve and the weight transfer of rebalances in each interval.",
            (16, y + 1, 8, 8),
            timing,
            unit="s",
            min=0,
        ),
    ]


def _recorder_panels(y: int) -> list[dict]:
    topology = _panel(
        "table",
        "Topology",
        "eplb version and the served topology, from eplb_info.",
        (12, y + 1, 12, 6),
        [_target(m.INFO, instant=True, table=True)],
    )
    topology["transformations"] = [
        {
            "id": "organize",
            "options": {
                "excludeByName": {
                    "Time": True,
                    "Value": True,
                    "__name__": True,
                    "instance": True,
                    "job": True,
                }
            },
        }
    ]
    return [
        _row("Recorder and topology", y),
        _timeseries(
            "Forward passes",
            "Forward passes per second by kind, and the share the recorder counted.",
            (0, y + 1, 8, 6),
            [
                _target(f"sum by (kind) (rate({m.FORWARD_PASSES}[{RATE}]))", "{{kind}} passes/s"),
                _target(
                    f'sum(rate({m.FORWARD_PASSES}{{recorded="true"}}[{RATE}])) / sum(rate({m.FORWARD_PASSES}[{RATE}]))',
                    "recorded share",
                ),
            ],
            unit="short",
            min=0,
            right_axis={"recorded share": "percentunit"},
        ),
        _stat(
            "Window age",
            "Seconds since the manager last handed over a load window.",
            (8, y + 1, 4, 6),
            _target(f"time() - {m.WINDOW_TIMESTAMP}", "age"),
            unit="s",
        ),
        topology,
    ]


def build_dashboard() -> dict:
    """The dashboard as a JSON-ready dict (deterministic: same input, same bytes)."""
    panels = [*_balance_panels(0), *_load_panels(8), *_rebalance_panels(40), *_recorder_panels(49)]
    for i, panel in enumerate(panels, start=1):
        panel["id"] = i
    layer_query = f"label_values({m.LAYER_BALANCEDNESS}, layer)"
    return {
        "uid": "eplb-expert-load",
        "title": "EPLB expert load",
        "description": "Expert-parallel load balancing: balancedness, (layer x rank) load, hottest experts, rebalances.",
        "tags": ["eplb", "moe"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "schemaVersion": 39,
        "version": 1,
        "templating": {
            "list": [
                {
                    "name": "layer",
                    "label": "Layer",
                    "type": "query",
                    "datasource": DS,
                    "query": layer_query,
                    "definition": layer_query,
                    "refresh": 2,
                    "sort": 3,
                    "multi": True,
                    "includeAll": True,
                    "allValue": ".*",
                    "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
                }
            ]
        },
        "annotations": {
            "list": [
                {
                    "name": "Annotations & Alerts",
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "type": "dashboard",
                },
                {
                    # The value is the rebalance's own time (ms), so each rebalance is one event.
                    "name": "Rebalances",
                    "datasource": DS,
                    "enable": True,
                    "iconColor": "orange",
                    "expr": f"{m.LAST_REBALANCE_TIMESTAMP} * 1000",
                    "step": "15s",
                    "useValueForTime": True,
                    "titleFormat": "rebalance {{outcome}}",
                    "textFormat": "{{reason}}",
                    "tagKeys": "outcome",
                },
            ]
        },
        "panels": panels,
    }


def render(dashboard: dict) -> str:
    """The dashboard file's text: indented JSON with a final newline."""
    return json.dumps(dashboard, indent=2) + "\n"
