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

:class:`EplbManager` is the engine's side: the hooks, :meth:`~EplbManager.state`, and the wiring of
its parts, which share one :class:`~eplb.manager.context.Live` state: the rebalance from window to
record (eplb.manager.rebalance), the swap job (eplb.manager.schedule), and the survivors' side of a
lost rank (eplb.manager.lost_rank). Every event goes to the :class:`eplb.metrics.sink.MetricsSink`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch
import torch.distributed as dist

from eplb.config import EplbConfig
from eplb.hotswap.heartbeat import lost_after
from eplb.hotswap.swap import FaultHook, HotSwapOptions
from eplb.manager.backup import ExpertLoader, HostBackup
from eplb.manager.collectives import RankAgreement
from eplb.manager.context import Live, Setup, World, start_recorder
from eplb.manager.health import SwapGroups
from eplb.manager.liveness import Liveness, RankLost
from eplb.manager.lost_rank import LostRank
from eplb.manager.rebalance import Rebalancer
from eplb.manager.recovery import RankLossError, RecoveryRecord, RecoverySetup
from eplb.manager.schedule import SwapScheduler
from eplb.manager.types import ExpertEngine, ManagerState, RebalanceRecord, ServingWorld, default_planner
from eplb.manager.watchdog import Watchdog
from eplb.metrics.sink import MetricsSink, NullSink
from eplb.placement.model import Placement
from eplb.policy import PlanLike, Planner
from eplb.policy.clock import RebalanceClock
from eplb.policy.dispatch import dispatch_mode
from eplb.recorder.recorder import ExpertDistributionRecorder

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
        rank = dist.get_rank(group) if distributed else 0
        world_size = dist.get_world_size(group) if distributed else 1
        if world_size != placement.num_gpus:
            raise ValueError(f"placement spans {placement.num_gpus} GPUs but there are {world_size} ranks")
        if not recovery_timeout_s > 0:
            raise ValueError(f"recovery_timeout_s must be > 0, got {recovery_timeout_s}")
        config = config.for_layers(placement.num_layers)  # sizes continuous mode's default budget
        ranks: tuple[int, ...] = (0,)
        if distributed:
            ranks = tuple(dist.get_process_group_ranks(group) if group is not None else range(world_size))
        self.config, self.engine, self.device = config, engine, device
        self.sink: MetricsSink = sink or NullSink()
        self.swap_options = swap_options or HotSwapOptions()
        if (config.recorder_mode or "stat") not in ("stat", "per_pass"):
            raise ValueError(
                f"--expert-distribution-recorder-mode {config.recorder_mode} keeps token ids, not a load "
                "window: the rebalancer needs stat or per_pass"
            )
        watchdog = Watchdog(watchdog_s, rank)
        lost_after_s = lost_after(self.swap_options.timeout_s)
        liveness = Liveness(group, ranks, rank, lost_after_s) if world_size > 1 else None
        agree = RankAgreement.create(group, world_size, device, liveness)
        world = World(group=group, rank=rank, ranks=ranks, agree=agree)
        swaps = SwapGroups(group, agree, device, rank, timeout_s=self.swap_options.timeout_s)
        backup = None
        if config.eplb_host_backup and world_size > 1:
            backup = HostBackup.fill(
                engine.slot_tensors,
                placement,
                ranks=ranks,
                me=rank,
                group=group,
                loader=loader,
                liveness=liveness,
            )
        recorder = start_recorder(config, placement, device, world)
        self._prefill = False
        """This rank's batch of the pass in progress has prefill."""
        bytes_per_expert = sum(t[0].numel() * t.element_size() for t in engine.slot_tensors(0).values())
        planner = planner or default_planner(config, num_groups=num_groups, bytes_per_expert=bytes_per_expert)
        self._setup = Setup(
            config=config,
            engine=engine,
            device=device,
            swap_options=self.swap_options,
            bytes_per_expert=bytes_per_expert,
            static_dispatch=dispatch_mode(config.dispatch_algorithm).static_maps,
        )
        self._live = Live(
            sink=self.sink,
            watchdog=watchdog,
            world=world,
            swaps=swaps,
            recorder=recorder,
            placement=placement,
            clock=RebalanceClock(config.rebalance_interval),
            last_rebalance_at=time.monotonic(),
        )
        self._began = time.perf_counter()
        self._swapper = SwapScheduler(self._setup, self._live, swap_fault)
        recovery = RecoverySetup(
            device=device,
            timeout_s=recovery_timeout_s,
            lost_after_s=lost_after_s,
            num_groups=num_groups,
            backup=backup,
            loader=loader,
            slots_of=engine.slot_tensors,
        )
        self._lost = LostRank(self._setup, self._live, self._swapper, recovery)
        self._rebalancer = Rebalancer(self._setup, self._live, self._swapper, self._lost, planner)
        self._live.report_topology(placement)
        self._live.enter("idle")

    @property
    def rank(self) -> int:
        """This rank's rank in the group served with now."""
        return self._live.world.rank

    @property
    def world_size(self) -> int:
        """Ranks of the group served with now."""
        return self._live.world.size

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The group served with now (the survivors' after a lost rank)."""
        return self._live.world.group

    @property
    def recorder(self) -> ExpertDistributionRecorder:
        """The recorder the layers record into (a new one after a lost rank)."""
        return self._live.recorder

    @property
    def placement(self) -> Placement:
        return self._live.placement

    # ---- the hooks ---------------------------------------------------------------------------
    def on_forward_pass_begin(self, *, is_prefill: bool, num_tokens: int = 0) -> None:
        """Call on every rank before every forward pass (``is_prefill``: this rank's batch has prefill)."""
        self._prefill = is_prefill
        self._began = time.perf_counter()
        if self._live.swaps.running:
            self._live.recorder.begin_pass(has_prefill=is_prefill, num_tokens=num_tokens)

    def on_forward_pass_end(self, *, pass_seconds: float | None = None) -> None:
        """Call on every rank after every forward pass: count, and maybe solve, adopt or swap.

        ``pass_seconds``: the pass's duration, for pacing (e.g. from CUDA events); None: the host
        time since :meth:`on_forward_pass_begin`. Ranks may differ; pacing takes the maximum.
        """
        seconds = time.perf_counter() - self._began if pass_seconds is None else pass_seconds
        if not seconds >= 0.0:
            raise ValueError(f"pass_seconds must be >= 0, got {pass_seconds}")
        live = self._live
        live.passes += 1
        if not live.swaps.running:  # stopped: no collective (a peer may be gone): serve, count, report
            self.sink.on_forward_pass(kind="prefill" if self._prefill else "decode", recorded=False)
            return
        try:
            self._rebalancer.end_pass(seconds, self._prefill)
        except RankLost as lost:  # one of this pass's collectives: the survivors serve on without it
            self._rebalancer.recover(lost.ranks, str(lost))
        if live.leaving is not None:  # this rank's swap was interrupted: its state is everyone's now
            leaving, live.leaving = live.leaving, None
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
        live = self._live
        if live.world.me in named:
            raise ValueError(f"rank {live.world.me} reports itself lost")
        if live.world.size == 1:
            raise RankLossError("a manager of one rank has no peer to lose")
        if not live.swaps.running:
            raise RankLossError(f"the manager stopped earlier: {live.swaps.stopped}")
        record = self._rebalancer.recover(
            named, f"the engine reported rank(s) {list(named) or '(unnamed)'} lost"
        )
        if record is None:
            raise RankLossError(f"the survivors cannot serve on: {live.swaps.stopped}")
        return record

    def state(self) -> ManagerState:
        live = self._live
        return ManagerState(
            phase=live.phase,
            in_flight_seconds=live.watchdog.in_flight(),
            seconds_since_rebalance=time.monotonic() - live.last_rebalance_at,
            swap_groups=live.swaps.made,
            stopped=live.swaps.stopped,
            passes=live.passes,
            counted_passes=live.clock.counted,
            next_rebalance_at=live.clock.next_at,
            window_passes=live.recorder.num_window_passes,
            layers_pending=self._swapper.pending,
            placement=live.placement,
            history=tuple(live.history),
            windows=tuple(self._rebalancer.windows),
            ranks=live.world.ranks,
            degraded=self._lost.degraded(),
            recoveries=tuple(self._lost.records),
        )

    def close(self) -> None:
        """Stop the helper threads (a solve in flight is left to end on its own daemon thread)."""
        self._swapper.close()
        self._live.watchdog.close()
