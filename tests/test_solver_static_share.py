"""Static dispatch's replica shares in the share model (eplb.placement.share) against the ranks'
maps."""

from __future__ import annotations

import numpy as np
import pytest

from eplb.placement.dispatch_map import static_dispatch_maps
from eplb.placement.model import Placement
from eplb.placement.share import ShareModel
from eplb.policy.dispatch import dispatch_mode_names
from eplb.solver import SolveOptions, Topology, solve
from eplb.solver.scoring.dispatch import Dispatch
from tests.helpers.placements import maps_share_LP, random_phy2log

# (G, N, E, P): one node, several, one GPU per node, and DeepSeek-V3's EP32 shape.
SHAPES = [(4, 1, 16, 24), (8, 2, 16, 24), (8, 8, 16, 32), (16, 4, 32, 64), (32, 4, 256, 288)]


def static_share_LP(
    phy2log_LP: np.ndarray, E: int, G: int, N: int, layers: np.ndarray | None = None
) -> np.ndarray:
    """The share model's static shares of phy2log rows (counts from the rows themselves)."""
    cnt_LE = np.stack([np.bincount(row, minlength=E) for row in phy2log_LP])
    return ShareModel("static", N).share_LP(phy2log_LP, cnt_LE, G, layers)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("seed", range(3))
def test_shares_are_the_fraction_of_ranks_the_maps_send_to_each_replica(
    shape: tuple[int, int, int, int], seed: int
) -> None:
    G, N, E, P = shape
    rng = np.random.default_rng(seed)
    L = 3
    if seed == 0:  # the spare slots crowded onto three experts: many replicas, some on one node
        spare_LX = rng.choice(rng.integers(0, E, size=3), size=(L, P - E))
        phy2log_LP = np.concatenate([np.tile(np.arange(E), (L, 1)), spare_LX], axis=1)
        for row in phy2log_LP:
            rng.shuffle(row)
    else:
        phy2log_LP = random_phy2log(rng, L, E, P)
    placement = Placement.from_phy2log(phy2log_LP, G, N)
    want_LP = maps_share_LP(placement)
    np.testing.assert_allclose(static_share_LP(placement.phy2log_LP, E, G, N), want_LP)
    # A subset of layers keeps each layer's own rotation.
    rows = np.array([2, 0])
    np.testing.assert_allclose(static_share_LP(placement.phy2log_LP, E, G, N, rows), want_LP[rows])
    S = P // G
    for layer in range(L):
        for e in range(E):
            slots = np.flatnonzero(placement.phy2log_LP[layer] == e)
            (got,) = ShareModel("static", N).expert_shares([slots.tolist()], [layer * E + e], G, S)
            np.testing.assert_allclose(got, want_LP[layer, slots])


def test_an_uneven_static_split_is_what_the_solver_scores() -> None:
    """Three replicas, two on one node: 1/2, 1/4, 1/4 rather than the even split's 1/3 each.

    Node 0's four ranks all send to GPU 0's replica (its own, or the one on their node); on node 1,
    GPUs 4 and 5 keep their own and ranks 6 and 7 take one each.
    """
    G, N, E = 8, 2, 6
    # GPUs 0-3 on node 0, 4-7 on node 1; two slots per GPU; expert 0 on GPUs 0, 4 and 5.
    phy2log = np.array([[0, 1, 2, 3, 4, 5, 1, 2, 0, 3, 0, 4, 5, 1, 2, 3]])
    placement = Placement.from_phy2log(phy2log, G, N)
    share = static_share_LP(placement.phy2log_LP, E, G, N)[0]
    np.testing.assert_allclose(share, maps_share_LP(placement)[0])
    np.testing.assert_allclose(share[np.flatnonzero(phy2log[0] == 0)], [0.5, 0.25, 0.25])


