"""LP split of expert load over replicas, against the exact optimum from a brute-force cut bound.

For splittable load with eligible GPUs, the smallest possible busiest GPU is (max-flow min-cut)
the largest, over GPU sets T, of the load of experts whose replicas all lie in T, divided by |T|.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from eplb.placement.balance import gpu_load
from eplb.placement.model import Placement
from eplb.solver.search.split import lp_split
from tests.helpers.placements import random_phy2log


def _optimal_peak(load_E: np.ndarray, holders: list[set[int]], num_gpus: int) -> float:
    best = 0.0
    for size in range(1, num_gpus + 1):
        for subset in itertools.combinations(range(num_gpus), size):
            inside = set(subset)
            trapped = sum(load_E[e] for e, gpus in enumerate(holders) if gpus <= inside)
            best = max(best, trapped / size)
    return best


@pytest.mark.parametrize("seed", range(10))
def test_lp_split_reaches_the_brute_force_optimum(seed: int) -> None:
    rng = np.random.default_rng(seed)
    G = int(rng.integers(2, 6))
    S = int(rng.integers(2, 4))
    E = int(rng.integers(G, G * S))
    L = 3
    placement = Placement.from_phy2log(random_phy2log(rng, L, E, G * S), num_gpus=G)
    load_LE = rng.lognormal(0.0, 1.0, size=(L, E)) * rng.choice([1.0, 1e5])
    load_LE[0, rng.integers(E)] = 0.0  # an idle expert
    weights = lp_split(load_LE, placement)
    assert weights.dtype == np.float32 and weights.shape == placement.log2phy_LER.shape
    assert (weights >= 0).all() and (weights[placement.log2phy_LER < 0] == 0).all()
    np.testing.assert_allclose(weights.sum(axis=-1), 1.0, atol=1e-6)
    peaks = gpu_load(load_LE, placement, weights).max(axis=-1)
    even_peaks = gpu_load(load_LE, placement).max(axis=-1)
    gpu_of_slot = placement.gpu_of_slot()
    for layer in range(L):
        holders = [set(gpu_of_slot[placement.phy2log_LP[layer] == e].tolist()) for e in range(E)]
        optimum = _optimal_peak(load_LE[layer], holders, G)
        assert peaks[layer] == pytest.approx(optimum, rel=1e-5)
        assert peaks[layer] <= even_peaks[layer] * (1 + 1e-6)


def test_lp_split_keeps_the_even_split_when_it_is_optimal() -> None:
    """Uniform load, every expert twice on different GPUs: the even split is optimal and is kept."""
    E, G = 8, 4
    phy2log = np.concatenate([np.arange(E), np.roll(np.arange(E), 2)])[None].astype(np.int32)
    placement = Placement.from_phy2log(phy2log, num_gpus=G)
    weights = lp_split(np.ones((1, E)), placement)
    used = placement.log2phy_LER >= 0
    np.testing.assert_allclose(weights[used], 0.5, atol=1e-6)


def test_lp_split_without_replicas_is_all_ones() -> None:
    placement = Placement.trivial(2, 8, 4)
    weights = lp_split(np.random.default_rng(0).random((2, 8)), placement)
    np.testing.assert_array_equal(weights[:, :, 0], 1.0)
