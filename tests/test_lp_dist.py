"""``lp`` dispatch over 2 and 4 Gloo ranks (real processes, one rank idle): outputs and quotas.

Each rank runs tests/helpers/lp_workers.py in its own process (torch reference and Triton kernels,
interpreted on the CPU); the expected ids come from the one-token-at-a-time brute force over all
ranks' ids (tests/helpers/remap_reference.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import tests.helpers.lp_workers as w
from tests.helpers.remap_reference import brute_lp
from tests.helpers.spawn import rendezvous, run_spawned


def _run(world: int, out: Path) -> list[dict]:
    run_spawned(w.run, world, world, rendezvous(out), str(out), timeout=240)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.interpreter
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_split_replicated_experts_by_the_global_counts(world: int, tmp_path: Path) -> None:
    results = _run(world, tmp_path)
    pl = w.placement(world)
    for call in range(3):
        layer = call % w.L
        ids = [w.rank_ids(world, rank, call).tolist() for rank in range(world)]
        want = brute_lp(ids, pl, layer, [None] * world)
        total = np.zeros(pl.num_physical, dtype=np.int64)
        for rank, result in enumerate(results):
            for backend in ("torch", "triton"):
                assert result["outputs"][backend][call] == want[rank], (backend, rank, call)
                assert result["counts"][backend][call] == result["counts"]["torch"][call]
            total += np.array(result["counts"]["torch"][call])
            if rank == w.IDLE_RANK:
                assert want[rank] == [] and not any(result["counts"]["torch"][call])
        flat = np.array([x for rank_ids in want for row in rank_ids for x in row], dtype=np.int64)
        assert total.tolist() == np.bincount(flat[flat >= 0], minlength=pl.num_physical).tolist()
