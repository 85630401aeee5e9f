"""The fault harness: faults through the manager on real Gloo ranks (2 and 4), each process
ending by itself. A late peer, a real SIGINT mid-swap, a plan of more slots than the model and an
extra slot tensor on one rank each fail one rebalance alike on every rank, with its cause; the
serving group then answers an all-reduce and an all-to-all, and the next rebalance commits (on a
fresh swap group where the fault dropped the last). A peer asleep past the serving group's own
timeout, and a collective a peer never joins on a swap group, end within their groups' timeouts.
Every process exits 0 within 10 s of its end."""

from __future__ import annotations

import pytest

from eplb.hotswap.runtime import swap_group_timeout_s
from tests.helpers.fault_harness import (
    CAUSE,
    FAULTS,
    manager_faults,
    manager_stalled_past_the_serving_timeout,
    swap_group_collective_times_out,
)
from tests.helpers.swap_recovery import TIMEOUT_S, run_to_exit

EXIT_WITHIN_S = 10.0
"""The longest a process may take from the end of its work to its exit."""


@pytest.mark.parametrize("world", [2, 4], ids=["2ranks", "4ranks"])
def test_each_fault_fails_one_rebalance_alike_and_the_next_commits(world: int) -> None:
    at = world - 1
    outs = run_to_exit(manager_faults, world, args=(at, FAULTS), timeout_s=150, exit_within_s=EXIT_WITHIN_S)
    r0 = outs[0]
    want = [o for kind in FAULTS for o in (("failed", CAUSE[kind]), ("applied", None))]
    for o in outs:  # every rank ended every rebalance alike, with the fault's cause
        assert [(outcome, cause) for outcome, cause, _ in o["history"]] == want, o["history"]
        assert o["groups"] == r0["groups"], (o["groups"], r0["groups"])
        assert o["phase"] == "idle" and o["back_to_old"] and o["err"] < 1e-5, o
        # After each failure, and at the end: an all-reduce and an all-to-all on the serving group.
        assert o["serving"] == [True] * (len(FAULTS) + 1), o["serving"]
    reasons = [reason for _, _, reason in r0["history"]]
    assert f"rank {at}" in reasons[0] and "timeout" in reasons[0] and "dropped" in reasons[0], reasons[0]
    assert f"rank {at}" in reasons[2] and "peer lost" in reasons[2], reasons[2]
    L, P = 3, world * (-(-8 // world) + 2)  # the model of tests.helpers.swap_faults.setup
    assert "does not fit the model" in reasons[4] and f"[{L}, {P + world}]" in reasons[4], reasons[4]
    assert f"shape: rank {at}" in reasons[6], reasons[6]
    # The late peer and the SIGINT dropped the swap group; the next rebalance made a fresh one. A
    # shape is refused before anything moves: the group stays.
    assert r0["groups"] == [1, 2, 2, 3, 3, 3, 3, 3], r0["groups"]
    # Only the rank that got SIGINT saw KeyboardInterrupt (the engine caught it and served on).
    assert outs[at]["interrupted"] and all(not o["interrupted"] for r, o in enumerate(outs) if r != at)
    # The failed-rebalance metric counts each (rank 0's exporter).
    counts = r0["failed_counts"]
    assert counts["failed_timeout"] == 1 and counts["failed_peer"] == 1, counts
    assert counts["failed_shape"] == 2 and sum(counts.values()) == 4, counts


@pytest.mark.parametrize("world", [2, 4], ids=["2ranks", "4ranks"])
def test_a_peer_asleep_past_the_serving_timeout_lets_every_process_exit(world: int) -> None:
    """The swaps' timeout_s is long enough here that the swap group's own timeout (3 x) outlasts
    the on-time ranks by more than 10 s: only leaving the dropped group's agreement behind
    (eplb.hotswap.runtime.keep_for_good) lets them exit in time."""
    serving_timeout_s, timeout_s = 4.0, 8.0
    stall_s = timeout_s + serving_timeout_s + 2.0  # the others gave up on both before it wakes
    # Ended at about timeout_s + serving_timeout_s; the swap group's agreement ends only later.
    assert swap_group_timeout_s(timeout_s) - timeout_s - serving_timeout_s > EXIT_WITHIN_S
    at = world - 1
    outs = run_to_exit(
        manager_stalled_past_the_serving_timeout,
        world,
        args=(at, stall_s, timeout_s),
        timeout_s=90,
        serving_timeout_s=serving_timeout_s,
        exit_within_s=EXIT_WITHIN_S,
    )
    for rank, o in enumerate(outs):
        # The swap failed late on every rank (the late one too, once it woke) ...
        assert o["history"] == [("failed", "timeout")], o
        # ... and then a forward pass on the serving group failed, as an engine's would, and ended.
        assert o["forward"] is not None, o
        if rank != at:  # in the serving group's own timeout, not the swap group's
            assert o["seconds"] < stall_s + serving_timeout_s, o


def test_the_swap_groups_own_timeout_ends_a_collective_a_peer_never_joins() -> None:
    outs = run_to_exit(
        swap_group_collective_times_out, 2, timeout_s=90, serving_timeout_s=60.0, exit_within_s=EXIT_WITHIN_S
    )
    group_s = swap_group_timeout_s(TIMEOUT_S)
    assert [o["group_timeout_s"] for o in outs] == [group_s] * 2
    r0 = outs[0]
    assert r0["error"] is not None, r0  # Gloo gave up ...
    assert group_s - 0.5 < r0["waited_s"] < group_s + 5.0, r0  # ... at the group's own timeout
