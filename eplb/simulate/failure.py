"""Replaying a trace with ranks lost at given steps: eplb's degraded plan, SGLang's, no replanning.

Shape legend: F steps, n passes (the steps of one chunk), L layers, E logical experts, G GPUs (EP
ranks).

The schedule is the simulator's (eplb.simulate.engine: the same rebalance steps and chunks, each
run a ``RunState``), with the losses of ``--rank-failure STEP:RANK`` added. At a loss, before the
step is served, each run answers:

- a solver run (``scipy``, ``deepseek``, ...): the degraded plan over the survivors from the
  window so far (eplb.solver.degraded, through the run's Decider as its rebalance at that pass:
  eplb.policy.decision), then periodic plans over them;
- ``sglang_elasticity_aware``: SGLang's own planner over the active ranks
  (eplb.simulate.sglang_peer), at the loss and at every rebalance, as SGLang's elastic EP runs it;
- ``none``: the first solver run's plans until the loss, then no replanning (what eplb's manager
  did until now: it stops rebalancing once a rank is gone). Its maps still send tokens to the lost
  ranks: those tokens are lost, and the survivors' balance is what the rest gives them.

From a loss on, a run's placement spans the live GPUs only (eplb.placement.degraded's survivors),
so balancedness is over them; a swap in flight at the loss is given up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from eplb.placement.degraded import orphans
from eplb.placement.model import Placement
from eplb.policy.decision import RankLoss, Request
from eplb.simulate.config import SimulationConfig
from eplb.simulate.dispatch_lp import join_gpus, take_gpus
from eplb.simulate.engine import Chunk, plan_chunks, planner_for, rebalance_steps, recorded_steps_mask
from eplb.simulate.failure_results import FailureResult, FailureRun, LossEvent, RankFailure
from eplb.simulate.planners import RunSpec
from eplb.simulate.run_state import RunState
from eplb.simulate.sglang_peer import ElasticPlanner
from eplb.traces import Trace

SGLANG_RUN = "sglang_elasticity_aware"
"""The algorithm name of SGLang's run."""


def parse_rank_failures(texts: Sequence[str], num_steps: int, num_gpus: int) -> list[RankFailure]:
    """``["1000:5", "1500:8-15"]`` -> losses by step; ValueError naming a bad entry.

    A rank may be lost once; a step must lie inside the trace after step 0; some rank must live.
    """
    by_step: dict[int, set[int]] = {}
    seen: set[int] = set()
    for text in texts:
        step_text, sep, ranks_text = text.partition(":")
        first, dash, last = ranks_text.partition("-")
        try:
            if not sep:
                raise ValueError
            step = int(step_text)
            ranks = range(int(first), int(last) + 1) if dash else range(int(first), int(first) + 1)
        except ValueError:
            raise ValueError(f"--rank-failure expects STEP:RANK or STEP:FIRST-LAST, got {text!r}") from None
        if not 1 <= step < num_steps:
            raise ValueError(
                f"--rank-failure {text}: step {step} is not in 1..{num_steps - 1} (the trace's steps)"
            )
        if not ranks or ranks.start < 0 or ranks.stop > num_gpus:
            raise ValueError(
                f"--rank-failure {text}: ranks must lie in 0..{num_gpus - 1} (--ep-size {num_gpus})"
            )
        again = seen.intersection(ranks)
        if again:
            raise ValueError(f"--rank-failure {text}: rank {min(again)} is lost twice")
        seen.update(ranks)
        by_step.setdefault(step, set()).update(ranks)
    if len(seen) >= num_gpus:
        raise ValueError("--rank-failure: every rank is lost; at least one must survive")
    return [RankFailure(step, tuple(sorted(by_step[step]))) for step in sorted(by_step)]


def check_survivable(
    failures: Sequence[RankFailure], num_gpus: int, slots_per_gpu: int, num_experts: int
) -> None:
    """ValueError when the survivors of some loss have fewer slots than there are logical experts."""
    live = num_gpus
    for f in failures:
        live -= len(f.ranks)
        if live * slots_per_gpu < num_experts:
            raise ValueError(
                f"--rank-failure at step {f.step}: {live} live ranks hold {live * slots_per_gpu} slots, fewer "
                f"than the {num_experts} logical experts (more --ep-num-redundant-experts)"
            )


