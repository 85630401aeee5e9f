"""The simulation loop: replay a trace under each run's placements, rebalancing every interval.

Shape legend: T steps, n steps of one chunk, W window, L layers, E logical experts, G GPUs.

Schedule (SGLang's): a step is *recorded* (all steps, or only prefill steps with
``record_prefill_only``); after every ``interval``-th recorded step the planner gets the last
``window`` recorded steps and its placement serves from the next step on. The schedule does not
depend on the algorithm, so every run is cut into the same chunks and all runs advance chunk by
chunk, sharing the chunk's load arrays. Within a chunk each run's placement is fixed and the
whole chunk is evaluated at once: one matrix product per layer turns logical
load [n, E] into GPU load [n, G] (``eplb.placement.balance.expert_gpu_share``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from eplb.placement.balance import balancedness
from eplb.placement.diff import diff_placements
from eplb.placement.model import Placement
from eplb.policy import PlanLike, Planner
from eplb.simulate.cost_model import DEEPSEEK_V3_BYTES_PER_EXPERT, CostModel
from eplb.simulate.dispatch import DISPATCH_MODES, DispatchMatrices, dispatch_matrices, fake_gpu_load
from eplb.simulate.planners import PastView, RunSpec, make_planner
from eplb.simulate.results import RebalanceEvent, RunResult, SimulationResult
from eplb.traces import Trace

CHUNK_STEPS = 256
"""Most steps evaluated in one matrix product (bounds memory at L * n * E float32)."""


@dataclass(frozen=True, kw_only=True)
class SimulationConfig:
    """Topology, schedule and costs of a simulation (flag names follow SGLang's where they exist)."""

    num_gpus: int = 32
    """--ep-size: EP ranks."""
    num_nodes: int = 4
    """--nnodes: nodes the ranks span."""
    num_redundant: int = 32
    """--ep-num-redundant-experts: physical slots beyond one per logical expert."""
    interval: int = 500
    """--eplb-rebalance-num-iterations: rebalance after every this many recorded steps."""
    window: int | None = None
    """--expert-distribution-recorder-buffer-size: recorded steps the planner sees (None: interval)."""
    record_prefill_only: bool = False
    """--eplb-record-prefill-only: record and count only prefill steps."""
    utilization_threshold: float = 1.0
    """--eplb-min-rebalancing-utilization-threshold: skip when the window's balancedness is above it."""
    default_dispatch: str = "static"
    """--ep-dispatch-algorithm: dispatch of the no-balancing baseline (and of runs without one)."""
    bytes_per_expert: int = DEEPSEEK_V3_BYTES_PER_EXPERT
    """Bytes of one expert's weights in one layer (transfer cost)."""
    num_groups: int = 1
    """Expert groups of the model (the hierarchical algorithm packs groups onto nodes)."""
    seed: int = 0
    """Seed of the planners and of fake dispatch."""
    cost: CostModel = field(default_factory=CostModel)
    solver_options: Mapping[str, Any] = field(default_factory=dict)
    """Extra ``eplb.solver.SolveOptions`` fields for the solver-backed runs (--solver-option)."""

    def __post_init__(self) -> None:
        if self.num_gpus < 1 or self.num_nodes < 1 or self.num_gpus % self.num_nodes:
            raise ValueError(
                f"--nnodes ({self.num_nodes}) must divide --ep-size ({self.num_gpus}), both >= 1"
            )
        if self.num_redundant < 0:
            raise ValueError(f"--ep-num-redundant-experts must be >= 0, got {self.num_redundant}")
        if self.interval < 1:
            raise ValueError(f"--eplb-rebalance-num-iterations must be >= 1, got {self.interval}")
        if self.window is not None and not 1 <= self.window <= self.interval:
            raise ValueError(
                f"--expert-distribution-recorder-buffer-size ({self.window}) must lie in "
                f"[1, --eplb-rebalance-num-iterations ({self.interval})]"
            )
        if not 0.0 <= self.utilization_threshold <= 1.0:
            raise ValueError("--eplb-min-rebalancing-utilization-threshold must lie in [0, 1]")
        if self.default_dispatch not in DISPATCH_MODES:
            raise ValueError(f"unknown dispatch {self.default_dispatch!r}; choose from {DISPATCH_MODES}")
        if self.bytes_per_expert < 0 or self.num_groups < 1:
            raise ValueError("bytes_per_expert must be >= 0 and num_groups >= 1")

    @property
    def window_size(self) -> int:
        return self.interval if self.window is None else self.window

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "solver_options": dict(self.solver_options)}


@dataclass(frozen=True)
class Chunk:
    """Steps [start, stop), on one placement per run; ``rebalance``: every run plans before the first."""

    start: int
    stop: int
    rebalance: bool


def rebalance_steps(trace: Trace, config: SimulationConfig) -> np.ndarray:
    """int64 [k]: the steps from which a new plan serves (after every interval-th recorded step)."""
    recorded_T = recorded_steps_mask(trace, config)
    count_T = np.cumsum(recorded_T)
    after = np.flatnonzero(recorded_T & (count_T % config.interval == 0))
    return after[after + 1 < trace.num_steps] + 1


