"""Checks a Grafana dashboard's PromQL against what eplb exports (``eplb.metrics.names``).

A query that names an unknown metric or label shows an empty panel in Grafana, not an error, so
``generate.py --check`` (run by CI) lists every such query instead: a metric the code does not
define, a label that metric does not have (its own, the engine labels on every series, or the
``instance``/``job`` Prometheus adds), a grouping by a label none of its metrics has, a variable
the dashboard does not define, a multi-value variable matched with anything but ``=~``, a query
naming no eplb metric at all.
The check reads the dashboard's JSON dict only, so it covers hand edits as well as the builder.
Names are found by regular expressions over the query text, not a PromQL parser: the queries
are this project's own, written in the plain shapes these expressions match.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from eplb.metrics import names as m


@dataclass(frozen=True)
class Query:
    """One PromQL expression of the dashboard, with where it comes from."""

    where: str
    """Panel and refId, variable or annotation, for messages and test ids."""
    expr: str
    """The expression as Grafana sends it, before variables are expanded."""
    instant: bool
    """Evaluated at one time (an instant query) rather than over the time range."""


def queries(dashboard: dict) -> list[Query]:
    """Every PromQL expression in the dashboard: panel targets, variable queries, annotations."""
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out.append(
                Query(f"panel {panel['title']!r} {target['refId']}", target["expr"], bool(target["instant"]))
            )
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue  # the datasource variable lists datasources, not series
        inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", var["query"])
        out.append(Query(f"variable ${var['name']}", inner.group(1) if inner else var["query"], True))
    for ann in dashboard["annotations"]["list"]:
        if "expr" in ann:
            out.append(Query(f"annotation {ann['name']!r}", ann["expr"], False))
    return out


_METRIC = re.compile(r"\b(eplb_[A-Za-z0-9_:]*)")
_SELECTOR = re.compile(r"\b(eplb_[A-Za-z0-9_:]*)\s*\{([^}]*)\}")
_MATCHER = re.compile(r'([A-Za-z_]\w*)\s*(=~|!~|!=|=)\s*"([^"]*)"')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_VARIABLE = re.compile(r"\$\{?(\w+)")


def _labels_of(series: str) -> set[str]:
    for spec in m.METRICS:
        if series in spec.series_names():
            own = set(spec.labels) | ({"le"} if series.endswith("_bucket") else set())
            return own | set(m.ENGINE_LABELS) | set(m.TARGET_LABELS)
    return set()


def problems(dashboard: dict) -> list[str]:
    """What is wrong with the dashboard's queries (empty when every name is one the code exports)."""
    known = m.all_series_names()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    found = []
    for q in queries(dashboard):
        for name in _VARIABLE.findall(q.expr):
            if not name.startswith("__") and name not in variables:
                found.append(f"{q.where}: variable ${name} is not defined by the dashboard")
        metrics = _METRIC.findall(q.expr)
        if not metrics:
            found.append(f"{q.where}: queries no eplb metric: {q.expr}")
        for name in metrics:
            if name not in known:
                found.append(f"{q.where}: metric {name!r} is not defined in eplb.metrics.names")
        for name, matchers in _SELECTOR.findall(q.expr):
            for label, op, value in _MATCHER.findall(matchers):
                if name in known and label not in _labels_of(name):
                    found.append(f"{q.where}: {name} has no label {label!r}")
                multi = [v for v in _VARIABLE.findall(value) if variables.get(v, {}).get("multi")]
                if multi and op != "=~":
                    found.append(f"{q.where}: multi-value variable needs =~ in {name}{{{matchers}}}")
        usable = set().union(*(_labels_of(n) for n in metrics)) if metrics else set()
        for group in _GROUPING.findall(q.expr):
            for label in filter(None, (s.strip() for s in group.split(","))):
                if label not in usable:
                    found.append(
                        f"{q.where}: groups by {label!r}, a label none of {sorted(set(metrics))} has"
                    )
    return found
