"""The Grafana expert-load dashboard as a JSON-ready dict: panels, variables, annotations.

Grafana's JSON model is verbose and a hand-edited file drifts from the metrics; building it here
from ``eplb.metrics.names`` keeps every query on the names the exporter uses, and the output is
deterministic (same code, same bytes), so CI can compare it with the committed file. The small
``_target``/``_panel``/``_timeseries``/``_stat``/``_row`` helpers hold Grafana's boilerplate;
the ``_*_panels`` functions lay out one dashboard row each. As vLLM's and SGLang's dashboards do,
the datasource is a variable (``$datasource``, any Prometheus; Grafana's default one first, which
dashboards/provisioning/datasources/eplb.yaml makes the one it adds), and ``$instance`` and
``$model_name`` pick one exporting process: every query selects by both, so one Prometheus can
hold many servers.
"""

from __future__ import annotations

import json
from typing import Any

from eplb.metrics import names as m

DS = {"type": "prometheus", "uid": "${datasource}"}
# One process: its scrape target and the model it serves (single-valued: exact matches, and sums
# over ranks or layers never mix two servers).
SEL = 'instance="$instance",model_name="$model_name"'
RATE = "$__rate_interval"


def _sel(metric: str, *matchers: str) -> str:
    """``metric`` of the selected process, with more label ``matchers``."""
    return f"{metric}{{{','.join([SEL, *matchers])}}}"


def _layers(metric: str) -> str:
    """``metric`` of the selected process and layers."""
    return _sel(metric, 'layer=~"$layer"')


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
            _target(_sel(m.MODEL_BALANCEDNESS), "model"),
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
                _target(_layers(m.LAYER_BALANCEDNESS), "layer {{layer}}"),
                _target(_sel(m.MODEL_BALANCEDNESS), "model"),
            ],
            **ratio,
        ),
        _timeseries(
            "Last rebalance: before / after",
            "Model balancedness the last rebalance started from and the one it expected or reached.",
            (18, y + 1, 6, 7),
            [_target(_sel(m.LAST_REBALANCE_BALANCEDNESS), "{{when}}")],
            **ratio,
        ),
    ]


def _load_panels(y: int) -> list[dict]:
    tokens = _layers(m.RANK_TOKENS)
    relative = f"{tokens} / on (layer) group_left () avg by (layer) ({tokens})"
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
        # Label values are strings: as numbers, rank 10 sorts after rank 9, not after rank 1.
        {
            "id": "convertFieldType",
            "options": {
                "conversions": [
                    {"targetField": "layer", "destinationType": "number"},
                    {"targetField": "rank", "destinationType": "number"},
                ],
                "fields": {},
            },
        },
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
                f"sort_desc(topk(16, {_layers(m.HOT_EXPERT_TOKENS)}))",
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
        [_target(f"sort(bottomk(8, {_layers(m.LAYER_BALANCEDNESS)}))", "layer {{layer}}", instant=True)],
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
        [_target(f"sum by (rank) ({_layers(m.RANK_TOKENS)})", "rank {{rank}}")],
        unit="short",
        min=0,
    )
    return [_row("Expert load", y), heatmap, hot, worst, ranks]


