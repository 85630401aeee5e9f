"""The simulation loop: replay a trace under each run's placements, rebalancing every interval.

Shape legend: F steps, n passes (the steps of one chunk), W window, L layers, E logical experts, G
GPUs.

Schedule (SGLang's clock in both modes, read from ``config.eplb``): a step is *recorded* (all
steps, or only prefill steps with ``eplb_record_prefill_only``); after every
``rebalance_interval``-th recorded step the planner gets the last ``recorder_buffer_size``
recorded steps; its placement serves from the next step on (periodic) or from the pass
boundary after its swap arrives (continuous, ``eplb.simulate.run_state``). The schedule does not
depend on the algorithm, so every run is cut into the same chunks and all runs advance chunk by
chunk, sharing the chunk's load arrays. Within a chunk each run's placement is fixed (but for the
one switch a swap arriving in it makes) and the chunk is evaluated at once: one matrix product
per layer turns logical load [n, E] into GPU load [n, G] (``eplb.placement.balance.expert_gpu_share``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
from threadpoolctl import threadpool_limits

from eplb.placement.model import Placement
from eplb.policy import Planner
from eplb.policy.clock import RebalanceClock
from eplb.simulate.config import SimulationConfig
from eplb.simulate.planners import RunSpec, make_planner
from eplb.simulate.results import SimulationResult
from eplb.simulate.run_state import RunState
from eplb.traces import Trace

__all__ = ["CHUNK_STEPS", "Chunk", "SimulationConfig", "plan_chunks", "rebalance_steps", "simulate"]

CHUNK_STEPS = 256
"""Most steps evaluated in one matrix product (bounds memory at L * n * E float32)."""


@dataclass(frozen=True)
class Chunk:
    """Steps [start, stop), on one placement per run; ``rebalance``: every run plans before the first."""

    start: int
    stop: int
    rebalance: bool


def rebalance_steps(trace: Trace, config: SimulationConfig) -> np.ndarray:
    """int64 [k]: the steps from which a new plan serves (after every interval-th recorded step,
    the server's clock replayed: eplb.policy.clock.RebalanceClock)."""
    due_F, _ = RebalanceClock(config.eplb.rebalance_interval).replay(recorded_steps_mask(trace, config))
    after = np.flatnonzero(due_F)
    return after[after + 1 < trace.num_steps] + 1


def recorded_steps_mask(trace: Trace, config: SimulationConfig) -> np.ndarray:
    """bool [F]: the steps the recorder counts."""
    if config.eplb.eplb_record_prefill_only:
        return trace.is_prefill_F.copy()
    return np.ones(trace.num_steps, dtype=bool)


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
    config = config.on_layers_of(trace)
    flags = config.eplb
    if flags.num_experts is None:
        replace(flags, num_experts=E)  # EplbConfig checks that the slots divide over the GPUs
    elif flags.num_experts != E:
        raise ValueError(f"--num-experts: the flags say {flags.num_experts} experts, the trace has {E}")
    G, N, R = flags.ep_size, flags.nnodes, flags.ep_num_redundant_experts
    fitted = initial is not None  # a given start-up placement: no unbudgeted first plan
    if initial is None:
        initial = Placement.trivial(L, E, G, R, N)
    else:
        got = (
            initial.num_layers,
            initial.num_logical,
            initial.num_physical,
            initial.num_gpus,
            initial.num_nodes,
        )
        want = (L, E, E + R, G, N)
        if got != want:
            raise ValueError(
                f"the initial placement is (L, E, P, G, N) = {got}; the trace and topology need {want}"
            )
    baseline_spec = RunSpec("none", flags.dispatch_algorithm)
    specs = list(runs) if baseline_spec in runs else [*runs, baseline_spec]
    apply_steps = rebalance_steps(trace, config)
    chunks = plan_chunks(trace.num_steps, apply_steps)
    # Steps before the first rebalance run on the initial placement in every run: not scored.
    scored_from = int(apply_steps[0]) if apply_steps.size else 0
    if config.score_from is not None:
        if config.score_from >= trace.num_steps:
            raise ValueError(
                f"--score-from {config.score_from} (SimulationConfig.score_from): not a step of the "
                f"{trace.num_steps}-step trace (steps 0-{trace.num_steps - 1})"
            )
        scored_from = config.score_from
    recorded_F = recorded_steps_mask(trace, config)
    states = [
        RunState(
            spec,
            initial,
            planner_for(spec, config, planners),
            trace,
            config,
            recorded_F,
            scored_from,
            fitted,
        )
        for spec in specs
    ]
    # The products are many small GEMMs: BLAS threads only add contention (65x slower measured on
    # a busy 2-core machine), so one thread it is.
    with threadpool_limits(limits=1, user_api="blas"):
        for chunk in progress(chunks) if progress else chunks:
            counts_nLE = trace.counts_FLE[chunk.start : chunk.stop]
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
            f"no rebalance happens: the trace records fewer than {flags.rebalance_interval} steps "
            "(--eplb-rebalance-num-iterations) before its end"
        )
    if trace.meta.get("chronological") is False:
        notes.append("the trace's steps may not be in time order (an SGLang stat dump's ring buffer)")
    notes.extend(n for n in (trace.prefill_note(), _bytes_note(trace, config)) if n)
    return SimulationResult(
        config=config.to_dict(),
        runs=results[: len(runs)] if baseline_spec not in runs else results,
        baseline=results[specs.index(baseline_spec)],
        is_prefill_F=trace.is_prefill_F.copy(),
        scored_from=scored_from,
        trace_meta={k: v for k, v in trace.meta.items() if k != "generator"},
        notes=notes,
    )


def _bytes_note(trace: Trace, config: SimulationConfig) -> str | None:
    """Bytes moved are at ``config.bytes_per_expert``: say so when the trace does not agree."""
    recorded = trace.meta.get("bytes_per_expert")
    if recorded == config.bytes_per_expert:
        return None
    said = "the trace does not record one" if recorded is None else f"the trace records {int(recorded):,}"
    return (
        f"bytes moved are at {config.bytes_per_expert:,} bytes per expert (--bytes-per-expert, "
        f"SimulationConfig.bytes_per_expert; DeepSeek-V3's by default); {said}"
    )


def planner_for(
    spec: RunSpec, config: SimulationConfig, planners: Mapping[str, Planner] | None = None
) -> Planner | None:
    """The planner of ``spec``: the one ``planners`` names, else the built-in one (None for "none")."""
    if planners and spec.name in planners:
        return planners[spec.name]
    return make_planner(spec, config)
