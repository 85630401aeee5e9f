"""The rebalance manager: count passes, solve off the serving path, hot-swap a chunk of layers per pass.

Shape legend: W window (passes), L layers, E logical experts, P physical slots, G GPUs (ranks),
R max replicas.

The engine calls, on every rank and for every forward pass::

    manager.on_forward_pass_begin(is_prefill=..., num_tokens=T)   # sets the recorder's device flag
    model(...)   # each MoE layer: remap_and_record(..., **manager.recorder.layer_kwargs(layer))
    manager.on_forward_pass_end()

All ranks run the same control logic on agreed inputs, so they take the same steps on the same
pass: record, plan on rank 0 in the background, adopt the broadcast plan, swap a chunk of layers
per pass (paced in continuous mode). The steps, their collectives and the failure rules are in
docs/architecture.md ("The control loop").

Every event goes to the :class:`eplb.metrics.sink.MetricsSink`; :meth:`EplbManager.state` exposes
the rest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
import torch.distributed as dist

from eplb.config import EplbConfig
from eplb.hotswap.swap import FaultHook, HotSwapOptions, HotSwapResult, hot_swap, prepare_swap
from eplb.manager.collectives import RankAgreement
from eplb.manager.health import SwapHealth
from eplb.manager.pacing import Pacer, chunk_costs, per_chunk_layers
from eplb.manager.types import (
    ExpertEngine,
    ManagerState,
    RebalanceRecord,
    SwapJob,
    chunk_steps,
    default_planner,
    share_plan,
    timed_plan,
)
from eplb.metrics.sink import MetricsSink, NullSink, RebalanceOutcome
from eplb.placement.balance import gpu_load, model_balancedness
from eplb.placement.diff import diff_placements
from eplb.placement.model import Placement
from eplb.policy import PlanLike, Planner
from eplb.policy.decision import Decider
from eplb.policy.dispatch import dispatch_mode
from eplb.recorder.recorder import ExpertDistributionRecorder, RecorderConfig

__all__ = [
    "EplbManager",
    "ExpertEngine",
    "ManagerState",
    "PlanLike",
    "Planner",
    "RebalanceRecord",
]

log = logging.getLogger("eplb.manager.manager")


class EplbManager:
    """Drives record -> solve -> hot-swap for one rank. Build one per rank with the same arguments."""

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
    ) -> None:
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if distributed else 0
        self.world_size = dist.get_world_size(group) if distributed else 1
        if self.world_size != placement.num_gpus:
            raise ValueError(
                f"placement spans {placement.num_gpus} GPUs but there are {self.world_size} ranks"
            )
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
        self._agree = RankAgreement.create(group, self.world_size, device)
        self._health = SwapHealth(self.rank)
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
        self._planned_at = 0
        """Counted pass of the rebalance in progress (its window ends there)."""
        self._executor: ThreadPoolExecutor | None = None
        self._preparer: ThreadPoolExecutor | None = None
        self._future: Future[tuple[PlanLike, float]] | None = None
        self._phase = "idle"
        self._passes = 0
        self._counted = 0
        self._next_at = config.rebalance_interval
        self._began = time.perf_counter()
        self._history: list[RebalanceRecord] = []
        self._windows: list[tuple[int, float]] = []
        self._job: SwapJob | None = None
        self._load_LE = np.zeros((L, E))
        self._before = 1.0
        self.sink.on_topology(
            num_layers=L,
            num_logical=E,
            num_physical=placement.num_physical,
            num_gpus=placement.num_gpus,
            num_nodes=placement.num_nodes,
        )

    # ---- the hooks ---------------------------------------------------------------------------
    def on_forward_pass_begin(self, *, is_prefill: bool, num_tokens: int = 0) -> None:
        """Call on every rank before every forward pass (``is_prefill``: this rank's batch has prefill)."""
        self._kind = "prefill" if is_prefill else "decode"
        self._began = time.perf_counter()
        if self._health.usable:
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
        if not self._health.usable:  # no collective on a lost group: serve, count, report
            self.sink.on_forward_pass(kind="prefill" if self._kind == "prefill" else "decode", recorded=False)
            return
        counted = self.recorder.end_pass()
        plan_ready = False
        if self._phase == "solving":
            ready = self.rank == 0 and self._future is not None and self._future.done()
            plan_ready = self._agree.any(ready)
        self.sink.on_forward_pass(kind="prefill" if self._kind == "prefill" else "decode", recorded=counted)
        if counted:
            self._counted += 1
        if self._phase == "applying":
            self._apply_due(seconds)
        elif self._phase == "solving" and plan_ready:
            self._adopt_plan(seconds)
        elif self._phase == "idle" and self._counted >= self._next_at:
            self._next_at = self._counted + self.config.rebalance_interval
            self._trigger()

    def state(self) -> ManagerState:
        return ManagerState(
            phase=self._phase,
            passes=self._passes,
            counted_passes=self._counted,
            next_rebalance_at=self._next_at,
            window_passes=self.recorder.num_window_passes,
            layers_pending=() if self._job is None else tuple(self._job.pending),
            placement=self._placement,
            history=tuple(self._history),
            windows=tuple(self._windows),
        )

    @property
    def placement(self) -> Placement:
        return self._placement

    def close(self) -> None:
        for pool in (self._executor, self._preparer):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        self._executor = self._preparer = None

    # ---- steps -------------------------------------------------------------------------------
    def _trigger(self) -> None:
        load_WLE = self.recorder.window_logical_counts(reduce=True).astype(np.float64)
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
        self._planned_at = self._counted
        why_not = self._decider.screen(
            window_passes=load_WLE.shape[0], window_load=float(load_LE.sum()), window_balancedness=before
        )
        if why_not is not None:
            self._finish("skipped", why_not, before, before, None, 0.0)
            return
        self._load_LE, self._before = load_LE, before
        if self.rank == 0:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eplb-solve")
            planner = self._decider.planner(self._planner, counted_pass=self._counted)
            self._future = self._executor.submit(timed_plan, planner, load_WLE, self._placement)
        self._phase = "solving"

    def _adopt_plan(self, seconds: float) -> None:
        """Rank 0 broadcasts its plan; every rank takes the same decision on the same pass."""
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
        self._phase = "applying"
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
        job.pacer.earn(self._agree.max(seconds))
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
            group=self.group,
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
        if self._agree.any(prepared is None) or prepared is None:
            result = HotSwapResult.not_started(
                tuple(chunk), error or "preparing the swap failed on another rank"
            )
        else:
            live, live_w = self._placement, self._weights_LER
            result = self._health.execute(
                tuple(chunk),
                lambda: prepared.execute(
                    update_maps=lambda: self.engine.set_placement(mixed, mixed_w),
                    restore_maps=lambda: self.engine.set_placement(live, live_w),
                    fault=self._swap_fault,
                ),
            )
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
        reason = f"hot-swap of layers {list(chunk)} failed and was rolled back: {result.error}"
        for future in job.prepared.values():
            future.cancel()
        job.prepared.clear()
        if job.done and self._health.usable:  # undo this rebalance's earlier chunks: one old placement
            live, live_w = self._placement, self._weights_LER
            back = self._health.execute(
                tuple(job.done),
                lambda: hot_swap(
                    self._slots(),
                    live,
                    job.original,
                    layers=job.done,
                    group=self.group,
                    options=self.swap_options,
                    update_maps=lambda: self.engine.set_placement(job.original, job.original_weights_LER),
                    restore_maps=lambda: self.engine.set_placement(live, live_w),
                ),
            )
            if back.ok:
                self._placement, self._weights_LER = job.original, job.original_weights_LER
                self.recorder.set_placement(job.original)
            reason += f"; layers {job.done} {'restored' if back.ok else 'NOT restored: ' + str(back.error)}"
        if not self._health.usable:
            reason += self._health.note(job.done)
            self.recorder.stop()
        self._finish("failed", reason, self._before, self._before, job.predicted, job.solve_seconds, job)
        if not self._health.usable:
            self._phase = "stopped"

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
        self._decider.record(
            counted_pass=self._planned_at, applied=outcome == "applied", copies=record.experts_moved
        )
        self._job = None
        self._phase = "idle"
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
