"""Each engine adapter's planning entry point, called as its engine calls it, without the engine.

The engine files (tests/test_integrations_vllm.py, _sglang.py, _elastic.py) run these through vLLM's
and SGLang's own loaders from PyPI, in the slow set; here the quick representative of each:
vLLM's ``EplbVllmPolicy.rebalance_experts`` and SGLang's ``rebalance_with_eplb`` on a skewed load,
judged in plain numpy: every expert placed, SGLang's three maps consistent with each other, the
same answer when asked again, and the busiest GPU lighter than under the trivial placement; with
a rank lost, SGLang's maps send no token to it and still serve every expert, and vLLM's scale-down
plans every expert onto the ranks it keeps.
Shape legend: W window passes, L layers, E logical experts, P physical slots, G GPUs, R max replicas.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from eplb.integrations import sglang
from eplb.integrations.engine_env import SOLVER_OPTIONS_ENV
from eplb.integrations.vllm import EplbVllmPolicy

W, L, E, G, NODES = 4, 3, 16, 4, 2
P = 24  # 8 redundant slots


def skewed_load_WLE(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    popularity_LE = rng.pareto(1.1, size=(L, E)) + 0.05
    return rng.poisson(200 * popularity_LE, size=(W, L, E)).astype(np.float64)


def busiest_gpu_L(load_LE: np.ndarray, phy2log_LP: np.ndarray) -> np.ndarray:
    """Each layer's heaviest GPU load, every expert's tokens split evenly over its replicas."""
    replicas_LE = np.stack([np.bincount(row, minlength=E) for row in phy2log_LP])
    share_LP = np.take_along_axis(load_LE / replicas_LE, phy2log_LP, axis=1)
    return share_LP.reshape(L, G, P // G).sum(axis=2).max(axis=1)


def trivial_LP() -> np.ndarray:
    """Expert e in slot e, the redundant slots holding experts 0, 1, ... again."""
    return np.tile(np.arange(P) % E, (L, 1))


def assert_places_every_expert(phy2log_LP: np.ndarray) -> None:
    assert phy2log_LP.shape == (L, P)
    for row in phy2log_LP:
        assert set(row.tolist()) == set(range(E))


@pytest.fixture
def fresh_adapters(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Both adapters with no state kept, reading the environment afresh."""
    # Without the MILP repacking (the solver's tests check it): it costs seconds a plan here.
    monkeypatch.setenv(SOLVER_OPTIONS_ENV, '{"milp_max_solves": 0}')
    EplbVllmPolicy.reset()
    sglang.reset()
    yield
    EplbVllmPolicy.reset()
    sglang.reset()


@pytest.mark.usefixtures("fresh_adapters")
@pytest.mark.parametrize("seed", [0, 1])
def test_vllms_entry_point_plans_a_valid_balanced_placement(seed: int) -> None:
    load_LE = skewed_load_WLE(seed).sum(axis=0)
    got = EplbVllmPolicy.rebalance_experts(torch.from_numpy(load_LE), P, 1, NODES, G)
    assert got.dtype == torch.int64 and got.device.type == "cpu"
    phy2log_LP = got.numpy()
    assert_places_every_expert(phy2log_LP)
    assert (busiest_gpu_L(load_LE, phy2log_LP) < busiest_gpu_L(load_LE, trivial_LP())).all()
    EplbVllmPolicy.reset()
    again = EplbVllmPolicy.rebalance_experts(torch.from_numpy(load_LE), P, 1, NODES, G)
    assert torch.equal(again, got)


def check_sglang_maps(
    phy2log_LP: np.ndarray, log2phy_LER: np.ndarray, logcnt_LE: np.ndarray, dead_gpu: int | None
) -> None:
    """log2phy lists, for each expert, exactly its live slots (padded with -1); logcnt counts them."""
    for layer in range(L):
        for expert in range(E):
            slots = [
                s
                for s in range(P)
                if phy2log_LP[layer, s] == expert and (dead_gpu is None or s // (P // G) != dead_gpu)
            ]
            assert slots, (layer, expert)
            row = log2phy_LER[layer, expert]
            assert sorted(row[row >= 0].tolist()) == slots and (row[len(slots) :] == -1).all()
            assert logcnt_LE[layer, expert] == len(slots)


@pytest.mark.usefixtures("fresh_adapters")
def test_sglangs_entry_point_returns_its_three_maps_consistent_and_balanced() -> None:
    window_WLE = skewed_load_WLE(2)
    algorithm = sglang.EplbSolverAlgorithm("scipy")
    maps = sglang.rebalance_with_eplb(torch.from_numpy(window_WLE), P, P // G, 1, NODES, algorithm)
    assert all(m.dtype == torch.int64 and m.device.type == "cpu" for m in maps)
    phy2log_LP, log2phy_LER, logcnt_LE = (m.numpy() for m in maps)
    assert_places_every_expert(phy2log_LP)
    check_sglang_maps(phy2log_LP, log2phy_LER, logcnt_LE, dead_gpu=None)
    load_LE = window_WLE.sum(axis=0)
    assert (busiest_gpu_L(load_LE, phy2log_LP) < busiest_gpu_L(load_LE, trivial_LP())).all()
    sglang.reset()
    again = sglang.rebalance_with_eplb(torch.from_numpy(window_WLE), P, P // G, 1, NODES, algorithm)
    assert all(torch.equal(a, b) for a, b in zip(again, maps, strict=True))


@pytest.mark.usefixtures("fresh_adapters")
def test_sglang_with_a_rank_lost_sends_it_nothing_and_serves_every_expert() -> None:
    window_WLE = skewed_load_WLE(3)
    dead = G - 1
    active = torch.ones(G, dtype=torch.int32)
    active[dead] = 0
    maps = sglang.rebalance_with_eplb(
        torch.from_numpy(window_WLE),
        P,
        P // G,
        1,
        NODES,
        sglang.EplbSolverAlgorithm("scipy"),
        current_phy2log=torch.from_numpy(trivial_LP()),
        active_ranks=active,
    )
    phy2log_LP, log2phy_LER, logcnt_LE = (m.numpy() for m in maps)
    check_sglang_maps(phy2log_LP, log2phy_LER, logcnt_LE, dead_gpu=dead)
    assert (phy2log_LP[:, dead * (P // G) : (dead + 1) * (P // G)] == 0).all()  # SGLang's filler


@pytest.mark.usefixtures("fresh_adapters")
def test_vllm_scale_down_plans_over_the_kept_ranks_only() -> None:
    # vLLM's elastic scale-down: the old map of G ranks with the new sizes (the last rank leaving).
    load_LE = skewed_load_WLE(4).sum(axis=0)
    kept, slots = G - 1, P // G
    got = EplbVllmPolicy.rebalance_experts(
        torch.from_numpy(load_LE),
        kept * slots,
        1,
        1,
        kept,
        old_global_expert_indices=torch.from_numpy(trivial_LP()),
    ).numpy()
    assert got.shape == (L, kept * slots)
    for row in got:
        assert set(row.tolist()) == set(range(E))
