"""Random placements for tests."""

from __future__ import annotations

import numpy as np

from eplb.placement.dispatch_map import static_dispatch_maps
from eplb.placement.model import Placement


def random_phy2log(
    rng: np.random.Generator, num_layers: int, num_logical: int, num_physical: int
) -> np.ndarray:
    """int32 [L, P]: every expert at least once, extra replicas drawn at random, slots shuffled."""
    rows = []
    for _ in range(num_layers):
        extra = rng.integers(0, num_logical, size=num_physical - num_logical)
        rows.append(rng.permutation(np.concatenate([np.arange(num_logical), extra])))
    return np.asarray(rows, dtype=np.int32).reshape(num_layers, num_physical)


def maps_share_LP(placement: Placement) -> np.ndarray:
    """float64 [L, P]: the fraction of ranks whose static map sends each slot's expert to it,
    counted rank by rank from the maps themselves (a slot no rank picks receives nothing)."""
    maps_GLE = static_dispatch_maps(placement)
    L, P, G = placement.num_layers, placement.num_physical, placement.num_gpus
    share_LP = np.zeros((L, P))
    for g in range(G):
        for layer in range(L):
            np.add.at(share_LP[layer], maps_GLE[g, layer], 1.0 / G)
    return share_LP
