"""A real Prometheus scrapes eplb's metrics exported from inside an engine: vLLM 0.33.0's policy table
(eplb loaded through vLLM's plugin loader) on two Gloo ranks with ``EPLB_METRICS_PORT`` set.

Only rank 0 exports; every series carries the ``engine`` and ``model_name`` labels given; the
rebalance counters, copies and the last window's balancedness equal what the ranks did (the
balancedness recomputed by the worker in plain numpy); the series stay within the fixed set
(layers x ranks, the fixed causes); and once the rebalances stop, the age since the last one
keeps growing. Skipped only when the ``prometheus`` binary is missing (apt-get install prometheus).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from eplb.metrics import names
from eplb.metrics.causes import REBALANCE_CAUSES
from tests.helpers.dashboards import promstack
from tests.helpers.engine_checks import G, L
from tests.helpers.polling import wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("prometheus") is None,
        reason="prometheus binary not installed (apt-get install prometheus)",
    ),
]
ROOT = Path(__file__).resolve().parents[1]
REBALANCES = 12
MODEL = "test/model-1"


def _value(prom: Any, query: str) -> float:
    (result,) = prom.api("query", query=query)["result"]
    return float(result["value"][1])


def test_prometheus_scrapes_the_vllm_adapter(engine_site: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EPLB_", "VLLM_", "SGLANG_"))}
    env.update(
        PYTHONPATH=os.pathsep.join([str(engine_site), str(ROOT)]),
        EPLB_VLLM_POLICY="1",
        EPLB_REBALANCE_MODE="continuous",
        EPLB_MAX_MOVED_EXPERTS="8",
        EPLB_METRICS_PORT="0",
        EPLB_MODEL_NAME=MODEL,
    )
    with tempfile.TemporaryDirectory() as tmp:
        init = Path(tmp) / "init"
        procs, logs = [], []
        try:
            for rank in range(2):
                log = open(Path(tmp) / f"log{rank}", "w")  # noqa: SIM115 - closed below
                logs.append(log)
                cmd = [sys.executable, "-m", "tests.helpers.engine_metrics_worker", str(rank), "2", str(init),
                       str(REBALANCES), str(Path(tmp) / f"events{rank}.json")]  # fmt: skip
                procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))  # fmt: skip

            def text(rank: int) -> str:
                return (Path(tmp) / f"log{rank}").read_text()

            wait_until(lambda: "metrics at" in text(0) or procs[0].poll() is not None, timeout_s=300)
            wait_until(lambda: "no exporter" in text(1) or procs[1].poll() is not None, timeout_s=300)
            assert "metrics at" in text(0), text(0)
            assert "no exporter" in text(1), text(1)  # rank 1 exports nothing
            url = next(line for line in text(0).splitlines() if line.startswith("metrics at")).split()[-1]
            target = url.removeprefix("http://").removesuffix("/metrics")
            with promstack.LocalPrometheus(target, interval_s=0.5) as prom:
                wait_until(lambda: all("rebalances done" in text(r) for r in range(2)), timeout_s=300)
                events = json.loads((Path(tmp) / "events0.json").read_text())
                assert events == json.loads((Path(tmp) / "events1.json").read_text())  # the same plans
                prom.wait_for_samples(names.LAST_REBALANCE_AGE, 4, timeout_s=60)
                time.sleep(1.0)  # a scrape after the last rebalance
                applied = sum(e["applied"] for e in events)
                total = f"sum({names.REBALANCES})"
                wait_until(lambda: _value(prom, total) == REBALANCES, timeout_s=30)
                assert _value(prom, f'sum({names.REBALANCES}{{outcome="applied"}})') == applied
                assert _value(prom, names.EXPERTS_MOVED) == sum(e["copies"] for e in events)
                assert _value(prom, names.MOVED_BYTES) == 0  # no bytes_per_expert given: unknown
                before = _value(prom, f'{names.LAST_REBALANCE_BALANCEDNESS}{{when="before"}}')
                assert before == pytest.approx(events[-1]["before"], rel=1e-9)
                whens = {
                    r["metric"]["when"]
                    for r in prom.api("query", query=names.LAST_REBALANCE_BALANCEDNESS)["result"]
                }
                assert whens == {"before", "after", "predicted", "realized"}
                assert _value(prom, f"{names.SOLVE_SECONDS}_count") == REBALANCES
                # Labels: every eplb series has the engine's; the set is bounded.
                series = prom.api(
                    "series", **{"match[]": '{__name__=~"eplb_.+"}', "start": time.time() - 600}
                )
                assert series and all(s["model_name"] == MODEL and s["engine"] == "0" for s in series)
                rank_tokens = [s for s in series if s["__name__"] == names.RANK_TOKENS]
                assert len(rank_tokens) == L * G
                causes = {s["cause"] for s in series if s["__name__"] == names.REBALANCES}
                assert causes == set(REBALANCE_CAUSES)
                assert len(series) < 400
                # A rebalancer that stopped: the age since its last rebalance keeps growing.
                first = _value(prom, names.LAST_REBALANCE_AGE)
                wait_until(lambda: _value(prom, names.LAST_REBALANCE_AGE) > first + 1.0, timeout_s=30)
                assert _value(prom, f'{names.MANAGER_PHASE}{{phase="idle"}}') == 1.0
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=30)
            for log in logs:
                log.close()
