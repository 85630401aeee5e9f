"""The rebalance manager: count passes, solve off the serving path, hot-swap a chunk of layers per pass.

Shape legend: W window (passes), L layers, E logical experts, P physical slots, G GPUs (ranks),
R max replicas.

The engine calls, on every rank and for every forward pass::

    manager.on_forward_pass_begin(is_prefill=..., num_tokens=T)   # sets the recorder's device flag
    model(...)   # each MoE layer: remaps[layer](ids), remaps = manager.recorder.prepare(tables)
    manager.on_forward_pass_end()

All ranks run the same control logic on agreed inputs, so they take the same steps on the same
pass: record, plan on rank 0 in the background, adopt the broadcast plan, swap a chunk of layers
per pass (paced in continuous mode). Swaps run on a process group of their own
(eplb.manager.health), so a swap given up leaves the serving group intact; a watchdog bounds how
long a rebalance may be in flight (eplb.manager.watchdog). When a rank is lost (a swap or one of
the manager's collectives says so, eplb.manager.liveness, or the engine calls
:meth:`EplbManager.on_rank_lost`), the survivors form a group of their own, agree on the degraded
plan, reload what the lost ranks alone held and serve on (eplb.manager.recovery). The steps,
their collectives and the failure rules are in docs/architecture.md ("The control loop",
"Surviving a lost rank").

Every event goes to the :class:`eplb.metrics.sink.MetricsSink`; :meth:`EplbManager.state` exposes
the rest.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from eplb.config import EplbConfig
from eplb.hotswap.heartbeat import lost_after
from eplb.hotswap.runtime import group_count
from eplb.hotswap.swap import FaultHook, HotSwapOptions, HotSwapResult, PreparedSwap, prepare_swap
from eplb.manager.backup import ExpertLoader, HostBackup
from eplb.manager.collectives import RankAgreement
from eplb.manager.health import SwapGroups
from eplb.manager.liveness import Liveness, RankLost
from eplb.manager.pacing import Pacer, chunk_costs, per_chunk_layers
from eplb.manager.recovery import (
    RankLossError,
    RecoveryRecord,
    Regrouped,
    placement_digest,
    regroup,
    window_span,
)
from eplb.manager.rendezvous import Arrival
from eplb.manager.types import (
    ExpertEngine,
    ManagerState,
    RebalanceRecord,
    ServingWorld,
    SwapJob,
    chunk_steps,
    default_planner,
    share_plan,
)
from eplb.manager.watchdog import Watchdog
from eplb.metrics.names import ManagerPhase
from eplb.metrics.sink import MetricsSink, NullSink, RebalanceOutcome
from eplb.placement.balance import gpu_load, model_balancedness
from eplb.placement.degraded import DegradedPlacement
from eplb.placement.diff import diff_placements
from eplb.placement.model import Placement
from eplb.policy import PlanLike, Planner
from eplb.policy.clock import RebalanceClock
from eplb.policy.decision import Decider, Outcome, Rebalance, Request
from eplb.policy.dispatch import dispatch_mode
from eplb.recorder.recorder import ExpertDistributionRecorder, RecorderConfig

if TYPE_CHECKING:
    from eplb.solver.types import SolveOptions

__all__ = [
    "EplbManager",
    "ExpertEngine",
    "ManagerState",
    "PlanLike",
    "Planner",
    "RankLossError",
    "RebalanceRecord",
    "RecoveryRecord",
    "ServingWorld",
]

log = logging.getLogger("eplb.manager.manager")


class EplbManager:
    """Drives record -> solve -> hot-swap for one rank. Build one per rank with the same arguments.

    Construction is collective over the ranks of ``group`` (the group the model serves with): it
    makes the hot-swap's own group, and with ``--eplb-host-backup`` the host copies
    (eplb.manager.backup). ``watchdog_s``: the longest a rebalance (solve, agreement, transfer)
    may be in flight before it is reported and ended (``math.inf``: never). ``loader``: reloads
    an expert (``loader(layer, expert)``, eplb.manager.backup.ExpertLoader) that only lost ranks
    held; it also fills the host copies when given. ``recovery_timeout_s``: the longest the
    survivors of a lost rank wait for each other, and the timeout of their new group.
    """

    def __init__(
        self,
        config: EplbConfig,
        engine: ExpertEngine,
        placement: Placement,
        *,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        sink: MetricsSink | None = None,
        planner: Planner | None = None,
        swap_options: HotSwapOptions | None = None,
        num_groups: int = 1,
        swap_fault: FaultHook | None = None,
        watchdog_s: float = 600.0,
        loader: ExpertLoader | None = None,
        recovery_timeout_s: float = 60.0,
    ) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if distributed else 0
        self.world_size = dist.get_world_size(group) if distributed else 1
        if self.world_size != placement.num_gpus:
            raise ValueError(
                f"placement spans {placement.num_gpus} GPUs but there are {self.world_size} ranks"
            )
        if not recovery_timeout_s > 0:
            raise ValueError(f"recovery_timeout_s must be > 0, got {recovery_timeout_s}")
        self._ranks: tuple[int, ...] = (0,)
        """Global ranks of the group the manager serves with, in group order."""
        if distributed:
            self._ranks = tuple(
                dist.get_process_group_ranks(group) if group is not None else range(self.world_size)
            )
        self._started = (self._ranks, placement.num_nodes)
        self._loader = loader
        self._recovery_timeout_s = recovery_timeout_s
        self._num_groups = num_groups
        self._recoveries: list[RecoveryRecord] = []
        self.config = config
        self.engine = engine
        self.device = device
        self.group = group
        self.sink: MetricsSink = sink or NullSink()
        self.swap_options = swap_options or HotSwapOptions()
        self._swap_fault = swap_fault
        self._placement = placement
        self._weights_LER: np.ndarray | None = None
        L, E = placement.num_layers, placement.num_logical
        if (config.recorder_mode or "stat") not in ("stat", "per_pass"):
            raise ValueError(
                f"--expert-distribution-recorder-mode {config.recorder_mode} keeps token ids, not a load "
                "window: the rebalancer needs stat or per_pass"
            )
        self._watchdog = Watchdog(watchdog_s, self.rank)
        self._lost_after_s = lost_after(self.swap_options.timeout_s)
        liveness = None
        if self.world_size > 1:
            liveness = Liveness(group, self._ranks, self.rank, self._lost_after_s)
        self._agree = RankAgreement.create(group, self.world_size, device, liveness)
        self._swaps = SwapGroups(group, self._agree, device, self.rank)
        self._backup: HostBackup | None = None
        if config.eplb_host_backup and self.world_size > 1:
            self._backup = HostBackup.fill(
                engine.slot_tensors,
                placement,
                ranks=self._ranks,
                me=self.rank,
                group=group,
                loader=loader,
                liveness=liveness,
            )
        self._leaving: BaseException | None = None
        """What interrupted this rank's swap (KeyboardInterrupt), re-raised at the end of the pass."""
        self.recorder = ExpertDistributionRecorder(
            RecorderConfig.from_eplb_config(config),
            placement,
            device=device,
            group=group,
            flag_group=self._agree.control,
        )
        self.recorder.start()
        self._kind: str = "decode"
        views = engine.slot_tensors(0)
        self._bytes_per_expert = sum(t[0].numel() * t.element_size() for t in views.values())
        self._planner: Planner = planner or default_planner(
            config, num_groups=num_groups, bytes_per_expert=self._bytes_per_expert
        )
        self._static_dispatch = dispatch_mode(config.dispatch_algorithm).static_maps
        """Static dispatch: before/after are scored with the static maps' replica shares, as the plans are."""
        self._decider = Decider(config, fitted=config.init_expert_location != "trivial")
        """Every rebalance decision, as the simulator takes them (eplb.policy.decision)."""
        self._rebalance: Rebalance | None = None
        """The rebalance in progress, or the last one (its window ends at its counted pass)."""
        self._clock = RebalanceClock(config.rebalance_interval)
        """Counted passes and the next rebalance's (eplb.policy.clock, as the simulator's)."""
        self._preparer: ThreadPoolExecutor | None = None
        self._future: Future[Outcome] | None = None
        self._phase: ManagerPhase = "idle"
        self._last_rebalance_at = time.monotonic()
        self._on_phase = getattr(self.sink, "on_phase", None)  # None: a sink older than the event
        self._passes = 0
        self._began = time.perf_counter()
        self._history: list[RebalanceRecord] = []
        self._windows: list[tuple[int, float]] = []
        self._job: SwapJob | None = None
        self._load_LE = np.zeros((L, E))
        self._before = 1.0
        self._report_topology(placement)
        self._enter("idle")

    # ---- the hooks ---------------------------------------------------------------------------
    def on_forward_pass_begin(self, *, is_prefill: bool, num_tokens: int = 0) -> None:
        """Call on every rank before every forward pass (``is_prefill``: this rank's batch has prefill)."""
        self._kind = "prefill" if is_prefill else "decode"
        self._began = time.perf_counter()
        if self._swaps.running:
            self.recorder.begin_pass(has_prefill=is_prefill, num_tokens=num_tokens)

    def on_forward_pass_end(self, *, pass_seconds: float | None = None) -> None:
        """Call on every rank after every forward pass: count, and maybe solve, adopt or swap.

        ``pass_seconds``: the pass's duration, for pacing (e.g. from CUDA events); None: the host
        time since :meth:`on_forward_pass_begin`. Ranks may differ; pacing takes the maximum.
        """
        seconds = time.perf_counter() - self._began if pass_seconds is None else pass_seconds
        if not seconds >= 0.0:
            raise ValueError(f"pass_seconds must be >= 0, got {pass_seconds}")
        self._passes += 1
        if not self._swaps.running:  # stopped: no collective (a peer may be gone): serve, count, report
            self.sink.on_forward_pass(kind="prefill" if self._kind == "prefill" else "decode", recorded=False)
            return
        try:
            self._end_pass(seconds)
        except RankLost as lost:  # one of this pass's collectives: the survivors serve on without it
            self._recover(lost.ranks, str(lost))
        if self._leaving is not None:  # this rank's swap was interrupted: its state is everyone's now
            leaving, self._leaving = self._leaving, None
            raise leaving

    def on_rank_lost(self, ranks: Iterable[int] = ()) -> RecoveryRecord:
        """The engine found a rank gone (a collective of its forward failed, or its own health
        check said so): form the survivors' group and serve on without it.

        Call it on every rank still serving, at the same point: in place of the failed pass's
        :meth:`on_forward_pass_end` (then begin the pass again), or between passes. ``ranks``:
        global ranks the engine knows are gone (the survivors still agree through the store on
        who is there: a rank named gone that arrives in time serves on). Returns once the
        engine's ``set_world`` was called (eplb.manager.types.ServingWorld); raises
        :class:`RankLossError` when the survivors cannot serve on together (the manager has
        stopped, and says why in ``state().stopped``).
        """
        named = tuple(int(r) for r in ranks)
        if self._ranks[self.rank] in named:
            raise ValueError(f"rank {self._ranks[self.rank]} reports itself lost")
        if self.world_size == 1:
            raise RankLossError("a manager of one rank has no peer to lose")
        if not self._swaps.running:
            raise RankLossError(f"the manager stopped earlier: {self._swaps.stopped}")
        record = self._recover(named, f"the engine reported rank(s) {list(named) or '(unnamed)'} lost")
        if record is None:
            raise RankLossError(f"the survivors cannot serve on: {self._swaps.stopped}")
        return record

    def _end_pass(self, seconds: float) -> None:
        """The pass's steps after its forward, on every rank (RankLost: a collective lost a rank)."""
        if (
            self.config.eplb_record_prefill_only
            and self.world_size > 1
            and self.recorder.any_rank_prefill is None
        ):
            # agree here, with the lost-rank watch, rather than in the recorder's own all-reduce
            self.recorder.any_rank_prefill = self._agree.any(self._kind == "prefill")
        counted = self.recorder.end_pass()
        plan_ready = expired = False
        if self._phase == "solving":
            ready = self.rank == 0 and self._future is not None and self._future.done()
            plan_ready, expired = self._agreed(ready, self._watchdog.expired())
        self.sink.on_forward_pass(kind="prefill" if self._kind == "prefill" else "decode", recorded=counted)
        if counted:
            self._clock.count()
        if self._phase == "applying":
            self._apply_due(seconds)
        elif self._phase == "solving" and expired:
            self._end_solve()
        elif self._phase == "solving" and plan_ready:
            self._adopt_plan(seconds)
        elif self._phase == "idle" and self._clock.due:
            self._trigger()

    def state(self) -> ManagerState:
        return ManagerState(
            phase=self._phase,
            in_flight_seconds=self._watchdog.in_flight(),
            seconds_since_rebalance=time.monotonic() - self._last_rebalance_at,
            swap_groups=self._swaps.made,
            stopped=self._swaps.stopped,
            passes=self._passes,
            counted_passes=self._clock.counted,
            next_rebalance_at=self._clock.next_at,
            window_passes=self.recorder.num_window_passes,
            layers_pending=() if self._job is None else tuple(self._job.pending),
            placement=self._placement,
            history=tuple(self._history),
            windows=tuple(self._windows),
            ranks=self._ranks,
            degraded=self._degraded(),
            recoveries=tuple(self._recoveries),
        )

    @property
    def placement(self) -> Placement:
        return self._placement

    def close(self) -> None:
        """Stop the helper threads (a solve in flight is left to end on its own daemon thread)."""
        if self._preparer is not None:
            self._preparer.shutdown(wait=True, cancel_futures=True)
        self._preparer = None
        self._watchdog.close()

    # ---- steps -------------------------------------------------------------------------------
    def _trigger(self) -> None:
        rebalance = self._rebalance = self._decider.open(counted_pass=self._clock.begin())
        local_WLE = self.recorder.window_logical_counts(reduce=False)
        load_WLE = self._agree.sum(torch.from_numpy(local_WLE)).numpy().astype(np.float64)
        load_LE = load_WLE.sum(axis=0)
        before = self._served(load_LE, self._placement, self._weights_LER)
        self._windows.append((self._passes, before))
        self.sink.on_window(logical_load_LE=load_LE, gpu_load_LG=gpu_load(load_LE, self._placement))
        if self.rank == 0:
            log.info(
                "pass %d: window of %d passes, window balancedness %.4f",
                self._passes,
                load_WLE.shape[0],
                before,
            )
        if self._swaps.dropped is not None:  # a boundary every rank reaches on this pass: renew
            why = self._swaps.renew(self._placement)
            if why is not None:
                self._finish("failed", f"cannot make a fresh swap group: {why}", before, before, None, 0.0)
                self._stop()
                return
        skipped = rebalance.screen(load_WLE, window_balancedness=before)
        if skipped is not None:
            self._finish("skipped", skipped.reason, before, before, None, 0.0)
            return
        self._load_LE, self._before = load_LE, before
        if self.rank == 0:
            request = Request(window_WLE=load_WLE, current=self._placement, planner=self._planner)
            self._future = solve_in_background(lambda: rebalance.plan(request))
        self._watchdog.doing = "solve"
        self._watchdog.begin()
        self._enter("solving")

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
        shared = share_plan(self._agree, self._future if self.rank == 0 else None, self._placement)
        self._future = None
        reason, predicted, solve_s = shared.reason, shared.predicted, shared.solve_seconds
        if shared.target is None:
            self._finish(shared.outcome, reason, self._before, self._before, predicted, solve_s)
            return
        target, weights_LER = shared.target, shared.weights_LER
        changed = diff_placements(self._placement, target).changed_layers().tolist()
        job = SwapJob(
            self._placement, self._weights_LER, target, weights_LER, changed, reason, predicted, solve_s
        )
        gbps = self.config.eplb_transfer_gbps
        per_chunk = per_chunk_layers(
            self.config.eplb_rebalance_layers_per_chunk, gbps is not None, len(changed)
        )
        job.chunks, job.steps = chunk_steps(
            self._placement, self._weights_LER, target, weights_LER, changed, per_chunk
        )
        if gbps is not None:
            job.pacer = Pacer(bytes_per_second=gbps * 1e9)
            job.costs = chunk_costs(self._placement, target, job.chunks, self._bytes_per_expert)
        self._job = job
        self._watchdog.doing = "transfer"
        self._enter("applying")
        self._prepare(0)
        self._prepare(1)
        self._apply_due(seconds)

    def _apply_due(self, seconds: float) -> None:
        """Unpaced: the next chunk. Paced: earn this pass's (agreed) credit, run the chunks it covers."""
        job = self._job
        assert job is not None
        if job.pacer is None:
            self._apply_next_chunk()
            return
        seconds, expired = self._agree.max_of(seconds, float(self._watchdog.expired()))
        if self._ended_by_watchdog(job, expired > 0.0):
            return
        job.pacer.earn(seconds)
        while self._job is job and job.pacer.take(job.costs[job.next_chunk]):
            self._apply_next_chunk()

    def _prepare(self, i: int) -> None:
        """Start planning chunk i's swap on the helper thread (host work; no collective)."""
        job = self._job
        assert job is not None
        if i >= len(job.chunks):
            return
        if self._preparer is None:
            self._preparer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eplb-prepare")
        before = job.steps[i - 1][0] if i else job.original
        job.prepared[i] = self._preparer.submit(
            prepare_swap,
            self._slots(),
            before,
            job.steps[i][0],
            layers=job.chunks[i],
            group=self._swaps.group,
            options=self.swap_options,
            check=False,
        )

    def _apply_next_chunk(self) -> None:
        job = self._job
        assert job is not None
        i = job.next_chunk
        job.next_chunk += 1
        chunk, (mixed, mixed_w) = job.chunks[i], job.steps[i]
        job.pending = [layer for c in job.chunks[i + 1 :] for layer in c]
        try:
            prepared, error = job.prepared.pop(i).result(), ""
        except Exception as exc:  # the same inputs on every rank: normally every rank gets here
            prepared, error = None, f"preparing the swap failed: {type(exc).__name__}: {exc}"
        unprepared, expired = self._agreed(prepared is None, self._watchdog.expired())
        if self._ended_by_watchdog(job, expired):
            return
        if unprepared or prepared is None:
            result = HotSwapResult.not_started(
                tuple(chunk), error or "preparing the swap failed on another rank"
            )
        else:
            live, live_w = self._placement, self._weights_LER
            with self._watchdog.watching(prepared):
                result = self._execute(
                    tuple(chunk),
                    prepared,
                    update_maps=lambda: self.engine.set_placement(mixed, mixed_w),
                    restore_maps=lambda: self.engine.set_placement(live, live_w),
                    fault=self._swap_fault,
                )
            self._watchdog.ended(result.error)
            self._prepare(i + 2)
        job.transfer_seconds += result.seconds
        if result.ok:
            self._placement, self._weights_LER = mixed, mixed_w
            self.recorder.set_placement(mixed)  # passes from now on count through the new map
            job.done.extend(chunk)
            job.experts_moved += result.experts_moved
            job.bytes_moved += result.bytes_moved
            if not job.pending:
                after = self._served(self._load_LE, self._placement, self._weights_LER)
                self._finish(
                    "applied", job.reason, self._before, after, job.predicted, job.solve_seconds, job
                )
            return
        self._fail_job(job, f"hot-swap of layers {list(chunk)} failed and was rolled back: {result.error}")

    # ---- a lost rank (eplb.manager.recovery) ---------------------------------------------------
    def _recover(self, named: Iterable[int], why: str, job: SwapJob | None = None) -> RecoveryRecord | None:
        """The survivors' recovery on this rank: their group, the degraded plan, the reloads, then
        serving on. ``named``: global ranks known lost; ``job``: the rebalance whose swap lost a
        peer (its caller records it and then the recovery). None: the survivors could not serve
        on together (rebalancing stopped; the reason in ``state().stopped``)."""
        started = time.monotonic()
        interrupted = self._job if job is None and self._phase in ("solving", "applying") else None
        in_flight = job is None and self._phase in ("solving", "applying")
        self._drop_rebalance()
        infos, phys_FLP = self.recorder.window_passes()
        me = self._ranks[self.rank]
        log.error("rank %d: a rank is lost (%s); the survivors regroup", me, why)
        arrival = Arrival(
            rank=me,
            placement=placement_digest(self._placement),
            groups=group_count(),
            passes=self._passes,
            counted=self._clock.counted,
            window=window_span(infos, self.recorder.num_counted_passes),
            loader=self._loader is not None,
            can_regroup=callable(getattr(self.engine, "set_world", None)),
        )
        try:
            got = regroup(
                old_group=self.group,
                world=self._ranks,
                me=me,
                device=self.device,
                arrival=arrival,
                named_lost=tuple(named),
                timeout_s=self._recovery_timeout_s,
                lost_after_s=self._lost_after_s,
                why=why,
                current=self._placement,
                window=(infos, phys_FLP),
                to_logical=self.recorder.to_logical,
                base_options=self._solve_options(),
                num_groups=self._num_groups,
                backup=self._backup,
                loader=self._loader,
                slots_of=self.engine.slot_tensors,
            )
            self._adopt(got)
        except RankLossError as exc:
            self._swaps.stopped = f"{self._swaps.stopped or 'a rank is lost'}; {exc}"
            log.error("rank %d: the survivors cannot serve on (%s); rebalancing stopped", me, exc)
            if in_flight:
                reason = f"peer lost: {why}{self._swaps.note([])}"
                self._finish("failed", reason, self._before, self._before, None, 0.0, interrupted)
            if job is None:
                self._stop()
            return None
        record = self._serve_on(got, started)
        if in_flight:
            reason = (
                f"peer lost: {why}; ranks {list(record.ranks)} serve on without rank(s) {list(record.lost)}"
            )
            self._finish("failed", reason, self._before, self._before, None, 0.0, interrupted)
        if job is None:
            self._report_recovery(record)
        if self._swaps.lost is not None:  # another rank lost in the recovery's swap: again
            self._recover(
                tuple(self._ranks[r] for r in self._swaps.lost), "a rank lost in the recovery's swap"
            )
        return record

    def _drop_rebalance(self) -> None:
        """Forget the rebalance in flight (its solve and prepared chunks): the world changes."""
        if self._job is not None:
            for future in self._job.prepared.values():
                future.cancel()
        self._job, self._future = None, None
        self._watchdog.end()

    def _adopt(self, got: Regrouped) -> None:
        """The survivors' world on this rank: its group, recorder, swap group and counters, and
        the engine's (set_world). Collective over the survivors."""
        arrivals = got.members.arrivals.values()
        self.group, self.rank, self.world_size = got.group, got.rank, len(got.members.ranks)
        self._ranks, self._agree = got.members.ranks, got.agree
        self._watchdog.rank = got.rank
        self.recorder.stop()
        self.recorder = ExpertDistributionRecorder(
            RecorderConfig.from_eplb_config(self.config),
            got.repaired,
            device=self.device,
            group=got.group,
            flag_group=got.agree.control,
        )
        self.recorder.start()
        try:
            self._swaps = SwapGroups(got.group, got.agree, self.device, got.rank)
        except (RankLost, RuntimeError) as exc:  # RuntimeError: new_group failed (a member lost)
            raise RankLossError(f"a rank was lost while the survivors made their swap group: {exc}") from exc
        self._placement, self._weights_LER = got.repaired, None
        self._passes = max(a.passes for a in arrivals)
        self._clock.restart(max(a.counted for a in arrivals))
        set_world = self.engine.set_world  # type: ignore[attr-defined]
        set_world(
            ServingWorld(
                group=got.group,
                rank=got.rank,
                ranks=got.members.ranks,
                placement=got.repaired,
                dispatch_weights_LER=None,
                recorder=self.recorder,
            )
        )
        self._report_topology(got.repaired)  # the metrics carry on with the survivors' world

    def _serve_on(self, got: Regrouped, started: float) -> RecoveryRecord:
        """From the repaired placement to the degraded plan (a hot-swap on the survivors' swap
        group; not paced) and the recovery's record. A swap that fails leaves the repair."""
        plan, repaired = got.plan, got.repaired
        target, weights_LER = plan.placement, plan.dispatch_weights_LER
        rebalanced, note = False, ""
        if target.same_slots(repaired):
            rebalanced = weights_LER is not None
            if rebalanced:
                self.engine.set_placement(target, weights_LER)
        else:
            layers = diff_placements(repaired, target).changed_layers().tolist()
            try:
                prepared = prepare_swap(
                    self._slots(),
                    repaired,
                    target,
                    layers=layers,
                    group=self._swaps.group,
                    options=self.swap_options,
                    check=False,
                )
                result = self._execute(
                    tuple(layers),
                    prepared,
                    update_maps=lambda: self.engine.set_placement(target, weights_LER),
                    restore_maps=lambda: self.engine.set_placement(repaired, None),
                )
            except ValueError as exc:  # the same on every member: the plan does not fit the slots
                result = HotSwapResult.not_started(tuple(layers), f"{type(exc).__name__}: {exc}")
            rebalanced = result.ok
            if not result.ok:
                note = f"; the move beyond the repair failed, serving on the repair: {result.error}"
        if rebalanced:
            self._placement, self._weights_LER = target, weights_LER
            self.recorder.set_placement(target)
        report = plan.reload
        assert report is not None, "a degraded plan reports its reloads"
        source = "none" if not got.reloads else "loader" if got.reloads[0].source is None else "host"
        if got.reloads and any((r.source is None) != (source == "loader") for r in got.reloads):
            source = "host+loader"
        record = RecoveryRecord(
            at_pass=self._passes,
            lost=got.members.lost,
            ranks=got.members.ranks,
            accounted=got.members.accounted,
            seconds=time.monotonic() - started,
            reloads=len(got.reloads),
            reload_source=source,
            survivor_copies=report.survivor_copies if rebalanced else 0,
            bytes_reloaded=len(got.reloads) * self._bytes_per_expert,
            bytes_moved=report.bytes_moved if rebalanced else 0,
            rebalanced=rebalanced,
            reason=plan.reason + note,
            balancedness_before=self._served(got.load_WLE.sum(axis=0), repaired, None),
            balancedness_after=self._served(got.load_WLE.sum(axis=0), self._placement, self._weights_LER),
            solve_seconds=float(plan.stats.get("solve_seconds", 0.0)),
        )
        self._recoveries.append(record)
        log.warning(
            "rank %d: ranks %s serve on without rank(s) %s after %.2f s (%s)",
            self._ranks[self.rank],
            list(record.ranks),
            list(record.lost),
            record.seconds,
            record.reason,
        )
        return record

    def _report_recovery(self, record: RecoveryRecord) -> None:
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
        self._history.append(rebalance)
        self._last_rebalance_at = time.monotonic()
        self._enter("idle")
        rebalance.report_to(self.sink)

    def _solve_options(self) -> SolveOptions:
        """The solver's options for the degraded plan: the planner's when it is eplb's, else the flags'."""
        from eplb.solver.types import SolveOptions  # SciPy's package only once a rank is lost

        options = getattr(self._planner, "options", None)
        if isinstance(options, SolveOptions):
            return options
        return SolveOptions.from_config(self.config, bytes_per_expert=self._bytes_per_expert)

    def _degraded(self) -> DegradedPlacement | None:
        """The live placement in the numbering of the ranks the manager started with (after a loss)."""
        ranks, nodes = self._started
        if self._ranks == ranks:
            return None
        alive_G = np.isin(np.asarray(ranks), self._ranks)
        return DegradedPlacement.from_survivors(self._placement, alive_G, nodes)

    def _ended_by_watchdog(self, job: SwapJob, expired: bool) -> bool:
        """``expired`` (agreed over the ranks): end the rebalance, failed, for the watchdog."""
        if expired:
            self._watchdog.fire()
            self._fail_job(job, self._watchdog.reason())
        return expired

    def _fail_job(self, job: SwapJob, reason: str) -> None:
        """End the rebalance, failed (on every rank alike): undo its applied chunks while a swap
        group is in place, else keep them (consistent per layer) and say so."""
        for future in job.prepared.values():
            future.cancel()
        job.prepared.clear()
        if job.done and self._swaps.usable:  # undo this rebalance's earlier chunks: one old placement
            live, live_w = self._placement, self._weights_LER
            back = self._execute(
                tuple(job.done),
                prepare_swap(
                    self._slots(),
                    live,
                    job.original,
                    layers=job.done,
                    group=self._swaps.group,
                    options=self.swap_options,
                    check=False,
                ),
                update_maps=lambda: self.engine.set_placement(job.original, job.original_weights_LER),
                restore_maps=lambda: self.engine.set_placement(live, live_w),
            )
            if back.ok:
                self._placement, self._weights_LER = job.original, job.original_weights_LER
                self.recorder.set_placement(job.original)
            reason += f"; layers {job.done} {'restored' if back.ok else 'NOT restored: ' + str(back.error)}"
        recovered = None
        if self._swaps.lost is not None:  # a peer lost: the survivors serve on without it
            lost = self._swaps.lost
            recovered = self._recover(tuple(self._ranks[r] for r in lost), reason, job)
        if recovered is not None:
            reason += (
                f"; rank(s) {list(recovered.lost)} lost: ranks {list(recovered.ranks)} serve on without "
                f"them (layers {job.done} of this rebalance stay applied)"
            )
        elif not self._swaps.usable:
            reason += self._swaps.note(job.done)
        self._finish("failed", reason, self._before, self._before, job.predicted, job.solve_seconds, job)
        if recovered is not None:
            self._report_recovery(recovered)  # after the failed swap's record
        elif not self._swaps.running:
            self._stop()

    def _execute(self, layers: tuple[int, ...], prepared: PreparedSwap, **kwargs: Any) -> HotSwapResult:
        """A swap on the swap group (eplb.manager.health); an interruption of this rank is kept for
        the end of the pass, once the manager's state is the other ranks'."""
        result, leaving = self._swaps.execute(layers, prepared, **kwargs)
        if leaving is not None and self._leaving is None:
            self._leaving = leaving
        return result

    def _agreed(self, *flags: bool) -> list[bool]:
        """Flags agreed over the ranks (each true if true on some rank): the pass's agreement, which
        waits for every rank (the watchdog's log says so, should one not come)."""
        doing = self._watchdog.doing
        self._watchdog.doing = f"{doing} (the pass's agreement)"
        try:
            return self._agree.any_of(*flags)
        finally:
            self._watchdog.doing = doing

    def _report_topology(self, placement: Placement) -> None:
        self.sink.on_topology(
            num_layers=placement.num_layers,
            num_logical=placement.num_logical,
            num_physical=placement.num_physical,
            num_gpus=placement.num_gpus,
            num_nodes=placement.num_nodes,
        )

    def _enter(self, phase: ManagerPhase) -> None:
        """The manager's phase (reported to the sink, with the rebalance in flight if any)."""
        self._phase = phase
        if self._on_phase is not None:
            self._on_phase(
                phase=phase, in_flight_since=self._watchdog.began, last_rebalance_at=self._last_rebalance_at
            )

    def _stop(self) -> None:
        """Rebalancing stopped for good on this rank (eplb.manager.health): no collective again."""
        self.recorder.stop()
        self._enter("stopped")

    def _served(self, load_LE: np.ndarray, placement: Placement, weights_LER: np.ndarray | None) -> float:
        """Balancedness of ``load_LE`` on ``placement`` as this server dispatches
        (eplb.solver.scoring.served)."""
        if not self._static_dispatch or weights_LER is not None:
            return float(model_balancedness(load_LE, placement, weights_LER))
        from eplb.solver.scoring.served import served_balancedness  # SciPy's module only where it is used

        return served_balancedness(load_LE, placement, dispatch=self.config.dispatch_algorithm)

    def _finish(
        self,
        outcome: RebalanceOutcome,
        reason: str,
        before: float,
        after: float,
        predicted: float | None,
        solve_seconds: float,
        job: SwapJob | None = None,
    ) -> None:
        record = RebalanceRecord(
            at_pass=self._passes,
            outcome=outcome,
            reason=reason,
            balancedness_before=before,
            balancedness_after=after,
            predicted_balancedness=predicted,
            solve_seconds=solve_seconds,
            transfer_seconds=0.0 if job is None else job.transfer_seconds,
            experts_moved=0 if job is None else job.experts_moved,
            bytes_moved=0 if job is None else job.bytes_moved,
        )
        self._history.append(record)
        assert self._rebalance is not None, "a rebalance ends after it began"
        self._rebalance.close(applied=outcome == "applied", copies=record.experts_moved)
        self._job = None
        self._watchdog.end()
        self._last_rebalance_at = time.monotonic()
        self._enter("idle")
        if self.rank == 0:
            log.info(
                "pass %d: rebalance %s (%s); window balancedness %.4f -> %.4f (the window it was planned from)",
                self._passes,
                outcome,
                reason,
                before,
                after,
            )
        record.report_to(self.sink)

    def _slots(self) -> list[Mapping[str, torch.Tensor]]:
        return [self.engine.slot_tensors(layer) for layer in range(self._placement.num_layers)]


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
