"""The recorder over 2 Gloo ranks: prefill-only lockstep (one rank idle), wrap-around, summed dumps.

Each rank runs tests/helpers/recorder_workers.py in its own process; the expected counts are computed
here by plain numpy bincounts of the same router ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import tests.helpers.recorder_workers as w
from eplb.traces import load_trace
from tests.helpers.spawn import rendezvous, run_spawned


def _expected() -> tuple[list[bool], list[np.ndarray], list[bool], list[int]]:
    """Which passes count, the summed expert counts [L, E] of each counted pass, prefill and tokens."""
    counted, counts, prefill, tokens = [], [], [], []
    for p, plan in enumerate(w.SCHEDULE):
        is_counted = any(has for has, _ in plan)
        counted.append(is_counted)
        if not is_counted:
            continue
        total = np.zeros((w.L, w.E), dtype=np.int64)
        for rank, (has_prefill, n) in enumerate(plan):
            if has_prefill:  # prefill-only: a rank records only its own prefill passes
                ids = w.pass_ids(p, rank, n).numpy().ravel()
                ids = ids[ids >= 0]
                total += np.bincount(ids, minlength=w.E)[None, :]  # every layer sees the same ids
        counts.append(total)
        prefill.append(True)
        tokens.append(sum(n for _, n in plan))
    return counted, counts, prefill, tokens


@pytest.fixture(scope="module")
def run_two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("recorder_dist")
    run_spawned(w.run, w.G, rendezvous(out), str(out))
    return out


def test_ranks_count_in_lockstep_with_an_idle_rank(run_two_ranks: Path) -> None:
    counted, _, _, _ = _expected()
    summaries = [json.loads((run_two_ranks / f"rank{r}.json").read_text()) for r in range(w.G)]
    for s in summaries:
        assert [c[0] for c in s["counted"]] == counted
        assert [c[1] for c in s["counted"]] == counted
        assert s["num_counted"] == [sum(counted)] * 2
        assert s["window_full"] is True
    # Pass 1 (counted, rank 0 idle) sits in the window as a zero row on rank 0.
    local0 = np.array(summaries[0]["local_window"])
    assert local0.shape == (3, w.L, w.E) and local0[0].sum() == 0


def test_window_wraps_and_sums_over_ranks(run_two_ranks: Path) -> None:
    _, counts, _, _ = _expected()
    last3 = np.stack(counts[-3:])  # 4 counted passes, window of 3: the first fell out
    for r in range(w.G):
        s = json.loads((run_two_ranks / f"rank{r}.json").read_text())
        assert np.array_equal(np.array(s["global_total"]), last3.sum(axis=0))
        assert np.array_equal(np.array(s["per_pass_global"]), last3)


def test_summed_dumps_load_back(run_two_ranks: Path) -> None:
    _, counts, prefill, tokens = _expected()
    last3 = np.stack(counts[-3:])
    for name in ("stat.safetensors", "per_pass.npz", "per_pass.pt"):
        trace = load_trace(run_two_ranks / name)
        assert np.array_equal(trace.counts_FLE, last3), name
    own = load_trace(run_two_ranks / "stat.safetensors")
    assert own.is_prefill_F.tolist() == prefill[-3:]
    assert own.num_tokens_F.tolist() == tokens[-3:]
    assert own.meta["ranks_summed"] == 2
    sglang = torch.load(run_two_ranks / "stat.pt", weights_only=True)
    assert sglang["rank"] == 0 and sglang["logical_count"].dtype == torch.int32
    assert np.array_equal(sglang["logical_count"].numpy(), last3)
    assert not (run_two_ranks / "stat.rank1.pt").exists()
