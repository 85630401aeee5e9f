"""The manager survives a lost rank: real Gloo processes at 4 ranks, one ended by ``os._exit``.

Two losses: rank 2 at the start of a pass (the survivors' forward fails, and the engine reports
the loss with ``on_rank_lost``), reloading from the host copies (``--eplb-host-backup``); and
rank 0 (the planning rank) in the first rebalance's swap (the swap reports ``peer lost``),
reloading through the caller's loader. Either way the three survivors agree on the same members
and plan, serve every logical expert of every layer as the dense reference does (routed tokens
and each expert alone), record and report with three ranks, and rebalance again among
themselves. Single-process tests cover the pieces every survivor decides from the same inputs:
the members, the reload sources, the host copies' keepers.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eplb.config import EplbConfig, parse_config
from eplb.manager.backup import checked_weights, keepers
from eplb.manager.manager import EplbManager
from eplb.manager.recovery import Reload, reload_plan
from eplb.manager.rendezvous import Arrival, RankLossError, accounted_for
from eplb.moe.spawn import run_ranks
from eplb.placement.model import Placement
from tests.helpers.manager import CPU, make
from tests.helpers.placements import random_phy2log
from tests.helpers.rank_loss import loses_a_rank

E, S, G = 8, 3, 4  # the 4-rank runs' shape: 12 slots, 3 per rank


def _check_survivors(outs: list, dead: int) -> list[dict]:
    assert outs[dead] is None  # ended itself
    alive = [o for r, o in enumerate(outs) if r != dead]
    survivors = tuple(r for r in range(G) if r != dead)
    first = alive[0]
    for o in alive:  # the same members, plan and history on every survivor
        assert o["ranks"] == survivors and o["phase"] == "idle" and o["stopped"] is None, o
        assert o["placement"] == first["placement"] and o["degraded"] == first["degraded"]
        assert [h[0] for h in o["history"]] == [h[0] for h in first["history"]]
        assert [survivors[i] for i in [o["rank_now"]]] == [o["rank"]]  # member i is the i-th survivor
        (rec,) = o["recoveries"]
        assert rec["lost"] == (dead,) and rec["ranks"] == survivors and rec["accounted"]
        # served as the dense reference computes it: routed tokens and every expert of every layer
        assert o["routed_err"] < 1e-5 and o["every_err"] < 1e-5, (o["routed_err"], o["every_err"])
        assert o["logcnt_min"] >= 1
        # the recorder and the metrics carry on with three ranks
        assert o["window_shape"][2] == len(survivors) * S and o["window_passes"] > 0
        assert any('num_gpus="3"' in line and 'num_physical="9"' in line for line in o["topology"])
        assert sorted(set(o["rank_tokens"])) == ["0", "1", "2"], o["rank_tokens"]
    # dead slots hold -1 in the starting numbering; the survivors' slots hold the live placement
    degraded = np.asarray(first["degraded"])
    dead_slots = np.arange(dead * S, (dead + 1) * S)
    assert (degraded[:, dead_slots] == -1).all()
    live = np.delete(degraded, dead_slots, axis=1)
    assert (live >= 0).all() and np.array_equal(live, np.asarray(first["placement"]))
    # what was reloaded: exactly the experts the lost rank alone held
    start = np.asarray(first["start"])
    lost_LE = np.ones((start.shape[0], E), dtype=bool)
    for layer in range(start.shape[0]):
        lost_LE[layer, np.delete(start[layer], dead_slots)] = False
    assert first["recoveries"][0]["reloads"] == int(lost_LE.sum()) > 0
    return alive


@pytest.mark.timeout(120)
def test_a_rank_lost_mid_serving_is_reported_and_the_survivors_serve_on_from_the_host_copies() -> None:
    outs = run_ranks(loses_a_rank, G, args=("serving", 2, True, False), timeout_s=90, may_die=[2])
    alive = _check_survivors(outs, 2)
    for o in alive:
        assert len(o["reported"]) == 1  # its forward failed once, and it said so
        assert o["recoveries"][0]["reload_source"] == "host" and o["loads"] == []
        assert [h[0] for h in o["history"]] == ["applied", "applied"]  # the degraded plan, then a rebalance
        assert o["history"][0][1].startswith("degraded: rank(s) [2] lost")


@pytest.mark.timeout(120)
def test_a_rank_lost_in_a_swap_is_found_by_the_swap_and_the_survivors_reload_through_the_loader() -> None:
    outs = run_ranks(loses_a_rank, G, args=("swap", 0, False, True), timeout_s=90, may_die=[0])
    alive = _check_survivors(outs, 0)
    reloaded = sorted(pair for o in alive for pair in o["loads"])
    assert len(reloaded) == alive[0]["recoveries"][0]["reloads"]  # each lost expert loaded once
    for o in alive:
        assert o["reported"] == [] and o["recoveries"][0]["reload_source"] == "loader"
        assert [h[0] for h in o["history"]] == ["failed", "applied", "applied"]
        failed = o["history"][0][1]
        assert "peer lost" in failed and "rank 0" in failed and "serve on without" in failed, failed


# ---- the pieces every survivor decides from the same inputs ------------------------------------
def test_the_members_are_decided_once_every_rank_is_accounted_for() -> None:
    assert accounted_for([0, 1, 2, 3], here={0, 1, 3}, gone={2})
    assert not accounted_for([0, 1, 2, 3], here={0, 1}, gone={2})
    a = Arrival(
        rank=3, placement=7, groups=4, passes=9, counted=8, window=(1, 8), loader=False, can_regroup=True
    )
    assert Arrival.decode(a.encode()) == a


def _brute_force_reloads(current: Placement, repaired: np.ndarray, alive: np.ndarray) -> set[tuple[int, int]]:
    """(layer, survivors' slot) pairs whose expert no live rank held before (by definition)."""
    out = set()
    slots = np.flatnonzero(np.repeat(alive, current.slots_per_gpu))
    for layer in range(current.num_layers):
        held = {int(current.phy2log_LP[layer, s]) for s in slots}
        for j in range(repaired.shape[1]):
            if int(repaired[layer, j]) not in held:
                out.add((layer, j))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_reloads_are_the_lost_experts_into_the_repaired_slots_from_the_nearest_source(seed: int) -> None:
    from eplb.solver.degraded import survivors
    from eplb.solver.types import SolveOptions, Topology

    rng = np.random.default_rng(seed)
    current = Placement.from_phy2log(random_phy2log(rng, 3, E, G * S), G, max_replicas=G * S - E + 1)
    dead = int(rng.integers(G))
    alive = np.arange(G) != dead
    load = rng.random((4, 3, E)) * 100
    topology = Topology(num_gpus=G, num_physical=G * S)
    repaired = survivors(load, topology, current, SolveOptions(alive_ranks=tuple(alive))).repaired.phy2log_LP
    ranks = [r for r in range(G) if r != dead]
    keep = {(layer, e): (e % G, (e + 1) % G) for layer in range(3) for e in range(E)}
    got = reload_plan(current, repaired, alive, keepers_of=keep, ranks=ranks, has_loader=False)
    assert {(r.layer, r.slot) for r in got} == _brute_force_reloads(current, repaired, alive)
    for r in got:
        assert r.expert == repaired[r.layer, r.slot] and r.dest == r.slot // S
        members = sorted(ranks.index(k) for k in keep[(r.layer, r.expert)] if k != dead)
        assert r.source == (r.dest if r.dest in members else members[0])
    by_loader = reload_plan(current, repaired, alive, keepers_of=None, ranks=ranks, has_loader=True)
    assert [(r.layer, r.slot, r.source) for r in by_loader] == [(r.layer, r.slot, None) for r in got]
    if got:
        with pytest.raises(RankLossError, match="nothing to reload it from"):
            reload_plan(current, repaired, alive, keepers_of=None, ranks=ranks, has_loader=False)
        lone = {key: (dead, dead) for key in keep}  # every host copy on the lost rank: the loader
        fallback = reload_plan(current, repaired, alive, keepers_of=lone, ranks=ranks, has_loader=True)
        assert all(r.source is None for r in fallback)
    assert all(isinstance(r, Reload) for r in got)


@pytest.mark.parametrize(("num_gpus", "per_node"), [(2, 2), (4, 4), (8, 4), (6, 2)])
def test_every_expert_has_two_host_copies_and_one_survives_any_rank_or_node(
    num_gpus: int, per_node: int
) -> None:
    for layer in range(3):
        for e in range(E):
            a, b = keepers(layer, e, E, num_gpus, per_node)
            assert a != b and 0 <= a < num_gpus and 0 <= b < num_gpus
            if num_gpus > per_node:  # several nodes: on different ones
                assert a // per_node != b // per_node
    counts = np.bincount(
        [k for layer in range(3) for e in range(E) for k in keepers(layer, e, E, num_gpus, per_node)]
    )
    assert counts.max() - counts.min() <= 1 + 2 * 3 * E % num_gpus  # spread evenly over the ranks


def test_a_loaders_answer_must_be_one_slot_of_every_buffer() -> None:
    like = {"w13": torch.zeros(3, 4, 2), "w2": torch.zeros(3, 2, 2)}
    ok = {"w13": torch.ones(4, 2), "w2": torch.ones(2, 2)}
    assert checked_weights(ok, like, "x") == ok
    with pytest.raises(ValueError, match="returned no \\['w2'\\]"):
        checked_weights({"w13": ok["w13"]}, like, "x")
    with pytest.raises(ValueError, match="'w2' must be one slot \\(2, 2\\)"):
        checked_weights({"w13": ok["w13"], "w2": torch.ones(3, 2)}, like, "x")


def test_the_host_backup_flag() -> None:
    assert parse_config(["--eplb-host-backup"]).eplb_host_backup
    assert not parse_config([]).eplb_host_backup


def test_one_rank_has_no_peer_to_lose_and_the_recovery_timeout_must_be_positive() -> None:
    model, placement, _ = make()
    manager = EplbManager(EplbConfig(), model, placement, device=CPU)
    with pytest.raises(RankLossError, match="no peer"):
        manager.on_rank_lost()
    with pytest.raises(ValueError, match="reports itself"):
        manager.on_rank_lost([0])
    assert manager.state().ranks == (0,) and manager.state().degraded is None
    manager.close()
    with pytest.raises(ValueError, match="recovery_timeout_s"):
        EplbManager(EplbConfig(), model, placement, device=CPU, recovery_timeout_s=0)
