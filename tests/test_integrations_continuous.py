"""Continuous mode through vLLM 0.33.0's and SGLang 0.5.23's own plugin loaders on a drifting trace
(benchmarks.bench_engine_continuous; the full 58-layer run and its figures are in
docs/benchmarks.md): every plan within the move budget plus the documented first plan and shift
burst (copies counted from the maps in plain numpy), the same plans in two processes fed the same
windows, and next-window balancedness at least the engine's default algorithm at its default
cadence, in one run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from benchmarks.bench_engine_continuous import Case, arrivals, run, sglang_schedule, vllm_schedule

pytestmark = pytest.mark.slow

# The deepseek-v3 preset's trace, its first 4 of 58 layers (EP32, 4 nodes, 32 redundant slots),
# with the budget scaled to them (160 copies for 58 layers is about 11 for 4).
CASE = Case(steps=2000, layers=4, max_moved_experts=12, score_from=1000)


def test_engine_schedules() -> None:
    # SGLang: every interval, the last buffer passes; vLLM: first after a quarter of the interval.
    assert sglang_schedule(250, 100, 100) == [(100, 0), (200, 100)]
    assert vllm_schedule(250, 100, 40) == [(25, 0), (125, 85), (225, 185)]
    old = np.array([[0, 1, 2, 3, 0, 1]])
    assert arrivals(old, np.array([[0, 1, 2, 3, 0, 1]]), 2) == 0
    assert arrivals(old, np.array([[0, 0, 2, 3, 1, 1]]), 2) == 0  # a swap within each GPU
    assert arrivals(old, np.array([[3, 1, 2, 0, 0, 1]]), 2) == 1  # expert 3 arrives on GPU 0 (0 was there)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_continuous_mode_through_the_engine_loader(engine_site: Path, engine: str) -> None:
    got = run(CASE, (engine,), site=engine_site)["engines"][engine]
    assert got["same_plans_on_both_ranks"]
    assert got["budget"]["within_budget"], got["budget"]
    assert got["eplb_plans"] == 40  # SGLang: every 50 passes; vLLM: after 12, then every 50
    assert got["eplb_next_window"] >= got["default_next_window"], got
