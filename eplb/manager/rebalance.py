"""One rebalance at a time, from its window to its record: every pass's step after the forward,
the trigger, the solve on rank 0's own thread, the agreed plan, the end of its swap job, and what
a lost rank does to the rebalance in flight.

Shape legend: W window (passes), L layers, E logical experts, P physical slots, G GPUs (ranks).

Every rank runs the same steps on agreed inputs (docs/architecture.md, "The control loop"):
idle -> solving (every ``--eplb-rebalance-num-iterations`` counted passes, unless the decision
skips it) -> applying (the plan every rank received, eplb.manager.schedule) -> idle, each step
ending with one :class:`~eplb.manager.types.RebalanceRecord`. A lost rank ends the rebalance in
flight, failed, and the survivors serve on (eplb.manager.lost_rank).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np
import torch

from eplb.hotswap.control import Cause
from eplb.manager.context import Live, Setup, log
from eplb.manager.lost_rank import LostRank
from eplb.manager.recovery import RecoveryRecord
from eplb.manager.schedule import SwapScheduler
from eplb.manager.types import RebalanceRecord, SwapJob, share_plan
from eplb.metrics.sink import RebalanceOutcome
from eplb.placement.balance import gpu_load
from eplb.policy import Planner
from eplb.policy.decision import Decider, Outcome, Rebalance, Request

if TYPE_CHECKING:
    from eplb.solver.types import SolveOptions


class Rebalancer:
    """This rank's rebalances: when one starts, its plan, its end and its record.

    ``planner``: plans on rank 0 (eplb.policy.Planner); ``swapper`` applies the adopted plan,
    ``lost`` serves on after a lost rank.
    """

    def __init__(
        self, setup: Setup, live: Live, swapper: SwapScheduler, lost: LostRank, planner: Planner
    ) -> None:
        self.setup, self.live, self.swapper, self.lost = setup, live, swapper, lost
        self._watchdog = live.watchdog
        self._planner = planner
        config = setup.config
        self._decider = Decider(config, fitted=config.init_expert_location != "trivial")
        """Every rebalance decision, as the simulator takes them (eplb.policy.decision)."""
        self._rebalance: Rebalance | None = None
        """The rebalance in progress, or the last one (its window ends at its counted pass)."""
        self._future: Future[Outcome] | None = None
        """Rank 0's solve in flight."""
        self.windows: list[tuple[int, float]] = []
        """(pass, balancedness of the window summed over ranks under the live placement) at each check."""
        self._load_LE = np.zeros((live.placement.num_layers, live.placement.num_logical))
        """The window of the rebalance in flight, summed over its passes."""
        self._before = 1.0
        """Its balancedness on the placement it was planned from."""

    def end_pass(self, seconds: float, prefill: bool) -> None:
        """The pass's steps after its forward, on every rank: count, and maybe solve, adopt or
        swap (RankLost: a collective lost a rank). ``prefill``: this rank's batch had prefill."""
        live = self.live
        if (
            self.setup.config.eplb_record_prefill_only
            and live.world.size > 1
            and live.recorder.any_rank_prefill is None
        ):
            # agree here, with the lost-rank watch, rather than in the recorder's own all-reduce
            live.recorder.any_rank_prefill = live.world.agree.any(prefill)
        counted = live.recorder.end_pass()
        plan_ready = expired = False
        if live.phase == "solving":
            ready = live.world.rank == 0 and self._future is not None and self._future.done()
            plan_ready, expired = live.agreed(ready, self._watchdog.expired())
        live.sink.on_forward_pass(kind="prefill" if prefill else "decode", recorded=counted)
        if counted:
            live.clock.count()
        if live.phase == "applying":
            self._apply_due(seconds)
        elif live.phase == "solving" and expired:
            self._end_solve()
        elif live.phase == "solving" and plan_ready:
            self._adopt_plan(seconds)
        elif live.phase == "idle" and live.clock.due:
            self._trigger()

    def _trigger(self) -> None:
        live = self.live
        rebalance = self._rebalance = self._decider.open(counted_pass=live.clock.begin())
        local_WLE = live.recorder.window_logical_counts(reduce=False)
        load_WLE = live.world.agree.sum(torch.from_numpy(local_WLE)).numpy().astype(np.float64)
        load_LE = load_WLE.sum(axis=0)
        before = self.setup.served(load_LE, live.placement, live.weights_LER)
        self.windows.append((live.passes, before))
        live.sink.on_window(logical_load_LE=load_LE, gpu_load_LG=gpu_load(load_LE, live.placement))
        if live.world.rank == 0:
            log.info(
                "pass %d: window of %d passes, window balancedness %.4f",
                live.passes,
                load_WLE.shape[0],
                before,
            )
        if live.swaps.dropped is not None:  # a boundary every rank reaches on this pass: renew
            why = live.swaps.renew(live.placement)
            if why is not None:
                self._finish("failed", f"cannot make a fresh swap group: {why}", before, before, None, 0.0)
                live.stop()
                return
        skipped = rebalance.screen(load_WLE, window_balancedness=before)
        if skipped is not None:
            self._finish("skipped", skipped.reason, before, before, None, 0.0)
            return
        self._load_LE, self._before = load_LE, before
        if live.world.rank == 0:
            request = Request(window_WLE=load_WLE, current=live.placement, planner=self._planner)
            self._future = solve_in_background(lambda: rebalance.plan(request))
        self._watchdog.doing = "solve"
        self._watchdog.begin()
        live.enter("solving")

    def _end_solve(self) -> None:
        """The watchdog's bound passed while rank 0 solved (agreed): end the rebalance, failed. The
        solve goes on alone on its daemon thread; its plan is never read."""
        self._future = None
        self._watchdog.fire()
        self._finish(
            "failed", self._watchdog.reason(), self._before, self._before, None, self._watchdog.bound_s
        )

    def _adopt_plan(self, seconds: float) -> None:
        """Rank 0 broadcasts its plan; every rank takes the same decision on the same pass."""
        self._watchdog.doing = "agreement"
        live = self.live
        shared = share_plan(live.world.agree, self._future if live.world.rank == 0 else None, live.placement)
        self._future = None
        reason, predicted, solve_s = shared.reason, shared.predicted, shared.solve_seconds
        if shared.target is None:
            self._finish(
                shared.outcome, reason, self._before, self._before, predicted, solve_s, cause=shared.cause
            )
            return
        self.swapper.adopt(shared)
        self._apply_due(seconds)

    def _apply_due(self, seconds: float) -> None:
        """This pass's chunks of the swap job (eplb.manager.schedule), and the rebalance's record
        once the job ends."""
        ended = self.swapper.apply_due(seconds)
        if ended is None:
            return
        job = ended.job
        if ended.failure is None:
            after = self.setup.served(self._load_LE, self.live.placement, self.live.weights_LER)
            self._finish("applied", job.reason, self._before, after, job.predicted, job.solve_seconds, job)
            return
        self._fail_job(job, ended.failure, ended.cause)

    def _fail_job(self, job: SwapJob, reason: str, cause: Cause | None = None) -> None:
        """The rebalance failed (its undo done, eplb.manager.schedule): when its swap lost a peer the
        survivors serve on without it, else the reason says what the swap group's state is."""
        live = self.live
        recovered = None
        if live.swaps.lost is not None:  # a peer lost: the survivors serve on without it
            lost = live.swaps.lost
            recovered = self.recover(tuple(live.world.ranks[r] for r in lost), reason, job)
        if recovered is not None:
            reason += (
                f"; rank(s) {list(recovered.lost)} lost: ranks {list(recovered.ranks)} serve on without "
                f"them (layers {job.done} of this rebalance stay applied)"
            )
        elif not live.swaps.usable:
            reason += live.swaps.note(job.done)
        self._finish(
            "failed", reason, self._before, self._before, job.predicted, job.solve_seconds, job, cause=cause
        )
        if recovered is not None:
            self.lost.report(recovered)  # after the failed swap's record
        elif not live.swaps.running:
            live.stop()

    def recover(self, named: Iterable[int], why: str, job: SwapJob | None = None) -> RecoveryRecord | None:
        """A lost rank and the rebalance in flight: forget it, let the survivors serve on
        (eplb.manager.lost_rank), and record it failed. ``job``: the rebalance whose swap lost a
        peer (its caller records it and then the recovery). None: the survivors could not serve
        on together (rebalancing stopped; the reason in ``state().stopped``)."""
        started = time.monotonic()
        live = self.live
        interrupted = self.swapper.job if job is None and live.phase in ("solving", "applying") else None
        in_flight = job is None and live.phase in ("solving", "applying")
        self._drop_rebalance()
        record = self.lost.serve_on_without(named, why, started, self._solve_options)
        if in_flight:
            if record is None:
                reason = f"peer lost: {why}{live.swaps.note([])}"
            else:
                reason = f"peer lost: {why}; ranks {list(record.ranks)} serve on without rank(s) {list(record.lost)}"
            self._finish(
                "failed", reason, self._before, self._before, None, 0.0, interrupted, cause="peer lost"
            )
        if record is None:
            if job is None:
                live.stop()
            return None
        # The repair, and the degraded plan beyond it, count as an applied rebalance of the
        # survivors' Decider (its placement's age and move allowance), as the simulator's
        # lost-rank runs record it.
        self._decider.open(counted_pass=live.clock.counted).close(
            applied=True, copies=float(record.reloads + record.survivor_copies)
        )
        if job is None:
            self.lost.report(record)
        if live.swaps.lost is not None:  # another rank lost in the recovery's swap: again
            self.recover(
                tuple(live.world.ranks[r] for r in live.swaps.lost), "a rank lost in the recovery's swap"
            )
        return record

    def _drop_rebalance(self) -> None:
        """Forget the rebalance in flight (its solve and prepared chunks): the world changes."""
        self.swapper.drop()
        self._future = None
        self._watchdog.end()

    def _solve_options(self) -> SolveOptions:
        """The solver's options for the degraded plan: the planner's when it is eplb's, else the flags'."""
        from eplb.solver.types import SolveOptions  # SciPy's package only once a rank is lost

        options = getattr(self._planner, "options", None)
        if isinstance(options, SolveOptions):
            return options
        return SolveOptions.from_config(self.setup.config, bytes_per_expert=self.setup.bytes_per_expert)

    def _finish(
        self,
        outcome: RebalanceOutcome,
        reason: str,
        before: float,
        after: float,
        predicted: float | None,
        solve_seconds: float,
        job: SwapJob | None = None,
        *,
        cause: Cause | None = None,
    ) -> None:
        record = RebalanceRecord(
            at_pass=self.live.passes,
            outcome=outcome,
            reason=reason,
            balancedness_before=before,
            balancedness_after=after,
            predicted_balancedness=predicted,
            solve_seconds=solve_seconds,
            transfer_seconds=0.0 if job is None else job.transfer_seconds,
            experts_moved=0 if job is None else job.experts_moved,
            bytes_moved=0 if job is None else job.bytes_moved,
            cause=cause if outcome == "failed" else None,
        )
        self.live.history.append(record)
        assert self._rebalance is not None, "a rebalance ends after it began"
        self._rebalance.close(applied=outcome == "applied", copies=record.experts_moved)
        self.swapper.job = None
        self._watchdog.end()
        self.live.last_rebalance_at = time.monotonic()
        self.live.enter("idle")
        if self.live.world.rank == 0:
            log.info(
                "pass %d: rebalance %s (%s); window balancedness %.4f -> %.4f (the window it was planned from)",
                self.live.passes,
                outcome,
                reason,
                before,
                after,
            )
        record.report_to(self.live.sink)


def solve_in_background(plan: Callable[[], Outcome]) -> Future[Outcome]:
    """Run ``plan`` (the rebalance's planning step) on a daemon thread of its own: serving never
    waits for it, and one that never returns (the watchdog ends its rebalance) holds up neither
    the next solve nor the process's exit."""
    future: Future[Outcome] = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(plan())
        except BaseException as exc:  # handed to rank 0's pass, which reports it
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True, name="eplb-solve").start()
    return future
