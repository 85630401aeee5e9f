"""A real Prometheus scrapes a live ``eplb demo --metrics-port``; every dashboard query returns data.

Queries run with the dashboard's variables set as Grafana sets them by default (the first
instance and model found, all layers), so the variables' own queries are checked too.

Skipped (with the reason) only when the ``prometheus`` binary is missing; .ci/run installs it.
The demo (2 CPU ranks over Gloo, tiny model, a rebalance every 20 passes) and Prometheus (1 s
scrapes) run on 127.0.0.1 for about half a minute; both are stopped however the test ends.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from eplb.metrics import names
from eplb.metrics.causes import REBALANCE_CAUSES
from tests.helpers.dashboards import panels, promql, promstack

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("prometheus") is None,
        reason="prometheus binary not installed (apt-get install prometheus)",
    ),
]

REBALANCE_EVERY = 20
"""The demo's --eplb-rebalance-num-iterations: passes per rebalance decision."""
# --steps bounds the workload trace the demo draws (steps x ranks); --duration-s only caps a leak.
DEMO_ARGS = [
    "--nproc",
    "2",
    "--steps",
    "3000",
    "--duration-s",
    "150",
    "--eplb-rebalance-num-iterations",
    str(REBALANCE_EVERY),
]


@pytest.fixture(scope="module")
def prometheus() -> Iterator[Any]:
    with (
        promstack.LiveDemo(*DEMO_ARGS) as demo,
        promstack.LocalPrometheus(f"127.0.0.1:{demo.port}", interval_s=1.0) as prom,
    ):
        try:
            # rate() over 5 s needs a few scrapes; 12 windows' worth of samples spans several rebalances.
            prom.wait_for_samples("eplb_rebalances_total", 12, timeout_s=90)
            prom.wait_for_samples("eplb_rank_tokens", 12, timeout_s=60)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n--- demo log ---\n{demo.log_tail()}") from exc
        yield prom


def test_target_is_up(prometheus: Any) -> None:
    targets = prometheus.api("targets")["activeTargets"]
    assert [t["health"] for t in targets] == ["up"], targets


@pytest.fixture(scope="module")
def variables(prometheus: Any) -> dict[str, str]:
    return prometheus.variables(panels.build_dashboard())


def test_variables_pick_the_demo(prometheus: Any, variables: dict[str, str]) -> None:
    (target,) = prometheus.api("targets")["activeTargets"]
    assert variables["instance"] == target["labels"]["instance"]
    assert variables["model_name"] == names.DEFAULT_MODEL_NAME  # the demo sets no model name
    assert variables["layer"] == ".*"


@pytest.mark.parametrize("query", promql.queries(panels.build_dashboard()), ids=lambda q: q.where)
def test_every_dashboard_query_returns_data(prometheus: Any, variables: dict[str, str], query: Any) -> None:
    expr = promstack.expand(query.expr, rate_interval="5s", **variables)
    now = time.time()
    if query.instant:
        data = prometheus.api("query", query=expr, time=now)
    else:
        data = prometheus.api("query_range", query=expr, start=now - 15, end=now, step=1)
    values = promstack.finite_values(data["result"])
    assert values, f"{query.where}: no finite value for {expr}: {data}"


def test_stored_window_is_one_consistent_window(prometheus: Any) -> None:
    # The (layer, rank) grid and the balancedness Prometheus stored come from one window the demo's
    # manager aggregated over both ranks: a full grid, and balancedness = mean/max of each row.
    (info,) = prometheus.api("query", query="eplb_info")["result"]
    num_layers, num_gpus = int(info["metric"]["num_layers"]), int(info["metric"]["num_gpus"])
    assert num_gpus == 2
    at = time.time()
    rows = prometheus.api("query", query="eplb_rank_tokens", time=at)["result"]
    balance = {
        r["metric"]["layer"]: float(r["value"][1])
        for r in prometheus.api("query", query="eplb_layer_balancedness", time=at)["result"]
    }
    by_layer: dict[str, list[float]] = {}
    for r in rows:
        by_layer.setdefault(r["metric"]["layer"], []).append(float(r["value"][1]))
    # Plain integers, as SGLang's layer="7": sorted as numbers they are exactly 0..L-1.
    assert sorted(by_layer, key=int) == [str(i) for i in range(num_layers)]
    assert all(len(v) == num_gpus for v in by_layer.values())
    for layer, tokens in by_layer.items():
        assert balance[layer] == pytest.approx(np.mean(tokens) / np.max(tokens), rel=1e-9)
    # One scrape holds both counters: every rebalance decided came after its REBALANCE_EVERY
    # passes, however fast or slow the machine ran the demo.
    (passes,) = prometheus.api("query", query="sum(eplb_forward_passes_total)", time=at)["result"]
    (decided,) = prometheus.api("query", query=f"sum({names.REBALANCES})", time=at)["result"]
    assert float(decided["value"][1]) >= 1
    assert float(passes["value"][1]) >= REBALANCE_EVERY * float(decided["value"][1])


def test_labels_are_bounded_and_fixed(prometheus: Any) -> None:
    # Every eplb series has the engine labels; the rebalance series are the fixed (outcome, cause)
    # set, and the demo's reasons all map onto a named cause (none falls through to *_other).
    unlabelled = prometheus.api("query", query='count({__name__=~"eplb_.+", model_name=""})')["result"]
    assert unlabelled == []
    unlabelled = prometheus.api("query", query='count({__name__=~"eplb_.+", engine=""})')["result"]
    assert unlabelled == []
    series = prometheus.api("series", **{"match[]": names.REBALANCES, "start": time.time() - 3600})
    causes = [s["cause"] for s in series]
    assert sorted(causes) == sorted(REBALANCE_CAUSES)
    happened = prometheus.api("query", query=f"{names.REBALANCES} > 0")["result"]
    assert happened, "the demo rebalanced"
    for result in happened:
        assert not result["metric"]["cause"].endswith("_other"), result["metric"]
    stamps = prometheus.api(
        "series", **{"match[]": names.LAST_REBALANCE_TIMESTAMP, "start": time.time() - 3600}
    )
    assert 1 <= len(stamps) <= len(REBALANCE_CAUSES)
    assert all(
        set(s) == {"__name__", "outcome", "cause", "engine", "model_name", "instance", "job"} for s in stamps
    )
