"""Plain-Python brute force of the remap+record semantics (eplb.remap.api), random test inputs, and
one way to run a remap through either entry point (the public function or the Triton launcher).

Shape legend: T tokens, K top-k, L layers, E logical experts, P physical slots, R replica capacity.
Independent of eplb.remap.torch_backend: one loop over elements, Python ints for the hash.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from eplb.placement.model import Placement
from eplb.remap.api import remap_and_record
from eplb.remap.call import RemapCall
from eplb.remap.tables import DispatchTables, mix32_int, salt_base
from tests.helpers.placements import random_phy2log

if TYPE_CHECKING:
    from eplb.kernels.remap_record import LaunchConfig


@dataclass
class BruteResult:
    out_TK: list[list[int]]
    counts_P: list[int]
    logical_E: list[int]


def brute_remap(
    ids_TK: list[list[int]],
    tables: DispatchTables,
    layer: int,
    mode: str,
    num_valid_tokens: int | None,
    record: bool,
) -> BruteResult:
    E, P = tables.num_logical, tables.num_physical
    static = tables.static_LE[layer].tolist()
    log2phy = tables.log2phy_LER[layer].tolist()
    logcnt = tables.logcnt_LE[layer].tolist()
    cum = tables.cumweights_LER[layer].tolist()  # float32 values, exact as Python floats
    seed = int(tables.seed_1.item()) & 0xFFFFFFFF
    if mode == "weighted":
        salt = mix32_int(salt_base(layer, -1))
    else:
        salt = mix32_int(salt_base(layer, tables.rank) ^ seed)
    K = len(ids_TK[0]) if ids_TK else 0
    out: list[list[int]] = []
    counts = [0] * P
    logical = [0] * E
    for row, ids in enumerate(ids_TK):
        out_row = []
        for k, x in enumerate(ids):
            valid = 0 <= x < E and (num_valid_tokens is None or row < num_valid_tokens)
            if not valid:
                out_row.append(x)
                continue
            h = mix32_int((row * K + k) ^ salt)
            if mode == "static":
                p = static[x]
            elif mode == "fake":
                p = h % P
            else:
                cnt = logcnt[x]
                if mode == "dynamic":
                    rep = h % cnt
                elif mode == "dynamic_row":
                    rep = row % cnt
                else:
                    u = (h >> 8) * 2.0**-24
                    rep = sum(1 for r in range(cnt - 1) if cum[x][r] <= u)
                p = log2phy[x][rep]
            out_row.append(p)
            if record:
                counts[p] += 1
                logical[x] += 1
        out.append(out_row)
    return BruteResult(out, counts, logical)


def random_tables(
    rng: np.random.Generator,
    num_logical: int,
    num_physical: int,
    num_gpus: int,
    rank: int,
    num_layers: int = 2,
    weighted: bool = True,
    device: torch.device | str = "cpu",
) -> tuple[Placement, DispatchTables]:
    """A random placement and the tables of ``rank`` on ``device``, with random weights and seed.

    The same generator state gives the same tables on every device.
    """
    pl = Placement.from_phy2log(random_phy2log(rng, num_layers, num_logical, num_physical), num_gpus=num_gpus)
    weights = None
    if weighted:
        weights = rng.random((num_layers, num_logical, pl.max_replicas)) + 0.01
    tables = DispatchTables.from_placement(pl, rank, device, weights)
    tables.seed_1.fill_(int(rng.integers(-(2**31), 2**31 - 1)))
    return pl, tables


def random_ids(rng: np.random.Generator, T: int, K: int, E: int, style: str) -> torch.Tensor:
    """int32 [T, K] router ids: uniform, with -1 padding and out-of-range ids, or one hot expert."""
    if style == "one_expert":
        ids = np.full((T, K), int(rng.integers(0, E)))
    elif style == "skewed":
        ids = np.minimum(rng.geometric(0.3, size=(T, K)) - 1, E - 1)
    else:
        ids = rng.integers(0, E, size=(T, K))
        if style == "nasty":
            ids = np.where(rng.random((T, K)) < 0.15, -1, ids)
            ids = np.where(rng.random((T, K)) < 0.05, E + rng.integers(0, 3, size=(T, K)), ids)
            ids = np.where(rng.random((T, K)) < 0.02, -(2**31), ids)
    return torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int32))


def run_remap(
    ids_TK: torch.Tensor,
    tables: DispatchTables,
    layer: int,
    mode: str,
    *,
    counts: torch.Tensor | None = None,
    logical: torch.Tensor | None = None,
    nvalid: torch.Tensor | None = None,
    record: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    backend: str = "triton",
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """The output ids of one remap: through ``remap_and_record(backend=...)``, or, given a launch
    ``config``, through the Triton launcher alone (always ``kernel[grid]``; ``backend`` unused)."""
    if config is None:
        return remap_and_record(
            ids_TK,
            tables,
            layer,
            mode=mode,
            counts_P=counts,
            logical_counts_E=logical,
            num_valid_tokens=nvalid,
            record=record,
            out_TK=out,
            backend=backend,
        )
    from eplb.kernels.remap_record import remap_record_triton

    call = RemapCall(
        topk_ids_TK=ids_TK,
        tables=tables,
        layer=layer,
        mode=mode,
        out_TK=torch.empty_like(ids_TK) if out is None else out,
        counts_P=counts,
        logical_counts_E=logical,
        num_valid_tokens=nvalid,
        record=record,
    )
    remap_record_triton(call, config=config)
    return call.out_TK
