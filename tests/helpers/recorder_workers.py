"""Worker process for the 2-rank Gloo recorder test (spawned; importable by the child).

Shape legend: L layers, E logical experts, P physical slots, T tokens, K top-k.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from eplb.placement.model import Placement
from eplb.recorder.recorder import ExpertDistributionRecorder, RecorderConfig
from eplb.remap.api import DispatchTables
from tests.helpers.spawn import init_gloo

L, E, K, G = 2, 6, 2, 2
# (has_prefill, tokens) per rank, per pass. Pass 1: rank 0 idle while rank 1 has prefill.
# Pass 2: decode everywhere (not counted). Pass 3: rank 1 decodes while rank 0 has prefill.
SCHEDULE = [
    [(True, 5), (True, 3)],
    [(False, 0), (True, 4)],
    [(False, 2), (False, 2)],
    [(True, 3), (False, 2)],
    [(True, 2), (True, 6)],
]


def placement() -> Placement:
    return Placement.trivial(L, E, num_gpus=G, num_redundant=2)


def pass_ids(pass_index: int, rank: int, tokens: int) -> torch.Tensor:
    """int32 [T, K] router ids of one rank in one pass (with -1 padding in the last row)."""
    rng = np.random.default_rng(1000 * pass_index + rank)
    ids = rng.integers(0, E, size=(tokens, K)).astype(np.int32)
    if tokens:
        ids[-1, -1] = -1
    return torch.from_numpy(ids)


def run(rank: int, init: str, out_dir: str) -> None:
    init_gloo(init, rank, G)
    try:
        _scenario(rank, Path(out_dir))
    finally:
        dist.destroy_process_group()


def _scenario(rank: int, out: Path) -> None:
    pl = placement()
    tables = DispatchTables.from_placement(pl, rank)
    stat = ExpertDistributionRecorder(RecorderConfig(mode="stat", window=3, prefill_only=True), pl)
    per_pass = ExpertDistributionRecorder(RecorderConfig(mode="per_pass", window=3, prefill_only=True), pl)
    for rec in (stat, per_pass):
        rec.start()
    prepared = [rec.prepare(tables, backend="torch") for rec in (stat, per_pass)]
    counted = []
    for p, plan in enumerate(SCHEDULE):
        has_prefill, tokens = plan[rank]
        ids = pass_ids(p, rank, tokens)
        for rec in (stat, per_pass):
            rec.begin_pass(has_prefill=has_prefill, num_tokens=tokens)
        for layer in range(L):
            for remaps in prepared:
                remaps[layer](ids)
        counted.append([stat.end_pass(), per_pass.end_pass()])
    stat.dump(out / "stat.safetensors")
    stat.dump(out / "stat.pt", fmt="sglang")
    per_pass.dump(out / "per_pass.npz")
    per_pass.dump(out / "per_pass.pt", fmt="sglang")
    summary = {
        "counted": counted,
        "num_counted": [stat.num_counted_passes, per_pass.num_counted_passes],
        "window_full": stat.window_full,
        "local_window": stat.window_logical_counts().tolist(),
        "global_total": stat.window_logical_total(reduce=True).tolist(),
        "per_pass_global": per_pass.window_logical_counts(reduce=True).tolist(),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(summary))
