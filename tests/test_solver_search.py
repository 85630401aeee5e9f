"""Packing and migration pieces of the scipy solver: MILP, swap search, relabelling, forecasts."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from eplb.placement.balance import model_balancedness
from eplb.placement.diff import diff_placements
from eplb.placement.model import Placement
from eplb.solver import SolveOptions, Topology, solve
from eplb.solver.predict import Prediction, pass_weights, predict
from eplb.solver.search import local_search as ls
from eplb.solver.search.copies import holds_per_gpu
from eplb.solver.search.migration import relabel, retarget_replicas
from eplb.solver.search.milp import milp_polish
from tests.helpers.placements import random_phy2log


def _one_scenario(load_LE: np.ndarray) -> Prediction:
    return Prediction(load_LE, load_LE[None], np.ones(1))


@pytest.mark.parametrize("seed", range(4))
def test_scipy_is_never_worse_than_the_greedy(seed: int) -> None:
    rng = np.random.default_rng(seed)
    G, N = [(4, 1), (8, 2), (16, 4), (6, 3)][seed]
    E = 8 * G
    topology = Topology(num_gpus=G, num_nodes=N, num_physical=E + 2 * G, num_groups=N)
    load = rng.lognormal(0.0, 1.2, size=(5, E))
    greedy = [
        solve(load, topology, None, SolveOptions(algorithm=a)).predicted_balancedness
        for a in ("deepseek", "deepseek_hierarchical")
    ]
    ours = solve(load, topology, None, SolveOptions(algorithm="scipy", prediction="sum", time_budget_s=0.3))
    assert ours.predicted_balancedness >= max(greedy) - 1e-12


@pytest.mark.parametrize("seed", range(5))
def test_milp_polish_never_worse_and_exact_on_a_whole_small_layer(seed: int) -> None:
    """With every GPU in the subproblem, one MILP solve reaches the brute-force optimum."""
    rng = np.random.default_rng(seed)
    G, S, E = 3, 3, 9
    load_LE = rng.lognormal(0.0, 1.0, size=(2, E))
    phy2log = np.stack([rng.permutation(E) for _ in range(2)]).astype(np.int64)
    cnt = np.ones((2, E), dtype=np.int64)
    stats: dict[str, float] = {}
    polished = milp_polish(phy2log, cnt, _one_scenario(load_LE), G, 5.0, stats, gpus_per_subproblem=G)
    before = model_balancedness(load_LE, Placement.from_phy2log(phy2log.astype(np.int32), G))
    after = model_balancedness(load_LE, Placement.from_phy2log(polished.astype(np.int32), G))
    assert after >= before - 1e-12
    for layer in range(2):
        best = np.inf
        for first in itertools.combinations(range(E), S):
            rest = [e for e in range(E) if e not in first]
            for second in itertools.combinations(rest, S):
                third = [e for e in rest if e not in second]
                loads = [load_LE[layer, list(group)].sum() for group in (first, second, third)]
                best = min(best, max(loads))
        peak = max(load_LE[layer, polished[layer, g * S : (g + 1) * S]].sum() for g in range(G))
        assert peak == pytest.approx(best, rel=1e-9)
    assert stats["milp_solves"] >= 1


def test_milp_polish_improves_a_bad_start_on_a_larger_layer() -> None:
    rng = np.random.default_rng(9)
    G, E, P = 8, 48, 56
    load_LE = rng.lognormal(0.0, 1.0, size=(3, E))
    phy2log = random_phy2log(rng, 3, E, P).astype(np.int64)
    cnt = np.stack([np.bincount(row, minlength=E) for row in phy2log])
    stats: dict[str, float] = {}
    polished = milp_polish(phy2log, cnt, _one_scenario(load_LE), G, 2.0, stats)
    np.testing.assert_array_equal(np.sort(polished, axis=1), np.sort(phy2log, axis=1))
    before = model_balancedness(load_LE, Placement.from_phy2log(phy2log, G))
    after = model_balancedness(load_LE, Placement.from_phy2log(polished, G))
    assert after > before + 0.01
    assert stats["milp_improved_layers"] >= 1


def test_swap_search_polish_keeps_counts_and_never_loses_balance() -> None:
    rng = np.random.default_rng(3)
    G, E, P, L = 8, 40, 48, 4
    origin = Placement.from_phy2log(random_phy2log(rng, L, E, P), G)
    load_LE = rng.lognormal(0.0, 1.0, size=(L, E))
    state = ls.make_swap_state(origin.phy2log_LP, load_LE[None], origin.logcnt_LE, G)
    assert ls.swap_search(state, np.ones(1), G) > 0
    new = Placement.from_phy2log(state.phy2log_LP, G)
    np.testing.assert_array_equal(new.logcnt_LE, origin.logcnt_LE)
    assert (model_balancedness(load_LE, new) >= model_balancedness(load_LE, origin) - 1e-12).all()
    # The state's GPU counts are those of its placement.
    np.testing.assert_array_equal(state.holds_LGE, holds_per_gpu(new.phy2log_LP, G, E))


def test_relabel_undoes_a_gpu_permutation_and_keeps_loads() -> None:
    rng = np.random.default_rng(5)
    G, N, S, E, L = 8, 2, 5, 32, 3
    current = random_phy2log(rng, L, E, G * S).astype(np.int64)
    # Same GPU contents, GPUs permuted and slots shuffled within each GPU.
    blocks = current.reshape(L, G, S)[:, rng.permutation(G)]
    shuffled = np.stack([[rng.permutation(b) for b in layer] for layer in blocks]).reshape(L, G * S)
    np.testing.assert_array_equal(relabel(shuffled, current, G, N), current)
    other = random_phy2log(rng, L, E, G * S).astype(np.int64)
    mapped = relabel(other, current, G, N)
    load = rng.random((L, E))
    a = Placement.from_phy2log(other, G, N)
    b = Placement.from_phy2log(mapped, G, N)
    np.testing.assert_allclose(model_balancedness(load, a), model_balancedness(load, b))
    cur = Placement.from_phy2log(current, G, N)
    assert (
        diff_placements(cur, b).experts_moved_across_gpus <= diff_placements(cur, a).experts_moved_across_gpus
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_retarget_replicas_reaches_the_counts_in_the_fewest_slots(seed: int) -> None:
    rng = np.random.default_rng(seed)
    G, S, E, L = 8, 5, 30, 4
    current = random_phy2log(rng, L, E, G * S).astype(np.int64)
    target = random_phy2log(rng, L, E, G * S).astype(np.int64)
    load = rng.random((L, E)) * 100

    def cnt(p2l: np.ndarray) -> np.ndarray:
        return np.stack([np.bincount(row, minlength=E) for row in p2l])

    out = retarget_replicas(current, cnt(target), load, G)
    np.testing.assert_array_equal(cnt(out), cnt(target))
    # Brute-force lower bound: every replica an expert gains needs a slot of its own.
    need_L = np.maximum(cnt(target) - cnt(current), 0).sum(axis=1)
    np.testing.assert_array_equal((out != current).sum(axis=1), need_L)
    # Only surplus experts give slots up.
    changed = out != current
    surplus = cnt(current) > cnt(target)
    assert all(surplus[layer, current[layer, slot]] for layer, slot in zip(*np.nonzero(changed), strict=True))
    # Already at the target: nothing moves.
    np.testing.assert_array_equal(retarget_replicas(current, cnt(current), load, G), current)


def test_forecasts() -> None:
    W = 40
    for method in ("sum", "decay", "recent", "robust"):
        weights = pass_weights(W, SolveOptions(decay_half_life=5.0, recent_fraction=0.25), method)
        assert weights.shape == (W,) and weights.sum() == pytest.approx(W)
        assert (np.diff(weights) >= 0).all()
    decay = pass_weights(W, SolveOptions(decay_half_life=5.0), "decay")
    assert decay[-1] / decay[-6] == pytest.approx(2.0)
    recent = pass_weights(W, SolveOptions(recent_fraction=0.25), "recent")
    assert (recent[:30] == 0).all() and (recent[30:] > 0).all()

    rng = np.random.default_rng(0)
    load = rng.random((W, 3, 16))
    robust = predict(load, SolveOptions(num_scenarios=4), "robust")
    assert robust.scenarios_ZLE.shape == (5, 3, 16)
    assert robust.scenario_weights_Z.sum() == pytest.approx(1.0)
    totals = robust.scenarios_ZLE.sum(axis=-1)
    np.testing.assert_allclose(totals, np.broadcast_to(robust.point_LE.sum(axis=-1), totals.shape))
    np.testing.assert_allclose(robust.scenarios_ZLE[0], robust.point_LE)
    plain = predict(load, SolveOptions(), "sum")
    np.testing.assert_allclose(plain.point_LE, load.sum(axis=0))
    assert plain.scenarios_ZLE.shape == (1, 3, 16)


@pytest.mark.parametrize("seed", range(3))
def test_the_swap_step_against_brute_force(seed: int) -> None:
    """The step every search shares (eplb.solver.search.swap): the hot GPU credited the most
    urgency, the lightest partners, every candidate swap's slots, loads and delta, and the swap."""
    from eplb.solver.search.swap import SwapCandidates, critical_gpu, lightest_partners, pair_peak, swap_slots

    rng = np.random.default_rng(seed)
    Z, L, G, S, E = 3, 4, 6, 3, 10
    P = G * S
    phy2log_LP = random_phy2log(rng, L, E, P).astype(np.int64)
    item_ZLP = rng.lognormal(0.0, 1.0, size=(Z, L, P))
    gpu_ZLG = item_ZLP.reshape(Z, L, G, S).sum(axis=-1)
    gpu_ZLG[:, 1, 2] = gpu_ZLG[:, 1].max(axis=-1) + 1.0  # one GPU busiest in every scenario
    weights_Z = np.array([0.5, 0.3, 0.2])
    mean_ZL = gpu_ZLG.mean(axis=-1)
    for power in (0, 2):
        hot_L = critical_gpu(gpu_ZLG, mean_ZL, weights_Z, power)
        for layer in range(L):
            urgency = [0.0] * G
            for z in range(Z):
                g = int(np.argmax(gpu_ZLG[z, layer]))
                urgency[g] += weights_Z[z] * (mean_ZL[z, layer] / gpu_ZLG[z, layer, g]) ** power
            assert hot_L[layer] == int(np.argmax(urgency))
    assert hot_L[1] == 2
    expected_LG = rng.random((L, G))
    expected_LG[0, :] = 0.5  # ties: the lower id
    partners_LB = lightest_partners(expected_LG, hot_L, 3)
    for layer in range(L):
        order = sorted((v, g) for g, v in enumerate(expected_LG[layer]) if g != hot_L[layer])
        assert partners_LB[layer].tolist() == [g for _, g in order[:3]]
    layers = np.array([3, 0, 2])
    cand = SwapCandidates.of(item_ZLP, phy2log_LP, layers, hot_L[layers], partners_LB[layers], S)
    delta_ZlSQ = cand.delta_ZlSQ()
    for i, layer in enumerate(layers.tolist()):
        hot = int(hot_L[layer])
        pairs = [
            (a, b)
            for a in range(hot * S, (hot + 1) * S)
            for g in partners_LB[layer]
            for b in range(g * S, (g + 1) * S)
        ]
        for flat, (a, b) in enumerate(pairs):
            s, q = divmod(flat, cand.num_partner_slots)
            got_a, got_b = cand.slots(np.array([flat] * layers.size))
            assert (got_a[i], got_b[i]) == (a, b)
            assert cand.gpu_lQ[i, q] == b // S
            np.testing.assert_array_equal(
                delta_ZlSQ[:, i, s, q], item_ZLP[:, layer, b] - item_ZLP[:, layer, a]
            )
            assert cand.distinct_lSQ()[i, s, q] == (phy2log_LP[layer, a] != phy2log_LP[layer, b])
            x_hot, x_b = gpu_ZLG[0, layer, hot], gpu_ZLG[0, layer, b // S]
            d = item_ZLP[0, layer, b] - item_ZLP[0, layer, a]
            assert pair_peak(x_hot, x_b, d) == max(x_hot + d, x_b - d)
    # The swap: experts, loads and part counts trade places.
    row_P, items_ZP = phy2log_LP[0].copy(), item_ZLP[:, 0].copy()
    holds_GE = holds_per_gpu(row_P[None], G, E)[0]
    a, b = 1, P - 1
    ea, eb = swap_slots(row_P, items_ZP, holds_GE, a, b, a // S, b // S)
    assert (ea, eb) == (phy2log_LP[0, a], phy2log_LP[0, b]) and (row_P[a], row_P[b]) == (eb, ea)
    np.testing.assert_array_equal(items_ZP[:, [a, b]], item_ZLP[:, 0, [b, a]])
    np.testing.assert_array_equal(holds_GE, holds_per_gpu(row_P[None], G, E)[0])
