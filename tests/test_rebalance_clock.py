"""``RebalanceClock`` against a brute-force count of the passes, stepped and replayed.

Shape legend: F steps (passes).

The reference is the rule in words, pass by pass: count the recorded passes; a rebalance begins
after a pass once ``interval`` counted passes have gone by since the previous one began (the
first: since start-up), and, where a rebalance is still in flight, as soon as it ended.
"""

from __future__ import annotations

import numpy as np
import pytest

from eplb.policy.clock import RebalanceClock


def brute_force(recorded_F: np.ndarray, interval: int, busy: int = 0) -> list[tuple[int, int]]:
    """(pass, counted passes) of every rebalance begun after a pass; each stays in flight for
    ``busy`` passes after the one it began after."""
    begun: list[tuple[int, int]] = []
    counted, last, free_from = 0, 0, 0
    for f, recorded in enumerate(recorded_F.tolist()):
        counted += int(recorded)
        if f >= free_from and counted - last >= interval:
            begun.append((f, counted))
            last, free_from = counted, f + 1 + busy
    return begun


def stepped(recorded_F: np.ndarray, interval: int, busy: int = 0) -> list[tuple[int, int]]:
    clock, begun, free_from = RebalanceClock(interval), [], 0
    for f, recorded in enumerate(recorded_F.tolist()):
        if recorded:
            clock.count()
        if f >= free_from and clock.due:
            begun.append((f, clock.begin()))
            free_from = f + 1 + busy
    return begun


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("interval", [1, 3, 10])
def test_the_clock_counts_as_the_rule_says(seed: int, interval: int) -> None:
    rng = np.random.default_rng(seed)
    recorded_F = rng.random(300) < (0.3 if seed % 2 else 1.0)  # every pass, or prefill only
    for busy in (0, 4):
        assert stepped(recorded_F, interval, busy) == brute_force(recorded_F, interval, busy)
    due_F, counted_F = RebalanceClock(interval).replay(recorded_F)
    want = brute_force(recorded_F, interval)
    assert [(int(f), int(counted_F[f]) + 1) for f in np.flatnonzero(due_F)] == want
    assert counted_F.tolist() == [int(recorded_F[:f].sum()) for f in range(recorded_F.size)]


def test_a_replay_carries_on_from_the_clocks_state_and_leaves_it() -> None:
    clock = RebalanceClock(5)
    clock.count(7)
    clock.begin()  # next at 12
    clock.count(2)
    due_F, counted_F = clock.replay(np.ones(12, dtype=bool))
    assert np.flatnonzero(due_F).tolist() == [2, 7]  # counts 12 and 17
    assert counted_F[0] == 9 and (clock.counted, clock.next_at) == (9, 12)


def test_a_restart_counts_from_the_survivors_count() -> None:
    clock = RebalanceClock(4)
    clock.count(3)
    clock.restart(10)
    assert (clock.counted, clock.next_at, clock.due) == (10, 14, False)
    clock.count(4)
    assert clock.due and clock.begin() == 14 and clock.next_at == 18


def test_the_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval"):
        RebalanceClock(0)
