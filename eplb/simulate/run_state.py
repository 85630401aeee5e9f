"""One simulated run as it advances: its placement, the swap in flight, and its timeline so far.

Shape legend: F steps, n passes (the steps of one chunk), W window, L layers, E logical experts, G
GPUs.

At a rebalance the run plans from the window. Periodic mode switches to the plan at once and
stalls for its transfer (so does an engine's synchronous swap, SGLang's, chunk by chunk;
``SimulationConfig.engine_swap``). Continuous mode keeps serving on the old placement while the swap goes
beside the passes (``eplb.policy.cost_model.swap_beside_passes``); the maps switch at the pass
boundary after it arrives, and a swap still in flight at the next rebalance stalls serving for
the rest of its link time. Each applied plan's *realized* balancedness is what its prediction
estimates (``Plan.predicted_balancedness``): the mean over the recorded steps it served until the
next rebalance of their model balancedness, each step weighted by its load; the balancedness of
that load summed, as a window is, is kept beside it (it reads higher: summing smooths the noise).
vLLM's asynchronous swap goes beside the passes too, one layer per pass at least, and a rebalance
due while it is in flight is skipped rather than stalled for.

Every pass is charged its dispatch kernels, once per layer (``--eplb-dispatch-cost``,
eplb.policy.cost_model.DispatchKernelCost, at the rank's tokens: the pass's global tokens over the
GPUs), beside its MoE time (``dispatch_us_F``). A swap beside the passes is timed on the MoE time
alone, as before the kernels were charged, so every plan stays as it was. ``auto`` runs ``lp`` or
static per pass (eplb.policy.auto_dispatch), modeled on the load of the window its placement was
planned from (the replica counts for the start-up placement).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from eplb.placement.balance import balancedness
from eplb.placement.diff import PlacementDiff
from eplb.placement.model import Placement
from eplb.policy import Planner
from eplb.policy.auto_dispatch import AutoDispatch, largest_passes
from eplb.policy.clock import RebalanceClock
from eplb.policy.cost_model import swap_beside_passes
from eplb.policy.decision import Decider, Request
from eplb.policy.dispatch import dispatch_mode
from eplb.simulate.config import SimulationConfig
from eplb.simulate.dispatch import DispatchMatrices, dispatch_matrices, fake_gpu_load
from eplb.simulate.planners import PastView, RunSpec
from eplb.simulate.results import RebalanceEvent, RunResult
from eplb.traces import Trace


@dataclass
class _Swap:
    """An applied plan whose weights are still travelling beside the passes."""

    placement: Placement
    weights_LER: np.ndarray | None
    event: int
    """Index of its rebalance event."""
    remaining_seconds: float
    """Link time it still needs."""
    slowdown: float
    """Slowdown of each pass it runs beside."""
    interference_seconds: float = 0.0
    """Time the passes have lost to it so far."""
    passes_left: int = 0
    """Passes it needs at least before it can switch (vLLM's swap: one per layer)."""
    sample_WLE: np.ndarray | None = None
    """int32 [w, L, E]: the largest passes of the window it was planned from (``auto`` models its
    passes by them)."""


class RunState:
    """One run's placement, dispatch matrices, swap in flight and accumulated timeline."""

    def __init__(
        self,
        spec: RunSpec,
        initial: Placement,
        planner: Planner | None,
        trace: Trace,
        config: SimulationConfig,
        recorded_F: np.ndarray,
        scored_from: int,
        fitted: bool = False,
    ) -> None:
        self.spec, self.planner, self.trace, self.config = spec, planner, trace, config
        self.decider = Decider(config.eplb, fitted=fitted, cost=config.cost)
        """The run's rebalance decisions, as a server's (eplb.policy.decision)."""
        self.placement = initial
        self.weights_LER: np.ndarray | None = None
        self.per_pass = bool(dispatch_mode(spec.dispatch).per_pass)
        """``auto``: each pass runs lp or static (``matrices`` are static's, ``lp_matrices`` lp's)."""
        self.kernels = config.eplb.dispatch_cost
        self.top_k = trace_top_k(trace)
        self.sample_WLE: np.ndarray | None = None
        """The largest passes of the window the serving placement was planned from (None: none yet)."""
        self.matrices = dispatch_matrices(initial, spec.dispatch)
        self.lp_matrices: DispatchMatrices | None = None
        self.auto: AutoDispatch | None = None
        self._per_pass_model()
        self.recorded_F = recorded_F
        self.past = PastView(trace, recorded_F)
        self.scored_from = scored_from
        F, L, E, G = trace.num_steps, trace.num_layers, trace.num_experts, config.eplb.ep_size
        self.balancedness_F = np.zeros(F)
        self.moe_us_F = np.zeros(F)
        self.dispatch_us_F = np.zeros(F)
        self.lp_F = np.zeros(F, dtype=bool)
        """bool [F]: the passes that ran ``lp`` (every pass under lp, auto's choice under auto)."""
        self.relative_load_LG = np.zeros((L, G))
        self.events: list[RebalanceEvent] = []
        self.swap: _Swap | None = None
        self.serving: int | None = None
        """Event whose plan serves now and whose realized window is still open."""
        self.served_LE = np.zeros((L, E))
        self.served_weighted = 0.0
        """Sum over the served recorded steps of load times balancedness (the realized mean's numerator)."""
        self.served_load = 0.0
        self.eval_seconds = 0.0
        self.apply_seconds = 0.0
        _, self.counted_F = RebalanceClock(config.eplb.rebalance_interval).replay(recorded_F)
        """int [F]: recorded steps before each step (the recorder's count of passes)."""

    # ---- rebalancing ----------------------------------------------------------------------------
    def counted_at(self, step: int) -> int:
        """Recorded steps before ``step`` (the recorder's count of passes; the trace's at its end)."""
        return int(self.counted_F[step]) if step < self.counted_F.size else int(self.recorded_F.sum())

    def rebalance(self, step: int) -> None:
        """The rebalance before ``step`` through the run's Decider (eplb.policy.decision), and, when
        its plan is applied, the transfer: at once (a stall) or beside the passes."""
        if self.planner is None:
            return
        # vLLM's swap still in flight: no plan now, the old one keeps going (a skip, not a stall).
        in_flight = self.swap is not None and self.config.engine_swap == "vllm"
        if self.swap is not None and not in_flight:
            # Not arrived yet: serving stalls until it has, then switches before this plan is made.
            self.events[self.swap.event] = replace(
                self.events[self.swap.event], stall_seconds=self.swap.remaining_seconds
            )
            self._switch(step)
        if not in_flight:
            self._close_realized()
        self.past.now = step
        window_WLE = self.past.window(self.config.eplb.recorder_buffer_size)
        window_bal = (
            self.matrices.summed_balancedness(window_WLE.sum(axis=0, dtype=np.float64))
            if window_WLE.shape[0] and not in_flight
            else float("nan")
        )
        request = Request(
            window_WLE=window_WLE,
            current=self.placement,
            planner=self.planner,
            history=self.past,
            bytes_per_expert=self.config.bytes_per_expert,
        )
        outcome = self.decider.rebalance(
            request, counted_pass=self.counted_at(step), window_balancedness=window_bal, in_flight=in_flight
        )
        event = RebalanceEvent(
            step=step,
            window_steps=len(window_WLE),
            applied=False,
            reason=outcome.reason,
            solve_seconds=outcome.solve_seconds,
            window_balancedness=window_bal,
            predicted_balancedness=outcome.predicted,
        )
        if not outcome.applied:
            self.events.append(event)
            return
        assert outcome.diff is not None and outcome.placement is not None
        self._start_swap(step, event, outcome.diff, outcome.placement, outcome.weights_LER)
        if self.per_pass and len(window_WLE):
            if self.swap is not None:
                self.swap.sample_WLE = largest_passes(window_WLE)
            else:  # switched at once: model its passes on the window it was planned from
                self.sample_WLE = largest_passes(window_WLE)
                self._per_pass_model()

    def _start_swap(
        self,
        step: int,
        event: RebalanceEvent,
        diff: PlacementDiff,
        placement: Placement,
        weights_LER: np.ndarray | None,
    ) -> None:
        """Send the applied plan's transfer (``diff``) and record its event: serving switches at
        once (a stall for the whole transfer), or once it arrived beside the passes."""
        cost, gbps = self.config.cost, self.config.eplb.eplb_transfer_gbps
        engine = self.config.engine_swap
        # Beside the passes: eplb's continuous swap, vLLM's asynchronous one; SGLang's waits.
        beside = engine == "vllm" or (engine == "eplb" and self.config.eplb.continuous)
        longest = 0.0
        if engine == "sglang":
            # Synchronous and unpaced: serving waits for each chunk of layers in turn.
            chunks_k = cost.chunk_transfer_seconds(diff, self.config.eplb.eplb_rebalance_layers_per_chunk)
            link_seconds, longest = float(chunks_k.sum()), float(chunks_k.max(initial=0.0))
        elif engine == "vllm":
            # One layer after the other, each on its own busiest GPU.
            link_seconds = float(cost.chunk_transfer_seconds(diff, 1, gbps).sum())
        else:
            link_seconds = cost.transfer_seconds(diff, gbps if beside else None)
            longest = 0.0 if beside else link_seconds
        self.events.append(
            replace(
                event,
                applied=True,
                transfer_seconds=link_seconds,
                # Not beside the passes: serving waits for the whole transfer.
                stall_seconds=0.0 if beside else link_seconds,
                longest_stall_seconds=longest,
                changed_slots=diff.num_changed_slots,
                experts_moved_across_gpus=diff.experts_moved_across_gpus,
                experts_moved_across_nodes=diff.experts_moved_across_nodes,
                bytes_moved=diff.bytes_across_gpus,
            )
        )
        # vLLM's swap runs at the link's own pace unless paced.
        pace = gbps if engine != "vllm" or gbps is not None else min(cost.nvlink_gbps, cost.internode_gbps)
        self.swap = _Swap(
            placement,
            weights_LER,
            len(self.events) - 1,
            link_seconds,
            cost.interference_slowdown(pace) if beside else 0.0,
            passes_left=self.trace.num_layers if engine == "vllm" else 0,
        )
        if not beside or (link_seconds == 0 and self.swap.passes_left == 0):
            self._switch(step)

    def _switch(self, step: int) -> None:
        """The swap in flight has arrived: its placement serves from ``step``."""
        swap = self.swap
        assert swap is not None
        started = time.perf_counter()
        self.events[swap.event] = replace(
            self.events[swap.event], switch_step=step, interference_seconds=swap.interference_seconds
        )
        self.placement, self.weights_LER = swap.placement, swap.weights_LER
        self.matrices = dispatch_matrices(self.placement, self.spec.dispatch, self.weights_LER)
        if swap.sample_WLE is not None:
            self.sample_WLE = swap.sample_WLE
        self._per_pass_model()
        self.swap, self.serving = None, swap.event
        self.served_LE[:] = 0.0
        self.served_weighted = self.served_load = 0.0
        self.apply_seconds += time.perf_counter() - started

    def lose_ranks(
        self, placement: Placement, weights_LER: np.ndarray | None, matrices: DispatchMatrices | None = None
    ) -> None:
        """Ranks lost (eplb.simulate.failure): serve ``placement`` over the survivors from now on, by
        ``matrices`` when given (no replanning: the old maps without the dead GPUs). A swap in flight
        is given up (its peers are gone) and the serving plan's realized window closes."""
        self._close_realized()
        self.swap = None
        self.placement, self.weights_LER = placement, weights_LER
        self.matrices = matrices or dispatch_matrices(placement, self.spec.dispatch, weights_LER)
        if matrices is None:
            self._per_pass_model()
        else:  # the old maps over the survivors: auto keeps them static (lp is not modeled there)
            self.auto = self.lp_matrices = None
        L, _, G = self.matrices.share_LEG.shape
        if self.relative_load_LG.shape[1] != G:  # the relative load map covers the survivors from here
            self.relative_load_LG = np.zeros((L, G))

    def _per_pass_model(self) -> None:
        """``auto``: lp's matrices and the per-pass choice on the placement now, modeled on the
        window it was planned from (a lost rank's survivors: the last one)."""
        if not self.per_pass:
            return
        sample = self.sample_WLE
        if sample is not None and sample.shape[1:] != self.placement.logcnt_LE.shape:
            sample = None
        self.lp_matrices = dispatch_matrices(self.placement, "lp")
        self.auto = AutoDispatch.of(
            self.placement, sample, top_k=self.top_k, cost=self.config.cost, kernels=self.kernels
        )

    def _close_realized(self) -> None:
        """Record the balancedness the serving plan realized on the load it served since its switch."""
        if self.serving is not None and self.served_load > 0:
            self.events[self.serving] = replace(
                self.events[self.serving],
                realized_balancedness=self.served_weighted / self.served_load,
                realized_summed_balancedness=self.matrices.summed_balancedness(self.served_LE),
            )
        self.serving = None

    # ---- evaluation -----------------------------------------------------------------------------
    def evaluate(
        self, start: int, counts_nLE: np.ndarray, load_LnE: np.ndarray, loaded_LnE: np.ndarray
    ) -> None:
        """Steps [start, start + n): counts int32 [n, L, E], as float32 [L, n, E] and as 0/1 float32."""
        started = time.perf_counter()
        n = counts_nLE.shape[0]
        tokens_LnG, active_LnG = self._gpu_load(start, counts_nLE, load_LnE, loaded_LnE)
        gpus = self.placement.num_gpus
        moe_us_n = self.config.cost.layer_times_us(tokens_LnG, active_LnG).sum(axis=0)
        switched = 0
        if self.swap is not None:
            progress = swap_beside_passes(self.swap.remaining_seconds, moe_us_n, self.swap.slowdown)
            self.swap.remaining_seconds = progress.remaining_seconds
            self.swap.interference_seconds += progress.interference_seconds
            floor = self.swap.passes_left
            self.swap.passes_left = max(floor - n, 0)
            if progress.remaining_seconds == 0 and floor <= n:
                switched = max(progress.passes, floor)
                self._switch(start + switched)
                # Fake dispatch ignores the placement: its load stays as drawn.
                if switched < n and self.spec.dispatch != "fake":
                    tail_LnG, tail_active_LnG = self._gpu_load(
                        start + switched,
                        counts_nLE[switched:],
                        load_LnE[:, switched:],
                        loaded_LnE[:, switched:],
                    )
                    tokens_LnG = np.concatenate([tokens_LnG[:, :switched], tail_LnG], axis=1)
                    moe_us_n[switched:] = self.config.cost.layer_times_us(tail_LnG, tail_active_LnG).sum(
                        axis=0
                    )
        stop = start + n
        self.moe_us_F[start:stop] = moe_us_n
        self._charge_dispatch(start, stop, gpus, switched)
        self.balancedness_F[start:stop] = balancedness(tokens_LnG).mean(axis=0)
        first = max(start, self.scored_from)
        if first < stop:
            part_LnG = tokens_LnG[:, first - start :]
            mean_Ln1 = part_LnG.mean(axis=2, keepdims=True)
            relative_LnG = np.divide(part_LnG, mean_Ln1, out=np.ones_like(part_LnG), where=mean_Ln1 > 0)
            self.relative_load_LG += relative_LnG.sum(axis=1)
        if self.serving is not None:
            served_n = self.recorded_F[start:stop].copy()
            served_n[:switched] = False
            self.served_LE += load_LnE[:, served_n].sum(axis=1, dtype=np.float64)
            weight_n = counts_nLE[served_n].sum(axis=(1, 2), dtype=np.float64)
            self.served_weighted += float(weight_n @ self.balancedness_F[start:stop][served_n])
            self.served_load += float(weight_n.sum())
        self.eval_seconds += time.perf_counter() - started

    def _charge_dispatch(self, start: int, stop: int, gpus: int, switched: int) -> None:
        """The dispatch kernels of steps [start, stop): each pass's mode at its rank tokens (the GPUs
        before the switch at ``start + switched``, those after it from there)."""
        tokens_n = self.trace.num_tokens_F[start:stop].astype(np.float64)
        ranks_n = np.full(stop - start, float(self.placement.num_gpus))
        ranks_n[:switched] = gpus
        prefill_n = self.trace.is_prefill_F[start:stop]
        rank_tokens_n = tokens_n / ranks_n
        mode = self.spec.dispatch
        if self.per_pass:
            lp_us = self.kernels.layer_us("lp", rank_tokens_n, prefill_n)
            static_us = self.kernels.layer_us("static", rank_tokens_n, prefill_n)
            layer_us_n = np.where(self.lp_F[start:stop], lp_us, static_us)
        else:
            layer_us_n = self.kernels.layer_us(mode, rank_tokens_n, prefill_n)
            self.lp_F[start:stop] = mode == "lp"
        self.dispatch_us_F[start:stop] = layer_us_n * self.trace.num_layers

    def _gpu_load(
        self, start: int, counts_nLE: np.ndarray, load_LnE: np.ndarray, loaded_LnE: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, active experts), float32 [L, n, G], of steps [start, start + n) on the placement now."""
        if self.spec.dispatch == "fake":
            # Seeded by the chunk, so every run sees the same random routing.
            rng = np.random.default_rng([self.config.seed, start])
            routed_nL = counts_nLE.sum(axis=2, dtype=np.int64)
            tokens_nLG, active_nLG = fake_gpu_load(
                routed_nL, self.placement.num_gpus, self.placement.slots_per_gpu, rng
            )
            return tokens_nLG.transpose(1, 0, 2), active_nLG.transpose(1, 0, 2)
        if self.per_pass:
            return self._per_pass_load(start, load_LnE, loaded_LnE)
        return np.matmul(load_LnE, self.matrices.share_LEG), np.matmul(loaded_LnE, self.matrices.replicas_LEG)

    def _per_pass_load(
        self, start: int, load_LnE: np.ndarray, loaded_LnE: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """``auto``'s (tokens, active experts) float32 [L, n, G]: static's on the passes it keeps
        static, lp's on the others (their choice kept in ``lp_F``)."""
        n = load_LnE.shape[1]
        stop = start + n
        if self.auto is None or self.lp_matrices is None:
            lp_n = np.zeros(n, dtype=bool)
        else:
            lp_n = self.auto.lp_n(self.trace.num_tokens_F[start:stop], self.trace.is_prefill_F[start:stop])
        self.lp_F[start:stop] = lp_n
        tokens_LnG = np.matmul(load_LnE, self.matrices.share_LEG)
        active_LnG = np.matmul(loaded_LnE, self.matrices.replicas_LEG)
        if lp_n.any():
            lp = self.lp_matrices
            assert lp is not None
            tokens_LnG[:, lp_n] = np.matmul(np.ascontiguousarray(load_LnE[:, lp_n]), lp.share_LEG)
            active_LnG[:, lp_n] = np.matmul(loaded_LnE[:, lp_n], lp.replicas_LEG)
        return tokens_LnG, active_LnG

    def result(self) -> RunResult:
        if self.swap is not None:  # still in flight when the trace ends: it never switched
            self.events[self.swap.event] = replace(
                self.events[self.swap.event], interference_seconds=self.swap.interference_seconds
            )
        after = self.trace.num_steps - self.scored_from
        return RunResult(
            spec=self.spec,
            balancedness_F=self.balancedness_F,
            moe_us_F=self.moe_us_F,
            dispatch_us_F=self.dispatch_us_F,
            lp_F=self.lp_F,
            relative_load_LG=self.relative_load_LG / max(after, 1),
            events=self.events,
            final_placement=self.placement,
            eval_seconds=self.eval_seconds,
            apply_seconds=self.apply_seconds,
        )


def trace_top_k(trace: Trace) -> int:
    """Experts per token of ``trace``: its metadata's ``top_k``, else routed copies over tokens."""
    top_k = trace.meta.get("top_k")
    if isinstance(top_k, int) and top_k >= 1:
        return top_k
    tokens = int(trace.num_tokens_F.sum())
    routed = float(trace.counts_FLE[:, 0].sum(dtype=np.float64)) if trace.num_layers else 0.0
    return max(1, round(routed / tokens)) if tokens > 0 else 1
