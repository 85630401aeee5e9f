"""Gloo, 2 and 4 real ranks: swaps never run on the serving group (here the default one), so one
given up (a peer that sleeps past ``timeout_s`` mid-transfer, a peer interrupted by
KeyboardInterrupt or by a real SIGINT mid-swap, or before its check) leaves it usable: an all_reduce and an
all_to_all on it succeed, the swap the fault ended then commits on a fresh swap group (the slots
hold the expected experts), and every process ends by itself with exit code 0 within 10 s of its
end (on the serving group itself, the next collective would abort a process with SIGABRT). Swaps
run on groups of ``swap_group``, or on the one ``hot_swap`` makes when given none. A peer asleep
past the serving group's own timeout leaves every process able to exit too."""

from __future__ import annotations

from typing import Any

import pytest

from eplb.hotswap import HotSwapOptions
from tests.helpers.swap_recovery import (
    TIMEOUT_S,
    hotswap_given_up,
    run_to_exit,
    stall_past_the_serving_timeout,
)

EXIT_WITHIN_S = 10.0
"""The longest a process may take from the end of its work to its exit."""


def check_given_up(per_rank: list[dict[str, Any]], at: int) -> None:
    """Every rank's view of one swap that rank ``at`` ended, against what its fault must cause."""
    kind = per_rank[0]["kind"]
    # A late rank is reported late (by itself too, once it wakes), one interrupted in the swap as
    # lost (alive), one interrupted before its check as late at the check.
    cause = {"stall": "timeout", "early": "timeout"}.get(kind, "peer lost")
    for rank, got in enumerate(per_rank):
        if rank == at and kind != "stall":  # it restored its side (if any), then re-raised
            assert got["type"] == "KeyboardInterrupt", got
        else:
            assert (got["type"], got["cause"], got["blamed"], got["alive"]) == (
                "HotSwapError",
                cause,
                at,
                True,
            ), got
        assert got["kept_old"], got  # nothing committed anywhere
        assert got["serving"], got  # all_reduce and all_to_all on the serving group
        assert got["then_ok"], got  # the same swap, on a fresh swap group, committed


@pytest.mark.parametrize("world", [2, 4], ids=["2ranks", "4ranks"])
def test_a_swap_given_up_on_its_own_group_leaves_the_serving_group_intact(world: int) -> None:
    at = world - 1
    kinds = ("stall", "interrupt", "early")
    outs = run_to_exit(
        hotswap_given_up, world, args=(at, True, kinds), timeout_s=120, exit_within_s=EXIT_WITHIN_S
    )
    for case, kind in enumerate(kinds):
        assert [o[case]["kind"] for o in outs] == [kind] * world
        check_given_up([o[case] for o in outs], at)


@pytest.mark.parametrize("world", [2, 4], ids=["2ranks", "4ranks"])
def test_hot_swap_without_a_group_never_swaps_on_the_serving_group(world: int) -> None:
    at = world - 1
    kinds = ("stall", "interrupt", "sigint", "early")
    outs = run_to_exit(
        hotswap_given_up, world, args=(at, False, kinds), timeout_s=150, exit_within_s=EXIT_WITHIN_S
    )
    for case, kind in enumerate(kinds):
        assert [o[case]["kind"] for o in outs] == [kind] * world
        check_given_up([o[case] for o in outs], at)


@pytest.mark.parametrize(
    ("world", "group_timeout_s"),
    [(2, None), (4, None), (2, HotSwapOptions.timeout_s)],
    ids=["2ranks", "4ranks", "2ranks-swap_group"],
)
def test_a_peer_asleep_past_the_serving_groups_timeout_leaves_every_process_able_to_exit(
    world: int, group_timeout_s: float | None
) -> None:
    """Without a group, and on a swap group of the default options' timeout (a group timeout of
    minutes: only leaving its given-up work behind lets a process exit in time)."""
    serving_timeout_s, stall_s = 10.0, 15.0
    assert stall_s > TIMEOUT_S + serving_timeout_s  # the others gave up on both before it wakes
    at = world - 1
    outs = run_to_exit(
        stall_past_the_serving_timeout,
        world,
        args=(at, stall_s, group_timeout_s),
        timeout_s=90,
        serving_timeout_s=serving_timeout_s,
        exit_within_s=EXIT_WITHIN_S,
    )
    for got in outs:  # the late rank too, once it wakes
        assert (got["type"], got["cause"], got["blamed"], got["alive"]) == (
            "HotSwapError",
            "timeout",
            at,
            True,
        )
        # While it sleeps past the serving group's timeout, no serving collective can complete.
        assert got["serving"] is not True, got
