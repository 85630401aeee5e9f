"""Static dispatch maps, placement diffs and GPU load, against plain-Python references."""

from __future__ import annotations

import numpy as np
import pytest

from eplb.placement.balance import balancedness, gpu_load, imbalance_ratio, model_balancedness
from eplb.placement.diff import diff_placements
from eplb.placement.dispatch_map import static_dispatch_map, static_dispatch_maps
from eplb.placement.model import Placement
from tests.helpers.placements import random_phy2log


def _random_placement(seed: int, L: int = 3, E: int = 12, G: int = 8, S: int = 2, N: int = 2) -> Placement:
    rng = np.random.default_rng(seed)
    return Placement.from_phy2log(random_phy2log(rng, L, E, G * S), num_gpus=G, num_nodes=N)


@pytest.mark.parametrize("seed", range(8))
def test_static_dispatch_prefers_gpu_then_node_and_spreads_fairly(seed: int) -> None:
    pl = _random_placement(seed)
    maps = static_dispatch_maps(pl)
    assert maps.dtype == np.int32 and maps.shape == (pl.num_gpus, pl.num_layers, pl.num_logical)
    S, gpn = pl.slots_per_gpu, pl.gpus_per_node
    for layer in range(pl.num_layers):
        for expert in range(pl.num_logical):
            slots = [p for p in range(pl.num_physical) if pl.phy2log_LP[layer, p] == expert]
            pool_users: dict[tuple[int, ...], list[int]] = {}
            for rank in range(pl.num_gpus):
                chosen = int(maps[rank, layer, expert])
                assert pl.phy2log_LP[layer, chosen] == expert
                local = [p for p in slots if p // S == rank]
                same_node = [p for p in slots if p // S // gpn == rank // gpn]
                if local:
                    assert chosen == local[0]
                elif same_node:
                    assert chosen in same_node
                    pool_users.setdefault(tuple(same_node), []).append(chosen)
                else:
                    pool_users.setdefault(tuple(slots), []).append(chosen)
            # Ranks that share a candidate pool are spread over it evenly (counts differ by <= 1).
            for pool, chosen_list in pool_users.items():
                counts = [chosen_list.count(p) for p in pool]
                assert max(counts) - min(counts) <= 1, (pool, chosen_list)


def test_static_dispatch_map_single_rank_and_bounds() -> None:
    pl = _random_placement(0)
    assert np.array_equal(static_dispatch_map(pl, 3), static_dispatch_maps(pl)[3])
    with pytest.raises(ValueError, match="rank"):
        static_dispatch_map(pl, pl.num_gpus)


def reference_diff(old: Placement, new: Placement) -> tuple[int, int, int, int]:
    S, gpn = new.slots_per_gpu, new.gpus_per_node
    changed = local = arrivals = cross = 0
    for layer in range(new.num_layers):
        old_on_gpu = {(p // S, int(e)) for p, e in enumerate(old.phy2log_LP[layer])}
        old_on_node = {(g // gpn, e) for g, e in old_on_gpu}
        new_on_gpu = {(p // S, int(e)) for p, e in enumerate(new.phy2log_LP[layer])}
        for p in range(new.num_physical):
            if old.phy2log_LP[layer, p] != new.phy2log_LP[layer, p]:
                changed += 1
                local += (p // S, int(new.phy2log_LP[layer, p])) in old_on_gpu
        for g, e in new_on_gpu - old_on_gpu:
            arrivals += 1
            cross += (g // gpn, e) not in old_on_node
    return changed, local, arrivals, cross


@pytest.mark.parametrize("seed", range(6))
def test_diff_matches_reference(seed: int) -> None:
    old, new = _random_placement(seed), _random_placement(seed + 100)
    d = diff_placements(old, new, bytes_per_expert=1000)
    changed, local, arrivals, cross = reference_diff(old, new)
    assert (
        d.num_changed_slots,
        d.local_copies,
        d.experts_moved_across_gpus,
        d.experts_moved_across_nodes,
    ) == (changed, local, arrivals, cross)
    assert d.bytes_across_gpus == 1000 * arrivals and d.bytes_across_nodes == 1000 * cross


def test_diff_of_identical_placements_is_empty_and_shapes_checked() -> None:
    pl = _random_placement(1)
    d = diff_placements(pl, pl, 7)
    assert d.summary() == dict.fromkeys(d.summary(), 0)
    assert d.changed_layers().size == 0
    with pytest.raises(ValueError, match="shape"):
        diff_placements(pl, Placement.trivial(3, 12, 8, 12, 2))
    with pytest.raises(ValueError, match="topology"):
        diff_placements(pl, Placement.from_phy2log(pl.phy2log_LP, 4, 2))


def reference_gpu_load(load_LE: np.ndarray, pl: Placement) -> np.ndarray:
    out = np.zeros((pl.num_layers, pl.num_gpus))
    for layer in range(pl.num_layers):
        for p, e in enumerate(pl.phy2log_LP[layer]):
            out[layer, p // pl.slots_per_gpu] += load_LE[layer, e] / pl.logcnt_LE[layer, e]
    return out


@pytest.mark.parametrize("seed", range(4))
def test_gpu_load_and_balancedness_match_reference(seed: int) -> None:
    pl = _random_placement(seed)
    rng = np.random.default_rng(seed)
    load_FLE = rng.integers(0, 1000, size=(5, pl.num_layers, pl.num_logical))
    got = gpu_load(load_FLE, pl)
    for t in range(5):
        ref = reference_gpu_load(load_FLE[t], pl)
        np.testing.assert_allclose(got[t], ref)
        np.testing.assert_allclose(balancedness(got[t]), ref.mean(1) / ref.max(1))
        np.testing.assert_allclose(model_balancedness(load_FLE[t], pl), (ref.mean(1) / ref.max(1)).mean())
        np.testing.assert_allclose(imbalance_ratio(load_FLE[t], pl), (ref.max(1) / ref.mean(1)).mean())


def test_balancedness_edge_cases() -> None:
    assert balancedness(np.zeros(4)) == 1.0  # no load is perfectly balanced
    assert balancedness(np.array([0.0, 0.0, 0.0, 8.0])) == 0.25  # one GPU takes everything
    assert np.isnan(balancedness(np.array([1.0, np.nan])))


def test_weighted_gpu_load_follows_weights() -> None:
    pl = Placement.from_phy2log(np.array([[0, 1, 0, 1]]), num_gpus=2)
    weights = np.zeros(pl.log2phy_LER.shape)
    weights[0, 0, :2] = [0.75, 0.25]
    weights[0, 1, :2] = [0.5, 0.5]
    got = gpu_load(np.array([[100.0, 40.0]]), pl, weights)
    np.testing.assert_allclose(got, [[75 + 20, 25 + 20]])