def test_a_static_plan_is_scored_with_the_maps_shares() -> None:
    """current_balancedness of a static solve equals the maps' balancedness on the held-out passes' terms."""
    rng = np.random.default_rng(4)
    topology = Topology(num_gpus=8, num_nodes=2, num_physical=24)
    current = Placement.from_phy2log(random_phy2log(rng, 2, 16, 24), 8, 2)
    load = rng.poisson(rng.lognormal(0.0, 1.0, size=(1, 2, 16)) * 50, size=(1, 2, 16)).astype(float)
    # A window of one pass: the prediction is the forecast's own balancedness, under each split.
    even = solve(load, topology, current, SolveOptions(max_moved_experts=4))
    static = solve(load, topology, current, SolveOptions(max_moved_experts=4, dispatch="static"))
    share_LP = maps_share_LP(current)
    gpu_LG = np.stack(
        [
            np.bincount(np.arange(24) // 3, load[0, layer, current.phy2log_LP[layer]] * share_LP[layer], 8)
            for layer in range(2)
        ]
    )
    want = float((gpu_LG.mean(axis=1) / gpu_LG.max(axis=1)).mean())
    assert static.stats["current_balancedness"] == pytest.approx(want)
    assert static.stats["current_balancedness"] != pytest.approx(even.stats["current_balancedness"])


def test_the_dispatch_is_one_mode_name() -> None:
    """One ``dispatch`` field (a mode of eplb.policy.dispatch) replaced the static_dispatch and
    weighted flags, so a plan can no longer ask for both; weights follow from the mode."""
    for name in dispatch_mode_names():
        options = SolveOptions(dispatch=name)
        assert options.weighted == (name == "weighted")
        assert Dispatch(name).static == (name in ("static", "auto"))  # auto is planned for static's maps
    with pytest.raises(ValueError, match="unknown dispatch mode 'statik'"):
        SolveOptions(dispatch="statik")
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['static_dispatch', 'weighted'\]"):
        SolveOptions.from_mapping({"static_dispatch": True, "weighted": True})
    with pytest.raises(AttributeError):
        SolveOptions(dispatch="weighted").weighted = False  # type: ignore[misc]


def test_the_search_state_keeps_exact_static_loads_through_swaps_and_replica_changes() -> None:
    """After any sequence of moves the state's slot and GPU loads are the static shares' loads, and
    its replica counts per GPU and per node are those of its phy2log, counted again in numpy."""
    from eplb.solver.search import moves

    rng = np.random.default_rng(9)
    G, N, E, P, L = 8, 2, 16, 32, 3
    current = Placement.from_phy2log(random_phy2log(rng, L, E, P), G, N)
    scenarios_ZLE = rng.lognormal(0.0, 1.0, size=(1, L, E))
    cost_LGE = np.ones((L, G, E))
    state = moves.make_move_state(
        scenarios_ZLE, current.phy2log_LP, current.logcnt_LE, cost_LGE, None, Dispatch("static", N)
    )
    for _ in range(300):
        layer = int(rng.integers(L))
        if rng.random() < 0.5:
            a, b = (int(x) for x in rng.choice(P, size=2, replace=False))
            moves.apply_swap(state, layer, a, b)
        else:
            givers = np.flatnonzero(state.cnt_LE[layer, state.phy2log_LP[layer]] >= 2)
            if givers.size:
                moves.apply_replica_change(state, layer, int(rng.choice(givers)), int(rng.integers(E)))
        share_LP = static_share_LP(state.phy2log_LP, E, G, N)
        rows = np.arange(L)[:, None]
        want_LP = state.norm_ZLE[0][rows, state.phy2log_LP] * share_LP
        np.testing.assert_allclose(state.item_ZLP[0], want_LP, atol=1e-12)
        np.testing.assert_allclose(state.gpu_ZLG[0], want_LP.reshape(L, G, -1).sum(axis=-1), atol=1e-9)
        holds_LGE = np.zeros((L, G, E), dtype=np.int64)
        for lay in range(L):
            for slot, expert in enumerate(state.phy2log_LP[lay]):
                holds_LGE[lay, slot // (P // G), expert] += 1
        np.testing.assert_array_equal(state.holds_LGE, holds_LGE)
        assert state.node_has_LNE is not None
        np.testing.assert_array_equal(state.node_has_LNE, holds_LGE.reshape(L, N, G // N, E).sum(axis=2) > 0)


@pytest.mark.parametrize("shape", SHAPES)
def test_served_balancedness_is_the_maps_gpu_loads(shape: tuple[int, int, int, int]) -> None:
    """What the manager reports before and after a plan: GPU loads of every rank sending its
    share of each expert through its own static map (numpy, from the maps), mean / max per layer."""
    from eplb.placement.balance import balancedness, model_balancedness
    from eplb.solver.scoring.served import served_balancedness

    G, N, E, P = shape
    rng = np.random.default_rng(7)
    placement = Placement.from_phy2log(random_phy2log(rng, 3, E, P), G, N)
    load_LE = rng.gamma(0.5, 100.0, size=(3, E))
    maps_GLE = static_dispatch_maps(placement)
    S = P // G
    gpu_LG = np.zeros((3, G))
    for g in range(G):
        for layer in range(3):
            np.add.at(gpu_LG[layer], maps_GLE[g, layer] // S, load_LE[layer] / G)
    want = float(balancedness(gpu_LG).mean())
    assert served_balancedness(load_LE, placement, dispatch="static") == pytest.approx(want, abs=1e-12)
    even = float(model_balancedness(load_LE, placement))
    assert served_balancedness(load_LE, placement) == pytest.approx(even, abs=1e-12)
