"""Two GPUs over NCCL: a captured decode graph replays correctly after a hot-swap, without recapture.

The check itself lives in benchmarks/bench_hotswap.py (``check``), so the benchmark and this test
run the same code; here it runs on two ranks and every rank must pass.
"""

from __future__ import annotations

import pytest
import torch

from eplb.moe.spawn import run_ranks


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_graph_replays_after_swap_on_two_gpus() -> None:
    from benchmarks.bench_hotswap import check

    results = run_ranks(check, 2, args=(True,), backend="nccl", timeout_s=300)
    for r in results:
        assert r["passed"], r
        assert r["swap_ok"] and r["ptrs_same"] and r["rollback_ok"]
    assert results[0]["experts_moved"] > 0


def test_gloo_check_of_the_same_code() -> None:
    """The same check on two CPU ranks (eager instead of a graph), so CI runs its code."""
    from benchmarks.bench_hotswap import check

    results = run_ranks(check, 2, args=(True,), backend="gloo", timeout_s=120)
    assert all(r["passed"] for r in results), results
