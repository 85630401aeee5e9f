"""Gloo, 2 and 4 real ranks: swaps run on a process group of their own (``swap_group``), so one
given up with transfers still posted (a peer that sleeps past ``timeout_s`` mid-transfer, a peer
interrupted by KeyboardInterrupt) leaves the serving group (here the default one) usable: an
all_reduce and an all_to_all on it succeed, a fresh swap group commits the swap the fault ended,
and every process ends by itself with exit code 0 (on the serving group itself, the next
collective would abort a process with SIGABRT)."""

from __future__ import annotations

import pytest

from tests.helpers.swap_recovery import hotswap_on_its_own_group, run_to_exit


@pytest.mark.parametrize("world", [2, 4], ids=["2ranks", "4ranks"])
def test_a_swap_given_up_on_its_own_group_leaves_the_serving_group_intact(world: int) -> None:
    at = world - 1
    outs = run_to_exit(hotswap_on_its_own_group, world, args=(at,), timeout_s=90)
    for case in range(2):
        per_rank = [o[case] for o in outs]
        kind = per_rank[0]["kind"]
        for rank, got in enumerate(per_rank):
            if kind == "stall":  # every rank, the late one too once it wakes, reports it late
                assert (got["type"], got["cause"], got["blamed"], got["alive"]) == (
                    "HotSwapError",
                    "timeout",
                    at,
                    True,
                ), got
            elif rank == at:  # it restored its side, then re-raised
                assert got["type"] == "KeyboardInterrupt", got
            else:
                assert (got["type"], got["cause"], got["blamed"], got["alive"]) == (
                    "HotSwapError",
                    "peer lost",
                    at,
                    True,
                ), got
            assert got["kept_old"], got  # nothing committed anywhere
            assert got["serving"], got  # all_reduce and all_to_all on the serving group
            assert got["then_ok"], got  # the same swap, on a fresh swap group, committed
