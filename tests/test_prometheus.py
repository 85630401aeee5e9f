"""A real Prometheus scrapes a live eplb exporter; every query of the generated dashboard returns data.

Shape legend: L layers, E logical experts, G GPUs.

Skipped (with the reason) only when the ``prometheus`` binary is missing; .ci/run installs it.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from dashboards_import import generate, promstack

from eplb.balance import gpu_load
from eplb.metrics import PrometheusSink
from eplb.metrics_exporter import MetricsExporter
from eplb.placement import Placement

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="prometheus binary not installed (apt-get install prometheus)"
)


def _drive(sink: PrometheusSink, stop: threading.Event) -> None:
    """What the manager reports: passes, a window every 5 passes, a rebalance every 15 (all outcomes)."""
    rng = np.random.default_rng(0)
    L, E, G = 4, 16, 4
    placement = Placement.trivial(L, E, num_gpus=G, num_redundant=4)
    sink.on_topology(num_layers=L, num_logical=E, num_physical=E + 4, num_gpus=G, num_nodes=1)
    popularity_E = rng.pareto(1.5, size=E) + 0.1
    outcomes = ("applied", "skipped", "applied", "failed")
    step = 0
    while not stop.is_set():
        sink.on_forward_pass(kind="prefill" if step % 3 == 0 else "decode", recorded=step % 3 == 0)
        if step % 5 == 0:
            load_LE = rng.poisson(200 * popularity_E, size=(L, E)).astype(np.float64)
            sink.on_window(logical_load_LE=load_LE, gpu_load_LG=gpu_load(load_LE, placement))
        if step % 15 == 0:
            sink.on_rebalance(
                outcome=outcomes[(step // 15) % 4],  # type: ignore[arg-type]
                reason=f"window {step}",
                solve_seconds=float(rng.uniform(0.01, 0.2)),
                transfer_seconds=float(rng.uniform(0.05, 0.5)),
                experts_moved=int(rng.integers(1, 10)),
                bytes_moved=int(rng.integers(1, 10)) * 44_000_000,
                balancedness_before=0.6,
                balancedness_after=0.9,
            )
        step += 1
        stop.wait(0.02)


@pytest.fixture(scope="module")
def prometheus() -> Iterator[object]:
    sink = PrometheusSink(hot_experts_per_layer=4)
    stop = threading.Event()
    driver = threading.Thread(target=_drive, args=(sink, stop), daemon=True)
    driver.start()
    try:
        with (
            MetricsExporter(sink) as exporter,
            promstack.LocalPrometheus(f"127.0.0.1:{exporter.port}") as prom,
        ):
            # rate() over 5 s needs a few scrapes; 12 samples also spans several rebalances.
            prom.wait_for_samples("eplb_model_balancedness", 12, timeout_s=60)
            yield prom
    finally:
        stop.set()
        driver.join(timeout=5)


def test_target_is_up(prometheus: Any) -> None:
    targets = prometheus.api("targets")["activeTargets"]
    assert [t["health"] for t in targets] == ["up"], targets


@pytest.mark.parametrize("query", generate.queries(generate.build_dashboard()), ids=lambda q: q.where)
def test_every_dashboard_query_returns_data(prometheus: Any, query: Any) -> None:
    expr = promstack.expand(query.expr, rate_interval="5s")
    now = time.time()
    if query.instant:
        data = prometheus.api("query", query=expr, time=now)
    else:
        data = prometheus.api("query_range", query=expr, start=now - 12, end=now, step=1)
    values = promstack.finite_values(data["result"])
    assert values, f"{query.where}: no finite value for {expr}: {data}"


def test_window_values_match_the_last_handed_window(prometheus: Any) -> None:
    # What Prometheus stored for the (layer, rank) grid is a window the sink was given: every layer's
    # rank tokens sum to that layer's tokens, and balancedness is mean/max of the same row.
    rows = prometheus.api("query", query="eplb_rank_tokens")["result"]
    balance = {
        r["metric"]["layer"]: float(r["value"][1])
        for r in prometheus.api("query", query="eplb_layer_balancedness")["result"]
    }
    by_layer: dict[str, list[float]] = {}
    for r in rows:
        by_layer.setdefault(r["metric"]["layer"], []).append(float(r["value"][1]))
    assert sorted(by_layer) == ["0", "1", "2", "3"] and all(len(v) == 4 for v in by_layer.values())
    for layer, tokens in by_layer.items():
        # Scrapes of the two families may straddle a window swap only across scrapes, not within one.
        assert balance[layer] == pytest.approx(np.mean(tokens) / np.max(tokens), rel=1e-9)
