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
from eplb.policy.dispatch import dispatch_mode
from eplb.remap.api import MODES, remap_and_record
from eplb.remap.call import RemapCall
from eplb.remap.tables import DispatchTables, mix32_int, salt_base
from tests.helpers.placements import random_phy2log

if TYPE_CHECKING:
    from eplb.kernels.remap_record import LaunchConfig


LOCAL_MODES = tuple(mode for mode in MODES if not dispatch_mode(mode).collective)
"""The modes one call computes alone (``lp`` exchanges counts: tests/test_remap_lp.py)."""


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
    map_padded: bool = False,
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
            in_range = 0 <= x < E
            valid = in_range and (num_valid_tokens is None or row < num_valid_tokens)
            if not (in_range if map_padded else valid):
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
            if record and valid:
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
    map_padded: bool = False,
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
            map_padded_rows=map_padded,
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
        map_padded_rows=map_padded,
    )
    remap_record_triton(call, config=config)
    return call.out_TK


# ---- lp dispatch (eplb.remap.lp_rule), one token at a time --------------------------------------
LP_PASSES_REFERENCE = 4
"""Re-fill passes of the rule (eplb.remap.lp_rule.LP_PASSES), restated so the reference stays independent."""
LP_SCALE_ROUNDS_REFERENCE = 0
"""Rounds of the proportional start (eplb.remap.lp_rule.LP_SCALE_ROUNDS), restated likewise."""
LP_FILL_WIDTH_REFERENCE = 8
"""Widest expert that re-fills (eplb.remap.lp_rule.LP_FILL_WIDTH), restated likewise."""


def _pour(amount: int, levels: list[int]) -> list[int]:
    """Tokens one at a time, each onto the lowest level (ties: the first): the water-filling."""
    level = list(levels)
    got = [0] * len(levels)
    for _ in range(amount):
        d = min(range(len(level)), key=lambda i: (level[i], i))
        level[d] += 1
        got[d] += 1
    return got


def _scale_start(
    quota: dict[int, dict[int, int]], base: list[int], amount: dict[int, int], rounds: int
) -> None:
    """The proportional start, in place: the water level found by bisection, then the rounds."""
    used = sorted({g for split in quota.values() for g in split})
    total = sum(amount.values())
    lo, hi = 0, max([base[g] for g in used], default=0) + total + 1  # lo reachable, hi not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if sum(max(0, mid - base[g]) for g in used) <= total else (lo, mid)
    room = {g: max(0, lo - base[g]) + 1 for g in used}
    for _ in range(rounds):
        demand = {g: sum(split.get(g, 0) for split in quota.values()) for g in used}
        for e, split in quota.items():
            gpus = sorted(split)
            scaled = [split[g] * room[g] // max(demand[g], 1) for g in gpus]
            if sum(scaled) == 0:
                continue
            cum = [sum(scaled[: i + 1]) for i in range(len(gpus))]
            floors = [0] + [c * amount[e] // cum[-1] for c in cum]
            quota[e] = {g: floors[i + 1] - floors[i] for i, g in enumerate(gpus)}


def brute_lp_quotas(
    counts_E: list[int],
    placement: Placement,
    layer: int,
    *,
    scale_rounds: int = LP_SCALE_ROUNDS_REFERENCE,
    passes: int = LP_PASSES_REFERENCE,
) -> dict[int, dict[int, int]]:
    """expert -> {gpu: tokens} for every replicated expert of ``layer``, from global counts."""
    S, G = placement.slots_per_gpu, placement.num_gpus
    p2l = placement.phy2log_LP[layer].tolist()
    gpus_of: dict[int, list[int]] = {}
    for slot, expert in enumerate(p2l):
        gpus_of.setdefault(expert, [])
        if slot // S not in gpus_of[expert]:
            gpus_of[expert].append(slot // S)
    copies = {e: p2l.count(e) for e in gpus_of}
    loads = [0] * G
    for e, gpus in gpus_of.items():
        if copies[e] == 1:
            loads[gpus[0]] += counts_E[e]
    replicated = sorted(e for e in gpus_of if copies[e] > 1)
    quota: dict[int, dict[int, int]] = {}
    for e in replicated:
        gpus = sorted(gpus_of[e])
        c, w = counts_E[e], len(gpus)
        quota[e] = {g: c // w + (1 if i < c % w else 0) for i, g in enumerate(gpus)}
    if scale_rounds:
        _scale_start(quota, loads, {e: counts_E[e] for e in replicated}, scale_rounds)
    for e in replicated:
        for g, q in quota[e].items():
            loads[g] += q
    # Colours: in ascending expert id, the lowest colour that no earlier expert sharing a GPU has
    # (experts on one GPU, or on more than the fill width, keep the even split and take none).
    color: dict[int, int] = {}
    for e in replicated:
        if not 2 <= len(gpus_of[e]) <= LP_FILL_WIDTH_REFERENCE:  # one GPU: nothing to re-fill
            continue
        clash = {color[f] for f in color if set(gpus_of[f]) & set(gpus_of[e])}
        color[e] = min(c for c in range(len(replicated) + 1) if c not in clash)
    order = sorted(color, key=lambda e: (color[e], e))
    for _ in range(passes):
        for e in order:
            gpus = sorted(quota[e])
            for g in gpus:
                loads[g] -= quota[e][g]
            got = _pour(counts_E[e], [loads[g] for g in gpus])
            quota[e] = dict(zip(gpus, got, strict=True))
            for g in gpus:
                loads[g] += quota[e][g]
    return quota


def brute_lp(
    ids_by_rank: list[list[list[int]]],
    placement: Placement,
    layer: int,
    nvalid_by_rank: list[int | None],
) -> list[list[list[int]]]:
    """Every rank's output ids under ``lp`` (ranks' tokens in rank order, then flat order)."""
    E, S = placement.num_logical, placement.slots_per_gpu
    p2l = placement.phy2log_LP[layer].tolist()

    def valid(rank: int, row: int, x: int) -> bool:
        nvalid = nvalid_by_rank[rank]
        return 0 <= x < E and (nvalid is None or row < nvalid)

    counts = [0] * E
    for rank, ids in enumerate(ids_by_rank):
        for row, xs in enumerate(ids):
            for x in xs:
                if valid(rank, row, x):
                    counts[x] += 1
    quota = brute_lp_quotas(counts, placement, layer)
    first_slot = {}
    for slot, expert in enumerate(p2l):
        first_slot.setdefault((expert, slot // S), slot)
    seen = [0] * E
    outs = []
    for rank, ids in enumerate(ids_by_rank):
        out = []
        for row, xs in enumerate(ids):
            out_row = []
            for x in xs:
                if not valid(rank, row, x):
                    out_row.append(x)
                elif x not in quota:
                    out_row.append(p2l.index(x))
                else:
                    position, seen[x] = seen[x], seen[x] + 1
                    for g in sorted(quota[x]):
                        if position < quota[x][g]:
                            out_row.append(first_slot[(x, g)])
                            break
                        position -= quota[x][g]
            out.append(out_row)
        outs.append(out)
    return outs