def recorded_steps_mask(trace: Trace, config: SimulationConfig) -> np.ndarray:
    """bool [T]: the steps the recorder counts."""
    return trace.is_prefill_T.copy() if config.record_prefill_only else np.ones(trace.num_steps, dtype=bool)


def plan_chunks(num_steps: int, apply_steps: np.ndarray) -> list[Chunk]:
    """The trace cut at each rebalance and every CHUNK_STEPS steps."""
    applies = set(apply_steps.tolist())
    cuts = sorted({0, num_steps, *applies, *range(0, num_steps, CHUNK_STEPS)})
    return [Chunk(a, b, a in applies) for a, b in itertools.pairwise(cuts)]


def simulate(
    trace: Trace,
    runs: Sequence[RunSpec],
    config: SimulationConfig,
    *,
    initial: Placement | None = None,
    planners: Mapping[str, Planner] | None = None,
    progress: Callable[[list[Chunk]], Iterable[Chunk]] | None = None,
) -> SimulationResult:
    """Replay ``trace`` under every run in ``runs`` and the no-balancing baseline.

    ``initial`` is the placement before the first rebalance (default: trivial, as SGLang's);
    ``planners`` maps run names to planners that replace the built-in ones (tests, experiments).
    """
    if trace.num_steps == 0:
        raise ValueError("the trace has no steps")
    L, E = trace.num_layers, trace.num_experts
    if (E + config.num_redundant) % config.num_gpus:
        raise ValueError(
            f"{E} experts + {config.num_redundant} redundant = {E + config.num_redundant} slots do not "
            f"divide evenly over --ep-size {config.num_gpus}"
        )
    if initial is None:
        initial = Placement.trivial(L, E, config.num_gpus, config.num_redundant, config.num_nodes)
    else:
        got = (
            initial.num_layers,
            initial.num_logical,
            initial.num_physical,
            initial.num_gpus,
            initial.num_nodes,
        )
        want = (L, E, E + config.num_redundant, config.num_gpus, config.num_nodes)
        if got != want:
            raise ValueError(
                f"the initial placement is (L, E, P, G, N) = {got}; the trace and topology need {want}"
            )
    baseline_spec = RunSpec("none", config.default_dispatch)
    specs = list(runs) if baseline_spec in runs else [*runs, baseline_spec]
    apply_steps = rebalance_steps(trace, config)
    chunks = plan_chunks(trace.num_steps, apply_steps)
    # Steps before the first rebalance run on the initial placement in every run: not scored.
    scored_from = int(apply_steps[0]) if apply_steps.size else 0
    states = [
        _RunState(spec, initial, _planner_for(spec, config, planners), trace, config, scored_from)
        for spec in specs
    ]
    # The products are many small GEMMs: BLAS threads only add contention (65x slower measured on
    # a busy 2-core machine), so one thread it is.
    with threadpool_limits(limits=1, user_api="blas"):
        for chunk in progress(chunks) if progress else chunks:
            counts_nLE = trace.counts_TLE[chunk.start : chunk.stop]
            load_LnE = counts_nLE.astype(np.float32).transpose(1, 0, 2)
            loaded_LnE = (load_LnE > 0).astype(np.float32)
            for state in states:
                if chunk.rebalance:
                    state.rebalance(chunk.start)
                state.evaluate(chunk.start, counts_nLE, load_LnE, loaded_LnE)
    results = [s.result() for s in states]
    notes = []
    if not apply_steps.size:
        notes.append(
            f"no rebalance happens: the trace records fewer than {config.interval} steps "
            "(--eplb-rebalance-num-iterations) before its end"
        )
    if trace.meta.get("chronological") is False:
        notes.append("the trace's steps may not be in time order (an SGLang stat dump's ring buffer)")
    return SimulationResult(
        config={**config.to_dict(), "window_size": config.window_size},
        runs=results[: len(runs)] if baseline_spec not in runs else results,
        baseline=results[specs.index(baseline_spec)],
        is_prefill_T=trace.is_prefill_T.copy(),
        scored_from=scored_from,
        trace_meta={k: v for k, v in trace.meta.items() if k != "generator"},
        notes=notes,
    )


def _planner_for(
    spec: RunSpec, config: SimulationConfig, planners: Mapping[str, Planner] | None
) -> Planner | None:
    if planners and spec.name in planners:
        return planners[spec.name]
    return make_planner(
        spec,
        num_groups=config.num_groups,
        bytes_per_expert=config.bytes_per_expert,
        seed=config.seed,
        solver_options=config.solver_options,
    )


