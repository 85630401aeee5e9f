"""Random placements for tests."""

from __future__ import annotations

import numpy as np


def random_phy2log(
    rng: np.random.Generator, num_layers: int, num_logical: int, num_physical: int
) -> np.ndarray:
    """int32 [L, P]: every expert at least once, extra replicas drawn at random, slots shuffled."""
    rows = []
    for _ in range(num_layers):
        extra = rng.integers(0, num_logical, size=num_physical - num_logical)
        rows.append(rng.permutation(np.concatenate([np.arange(num_logical), extra])))
    return np.asarray(rows, dtype=np.int32).reshape(num_layers, num_physical)
