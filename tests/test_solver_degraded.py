"""The degraded plan (``solve`` with ``alive_ranks``); failure-aware placement is in tests/test_spread.py.

Checked against plain loops over slots (which experts need a reload, what each transfer copies)
and against a brute force over every placement of tiny cases (the fewest slots any plan must
change, the best balance any plan reaches), on random inputs with fixed seeds.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from eplb.placement.balance import model_balancedness
from eplb.placement.degraded import DegradedPlacement, check_alive, reload_report
from eplb.placement.model import Placement
from eplb.solver import SolveOptions, Topology, solve
from eplb.solver.degraded import survivors

BYTES = 1000


def _random_placement(rng: np.random.Generator, L: int, E: int, P: int, G: int, N: int) -> Placement:
    rows = []
    for _ in range(L):
        row = np.concatenate([np.arange(E), rng.integers(0, E, P - E)])
        rows.append(rng.permutation(row))
    return Placement.from_phy2log(np.array(rows), G, N)


def _alive(rng: np.random.Generator, G: int, S: int, E: int, dead: int) -> tuple[bool, ...]:
    alive = np.ones(G, dtype=bool)
    alive[rng.choice(G, dead, replace=False)] = False
    assert alive.sum() * S >= E
    return tuple(alive.tolist())


def _lost_by_loop(current: Placement, alive: tuple[bool, ...]) -> np.ndarray:
    """bool [L, E]: experts with no slot on a live GPU, slot by slot."""
    S = current.slots_per_gpu
    lost = np.ones((current.num_layers, current.num_logical), dtype=bool)
    for layer in range(current.num_layers):
        for slot in range(current.num_physical):
            if alive[slot // S]:
                lost[layer, current.phy2log_LP[layer, slot]] = False
    return lost


def _check_degraded(current: Placement, plan_degraded: DegradedPlacement, alive: tuple[bool, ...]) -> None:
    """Dead slots -1, live ones valid, every expert served on live slots only."""
    S = current.slots_per_gpu
    p2l = plan_degraded.phy2log_LP
    for slot in range(current.num_physical):
        if alive[slot // S]:
            assert (p2l[:, slot] >= 0).all()
        else:
            assert (p2l[:, slot] == -1).all()
    for layer in range(current.num_layers):
        served = set(p2l[layer][p2l[layer] >= 0].tolist())
        assert served == set(range(current.num_logical))
        for expert in range(current.num_logical):
            slots = plan_degraded.log2phy_LER[layer, expert]
            slots = slots[slots >= 0]
            assert slots.size == plan_degraded.logcnt_LE[layer, expert] >= 1
            assert all(alive[s // S] and p2l[layer, s] == expert for s in slots.tolist())


def _copies_by_loop(current: Placement, new: DegradedPlacement, alive: tuple[bool, ...]) -> tuple[int, int]:
    """(reloads, copies across GPUs) of the two-phase rule, by sets of (GPU, expert) pairs."""
    S = current.slots_per_gpu
    reloads = copies = 0
    live = [g for g in range(current.num_gpus) if alive[g]]
    for layer in range(current.num_layers):
        before = {
            (g, int(current.phy2log_LP[layer, s])) for s in range(current.num_physical) if alive[g := s // S]
        }
        after = {
            (s // S, int(new.phy2log_LP[layer, s])) for s in range(current.num_physical) if alive[s // S]
        }
        held = {e for _, e in before}
        for expert in range(current.num_logical):
            if expert not in held:
                reloads += 1
                first = min(g for g in live if (g, expert) in after)
                before.add((first, expert))
        copies += len(after - before)
    return reloads, copies


@pytest.mark.parametrize("seed", range(6))
def test_every_expert_served_on_live_slots_and_the_reload_list(seed: int) -> None:
    rng = np.random.default_rng(seed)
    L, E, G, N, S = 3, 12, 6, 2, 3
    current = _random_placement(rng, L, E, G * S, G, N)
    alive = _alive(rng, G, S, E, dead=int(rng.integers(1, 3)))
    load = rng.gamma(0.7, 100.0, (8, L, E))
    options = SolveOptions(alive_ranks=alive, bytes_per_expert=BYTES, reload_source="host")
    plan = solve(load, Topology(num_gpus=G, num_nodes=N, num_physical=G * S), current, options)
    assert plan.apply and plan.degraded is not None and plan.reload is not None
    _check_degraded(current, plan.degraded, alive)
    assert plan.placement.num_gpus == sum(alive)
    assert plan.placement.same_slots(plan.degraded.survivors)
    lost = _lost_by_loop(current, alive)
    np.testing.assert_array_equal(plan.reload.reload_LE, lost)
    assert plan.reload.reload_list() == [tuple(map(int, x)) for x in np.argwhere(lost)]
    reloads, copies = _copies_by_loop(current, plan.degraded, alive)
    assert (plan.reload.reloads, plan.reload.survivor_copies) == (reloads, copies)
    assert plan.reload.bytes_by_source == {"survivor": copies * BYTES, "host": reloads * BYTES}


@pytest.mark.parametrize("seed", range(4))
def test_survivors_replicas_stay_when_no_move_pays(seed: int) -> None:
    """At a prohibitive copy price nothing crosses GPUs but the reloads; the repair it starts from
    changes one slot per lost expert, the fewest possible (the search may add local copies: a
    replica on a GPU that holds the expert already moves no byte)."""
    rng = np.random.default_rng(100 + seed)
    L, E, G, S = 4, 10, 5, 3
    current = _random_placement(rng, L, E, G * S, G, 1)
    alive = _alive(rng, G, S, E, dead=1)
    load = rng.gamma(0.7, 100.0, (6, L, E))
    topology = Topology(num_gpus=G, num_physical=G * S)
    options = SolveOptions(alive_ranks=alive, copy_cost=1e6)
    plan = solve(load, topology, current, options)
    assert plan.reload is not None and plan.degraded is not None
    assert plan.reload.survivor_copies == 0
    assert plan.reload.reloads == _lost_by_loop(current, alive).sum()
    live = np.repeat(np.array(alive), S)
    changed_L = (current.phy2log_LP[:, live] != plan.degraded.phy2log_LP[:, live]).sum(axis=1)
    assert plan.reload.kept_slots == live.sum() * L - changed_L.sum()
    repaired = survivors(np.asarray(load, dtype=np.float64), topology, current, options).repaired
    repaired_L = (current.phy2log_LP[:, live] != repaired.phy2log_LP).sum(axis=1)
    np.testing.assert_array_equal(repaired_L, _lost_by_loop(current, alive).sum(axis=1))
    # And when copies are free, the plan balances at least as well as that repair.
    options = SolveOptions(alive_ranks=alive, copy_cost=0.0, prediction="sum")
    free = solve(load, topology, current, options)
    start = survivors(np.asarray(load, dtype=np.float64), topology, current, options).repaired
    assert model_balancedness(load.sum(0), free.placement) >= model_balancedness(load.sum(0), start) - 1e-9


def _all_placements(E: int, P: int) -> np.ndarray:
    """int [k, P]: every phy2log row over P slots that holds each of the E experts."""
    rows = np.array(list(itertools.product(range(E), repeat=P)))
    return rows[np.array([len(set(r.tolist())) == E for r in rows])]


@pytest.mark.parametrize("seed", range(5))
def test_against_a_brute_force_of_every_placement(seed: int) -> None:
    """Tiny case (E=4, 3 live GPUs of 2 slots): the repair changes the brute-force fewest slots, and
    the free plan's balance is within 0.1 of the best placement's (the search is a heuristic)."""
    rng = np.random.default_rng(200 + seed)
    E, G, S = 4, 4, 2
    current = _random_placement(rng, 1, E, G * S, G, 1)
    alive = _alive(rng, G, S, E, dead=1)
    load_LE = rng.gamma(0.8, 100.0, (1, E))
    rows = _all_placements(E, 3 * S)
    live = np.repeat(np.array(alive), S)
    old = current.phy2log_LP[0, live]
    fewest = int((rows != old).sum(axis=1).min())
    topology = Topology(num_gpus=G, num_physical=G * S)
    options = SolveOptions(alive_ranks=alive, copy_cost=1e6)
    repaired = survivors(load_LE[None], topology, current, options).repaired
    assert int((repaired.phy2log_LP[0] != old).sum()) == fewest
    count = np.stack([(rows == e).sum(axis=1) for e in range(E)], axis=1)
    share = load_LE[0][rows] / np.take_along_axis(count, rows, axis=1)
    gpu = share.reshape(len(rows), 3, S).sum(axis=2)
    best = float((gpu.mean(axis=1) / gpu.max(axis=1)).max())
    free = solve(load_LE, topology, current, SolveOptions(alive_ranks=alive, copy_cost=0.0, prediction="sum"))
    got = float(model_balancedness(load_LE, free.placement))
    assert got <= best + 1e-9
    assert got >= best - 0.1


def test_deterministic_whatever_the_seed() -> None:
    rng = np.random.default_rng(7)
    L, E, G, N, S = 4, 16, 8, 2, 3
    current = _random_placement(rng, L, E, G * S, G, N)
    alive = (True, False, True, True, True, True, False, True)
    load = rng.gamma(0.7, 100.0, (20, L, E))
    topology = Topology(num_gpus=G, num_nodes=N, num_physical=G * S)
    plans = [solve(load, topology, current, SolveOptions(alive_ranks=alive, seed=s)) for s in (0, 0, 5)]
    for other in plans[1:]:
        assert other.degraded is not None and plans[0].degraded is not None
        np.testing.assert_array_equal(other.degraded.phy2log_LP, plans[0].degraded.phy2log_LP)
        np.testing.assert_array_equal(other.degraded.log2phy_LER, plans[0].degraded.log2phy_LER)
    # One rank lost on each node: the survivors keep two nodes of three GPUs.
    assert plans[0].placement.num_nodes == 2
    assert plans[0].degraded is not None and plans[0].degraded.log2phy_LER.shape == (L, E, G * S - E + 1)


def test_every_rank_alive_keeps_the_placement_and_uneven_nodes_plan_as_one() -> None:
    rng = np.random.default_rng(3)
    L, E, G, N, S = 2, 8, 4, 2, 4
    current = _random_placement(rng, L, E, G * S, G, N)
    topology = Topology(num_gpus=G, num_nodes=N, num_physical=G * S)
    load = rng.gamma(0.7, 100.0, (5, L, E))
    plan = solve(load, topology, current, SolveOptions(alive_ranks=(True,) * G, copy_cost=1e6))
    assert plan.reload is not None and plan.reload.reloads == 0 and plan.reload.survivor_copies == 0
    assert plan.placement.same_slots(current)
    uneven = solve(load, topology, current, SolveOptions(alive_ranks=(True, True, True, False)))
    assert uneven.placement.num_nodes == 1 and uneven.placement.num_gpus == 3
    one = solve(load, topology, current, SolveOptions(alive_ranks=(False, False, True, True)))
    assert one.placement.num_nodes == 1  # one node left
    with pytest.raises(ValueError, match="fewer than the 8 logical experts"):
        solve(load, topology, current, SolveOptions(alive_ranks=(False, False, False, True)))


@pytest.mark.parametrize("dispatch", ["static", "weighted"])
def test_dispatch_modes(dispatch: str) -> None:
    rng = np.random.default_rng(11)
    L, E, G, N, S = 2, 12, 6, 2, 3
    current = _random_placement(rng, L, E, G * S, G, N)
    alive = (True, True, False, True, True, True)
    load = rng.gamma(0.7, 100.0, (10, L, E))
    plan = solve(
        load,
        Topology(num_gpus=G, num_nodes=N, num_physical=G * S),
        current,
        SolveOptions(alive_ranks=alive, dispatch=dispatch),
    )
    assert plan.degraded is not None
    _check_degraded(current, plan.degraded, alive)
    if dispatch == "weighted":
        assert plan.dispatch_weights_LER is not None
        assert plan.dispatch_weights_LER.shape == plan.placement.log2phy_LER.shape
        np.testing.assert_allclose(plan.dispatch_weights_LER.sum(axis=2), 1.0, atol=1e-5)


def test_bad_inputs() -> None:
    current = Placement.trivial(1, 4, 2, 4)
    topology = Topology(num_gpus=2, num_physical=8)
    load = np.ones((1, 4))
    with pytest.raises(ValueError, match="pass current"):
        solve(load, topology, None, SolveOptions(alive_ranks=(True, False)))
    with pytest.raises(ValueError, match="must list 2 ranks"):
        solve(load, topology, current, SolveOptions(alive_ranks=(True, False, True)))
    with pytest.raises(ValueError, match="no rank is alive"):
        solve(load, topology, current, SolveOptions(alive_ranks=(False, False)))
    with pytest.raises(ValueError, match="one boolean per EP rank"):
        SolveOptions(alive_ranks=(1, 2))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reload_source"):
        SolveOptions(reload_source="disk")
    with pytest.raises(ValueError, match="failure_domain"):
        SolveOptions(failure_domain="rack")
    with pytest.raises(ValueError, match="move budget"):
        SolveOptions(failure_domain="node", max_moved_experts=10)
    with pytest.raises(ValueError, match="booleans"):
        check_alive(np.array([0.5, 1.0]), 2)
    # From JSON (--solver-option alive_ranks=[1,0]): a list of 0/1 becomes booleans.
    assert SolveOptions.from_mapping({"alive_ranks": [1, 0]}).alive_ranks == (True, False)
    plan = solve(load, topology, current, SolveOptions(alive_ranks=(True, False)))
    assert plan.placement.num_gpus == 1 and plan.degraded is not None
    with pytest.raises(ValueError, match="reload source"):
        reload_report(current, plan.degraded, "tape")


def test_degraded_placement_validation() -> None:
    survivors = Placement.from_phy2log(np.array([[0, 1, 2, 0]]), 2)
    degraded = DegradedPlacement.from_survivors(survivors, np.array([True, False, True]), 1)
    np.testing.assert_array_equal(degraded.phy2log_LP, [[0, 1, -1, -1, 2, 0]])
    np.testing.assert_array_equal(degraded.log2phy_LER[0, 0, :2], [0, 5])
    bad = degraded.phy2log_LP.copy()
    bad[0, 2] = 1
    with pytest.raises(ValueError, match="dead rank's slot"):
        DegradedPlacement(
            survivors, degraded.alive_G, 1, bad, degraded.log2phy_LER, degraded.logcnt_LE
        ).validate()
    with pytest.raises(ValueError, match="ranks alive"):
        DegradedPlacement.from_survivors(survivors, np.array([True, False, False]), 1)


def test_an_expert_lost_with_two_replicas_is_reloaded_once() -> None:
    """Expert 0 has both its replicas on rank 0, and the degraded plan gives it two again: one load
    from the reload source (per layer), the second replica a copy between survivors."""
    current = Placement.from_phy2log(np.array([[0, 0, 1, 1, 2, 3, 3, 2, 4]] * 2), 3)
    load = np.array([[[60.0, 5.0, 5.0, 5.0, 5.0]] * 2])
    options = SolveOptions(alive_ranks=(False, True, True), bytes_per_expert=BYTES, copy_cost=0.0)
    plan = solve(load, Topology(num_gpus=3, num_nodes=1, num_physical=9), current, options)
    assert plan.reload is not None and plan.degraded is not None
    np.testing.assert_array_equal(plan.degraded.logcnt_LE[:, 0], [2, 2])
    assert plan.reload.reload_list() == [(0, 0), (1, 0)]
    assert plan.reload.reloads == 2 and plan.reload.bytes_reloaded == 2 * BYTES
    reloads, copies = _copies_by_loop(current, plan.degraded, (False, True, True))
    assert (plan.reload.reloads, plan.reload.survivor_copies) == (reloads, copies) and copies >= 2
