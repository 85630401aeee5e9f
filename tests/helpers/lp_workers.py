"""Worker process for the multi-rank Gloo ``lp`` dispatch tests (spawned; importable by the child).

Shape legend: L layers, E logical experts, P physical slots, T tokens, K top-k.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from eplb.placement.model import Placement
from eplb.remap.api import DispatchTables, remap_and_record
from eplb.remap.exchange import LpExchange
from tests.helpers.placements import random_phy2log
from tests.helpers.spawn import init_gloo

L, E, K = 2, 12, 4
IDLE_RANK = 1
"""This rank has no tokens on every call; the others must not hang waiting for it."""


def placement(world: int) -> Placement:
    rng = np.random.default_rng(world)
    return Placement.from_phy2log(random_phy2log(rng, L, E, E + 2 * world), num_gpus=world)


def rank_ids(world: int, rank: int, call: int) -> torch.Tensor:
    """int32 [T, K] router ids of one rank in one call (T = 0 on the idle rank), with -1 padding."""
    rng = np.random.default_rng(1000 * world + 10 * rank + call)
    T = 0 if rank == IDLE_RANK else int(rng.integers(5, 40))
    ids = rng.integers(0, E, size=(T, K)).astype(np.int32)
    ids[rng.random((T, K)) < 0.1] = -1
    return torch.from_numpy(ids)


def run(rank: int, world: int, init: str, out_dir: str) -> None:
    init_gloo(init, rank, world)
    try:
        pl = placement(world)
        tables = DispatchTables.from_placement(pl, rank)
        lp = LpExchange(tables)  # the default group: Gloo here
        outputs: dict[str, list[list[list[int]]]] = {"torch": [], "triton": []}
        counts: dict[str, list[list[int]]] = {"torch": [], "triton": []}
        for call in range(3):
            layer = call % L
            for backend in ("torch", "triton"):
                counts_P = torch.zeros(pl.num_physical, dtype=torch.int32)
                out = remap_and_record(
                    rank_ids(world, rank, call),
                    tables,
                    layer,
                    mode="lp",
                    counts_P=counts_P,
                    backend=backend,
                    lp=lp,
                )
                outputs[backend].append(out.tolist())
                counts[backend].append(counts_P.tolist())
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({"outputs": outputs, "counts": counts}))
    finally:
        dist.destroy_process_group()
