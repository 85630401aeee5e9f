"""A real Prometheus scrapes a live ``eplb demo --metrics-port``; every dashboard query returns data.

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

from tests.helpers.dashboards import panels, promql, promstack

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("prometheus") is None,
        reason="prometheus binary not installed (apt-get install prometheus)",
    ),
]

# --steps bounds the workload trace the demo draws (steps x ranks); --duration-s only caps a leak.
DEMO_ARGS = [
    "--nproc",
    "2",
    "--steps",
    "3000",
    "--duration-s",
    "150",
    "--eplb-rebalance-num-iterations",
    "20",
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


@pytest.mark.parametrize("query", promql.queries(panels.build_dashboard()), ids=lambda q: q.where)
def test_every_dashboard_query_returns_data(prometheus: Any, query: Any) -> None:
    expr = promstack.expand(query.expr, rate_interval="5s")
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
    assert sorted(by_layer) == [str(i) for i in range(num_layers)]
    assert all(len(v) == num_gpus for v in by_layer.values())
    for layer, tokens in by_layer.items():
        assert balance[layer] == pytest.approx(np.mean(tokens) / np.max(tokens), rel=1e-9)
    (passes,) = prometheus.api("query", query="sum(eplb_forward_passes_total)")["result"]
    assert float(passes["value"][1]) >= 20 * 12