class _Run:
    """A RunState, what kind of run it is, and the start-up ranks its GPUs are."""

    def __init__(self, kind: str, state: RunState, num_gpus: int) -> None:
        self.kind, self.state = kind, state
        self.ranks_G = np.arange(num_gpus)
        """int [G']: start-up rank of each GPU of the placement held now."""
        self.losses: list[LossEvent] = []
        self.lost_tokens_F: np.ndarray | None = None
        self.dead_share_LEG: np.ndarray | None = None
        """float32 [L, E, lost GPUs]: the share the frozen maps still send to lost ranks."""


def simulate_rank_failures(
    trace: Trace,
    runs: Sequence[RunSpec],
    config: SimulationConfig,
    failures: Sequence[RankFailure],
    *,
    initial: Placement | None = None,
    sglang: Callable[..., Any] | None = None,
    reload_source: str = "checkpoint",
    progress: Callable[[list[Chunk]], Iterable[Chunk]] | None = None,
) -> FailureResult:
    """Replay ``trace`` with ``failures``, for each run of ``runs`` and, given ``sglang`` (SGLang's
    ``elasticity_aware.rebalance_experts``, eplb.simulate.sglang_peer), SGLang's run."""
    config = config.on_layers_of(trace)
    flags = config.eplb
    G, N, R = flags.ep_size, flags.nnodes, flags.ep_num_redundant_experts
    L, E, F = trace.num_layers, trace.num_experts, trace.num_steps
    if not failures:
        raise ValueError("--rank-failure: no loss to replay")
    if any(spec.dispatch == "fake" for spec in runs) or (
        sglang is not None and flags.dispatch_algorithm == "fake"
    ):
        raise ValueError(
            "--rank-failure: fake dispatch ignores the placement, so a loss changes nothing there"
        )
    check_survivable(failures, G, (E + R) // G, E)
    fitted = initial is not None
    start = initial if initial is not None else Placement.trivial(L, E, G, R, N)
    recorded_F = recorded_steps_mask(trace, config)
    apply_steps = rebalance_steps(trace, config)
    scored_from = int(apply_steps[0]) if apply_steps.size else 0
    solver_specs = [s for s in runs if s.algorithm != "none"]

    items: list[_Run] = []
    for spec in runs:
        kind = "none" if spec.algorithm == "none" else "eplb"
        # No replanning follows the first solver run's plans until the loss (none at all without one).
        planned = spec if kind == "eplb" else (solver_specs[0] if solver_specs else None)
        planner = None if planned is None else planner_for(planned, config)
        state = RunState(spec, start, planner, trace, config, recorded_F, scored_from, fitted)
        items.append(_Run(kind, state, G))
    if sglang is not None:
        spec = RunSpec(SGLANG_RUN, flags.dispatch_algorithm)
        elastic = ElasticPlanner(sglang, G, N, config.num_groups)
        items.append(
            _Run("sglang", RunState(spec, start, elastic, trace, config, recorded_F, scored_from, fitted), G)
        )
    losses = {f.step: f for f in failures}
    chunks = plan_chunks(F, np.union1d(apply_steps, np.fromiter(losses, dtype=np.int64)))
    rebalances = set(apply_steps.tolist())
    tokens_F = trace.counts_FLE.sum(axis=(1, 2), dtype=np.float64)
    with threadpool_limits(limits=1, user_api="blas"):
        for chunk in progress(chunks) if progress else chunks:
            counts_nLE = trace.counts_FLE[chunk.start : chunk.stop]
            load_LnE = counts_nLE.astype(np.float32).transpose(1, 0, 2)
            loaded_LnE = (load_LnE > 0).astype(np.float32)
            failure = losses.get(chunk.start)
            for item in items:
                if failure is not None:
                    _lose(item, failure, chunk.start, config, reload_source)
                if chunk.start in rebalances and (failure is None or item.kind == "none"):
                    item.state.rebalance(chunk.start)
                item.state.evaluate(chunk.start, counts_nLE, load_LnE, loaded_LnE)
                if item.dead_share_LEG is not None and item.lost_tokens_F is not None:
                    lost_Ln = np.matmul(load_LnE, item.dead_share_LEG).sum(axis=2)
                    item.lost_tokens_F[chunk.start : chunk.stop] = lost_Ln.sum(axis=0)
    notes = []
    if sglang is None:
        notes.append(
            "SGLang's elasticity_aware run needs its files: --sglang-peer DIR (python -m benchmarks.peers)"
        )
    return FailureResult(
        config={**config.to_dict(), "reload_source": reload_source},
        failures=list(failures),
        runs=[
            FailureRun(
                name=i.state.spec.name,
                kind=i.kind,
                result=i.state.result(),
                losses=i.losses,
                lost_tokens_F=i.lost_tokens_F,
            )
            for i in items
        ],
        rebalance_steps=apply_steps,
        tokens_F=tokens_F,
        is_prefill_F=trace.is_prefill_F.copy(),
        notes=notes,
    )


def _lose(item: _Run, failure: RankFailure, step: int, config: SimulationConfig, reload_source: str) -> None:
    """``item``'s answer to ``failure`` at ``step``: its plan over the survivors, or none."""
    state = item.state
    alive_G = ~np.isin(item.ranks_G, failure.ranks)
    current = state.placement
    live = int(alive_G.sum())
    state.past.now = step
    window_WLE = state.past.window(config.eplb.recorder_buffer_size)
    window_LE = window_WLE.sum(axis=0, dtype=np.float64)
    # No replanning keeps the start-up ranks' placement: its mask is over them.
    held_alive = alive_G
    if current.num_gpus != alive_G.size:
        held_alive = np.zeros(current.num_gpus, dtype=bool)
        held_alive[item.ranks_G[alive_G]] = True
    lost_LE = orphans(current, held_alive)
    orphaned = float(window_LE[lost_LE].sum() / max(window_LE.sum(), 1.0))
    facts: dict[str, Any] = {
        "step": step,
        "ranks": failure.ranks,
        "live_ranks": live,
        "orphaned_load": orphaned,
    }
    if item.kind == "none":
        dead = item.dead_share_LEG
        lost_now = take_gpus(state.matrices.share_LEG, ~alive_G)
        item.dead_share_LEG = lost_now if dead is None else join_gpus(dead, lost_now)
        if item.lost_tokens_F is None:
            item.lost_tokens_F = np.zeros(state.trace.num_steps)
        state.planner = None
        state.lose_ranks(current, state.weights_LER, state.matrices.take_gpus(alive_G))
        item.ranks_G = item.ranks_G[alive_G]
        item.losses.append(LossEvent(**facts, reason="no replanning"))
        return
    if window_WLE.shape[0] == 0:  # a loss before anything was recorded: plan on no load
        window_WLE = np.zeros((1, state.trace.num_layers, state.trace.num_experts), dtype=np.int32)
    assert state.planner is not None
    if item.kind == "sglang":
        # SGLang's planner masks the ranks itself, numbered as at start-up.
        elastic = state.planner
        assert isinstance(elastic, ElasticPlanner)
        full_alive = np.zeros(elastic.num_gpus, dtype=bool)
        full_alive[item.ranks_G[alive_G]] = True
        elastic.alive_G = full_alive
    request = Request(
        window_WLE=window_WLE,
        current=current,
        planner=state.planner,
        history=state.past,
        loss=RankLoss(alive_G=alive_G, reload_source=reload_source),
        bytes_per_expert=config.bytes_per_expert,
    )
    outcome = state.decider.rebalance(request, counted_pass=state.counted_at(step))
    report, placement = outcome.reload, outcome.placement
    assert report is not None and placement is not None
    state.lose_ranks(placement, outcome.weights_LER)
    item.ranks_G = item.ranks_G[alive_G]
    item.losses.append(
        LossEvent(
            **facts,
            reload_experts=int(report.reload_LE.sum()),
            reloads=report.reloads,
            survivor_copies=report.survivor_copies,
            kept_slots=report.kept_slots,
            changed_slots=report.changed_slots,
            bytes_reloaded=report.bytes_reloaded,
            bytes_moved=report.bytes_moved,
            solve_seconds=outcome.solve_seconds,
            reason=outcome.reason,
        )
    )
