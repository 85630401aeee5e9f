"""Failure-aware placement (``SolveOptions.failure_domain``, eplb.solver.search.spread).

Checked against plain loops (the cover's counts by a scan instead of a heap; which experts a
domain's loss orphans, slot by slot), on seeded random placements and loads, and through
``solve`` and its degraded plan: with the option on, losing any one domain reloads no more than
the even share of the experts that have one replica.
"""

from __future__ import annotations

import numpy as np
import pytest

from eplb.placement.balance import model_balancedness
from eplb.placement.model import Placement
from eplb.solver import SolveOptions, Topology, solve
from eplb.solver.search import spread
from eplb.solver.search.spread import cover_counts, spread_replicas


def _random_placement(rng: np.random.Generator, L: int, E: int, P: int, G: int, N: int) -> Placement:
    rows = [rng.permutation(np.concatenate([np.arange(E), rng.integers(0, E, P - E)])) for _ in range(L)]
    return Placement.from_phy2log(np.array(rows), G, N)


def _cover_by_loop(count_LE: np.ndarray, load_LE: np.ndarray, share_R: np.ndarray, G: int) -> np.ndarray:
    """The cover rule by scans: the hottest single takes a replica from the donor whose replicas
    then carry least each, while that stays within the cap."""
    out = count_LE.copy()
    for layer in range(out.shape[0]):
        row, load = out[layer], load_LE[layer]
        cap = spread.COVER_CAP * load.sum() / G
        for taker in sorted(np.flatnonzero(row == 1).tolist(), key=lambda e: (-load[e], e)):
            donors = [e for e in range(row.size) if row[e] >= 3]
            if not donors:
                break
            donor = min(donors, key=lambda e: (load[e] * share_R[row[e] - 1], e))
            if load[donor] * share_R[row[donor] - 1] > cap:
                break
            row[donor] -= 1
            row[taker] = 2
    return out


