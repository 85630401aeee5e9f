"""The manager's side of surviving a lost rank: what this rank brings to the survivors, their world
taken over once they regrouped, the move to the degraded plan, and the recovery's records.

Shape legend: W window (passes), F steps (the passes the recorder holds), L layers, E logical experts,
P physical slots, G GPUs (ranks), R max replicas.

:meth:`LostRank.serve_on_without` runs on every survivor at the same point: it publishes this
rank's :class:`~eplb.manager.rendezvous.Arrival`, regroups (eplb.manager.recovery: members, group,
degraded plan, reloads), then takes the survivors' world over (group, recorder, swap group,
counters, the engine's ``set_world``) and hot-swaps from the repaired placement to the plan on
the survivors' swap group. What the loss does to the rebalance in flight is decided in
eplb.manager.rebalance; docs/architecture.md, "Surviving a lost rank", has the steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from eplb.hotswap.runtime import group_count
from eplb.hotswap.swap import HotSwapResult
from eplb.manager.context import Live, Setup, World, log, start_recorder
from eplb.manager.health import SwapGroups
from eplb.manager.liveness import RankLost
from eplb.manager.recovery import (
    RankLossError,
    RecoveryRecord,
    RecoverySetup,
    Regrouped,
    placement_digest,
    regroup,
    window_span,
)
from eplb.manager.rendezvous import Arrival, Loss
from eplb.manager.schedule import SwapScheduler
from eplb.manager.types import RebalanceRecord, ServingWorld
from eplb.placement.degraded import DegradedPlacement
from eplb.placement.diff import diff_placements
from eplb.recorder.buffers import PassInfo

if TYPE_CHECKING:
    from eplb.solver.types import SolveOptions


class LostRank:
    """This rank's recoveries from lost ranks, and their records.

    ``swapper``: runs the move beyond the repair; ``recovery``: what every recovery takes
    (eplb.manager.recovery.RecoverySetup).
    """

    def __init__(self, setup: Setup, live: Live, swapper: SwapScheduler, recovery: RecoverySetup) -> None:
        self.setup, self.live, self.swapper, self.recovery = setup, live, swapper, recovery
        self.records: list[RecoveryRecord] = []
        """One per recovery, in order."""
        self._started = (live.world.ranks, live.placement.num_nodes)
        """The global ranks and nodes the manager started with (the numbering of :meth:`degraded`)."""

    def serve_on_without(
        self, named: Iterable[int], why: str, started: float, solve_options: Callable[[], SolveOptions]
    ) -> RecoveryRecord | None:
        """The survivors' recovery on this rank: their group, the degraded plan, the reloads, then
        serving on. ``named``: global ranks known lost; ``started``: when the recovery began
        (``time.monotonic()``); ``solve_options``: the solver's options the degraded plan starts
        from. None: the survivors could not serve on together (rebalancing stops; the reason in
        ``swaps.stopped``, logged)."""
        live = self.live
        infos, phys_FLP = live.recorder.window_passes()
        me = live.world.me
        log.error("rank %d: a rank is lost (%s); the survivors regroup", me, why)
        loss = Loss(
            world=live.world.ranks, me=me, arrival=self._arrival(infos), named_lost=tuple(named), why=why
        )
        try:
            got = regroup(
                self.recovery,
                loss,
                old_group=live.world.group,
                current=live.placement,
                window=(infos, phys_FLP),
                to_logical=live.recorder.to_logical,
                base_options=solve_options(),
            )
            self._adopt(got)
        except RankLossError as exc:
            live.swaps.stopped = f"{live.swaps.stopped or 'a rank is lost'}; {exc}"
            log.error("rank %d: the survivors cannot serve on (%s); rebalancing stopped", me, exc)
            return None
        return self._serve_on(got, started)

    def report(self, record: RecoveryRecord) -> None:
        """The recovery as an applied rebalance (history and sink): the degraded plan's moves."""
        rebalance = RebalanceRecord(
            at_pass=record.at_pass,
            outcome="applied",
            reason=record.reason,
            balancedness_before=record.balancedness_before,
            balancedness_after=record.balancedness_after,
            predicted_balancedness=None,
            solve_seconds=record.solve_seconds,
            transfer_seconds=record.seconds,
            experts_moved=record.reloads + record.survivor_copies,
            bytes_moved=record.bytes_reloaded + record.bytes_moved,
        )
        self.live.history.append(rebalance)
        self.live.last_rebalance_at = time.monotonic()
        self.live.enter("idle")
        rebalance.report_to(self.live.sink)

    def degraded(self) -> DegradedPlacement | None:
        """The live placement in the numbering of the ranks the manager started with (after a loss)."""
        ranks, nodes = self._started
        if self.live.world.ranks == ranks:
            return None
        alive_G = np.isin(np.asarray(ranks), self.live.world.ranks)
        return DegradedPlacement.from_survivors(self.live.placement, alive_G, nodes)

    def _arrival(self, infos: Sequence[PassInfo]) -> Arrival:
        """What this rank holds as it begins the recovery (every member reads every member's)."""
        live = self.live
        return Arrival(
            rank=live.world.me,
            placement=placement_digest(live.placement),
            groups=group_count(),
            passes=live.passes,
            counted=live.clock.counted,
            window=window_span(infos, live.recorder.num_counted_passes),
            loader=self.recovery.loader is not None,
            can_regroup=callable(getattr(self.setup.engine, "set_world", None)),
        )

    def _adopt(self, got: Regrouped) -> None:
        """The survivors' world on this rank: its group, recorder, swap group and counters, and
        the engine's (set_world). Collective over the survivors."""
        live, setup, survivors = self.live, self.setup, got.survivors
        arrivals = got.members.arrivals.values()
        live.world = World(
            group=survivors.group, rank=survivors.rank, ranks=survivors.ranks, agree=survivors.agree
        )
        live.watchdog.rank = survivors.rank
        live.recorder.stop()
        live.recorder = start_recorder(setup.config, got.repaired, setup.device, live.world)
        try:
            live.swaps = SwapGroups(
                survivors.group,
                survivors.agree,
                setup.device,
                survivors.rank,
                timeout_s=setup.swap_options.timeout_s,
            )
        except (RankLost, RuntimeError) as exc:  # RuntimeError: new_group failed (a member lost)
            raise RankLossError(f"a rank was lost while the survivors made their swap group: {exc}") from exc
        live.placement, live.weights_LER = got.repaired, None
        live.passes = max(a.passes for a in arrivals)
        live.clock.restart(max(a.counted for a in arrivals))
        set_world = setup.engine.set_world  # type: ignore[attr-defined]
        set_world(
            ServingWorld(
                group=survivors.group,
                rank=survivors.rank,
                ranks=survivors.ranks,
                placement=got.repaired,
                dispatch_weights_LER=None,
                recorder=live.recorder,
            )
        )
        live.report_topology(got.repaired)  # the metrics carry on with the survivors' world

    def _serve_on(self, got: Regrouped, started: float) -> RecoveryRecord:
        """From the repaired placement to the degraded plan (a hot-swap on the survivors' swap
        group; not paced) and the recovery's record. A swap that fails leaves the repair."""
        live = self.live
        plan, repaired = got.plan, got.repaired
        target, weights_LER = plan.placement, plan.dispatch_weights_LER
        rebalanced, note = False, ""
        if target.same_slots(repaired):
            rebalanced = weights_LER is not None
            if rebalanced:
                self.setup.engine.set_placement(target, weights_LER)
        else:
            layers = diff_placements(repaired, target).changed_layers().tolist()
            try:
                result = self.swapper.swap_at_once(target, weights_LER, layers)
            except ValueError as exc:  # the same on every member: the plan does not fit the slots
                result = HotSwapResult.not_started(tuple(layers), f"{type(exc).__name__}: {exc}")
            rebalanced = result.ok
            if not result.ok:
                note = f"; the move beyond the repair failed, serving on the repair: {result.error}"
        if rebalanced:
            live.serve(target, weights_LER)
        report = plan.reload
        assert report is not None, "a degraded plan reports its reloads"
        source = "none" if not got.reloads else "loader" if got.reloads[0].source is None else "host"
        if got.reloads and any((r.source is None) != (source == "loader") for r in got.reloads):
            source = "host+loader"
        record = RecoveryRecord(
            at_pass=live.passes,
            lost=got.members.lost,
            ranks=got.members.ranks,
            accounted=got.members.accounted,
            seconds=time.monotonic() - started,
            reloads=len(got.reloads),
            reload_source=source,
            survivor_copies=report.survivor_copies if rebalanced else 0,
            bytes_reloaded=len(got.reloads) * self.setup.bytes_per_expert,
            bytes_moved=report.bytes_moved if rebalanced else 0,
            rebalanced=rebalanced,
            reason=plan.reason + note,
            balancedness_before=self.setup.served(got.load_WLE.sum(axis=0), repaired, None),
            balancedness_after=self.setup.served(got.load_WLE.sum(axis=0), live.placement, live.weights_LER),
            solve_seconds=float(plan.stats.get("solve_seconds", 0.0)),
        )
        self.records.append(record)
        log.warning(
            "rank %d: ranks %s serve on without rank(s) %s after %.2f s (%s)",
            live.world.me,
            list(record.ranks),
            list(record.lost),
            record.seconds,
            record.reason,
        )
        return record