def _rebalance_panels(y: int) -> list[dict]:
    timing = [
        _target(
            f"histogram_quantile({q}, sum by (le) (rate({_sel(metric + '_bucket')}[{RATE}])))",
            f"{what} p{pct}",
        )
        for what, metric in (("solve", m.SOLVE_SECONDS), ("transfer", m.TRANSFER_SECONDS))
        for q, pct in (("0.5", 50), ("0.99", 99))
    ]
    return [
        _row("Rebalancing", y),
        _timeseries(
            "Rebalances",
            "Rebalances decided per interval, by cause: applied, skipped_* (why nothing was moved), "
            "failed_* (what went wrong; rolled back). The manager's log has each one's full reason.",
            (0, y + 1, 8, 8),
            # Only causes that happened: 14 series of zeros would bury the few that did.
            [
                _target(
                    f"sum by (cause) (increase({_sel(m.REBALANCES)}[{RATE}])) "
                    f"and on (cause) (sum by (cause) ({_sel(m.REBALANCES)}) > 0)",
                    "{{cause}}",
                )
            ],
            unit="short",
            min=0,
            bars=True,
        ),
        _timeseries(
            "Expert weights moved",
            "Bytes per second of expert weights moved between GPUs, and experts moved per interval.",
            (8, y + 1, 8, 8),
            [
                _target(f"rate({_sel(m.MOVED_BYTES)}[{RATE}])", "bytes/s"),
                _target(f"increase({_sel(m.EXPERTS_MOVED)}[{RATE}])", "experts moved"),
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


def _rebalancer_panels(y: int) -> list[dict]:
    phase = _stat(
        "Manager phase",
        "What the rebalance manager does now: idle, solving (rank 0, in the background), applying "
        "(a chunk of layers per pass) or stopped (for good; its log says why).",
        (0, y + 1, 6, 6),
        _target(f"{_sel(m.MANAGER_PHASE)} == 1", "{{phase}}"),
    )
    phase["options"]["textMode"] = "name"
    phase["options"]["graphMode"] = "none"
    return [
        _row("Rebalancer health", y),
        phase,
        _timeseries(
            "Rebalance in flight",
            "Seconds the rebalance in progress (solve, agreement, transfer) has been in flight, 0 "
            "between rebalances; past the watchdog's bound it is ended (failed_watchdog) and the "
            "manager's log names the phase. Grows while the manager is blocked.",
            (6, y + 1, 12, 6),
            [_target(_sel(m.IN_FLIGHT_SECONDS), "in flight")],
            unit="s",
            min=0,
        ),
        _stat(
            "Since the last rebalance",
            "Seconds since the last rebalance ended (any outcome); growing past the rebalance "
            "interval means the rebalancer stalls or stopped.",
            (18, y + 1, 6, 6),
            _target(_sel(m.LAST_REBALANCE_AGE), "age"),
            unit="s",
        ),
    ]


def _recorder_panels(y: int) -> list[dict]:
    recorded = _sel(m.FORWARD_PASSES, 'recorded="true"')
    topology = _panel(
        "table",
        "Topology",
        "eplb version and the served topology, from eplb_info.",
        (12, y + 1, 12, 6),
        [_target(_sel(m.INFO), instant=True, table=True)],
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
                _target(f"sum by (kind) (rate({_sel(m.FORWARD_PASSES)}[{RATE}]))", "{{kind}} passes/s"),
                _target(
                    f"sum(rate({recorded}[{RATE}])) / sum(rate({_sel(m.FORWARD_PASSES)}[{RATE}]))",
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
            _target(f"time() - {_sel(m.WINDOW_TIMESTAMP)}", "age"),
            unit="s",
        ),
        topology,
    ]


def _query_variable(name: str, label: str, query: str, *, multi: bool) -> dict:
    variable: dict[str, Any] = {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "query": query,
        "definition": query,
        "refresh": 2,  # on time range change: a server that came up shows without a reload
        "sort": 3 if multi else 1,  # layers numerically, names alphabetically
        "multi": multi,
        "includeAll": multi,
    }
    if multi:
        variable.update(allValue=".*", current={"selected": True, "text": ["All"], "value": ["$__all"]})
    else:
        variable["current"] = {}  # the first value Grafana finds
    return variable


def _variables() -> list[dict]:
    """The datasource, then one process (instance, model), then its layers: each narrows the next."""
    datasource = {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},  # Grafana's default Prometheus (the provisioned one is made the default)
        "refresh": 1,
        "regex": "",
        "hide": 0,
        "multi": False,
        "includeAll": False,
    }
    return [
        datasource,
        _query_variable("instance", "Instance", f"label_values({m.INFO}, instance)", multi=False),
        _query_variable(
            "model_name", "Model", f'label_values({m.INFO}{{instance="$instance"}}, model_name)', multi=False
        ),
        _query_variable("layer", "Layer", f"label_values({_sel(m.LAYER_BALANCEDNESS)}, layer)", multi=True),
    ]


def build_dashboard() -> dict:
    """The dashboard as a JSON-ready dict (deterministic: same input, same bytes)."""
    panels = [
        *_balance_panels(0),
        *_load_panels(8),
        *_rebalance_panels(40),
        *_rebalancer_panels(49),
        *_recorder_panels(56),
    ]
    for i, panel in enumerate(panels, start=1):
        panel["id"] = i
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
        "templating": {"list": _variables()},
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
                    "expr": f"{_sel(m.LAST_REBALANCE_TIMESTAMP)} * 1000",
                    "step": "15s",
                    "useValueForTime": True,
                    "titleFormat": "rebalance {{outcome}}",
                    "textFormat": "{{cause}}",
                    "tagKeys": "outcome,cause",
                },
            ]
        },
        "panels": panels,
    }


def render(dashboard: dict) -> str:
    """The dashboard file's text: indented JSON with a final newline."""
    return json.dumps(dashboard, indent=2) + "\n"