class _RunState:
    """One run's placement, dispatch matrices and accumulated timeline."""

    def __init__(
        self,
        spec: RunSpec,
        initial: Placement,
        planner: Planner | None,
        trace: Trace,
        config: SimulationConfig,
        scored_from: int,
    ) -> None:
        self.spec, self.planner, self.trace, self.config = spec, planner, trace, config
        self.placement = initial
        self.weights_LER: np.ndarray | None = None
        self.matrices = dispatch_matrices(initial, spec.dispatch)
        self.past = PastView(trace, recorded_steps_mask(trace, config))
        self.scored_from = scored_from
        T, L, G = trace.num_steps, trace.num_layers, config.num_gpus
        self.balancedness_T = np.zeros(T)
        self.moe_us_T = np.zeros(T)
        self.relative_load_LG = np.zeros((L, G))
        self.events: list[RebalanceEvent] = []
        self.eval_seconds = 0.0
        self.apply_seconds = 0.0

    def rebalance(self, step: int) -> None:
        if self.planner is None:
            return
        self.past.now = step
        window_WLE = self.past.window(self.config.window_size)
        if window_WLE.shape[0] == 0:
            self.events.append(
                RebalanceEvent(
                    step=step, window_steps=0, applied=False, reason="empty window", solve_seconds=0.0
                )
            )
            return
        window_bal = float(
            _model_balancedness(window_WLE.sum(axis=0, dtype=np.float32)[:, None, :], self.matrices)[0]
        )
        if window_bal > self.config.utilization_threshold:
            reason = (
                f"window balancedness {window_bal:.3f} above threshold {self.config.utilization_threshold}"
            )
            self.events.append(
                RebalanceEvent(
                    step=step,
                    window_steps=len(window_WLE),
                    applied=False,
                    reason=reason,
                    solve_seconds=0.0,
                    window_balancedness=window_bal,
                )
            )
            return
        started = time.perf_counter()
        proposal: PlanLike = self.planner(window_WLE, self.placement, self.past)
        skipped = RebalanceEvent(
            step=step,
            window_steps=len(window_WLE),
            applied=False,
            reason=proposal.reason,
            solve_seconds=time.perf_counter() - started,
            window_balancedness=window_bal,
            predicted_balancedness=proposal.predicted_balancedness,
        )
        if not proposal.apply:
            self.events.append(skipped)
            return
        started = time.perf_counter()
        diff = diff_placements(self.placement, proposal.placement, self.config.bytes_per_expert)
        self.events.append(
            replace(
                skipped,
                applied=True,
                transfer_seconds=self.config.cost.transfer_seconds(diff),
                changed_slots=diff.num_changed_slots,
                experts_moved_across_gpus=diff.experts_moved_across_gpus,
                experts_moved_across_nodes=diff.experts_moved_across_nodes,
                bytes_moved=diff.bytes_across_gpus,
            )
        )
        self.placement, self.weights_LER = proposal.placement, proposal.dispatch_weights_LER
        self.matrices = dispatch_matrices(self.placement, self.spec.dispatch, self.weights_LER)
        self.apply_seconds += time.perf_counter() - started

    def evaluate(
        self, start: int, counts_nLE: np.ndarray, load_LnE: np.ndarray, loaded_LnE: np.ndarray
    ) -> None:
        """Steps [start, start + n): counts int32 [n, L, E], as float32 [L, n, E] and as 0/1 float32."""
        started = time.perf_counter()
        stop = start + counts_nLE.shape[0]
        if self.spec.dispatch == "fake":
            # Seeded by the chunk, so every run sees the same random routing.
            rng = np.random.default_rng([self.config.seed, start])
            routed_nL = counts_nLE.sum(axis=2, dtype=np.int64)
            tokens_nLG, active_nLG = fake_gpu_load(
                routed_nL, self.placement.num_gpus, self.placement.slots_per_gpu, rng
            )
            tokens_LnG, active_LnG = tokens_nLG.transpose(1, 0, 2), active_nLG.transpose(1, 0, 2)
        else:
            tokens_LnG = np.matmul(load_LnE, self.matrices.share_LEG)
            active_LnG = np.matmul(loaded_LnE, self.matrices.replicas_LEG)
        self.moe_us_T[start:stop] = self.config.cost.layer_times_us(tokens_LnG, active_LnG).sum(axis=0)
        self.balancedness_T[start:stop] = balancedness(tokens_LnG).mean(axis=0)
        first = max(start, self.scored_from)
        if first < stop:
            part_LnG = tokens_LnG[:, first - start :]
            mean_Ln1 = part_LnG.mean(axis=2, keepdims=True)
            relative_LnG = np.divide(part_LnG, mean_Ln1, out=np.ones_like(part_LnG), where=mean_Ln1 > 0)
            self.relative_load_LG += relative_LnG.sum(axis=1)
        self.eval_seconds += time.perf_counter() - started

    def result(self) -> RunResult:
        after = self.trace.num_steps - self.scored_from
        return RunResult(
            spec=self.spec,
            balancedness_T=self.balancedness_T,
            moe_us_T=self.moe_us_T,
            relative_load_LG=self.relative_load_LG / max(after, 1),
            events=self.events,
            final_placement=self.placement,
            eval_seconds=self.eval_seconds,
            apply_seconds=self.apply_seconds,
        )


def _model_balancedness(load_LnE: np.ndarray, matrices: DispatchMatrices) -> np.ndarray:
    """float64 [n]: model balancedness of logical load [L, n, E] under dispatch ``matrices``."""
    return balancedness(np.matmul(load_LnE, matrices.share_LEG)).mean(axis=0)
