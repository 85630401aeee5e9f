"""Inputs and stand-ins for the SGLang ``lp`` tests: placements, batches, an EP group of one process.

Shape legend: L layers, E logical experts, P physical slots, G GPUs (EP ranks), T tokens, K top-k.

A batch is one pass: per layer, global counts per expert of a kind (``random``, ``heavy``: Pareto,
``one_hot``: one expert takes everything, ``replicated``: only the replicated experts, ``idle``:
heavy-tailed with the experts of the first quarter of the GPUs unrouted and the last rank without
tokens), spread over the ranks' ids [T, K] (-1 pads each rank's last row). :class:`OneProcessGroup`
plays SGLang's EP ``GroupCoordinator`` for G ranks run one after another in one process: it knows
every rank's counts of the call in advance, checks that the calling rank contributes exactly its
own, and fills the gathered rows. :func:`gloo_rank` is one rank of the multi-process test.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from eplb.placement.model import Placement
from tests.helpers.placements import random_phy2log
from tests.helpers.spawn import init_gloo

K = 8
KINDS = ("random", "heavy", "one_hot", "replicated", "idle")
SHAPES = ((32, 48, 8), (16, 24, 4), (16, 16, 4))
"""(E, P, G) of the test placements; the last has no redundant slot (no expert replicated)."""
L = 3


def placement(shape: int, seed: int = 0) -> Placement:
    """A random placement of SHAPES[shape] (every expert at least once, extra replicas at random)."""
    E, P, G = SHAPES[shape]
    rng = np.random.default_rng(100 * shape + seed)
    return Placement.from_phy2log(random_phy2log(rng, L, E, P), num_gpus=G)


def global_counts(kind: str, pl: Placement, seed: int) -> np.ndarray:
    """int64 [L, E]: one batch's counts per layer of ``kind``."""
    rng = np.random.default_rng(seed)
    E, G, S = pl.num_logical, pl.num_gpus, pl.slots_per_gpu
    if kind == "random":
        return rng.integers(0, 200, size=(L, E))
    counts = np.rint(150 * (rng.pareto(1.2, size=(L, E)) + 0.05)).astype(np.int64)
    if kind == "one_hot":
        counts = np.zeros((L, E), dtype=np.int64)
        counts[np.arange(L), np.argmax(pl.logcnt_LE, axis=1)] = 6000
    elif kind == "replicated":
        counts = np.where(pl.logcnt_LE >= 2, rng.integers(1, 3000, size=(L, E)), 0)
    elif kind == "idle":
        for layer in range(L):
            counts[layer, np.unique(pl.phy2log_LP[layer, : max(G // 4, 1) * S])] = 0
    return counts


def rank_ids(
    counts_LE: np.ndarray, num_gpus: int, seed: int, idle_ranks: tuple[int, ...] = ()
) -> list[np.ndarray]:
    """Per rank int32 [L, T_r, K]: the layers' tokens spread over the ranks not in ``idle_ranks``
    (T_r = 0 there), in random order, -1 padding the rest of each rank's rows."""
    rng = np.random.default_rng(seed)
    active = [g for g in range(num_gpus) if g not in idle_ranks]
    elements = max(int(counts_LE.sum(axis=1).max()), 1)
    T = -(-elements // (K * len(active)))
    out = [
        np.full((counts_LE.shape[0], T if g in active else 0, K), -1, dtype=np.int32) for g in range(num_gpus)
    ]
    for layer, counts_E in enumerate(counts_LE):
        flat = rng.permutation(np.repeat(np.arange(counts_E.size, dtype=np.int32), counts_E))
        flat = np.concatenate([flat, np.full(T * K * len(active) - flat.size, -1, dtype=np.int32)])
        for i, g in enumerate(active):
            out[g][layer] = flat[i * T * K : (i + 1) * T * K].reshape(T, K)
    return out


@dataclass(frozen=True)
class Batch:
    """One test pass: the placement, its kind, and every rank's ids per layer."""

    shape: int
    kind: str
    seed: int

    @property
    def idle_ranks(self) -> tuple[int, ...]:
        return (SHAPES[self.shape][2] - 1,) if self.kind == "idle" else ()

    def ids(self) -> list[np.ndarray]:
        pl = placement(self.shape)
        return rank_ids(global_counts(self.kind, pl, self.seed), pl.num_gpus, self.seed + 1, self.idle_ranks)


BATCHES = [Batch(shape, kind, 10 * shape + i) for shape in range(len(SHAPES)) for i, kind in enumerate(KINDS)]


class OneProcessGroup:
    """SGLang's EP ``GroupCoordinator`` (``world_size``, ``rank_in_group``,
    ``all_gather_into_tensor``) for ranks run one after another in one process."""

    def __init__(self, rank: int, local_GE: np.ndarray) -> None:
        self.world_size = int(local_GE.shape[0])
        self.rank_in_group = rank
        self.local_GE = local_GE
        """int32 [G, E]: every rank's counts of the call about to run (set per call)."""
        self.calls = 0

    def all_gather_into_tensor(self, output: Any, input: Any) -> None:
        import torch

        mine = torch.from_numpy(self.local_GE[self.rank_in_group].astype(np.int32))
        assert torch.equal(input.cpu(), mine), "a rank contributed counts other than its own"
        output.copy_(torch.from_numpy(self.local_GE.astype(np.int32)).reshape(-1))
        self.calls += 1


def local_counts(ids_TK: np.ndarray, num_logical: int) -> np.ndarray:
    """int64 [E]: a rank's valid ids per expert (what it contributes to the exchange)."""
    flat = ids_TK.reshape(-1)
    return np.bincount(flat[(flat >= 0) & (flat < num_logical)], minlength=num_logical)


def gloo_rank(rank: int, world: int, init: str, out_dir: str) -> None:
    """One real process of the Gloo test: eplb's SGLang ``lp`` solvers over a real EP group."""
    import torch
    import torch.distributed as dist

    from eplb.integrations.sglang_lp import LpServing, gather_for

    init_gloo(init, rank, world)
    try:
        pl = placement(1)
        group = _GlooGroup(world, rank)
        serving = LpServing(pl, rank, torch.device("cpu"), gather_for(group, world, rank))
        batch = Batch(1, "idle", 5)
        ids = batch.ids()[rank]
        out = [
            serving.solvers[layer].solve(torch.from_numpy(ids[layer])).phys_TK.tolist() for layer in range(L)
        ]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


class _GlooGroup:
    """The three members of SGLang's GroupCoordinator that eplb's exchange uses, over torch.distributed."""

    def __init__(self, world: int, rank: int) -> None:
        self.world_size, self.rank_in_group = world, rank

    def all_gather_into_tensor(self, output: Any, input: Any) -> None:
        import torch.distributed as dist

        dist.all_gather_into_tensor(output, input)


__all__ = [
    "BATCHES",
    "KINDS",
    "SHAPES",
    "Batch",
    "OneProcessGroup",
    "global_counts",
    "gloo_rank",
    "local_counts",
    "placement",
    "rank_ids",
]
