"""The rebalance watchdog: a rebalance in flight (solve, agreement, transfer) past a bound is
reported and ended, the same way on every rank.

Each rank times the rebalance on its own clock from the pass that started it. Past the bound, a
daemon thread logs one warning naming what the rebalance is doing, and the manager reports the
time in flight (``eplb_rebalance_in_flight_seconds``, derived at scrape time, so it grows while
the manager's thread is blocked). Ending it is never one rank's decision, because clocks differ:

- between passes (a solve on rank 0 that does not return, a paced transfer that waits for
  credit), each rank's "over the bound" goes into an all-reduce that every rank calls on the same
  pass anyway (rank 0's plan is ready; the pass's duration; the chunk's preparation), and every
  rank gets the same maximum: all end the rebalance on that pass, or none does;
- inside a swap (a peer hangs in the transfer while the others wait), the thread proposes the
  failure as the swap's one decision in the store (``PreparedSwap.abort``): the first proposal
  wins, so either the swap had already committed everywhere, or every rank's wait sees the
  abort and gives the swap up (its group dropped, a fresh one at the next rebalance).

A rank that stops calling the pass hooks stalls the serving group itself: the watchdog reports
it (log line, gauge), and the rebalance ends at the first pass every rank reaches again.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Iterator

from eplb.hotswap.swap import PreparedSwap

log = logging.getLogger("eplb.manager.watchdog")


class Watchdog:
    """Bounds how long one rebalance may be in flight on this rank (``bound_s``; inf: never)."""

    def __init__(self, bound_s: float, rank: int) -> None:
        if not bound_s > 0:
            raise ValueError(f"the rebalance watchdog's bound must be > 0 seconds, got {bound_s}")
        self.bound_s, self.rank = bound_s, rank
        self.began: float | None = None
        """``time.monotonic()`` when the rebalance in flight began (None: none is)."""
        self.doing = "solve"
        """What the rebalance does now, for the log: solve, agreement or transfer (the manager's)."""
        self._fired = False
        self._swap: PreparedSwap | None = None
        self._wake = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    def begin(self) -> None:
        """A rebalance began (on every rank, on the same pass)."""
        with self._wake:
            self.began, self._fired = time.monotonic(), False
            if self._thread is None and math.isfinite(self.bound_s):
                self._thread = threading.Thread(target=self._watch, daemon=True, name="eplb-watchdog")
                self._thread.start()
            self._wake.notify_all()

    def end(self) -> None:
        """The rebalance ended (any outcome)."""
        with self._wake:
            self.began, self._swap = None, None
            self._wake.notify_all()

    def in_flight(self) -> float:
        """Seconds the rebalance in flight has run on this rank's clock (0: none is)."""
        began = self.began
        return 0.0 if began is None else time.monotonic() - began

    def expired(self) -> bool:
        """This rank's clock says the rebalance is over the bound: the manager puts this into the
        pass's agreement, which decides for every rank."""
        return self.began is not None and self.in_flight() > self.bound_s

    def reason(self) -> str:
        """The failed rebalance's reason: the bound and what it was doing, the same on every rank."""
        return f"rebalance watchdog: in flight over the bound of {self.bound_s:g} s, in the {self.doing}"

    def ended(self, error: str | None) -> bool:
        """Whether a swap failed with ``error`` because some rank's watchdog ended it (every rank
        writes the same reason); if so, this rank logs it too, as if its own clock had said so."""
        if error is None or self.reason() not in error:
            return False
        self.fire()
        return True

    @contextlib.contextmanager
    def watching(self, swap: PreparedSwap) -> Iterator[None]:
        """While ``swap`` executes: past the bound, the watchdog ends it on every rank."""
        with self._wake:
            self._swap = swap
            fired = self._fired
        if fired:  # already over the bound here: this swap is ended from its start
            swap.abort(self.reason())
        try:
            yield
        finally:
            with self._wake:
                self._swap = None

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify_all()

    def _watch(self) -> None:
        with self._wake:
            while not self._closed:
                began = self.began
                if began is None or self._fired:
                    self._wake.wait()
                    continue
                left = began + self.bound_s - time.monotonic()
                if left > 0:
                    self._wake.wait(left)
                    continue
                self._wake.release()  # the log and the store write happen outside the lock
                try:
                    self.fire()
                finally:
                    self._wake.acquire()

    def fire(self) -> None:
        """Once per rebalance, at the bound on this rank's clock or when the ranks agreed to end
        it (whichever comes first): log it, and end the swap in flight (the pass's agreement ends
        the rest)."""
        with self._wake:
            if self._fired or self.began is None:
                return
            self._fired, swap, seconds = True, self._swap, self.in_flight()
        where = "" if swap is None else f" ({swap.where()})"
        log.warning(
            "rank %d: rebalance watchdog: in flight %.1f s (bound %g s), in the %s%s; ending it",
            self.rank,
            seconds,
            self.bound_s,
            self.doing,
            where,
        )
        if swap is not None:
            swap.abort(self.reason())
