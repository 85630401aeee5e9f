"""Swap scheduling: the adopted plan applied a chunk of layers per pass, each chunk's swap prepared
ahead on a helper thread; paced by a byte credit in continuous mode; a failed chunk undoes the
rebalance's earlier ones.

Shape legend: L layers, E logical experts, P physical slots, R max replicas.

Every rank holds the same job (made from the broadcast plan) and takes the same step on the same
pass: chunk i's swap is prepared (host work, no collective) while the passes before it run, and
the pass that applies it agrees first that every rank prepared it and that the watchdog has not
ended the rebalance (docs/architecture.md, "The control loop", steps 4 and 5). How a job ends is
handed back as a :class:`JobEnd`, for the rebalance's record (eplb.manager.rebalance).
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from eplb.hotswap.control import Cause
from eplb.hotswap.swap import FaultHook, HotSwapResult, prepare_swap
from eplb.manager.context import Live, Setup
from eplb.manager.pacing import Pacer, chunk_costs, per_chunk_layers
from eplb.manager.types import SharedPlan, SwapJob, chunk_steps
from eplb.placement.diff import diff_placements
from eplb.placement.model import Placement


@dataclass(frozen=True)
class JobEnd:
    """How the swap job ended on this pass, the same on every rank."""

    job: SwapJob
    failure: str | None
    """Why it failed, with what its undo did (None: every chunk applied)."""
    cause: Cause | None = None
    """The failed swap's cause (eplb.hotswap.control.Cause), the same on every rank; None: every
    chunk applied, or ended otherwise (the watchdog between passes)."""


class SwapScheduler:
    """This rank's swap job: made from the adopted plan, a chunk applied per due pass.

    ``fault``: a hook into every chunk's swap (tests' fault injection, eplb.hotswap.swap.FaultHook).
    """

    def __init__(self, setup: Setup, live: Live, fault: FaultHook | None) -> None:
        self.setup, self.live, self.fault = setup, live, fault
        self.job: SwapJob | None = None
        """The adopted plan being applied (None: no swap in flight)."""
        self._preparer: ThreadPoolExecutor | None = None

    @property
    def pending(self) -> tuple[int, ...]:
        """Layers of the job still to swap."""
        return () if self.job is None else tuple(self.job.pending)

    def adopt(self, shared: SharedPlan) -> None:
        """The job for the plan every rank received: its chunks (and their costs when paced), the
        first two being prepared."""
        live = self.live
        target, weights_LER = shared.target, shared.weights_LER
        assert target is not None, "only a plan to apply is adopted"
        changed = diff_placements(live.placement, target).changed_layers().tolist()
        job = SwapJob(
            live.placement,
            live.weights_LER,
            target,
            weights_LER,
            changed,
            shared.reason,
            shared.predicted,
            shared.solve_seconds,
        )
        gbps = self.setup.config.eplb_transfer_gbps
        per_chunk = per_chunk_layers(
            self.setup.config.eplb_rebalance_layers_per_chunk, gbps is not None, len(changed)
        )
        job.chunks, job.steps = chunk_steps(
            live.placement, live.weights_LER, target, weights_LER, changed, per_chunk
        )
        if gbps is not None:
            job.pacer = Pacer(bytes_per_second=gbps * 1e9)
            job.costs = chunk_costs(live.placement, target, job.chunks, self.setup.bytes_per_expert)
        self.job = job
        live.watchdog.doing = "transfer"
        live.enter("applying")
        self._prepare(0)
        self._prepare(1)

    def apply_due(self, seconds: float) -> JobEnd | None:
        """Unpaced: the next chunk. Paced: earn this pass's (agreed) credit, run the chunks it
        covers. None: the job goes on."""
        job = self.job
        assert job is not None
        if job.pacer is None:
            return self._apply_next_chunk()
        seconds, expired = self.live.world.agree.max_of(seconds, float(self.live.watchdog.expired()))
        if expired > 0.0:
            return self._ended_by_watchdog(job)
        job.pacer.earn(seconds)
        while job.pacer.take(job.costs[job.next_chunk]):
            ended = self._apply_next_chunk()
            if ended is not None:
                return ended
        return None

    def swap_at_once(
        self, target: Placement, target_weights_LER: np.ndarray | None, layers: list[int]
    ) -> HotSwapResult:
        """``layers`` of the live placement moved to ``target``'s in one swap, prepared here (not
        paced); the maps follow when it commits. ValueError: the swap does not fit the slots."""
        live = self.live
        current, current_w = live.placement, live.weights_LER
        prepared = prepare_swap(
            self._slots(),
            current,
            target,
            layers=layers,
            group=live.swaps.group,
            options=self.setup.swap_options,
            check=False,
        )
        return live.execute(
            tuple(layers),
            prepared,
            update_maps=lambda: self.setup.engine.set_placement(target, target_weights_LER),
            restore_maps=lambda: self.setup.engine.set_placement(current, current_w),
        )

    def drop(self) -> None:
        """Forget the job (its prepared chunks cancelled): the world changes under it."""
        if self.job is not None:
            for future in self.job.prepared.values():
                future.cancel()
        self.job = None

    def close(self) -> None:
        """Stop the helper thread."""
        if self._preparer is not None:
            self._preparer.shutdown(wait=True, cancel_futures=True)
        self._preparer = None

    def _prepare(self, i: int) -> None:
        """Start planning chunk i's swap on the helper thread (host work; no collective)."""
        job = self.job
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
            group=self.live.swaps.group,
            options=self.setup.swap_options,
            check=False,
        )

    def _apply_next_chunk(self) -> JobEnd | None:
        job = self.job
        assert job is not None
        live, watchdog, engine = self.live, self.live.watchdog, self.setup.engine
        i = job.next_chunk
        job.next_chunk += 1
        chunk, (mixed, mixed_w) = job.chunks[i], job.steps[i]
        job.pending = [layer for c in job.chunks[i + 1 :] for layer in c]
        try:
            prepared, error = job.prepared.pop(i).result(), ""
        except Exception as exc:  # the same inputs on every rank: normally every rank gets here
            prepared, error = None, f"preparing the swap failed: {type(exc).__name__}: {exc}"
        unprepared, expired = live.agreed(prepared is None, watchdog.expired())
        if expired:
            return self._ended_by_watchdog(job)
        if unprepared or prepared is None:
            result = HotSwapResult.not_started(
                tuple(chunk), error or "preparing the swap failed on another rank"
            )
        else:
            current, current_w = live.placement, live.weights_LER
            with watchdog.watching(prepared):
                result = live.execute(
                    tuple(chunk),
                    prepared,
                    update_maps=lambda: engine.set_placement(mixed, mixed_w),
                    restore_maps=lambda: engine.set_placement(current, current_w),
                    fault=self.fault,
                )
            watchdog.ended(result.error)
            self._prepare(i + 2)
        job.transfer_seconds += result.seconds
        if result.ok:
            live.serve(mixed, mixed_w)
            job.done.extend(chunk)
            job.experts_moved += result.experts_moved
            job.bytes_moved += result.bytes_moved
            return None if job.pending else JobEnd(job, None)
        return self._fail(
            job, f"hot-swap of layers {list(chunk)} failed and was rolled back: {result.error}", result.cause
        )

    def _ended_by_watchdog(self, job: SwapJob) -> JobEnd:
        """The ranks agreed the watchdog's bound passed: end the job, failed, for the watchdog."""
        self.live.watchdog.fire()
        return self._fail(job, self.live.watchdog.reason())

    def _fail(self, job: SwapJob, reason: str, cause: Cause | None = None) -> JobEnd:
        """End the job, failed (on every rank alike): undo its applied chunks while a swap group is
        in place, else keep them (consistent per layer)."""
        for future in job.prepared.values():
            future.cancel()
        job.prepared.clear()
        if job.done and self.live.swaps.usable:  # undo this rebalance's earlier chunks: one old placement
            back = self.swap_at_once(job.original, job.original_weights_LER, job.done)
            if back.ok:
                self.live.serve(job.original, job.original_weights_LER)
            reason += f"; layers {job.done} {'restored' if back.ok else 'NOT restored: ' + str(back.error)}"
        return JobEnd(job, reason, cause)

    def _slots(self) -> list[Mapping[str, torch.Tensor]]:
        return [self.setup.engine.slot_tensors(layer) for layer in range(self.live.placement.num_layers)]
