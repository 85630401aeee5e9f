"""DeepSeek's algorithm (eplb.solver.policies.deepseek) against SGLang 0.5.23's vendored copy, and the
drop-in.

The peer code is downloaded from PyPI by benchmarks.peers at test time (never committed). Random
float loads have no ties, so the maps must be identical; integer loads tie often, and the
reference's unstable sort may then order equal items differently, which permutes equal items
between GPUs: the per-GPU loads, hence the busiest GPU, must still be identical.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from eplb.placement.balance import gpu_load
from eplb.placement.model import Placement
from eplb.solver import SolveOptions, rebalance_experts


@pytest.fixture(scope="module")
def peer() -> Any:
    from benchmarks.peers import load_sglang_deepseek

    return load_sglang_deepseek()


def _random_case(rng: np.random.Generator) -> tuple[int, int, int, int, int, int]:
    """(L, E, P, G, N, groups) with groups dividing E and divisible by N."""
    G = int(rng.choice([1, 2, 4, 8]))
    N = int(rng.choice([n for n in (1, 2, 4) if G % n == 0]))
    groups = int(rng.choice([g for g in (1, 2, 4, 8) if g % N == 0]))
    E = groups * int(rng.integers(1, 5)) * 2
    P = G * int(np.ceil((E + rng.integers(0, 12)) / G))
    return int(rng.integers(1, 5)), E, P, G, N, groups


def _ours(
    weight: torch.Tensor, P: int, groups: int, N: int, G: int, hierarchical: bool
) -> tuple[torch.Tensor, ...]:
    algorithm = "deepseek_hierarchical" if hierarchical else "deepseek"
    if hierarchical:
        return rebalance_experts(weight, P, groups, N, G, options=SolveOptions(algorithm=algorithm))
    return rebalance_experts(weight, P, 1, 1, G, options=SolveOptions(algorithm=algorithm))


@pytest.mark.parametrize("seed", range(6))
def test_identical_maps_on_float_loads(peer: Any, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(12):
        L, E, P, G, N, groups = _random_case(rng)
        weight = torch.from_numpy((rng.random((L, E)) * rng.choice([1.0, 1e4])).astype(np.float32))
        for hierarchical in (False, True):
            expected = peer.rebalance_experts(weight, P, groups, N, G, hierarchical)
            got = _ours(weight, P, groups, N, G, hierarchical)
            assert all(t.dtype == torch.int32 for t in got)
            assert torch.equal(got[0], expected[0].int()), (L, E, P, G, N, groups, hierarchical)
            assert torch.equal(got[2], expected[2].int())
            assert got[1].shape == expected[1].shape
            # Replicas of one expert carry equal loads: their order in log2phy may differ.
            assert torch.equal(got[1].sort(dim=-1).values, expected[1].int().sort(dim=-1).values)


@pytest.mark.parametrize("seed", range(4))
def test_identical_gpu_loads_on_tied_integer_loads(peer: Any, seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    for _ in range(12):
        L, E, P, G, _, _ = _random_case(rng)
        weight_np = rng.integers(0, 6, size=(L, E)).astype(np.float32)
        weight = torch.from_numpy(weight_np)
        expected = Placement.from_deepseek(*peer.rebalance_experts(weight, P, 1, 1, G, False), num_gpus=G)
        got = Placement.from_deepseek(*_ours(weight, P, 1, 1, G, False), num_gpus=G)
        np.testing.assert_array_equal(got.logcnt_LE, expected.logcnt_LE)
        np.testing.assert_allclose(
            np.sort(gpu_load(weight_np, got), axis=-1), np.sort(gpu_load(weight_np, expected), axis=-1)
        )


def test_deepseek_shape_matches_peer(peer: Any) -> None:
    """One DeepSeek-V3-shaped case per node count (58 x 256, 288 slots, 8 groups)."""
    rng = np.random.default_rng(7)
    weight = torch.from_numpy(rng.lognormal(0.0, 1.0, size=(58, 256)).astype(np.float32))
    for G, N in ((8, 1), (16, 2), (32, 4)):
        expected = peer.rebalance_experts(weight, 288, 8, N, G, True)
        got = _ours(weight, 288, 8, N, G, True)
        assert torch.equal(got[0], expected[0].int())


def test_drop_in_follows_deepseeks_hierarchy_rule() -> None:
    """``deepseek`` goes hierarchical when groups divide over nodes, as DeepSeek's entry point does."""
    rng = np.random.default_rng(3)
    weight = rng.random((3, 32)).astype(np.float32)
    plain = rebalance_experts(weight, 40, 4, 2, 8, options=SolveOptions(algorithm="deepseek"))
    hier = rebalance_experts(weight, 40, 4, 2, 8, options=SolveOptions(algorithm="deepseek_hierarchical"))
    flat = rebalance_experts(weight, 40, 3, 2, 8, options=SolveOptions(algorithm="deepseek"))  # 3 % 2 != 0
    assert torch.equal(plain[0], hier[0])
    assert flat[0].shape == (3, 40)


@pytest.mark.parametrize("algorithm", ["auto", "scipy", "deepseek", "deepseek_hierarchical"])
def test_drop_in_returns_valid_int32_triple(algorithm: str) -> None:
    rng = np.random.default_rng(11)
    weight = torch.from_numpy(rng.random((4, 64)).astype(np.float32))
    phy2log, log2phy, logcnt = rebalance_experts(
        weight, 80, 4, 2, 8, options=SolveOptions(algorithm=algorithm)
    )
    assert (phy2log.dtype, log2phy.dtype, logcnt.dtype) == (torch.int32,) * 3
    placement = Placement.from_deepseek(phy2log, log2phy, logcnt, num_gpus=8, num_nodes=2)
    assert log2phy.shape[2] == int(logcnt.max())
    assert placement.num_physical == 80


def test_drop_in_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="NaN"):
        rebalance_experts(np.full((2, 8), np.nan), 8, 1, 1, 2)
    with pytest.raises(ValueError, match="divisible"):
        rebalance_experts(np.ones((2, 8)), 9, 1, 1, 2)
    with pytest.raises(ValueError, match="fewer physical slots"):
        rebalance_experts(np.ones((2, 8)), 6, 1, 1, 2)
