"""The share model of every dispatch mode (eplb.placement.share) against a count, rank by rank, of
where a plain-Python dispatch sends each rank's tokens."""

from __future__ import annotations

import numpy as np
import pytest

from eplb.placement.model import Placement
from eplb.placement.share import ShareModel, canonical_slots
from eplb.policy.dispatch import dispatch_mode_names
from tests.helpers.placements import random_phy2log

# (G, N, E, P): one node, several, three GPUs a node (a node holding every replica continues the
# other nodes' count by an odd number of ranks: an odd count of nodes without one), one GPU per node.
SHAPES = [
    (4, 1, 8, 16),
    (8, 2, 12, 24),
    (6, 3, 9, 18),
    (6, 2, 12, 18),
    (12, 4, 16, 36),
    (8, 8, 10, 24),
    (16, 4, 20, 48),
]


def _static_choice(
    slots: list[int], rank: int, offset: int, G: int, N: int, S: int, anywhere_before: int
) -> int:
    """The replica (a slot) rank ``rank`` sends to: its GPU's first, else its node's, else any; the
    ranks of a pool dealt round-robin from ``offset`` (a node holding every replica continues the
    count of the ranks of nodes without one)."""
    gpn = G // N
    own = [p for p in slots if p // S == rank]
    if own:
        return own[0]
    node = rank // gpn
    mine = [p for p in slots if p // S // gpn == node]
    if mine:
        pool_ranks = [r for r in range(node * gpn, (node + 1) * gpn) if not any(p // S == r for p in slots)]
        j = pool_ranks.index(rank) + (anywhere_before if len(mine) == len(slots) else 0)
        return mine[(j + offset) % len(mine)]
    nodes_with = {p // S // gpn for p in slots}
    pool_ranks = [r for r in range(G) if r // gpn not in nodes_with]
    return slots[(pool_ranks.index(rank) + offset) % len(slots)]


def _reference_share_LP(placement: Placement, mode: str, weights_LER: np.ndarray | None) -> np.ndarray:
    """float64 [L, P]: what each slot receives, counted rank by rank (static) or by the mode's rule."""
    L, P, G, N = placement.num_layers, placement.num_physical, placement.num_gpus, placement.num_nodes
    E, S, gpn = placement.num_logical, placement.slots_per_gpu, G // N
    share_LP = np.zeros((L, P))
    for layer in range(L):
        for e in range(E):
            count = int(placement.logcnt_LE[layer, e])
            slots = [int(p) for p in placement.log2phy_LER[layer, e, :count]]  # the maps' order
            if weights_LER is not None:
                for r, p in enumerate(slots):
                    share_LP[layer, p] = weights_LER[layer, e, r]
            elif mode in ("static", "auto"):  # auto is planned for static's maps
                nodes_with = {p // S // gpn for p in slots}
                anywhere = sum(1 for r in range(G) if r // gpn not in nodes_with)
                for rank in range(G):
                    p = _static_choice(slots, rank, layer * E + e, G, N, S, anywhere)
                    share_LP[layer, p] += 1.0 / G
            else:
                for p in slots:
                    share_LP[layer, p] = 1.0 / count
    return share_LP


def _placements(rng: np.random.Generator, G: int, N: int, E: int, P: int) -> list[Placement]:
    L = 3
    crowded = np.concatenate([np.tile(np.arange(E), (L, 1)), rng.choice(3, size=(L, P - E))], axis=1)
    for row in crowded:
        rng.shuffle(row)
    out = [Placement.from_phy2log(p2l, G, N) for p2l in (random_phy2log(rng, L, E, P), crowded)]
    # log2phy listing replicas out of slot order (as DeepSeek's replica ranks may): the maps follow it.
    shuffled = out[0].log2phy_LER.copy()
    for layer in range(L):
        for e in range(E):
            count = int(out[0].logcnt_LE[layer, e])
            shuffled[layer, e, :count] = shuffled[layer, e, :count][rng.permutation(count)]
    base = out[0]
    out.append(
        Placement(
            phy2log_LP=base.phy2log_LP,
            log2phy_LER=shuffled,
            logcnt_LE=base.logcnt_LE,
            num_gpus=G,
            num_nodes=N,
        )
    )
    return out


@pytest.mark.parametrize("mode", dispatch_mode_names())
@pytest.mark.parametrize("shape", SHAPES)
def test_every_mode_shares_as_its_dispatch_counts(mode: str, shape: tuple[int, int, int, int]) -> None:
    G, N, E, P = shape
    rng = np.random.default_rng(G * 100 + E)
    model = ShareModel(mode, N)
    for placement in _placements(rng, G, N, E, P):
        weights_LER = None
        if model.weighted:
            raw = rng.random(placement.log2phy_LER.shape) * (placement.log2phy_LER >= 0)
            weights_LER = raw / raw.sum(axis=2, keepdims=True)
        want_LP = _reference_share_LP(placement, mode, weights_LER)
        got_LP = model.placement_share_LP(placement, weights_LER)
        np.testing.assert_allclose(got_LP, want_LP, atol=1e-12)
        # Every expert's tokens are split whole.
        layer_LP = np.broadcast_to(np.arange(placement.num_layers)[:, None], got_LP.shape)
        totals = np.zeros((placement.num_layers, E))
        np.add.at(totals, (layer_LP, placement.phy2log_LP), got_LP)
        np.testing.assert_allclose(totals, 1.0, atol=1e-12)
        # Per GPU: the same shares summed where the slots sit.
        want_LEG = np.zeros((placement.num_layers, E, G))
        for layer in range(placement.num_layers):
            for p in range(P):
                want_LEG[layer, placement.phy2log_LP[layer, p], p // (P // G)] += want_LP[layer, p]
        np.testing.assert_allclose(model.gpu_share_LEG(placement, weights_LER), want_LEG, atol=1e-12)


@pytest.mark.parametrize("mode", dispatch_mode_names())
@pytest.mark.parametrize("shape", SHAPES)
def test_shares_from_phy2log_rows_and_one_expert_at_a_time(
    mode: str, shape: tuple[int, int, int, int]
) -> None:
    """The search's two ways (a layer's rows; the experts a move touched, several at once) agree
    with the rank-by-rank count on placements whose log2phy lists slots ascending."""
    G, N, E, P = shape
    rng = np.random.default_rng(G + E)
    model = ShareModel(mode, N)
    S = P // G
    for placement in _placements(rng, G, N, E, P)[:2]:
        want_LP = _reference_share_LP(placement, mode, None)
        p2l_LP = placement.phy2log_LP.astype(np.int64)
        np.testing.assert_allclose(model.share_LP(p2l_LP, placement.logcnt_LE, G), want_LP, atol=1e-12)
        rows = np.array([2, 0])
        np.testing.assert_allclose(
            model.share_LP(p2l_LP, placement.logcnt_LE, G, rows), want_LP[rows], atol=1e-12
        )
        layer = 1
        slots_X = [np.flatnonzero(p2l_LP[layer] == e).tolist() for e in range(E)]
        shares_X = model.expert_shares(slots_X, [layer * E + e for e in range(E)], G, S)
        for slots, shares in zip(slots_X, shares_X, strict=True):
            np.testing.assert_allclose(shares, want_LP[layer, slots], atol=1e-12)


@pytest.mark.parametrize("mode", ["static", "dynamic"])
def test_the_largest_share_of_r_replicas_is_the_worst_rotation_on_the_canonical_spread(mode: str) -> None:
    G, N, S = 8, 2, 3
    model = ShareModel(mode, N)
    table = model.max_share_R(12, G, S)
    assert table.shape == (13,)
    for count in range(1, 13):
        slots = canonical_slots(count, G, N, S)
        worst = 0.0
        for offset in range(count):
            placement_slots = sorted(slots)
            if mode == "static":
                nodes_with = {p // S // (G // N) for p in placement_slots}
                anywhere = sum(1 for r in range(G) if r // (G // N) not in nodes_with)
                got = [_static_choice(placement_slots, r, offset, G, N, S, anywhere) for r in range(G)]
                worst = max(worst, max(got.count(p) for p in placement_slots) / G)
            else:
                worst = 1.0 / count
        assert table[count] == pytest.approx(worst)


def test_an_unknown_mode_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown dispatch mode 'statik'"):
        ShareModel("statik")
