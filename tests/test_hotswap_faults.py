"""Gloo, 2 and 4 ranks, real processes: a peer that dies (``os._exit``), stalls past the timeout,
raises KeyboardInterrupt (in a fault hook or in ``update_maps``), fails ``update_maps`` or alone gets
a placement of another shape. On every surviving rank and for every layer the weights equal the
old or the new placement bit for bit and the maps match them; every survivor ends on the same
placement, names the cause and the rank, and notices within ``timeout_s`` + 1 s. After a commit a
fresh store client (a restarted rank) reads the committed placement.

Faults that leave every process alive run one after another in one spawn, each on a new group."""

from __future__ import annotations

from typing import Any

import pytest

from eplb.moe.spawn import host_store, run_ranks
from tests.helpers.swap_faults import check, fault_time, outcome, reported, run_cases, setup

# ---- faults that leave every process alive: one spawn per world size ------------------------------
LIVE = {
    2: [
        dict(name="stall_transfer", kind="stall", rank=1, stage="prepare", chunk=1),
        dict(name="stall_vote", kind="stall", rank=0, stage="vote"),
        dict(name="interrupt_hook", kind="interrupt", rank=1, stage="received", chunk=1),
        dict(name="interrupt_maps", kind="maps_interrupt", rank=0),
        dict(name="maps_error", kind="maps_error", rank=1, then_swap=True),
        dict(name="shape", kind="shape", rank=1, then_swap=True),
    ],
    4: [
        dict(name="stall_transfer", kind="stall", rank=2, stage="prepare", chunk=2),
        dict(name="interrupt_hook", kind="interrupt", rank=3, stage="prepare", chunk=1),
        dict(name="maps_error", kind="maps_error", rank=2, then_swap=True),
        dict(name="shape", kind="shape", rank=3, then_swap=True),
    ],
}


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def live(
    request: pytest.FixtureRequest,
) -> tuple[list[dict[str, Any]], list[list[dict[str, Any]]], dict[str, float]]:
    world = int(request.param)
    cases = [dict(c, seed=i) for i, c in enumerate(LIVE[world])]
    server = host_store()
    results = run_ranks(run_cases, world, args=(cases,), timeout_s=150, store=server)
    fault_at = {c["name"]: fault_time(server, c["name"]) for c in cases}
    per_case = [[results[r][i] for r in range(world)] for i in range(len(cases))]
    return cases, per_case, fault_at


def only(live: Any, kind: str) -> tuple[dict[str, Any], list[dict[str, Any]], float]:
    """The one live case of ``kind``: (case, every rank's outcome, when the fault fired)."""
    cases, per_case, fault_at = live
    ((case, outs),) = [(c, o) for c, o in zip(cases, per_case, strict=True) if c["kind"] == kind]
    return case, outs, fault_at[case["name"]]


def test_a_late_peer_fails_the_swap_on_every_rank_as_a_timeout(live: Any) -> None:
    cases, per_case, fault_at = live
    for case, outs in zip(cases, per_case, strict=True):
        if case["kind"] != "stall":
            continue
        check(case, outs, fault_at[case["name"]], "old")
        # Every rank, the late one too once it wakes, reports the same timeout naming it.
        assert {outcome(o) for o in outs} == {("HotSwapError", "timeout", case["rank"])}, outs
        assert all("timed out" in o["error"] and not o["committed"] for o in outs)


def test_a_peer_that_raises_keyboardinterrupt_leaves_every_rank_on_the_old_placement(live: Any) -> None:
    cases, per_case, fault_at = live
    for case, outs in zip(cases, per_case, strict=True):
        if case["kind"] not in ("interrupt", "maps_interrupt"):
            continue
        check(case, outs, fault_at[case["name"]], "old")
        for o in outs:  # the rank raised KeyboardInterrupt, restored first; the others lost it
            lost = ("HotSwapError", "peer lost", case["rank"])
            expected = ("KeyboardInterrupt", None, None) if o["rank"] == case["rank"] else lost
            assert outcome(o) == expected, (case["name"], o)


def test_update_maps_raising_on_one_rank_fails_the_swap_everywhere(live: Any) -> None:
    case, outs, fault_at = only(live, "maps_error")
    check(case, outs, fault_at, "old")
    assert {outcome(o) for o in outs} == {("result", "error", case["rank"])}
    assert all(o["ok"] is False and "maps injected" in o["error"] and o["then_ok"] for o in outs)


def test_a_rank_with_a_placement_of_another_shape_is_named_and_nothing_moves(live: Any) -> None:
    case, outs, fault_at = only(live, "shape")
    check(case, outs, fault_at, "old")
    # A ValueError (the caller's placements do not fit) that names the swap's cause and the rank.
    assert {outcome(o) for o in outs} == {("HotSwapShapeError", "shape", case["rank"])}, outs
    assert all(f"shape: rank {case['rank']}" in o["error"] for o in outs)
    assert all(o["then_ok"] for o in outs)  # refused before anything moved: the group is fine


# ---- a peer that dies ------------------------------------------------------------------------------
# Four ranks: rank 3 dies before it votes; ranks 0-2 go on in a group of three, where its rank 0
# dies once chunk 1 arrived; the two left (global 1, 2) commit a swap that its rank 1 dies in after
# the commit point. Two ranks: rank 1 dies while chunk 1 is posted.
CHAIN = [
    dict(name="exit_vote", kind="exit", rank=3, stage="vote", members=[0, 1, 2, 3], expect="old"),
    dict(
        name="exit_rank0_received",
        kind="exit",
        rank=0,
        stage="received",
        chunk=1,
        members=[0, 1, 2],
        expect="old",
    ),
    dict(name="exit_committed", kind="exit", rank=1, stage="committed", members=[1, 2], expect="new"),
]
DEATHS = {
    "4ranks": (4, CHAIN),
    "2ranks": (
        2,
        [
            dict(
                name="exit_transfer",
                kind="exit",
                rank=1,
                stage="prepare",
                chunk=1,
                members=[0, 1],
                expect="old",
            )
        ],
    ),
}


@pytest.mark.parametrize("name", DEATHS)
def test_a_peer_that_dies_leaves_every_survivor_consistent(name: str) -> None:
    import torch.distributed as dist

    from eplb.hotswap.control import committed_placement

    world, cases = DEATHS[name]
    cases = [dict(c, seed=7 + i) for i, c in enumerate(cases)]
    dead = [c["members"][c["rank"]] for c in cases]
    server = host_store()
    outs = run_ranks(run_cases, world, args=(cases,), timeout_s=120, may_die=dead, store=server)
    assert [r for r, o in enumerate(outs) if o is None] == sorted(dead)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False)  # as a restarted rank would
    for i, case in enumerate(cases):
        members, died = case["members"], dead[i]
        got = [reported(server, case, r) for r in range(len(members))]
        assert got[case["rank"]] is None
        check(case, got, fault_time(server, case["name"]), case["expect"])
        survivors = [o for o in got if o is not None]
        if case["expect"] == "old":
            assert {outcome(o) for o in survivors} == {("HotSwapError", "peer lost", case["rank"])}, survivors
        else:  # it died after the commit point: the survivors committed without it
            assert all(o["type"] == "result" and o["ok"] for o in survivors), survivors
        # A restarted rank reads the placement its group serves from the store.
        _, _, old, new = setup(len(members), case["seed"])
        served = committed_placement(old, store=client, peers=members)
        assert served.same_slots(new if case["expect"] == "new" else old), (case["name"], died)