def _orphans_by_loop(row: np.ndarray, width: int) -> list[int]:
    """Experts whose every replica lies in each domain (slot by slot)."""
    out = []
    for d in range(row.size // width):
        inside = set(row[d * width : (d + 1) * width].tolist())
        outside = set(np.delete(row, np.arange(d * width, (d + 1) * width)).tolist())
        out.append(len(inside - outside))
    return out


def _lost_load_by_loop(phy2log_LP: np.ndarray, load_LE: np.ndarray, width: int) -> float:
    """Mean over layers of the largest share of load whose every replica lies in one domain."""
    out = []
    for layer, row in enumerate(phy2log_LP):
        per_domain = []
        for d in range(row.size // width):
            inside = set(row[d * width : (d + 1) * width].tolist())
            outside = set(np.delete(row, np.arange(d * width, (d + 1) * width)).tolist())
            per_domain.append(sum(load_LE[layer, e] for e in inside - outside))
        out.append(max(per_domain) / load_LE[layer].sum())
    return float(np.mean(out))


@pytest.mark.parametrize("seed", range(6))
def test_cover_counts_against_a_scan(seed: int) -> None:
    rng = np.random.default_rng(40 + seed)
    L, E, P, G = 5, 16, 40, 8
    count_LE = np.stack([np.bincount(_random_placement(rng, 1, E, P, G, 1).phy2log_LP[0], minlength=E)] * L)
    count_LE = np.stack([rng.permutation(row) for row in count_LE])
    load_LE = rng.gamma(0.4, 100.0, (L, E))
    share_R = 1.0 / np.maximum(np.arange(P - E + 2), 1)
    got = cover_counts(count_LE, load_LE, share_R, G)
    np.testing.assert_array_equal(got, _cover_by_loop(count_LE, load_LE, share_R, G))
    np.testing.assert_array_equal(got.sum(axis=1), count_LE.sum(axis=1))
    assert (got >= 1).all() and (got[count_LE >= 2] >= 2).all()


def test_a_hot_expert_keeps_the_replicas_that_stop_it_outweighing_a_gpu() -> None:
    # 4 GPUs, mean load (100 + 7) / 4 = 26.75: expert 0 on 4 replicas carries 25 each (within),
    # on 3 it would carry 33.3 (over): it gives one of its five, to the hottest single (expert 1).
    count = np.array([[5, 1, 1, 1, 1, 1, 1, 1]])
    load = np.array([[100.0, 2.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.5]])
    share_R = 1.0 / np.maximum(np.arange(6), 1)
    np.testing.assert_array_equal(cover_counts(count, load, share_R, 4), [[4, 2, 1, 1, 1, 1, 1, 1]])


@pytest.mark.parametrize(("seed", "domain"), [(s, d) for s in range(6) for d in ("gpu", "node")])
def test_spread_covers_and_evens_what_each_domain_loses(seed: int, domain: str) -> None:
    rng = np.random.default_rng(300 + seed)
    L, E, G, N, S = 4, 24, 8, 2, 4
    P = G * S
    placement = _random_placement(rng, L, E, P, G, N)
    load_LE = rng.gamma(0.7, 100.0, (L, E))
    stats: dict[str, float] = {}
    out = spread_replicas(placement.phy2log_LP, load_LE, G, N, domain, stats)
    after = Placement.from_phy2log(out, G, N)  # validates: every expert served, P slots
    share_R = 1.0 / np.maximum(np.arange(P - E + 2), 1)
    np.testing.assert_array_equal(after.logcnt_LE, _cover_by_loop(placement.logcnt_LE, load_LE, share_R, G))
    width = S if domain == "gpu" else P // N
    D = P // width
    lost_before_LD = np.array([_orphans_by_loop(row, width) for row in placement.phy2log_LP])
    lost_LD = np.array([_orphans_by_loop(row, width) for row in out])
    # Each layer's lost experts split as evenly as the domains allow, and so do their sums.
    assert (lost_LD.max(axis=1) - lost_LD.min(axis=1) <= 1).all()
    assert lost_LD.sum(axis=0).max() - lost_LD.sum(axis=0).min() <= 1
    assert stats["lost_experts_before"] == lost_before_LD.sum(axis=0).max()
    assert stats["lost_experts_after"] == lost_LD.sum(axis=0).max() <= stats["lost_experts_before"]
    assert stats["lost_load_before"] == pytest.approx(
        _lost_load_by_loop(placement.phy2log_LP, load_LE, width)
    )
    assert stats["lost_load_after"] == pytest.approx(_lost_load_by_loop(out, load_LE, width))
    assert stats["spread_cost"] == pytest.approx(
        float(model_balancedness(load_LE, placement)) - float(model_balancedness(load_LE, after))
    )
    assert stats["spread_changed_slots"] == (out != placement.phy2log_LP).sum()
    assert D > 1


def test_spread_splits_replicas_sharing_a_gpu() -> None:
    # Expert 0 (the hottest) has both replicas on GPU 0 (load 40; GPU 1: 30, GPU 2: 20).
    row = np.array([[0, 0, 1, 3, 2, 4]])
    load = np.array([[40.0, 10.0, 10.0, 20.0, 10.0]])
    stats: dict[str, float] = {}
    out = spread_replicas(row, load, 3, 1, "gpu", stats)
    gpus_of_0 = {s // 2 for s in np.flatnonzero(out[0] == 0)}
    assert len(gpus_of_0) == 2 and stats["spread_swaps"] == 1
    # Trading with expert 2 on GPU 2 peaks at 30 (with expert 3 on GPU 1: 40): every GPU at 30.
    np.testing.assert_array_equal(out, [[2, 0, 1, 3, 0, 4]])
    assert stats["spread_cost"] == pytest.approx(0.75 - 1.0)


def test_one_domain_changes_nothing() -> None:
    rng = np.random.default_rng(9)
    placement = _random_placement(rng, 2, 10, 16, 4, 1)
    load = rng.gamma(0.5, 10.0, (2, 10))
    stats: dict[str, float] = {}
    np.testing.assert_array_equal(
        spread_replicas(placement.phy2log_LP, load, 4, 1, "node", stats), placement.phy2log_LP
    )
    assert stats["spread_swaps"] == stats["spread_covered"] == 0


@pytest.mark.parametrize(("domain", "dispatch"), [("gpu", "static"), ("node", "static"), ("gpu", "dynamic")])
def test_through_solve_and_the_degraded_plan(domain: str, dispatch: str) -> None:
    rng = np.random.default_rng(11)
    L, E, G, N, S = 3, 20, 8, 4, 4
    P = G * S
    window = rng.gamma(0.5, 100.0, (20, L, E))
    topology = Topology(num_gpus=G, num_nodes=N, num_physical=P)
    options = SolveOptions(failure_domain=domain, dispatch=dispatch, bytes_per_expert=1000)
    plan = solve(window, topology, None, options)
    again = solve(window, topology, None, options)
    np.testing.assert_array_equal(plan.placement.phy2log_LP, again.placement.phy2log_LP)  # deterministic
    keys = {"spread_covered", "spread_swaps", "spread_cost", "spread_fresh_layers", "lost_experts_after"}
    assert keys <= set(plan.stats)
    plain = solve(window, topology, None, SolveOptions(dispatch=dispatch, bytes_per_expert=1000))
    assert "spread_swaps" not in plain.stats
    width = S if domain == "gpu" else P // N
    singles_L = (plan.placement.logcnt_LE == 1).sum(axis=1)
    lost_LD = np.array([_orphans_by_loop(row, width) for row in plan.placement.phy2log_LP])
    # Only single replicas are lost, split as evenly as the domains allow.
    np.testing.assert_array_equal(lost_LD.sum(axis=1), singles_L)
    assert (lost_LD.max(axis=1) <= -(-singles_L // (P // width))).all()
    assert plan.stats["lost_experts_after"] == lost_LD.sum(axis=0).max()
    # Losing a domain reloads exactly its lost experts, once per (layer, expert).
    for d in range(P // width):
        alive = tuple(bool(g // (width // S) != d) for g in range(G))
        lost = solve(window, topology, plan.placement, SolveOptions(alive_ranks=alive, bytes_per_expert=1000))
        assert lost.reload is not None
        assert lost.reload.reloads == lost_LD[:, d].sum()
        assert lost.reload.bytes_reloaded == 1000 * lost_LD[:, d].sum()
