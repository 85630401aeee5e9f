"""When a rebalance is due: one interval clock for the manager, the simulator and the engine adapters.

Shape legend: F steps (passes of a replay).

A :class:`RebalanceClock` counts the recorded passes (the recorder's count: all passes, or only
prefill ones with ``--eplb-record-prefill-only``). The first rebalance is due after
``interval`` counted passes; each next one ``interval`` counted passes after the previous one
began. A rebalance due while another is still in flight (the manager's solve or swap) begins once
that one ended, and the next is counted from there. The manager steps it pass by pass, an engine
adapter by its interval per call (each call is a rebalance), and the simulator, whose rebalances
never wait, replays it over a whole trace at once (:meth:`RebalanceClock.replay`).
"""

from __future__ import annotations

import numpy as np


class RebalanceClock:
    """Counted passes, and when the next rebalance is due (module docstring)."""

    def __init__(self, interval: int) -> None:
        if interval < 1:
            raise ValueError(f"the rebalance interval must be >= 1 counted passes, got {interval}")
        self.interval = interval
        self.counted = 0
        """Passes counted so far."""
        self.next_at = interval
        """Counted pass at which the next rebalance is due."""

    def count(self, passes: int = 1) -> None:
        """``passes`` more recorded passes."""
        self.counted += passes

    @property
    def due(self) -> bool:
        """Whether a rebalance is due now."""
        return self.counted >= self.next_at

    def begin(self) -> int:
        """A rebalance begins now: the next is due ``interval`` counted passes later. Returns the
        counted pass its window ends at."""
        self.next_at = self.counted + self.interval
        return self.counted

    def restart(self, counted: int) -> None:
        """Carry on from ``counted`` passes (the survivors' count after a lost rank), the next
        rebalance ``interval`` passes later."""
        self.counted = counted
        self.next_at = counted + self.interval

    def replay(self, recorded_F: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A replay of passes ``recorded_F`` (bool [F]: counted or not) from this clock's state,
        every rebalance begun when due: ``(due_F, counted_F)``, bool [F] whether a rebalance
        begins after pass f, and int [F] the passes counted before pass f. Nothing waits, so
        the rebalances fall every ``interval`` counted passes from :attr:`next_at` (what
        stepping :meth:`count`, :attr:`due` and :meth:`begin` pass by pass gives); the clock
        itself is left as it is."""
        recorded_F = np.asarray(recorded_F, dtype=bool)
        after_F = self.counted + np.cumsum(recorded_F, dtype=np.int64)
        since_F = after_F - self.next_at
        due_F = recorded_F & (since_F >= 0) & (since_F % self.interval == 0)
        return due_F, after_F - recorded_F
