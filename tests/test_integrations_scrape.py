"""A scrape from inside each engine after rebalances: vLLM 0.33's and SGLang 0.5.23's own step,
policy call and weight movement on two Gloo ranks (tests.helpers.engine_scrape), with eplb's
plugin loaded by the engine's loader and ``EPLB_METRICS_PORT=0``.

Rank 0's exporter counts every pass the engine ran (vLLM: recorded from the step at which its
window starts, as vLLM's own arithmetic says) and one transfer-time observation per applied plan,
with seconds > 0; rank 1 exports nothing; the slots hold what the last plan placed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers.engine_scrape import INTERVAL, run

PASSES = "eplb_forward_passes_total{kind=decode,recorded=%s}"
TRANSFERS = "eplb_rebalance_transfer_seconds_count{}"
TRANSFER_SECONDS = "eplb_rebalance_transfer_seconds_sum{}"


def _check_transfers(ranks: list[dict[str, Any]]) -> dict[str, float]:
    assert ranks[1]["samples"] is None  # only rank 0 exports
    assert all(r["holds_plan"] for r in ranks)
    samples: dict[str, float] = ranks[0]["samples"]
    assert ranks[0]["applied"] > 0  # not vacuous: plans were moved
    assert samples[TRANSFERS] == ranks[0]["applied"]
    assert samples[TRANSFER_SECONDS] > 0
    return samples


def test_vllm_counts_its_steps_and_transfers(engine_site: Path) -> None:
    case = dict(L=3, E=8, P=12, seed=1, rebalances=4, passes=5, unrecorded=7)
    ranks = run("vllm", 2, case, {"EPLB_VLLM_POLICY": "1", "EPLB_METRICS_PORT": "0"})
    assert all(r["hooked"] == {"step": True, "transfer": True} for r in ranks)
    samples = _check_transfers(ranks)
    steps = case["rebalances"] * case["passes"]
    window = INTERVAL - case["unrecorded"]
    recorded = sum(INTERVAL - step <= window for step in range(steps))  # vLLM's _should_record_current_step
    assert 0 < recorded < steps
    assert samples[PASSES % "true"] == recorded and samples[PASSES % "false"] == steps - recorded


@pytest.mark.parametrize("updater", [False, True], ids=["sglang-updater", "eplb-hot-swap"])
def test_sglang_counts_its_passes_and_transfers(engine_site: Path, updater: bool) -> None:
    env = {"EPLB_METRICS_PORT": "0", **({"EPLB_SGLANG_WEIGHT_UPDATER": "1"} if updater else {})}
    ranks = run("sglang", 2, dict(P=20, seed=1, rebalances=3), env)
    assert all(r["hooked"] == {"update": True} for r in ranks)
    samples = _check_transfers(ranks)
    assert samples[PASSES % "true"] == ranks[0]["passes"] > 0
