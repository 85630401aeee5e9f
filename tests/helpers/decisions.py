"""One trace through the manager (real ranks) and through the simulator, as comparable decisions.

Shape legend: T steps (passes), W window, L layers, E logical experts, P physical slots.

The manager side (:func:`manager_run`, one call per rank) replays the trace pass by pass: each
rank routes its half of every pass's counts through ``remap_and_record`` into the manager's
recorder, so the window the manager sums over ranks is the trace's. The simulator side
(:func:`simulator_decisions`) replays the same trace under the same flags. Both keep their own
default planner and go through their own Decider (eplb.policy.decision), the one path;
:func:`recording_decisions` only watches the Decider's steps, ``Rebalance.plan`` (what each plan
was asked: the planner as the rebalance prepared it, with its budgets, the window, the current
placement; and what was decided) and ``Rebalance.close`` (what the Decider recorded).
:class:`Decision` is one rebalance in a form both callers fill the same way.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from eplb.config import EplbConfig
from eplb.manager.manager import EplbManager
from eplb.moe.model import MoEModel, MoEModelConfig
from eplb.moe.spawn import RankContext
from eplb.placement.model import Placement
from eplb.policy.decision import Outcome, Rebalance, Request
from eplb.simulate import RunSpec, SimulationConfig, simulate
from eplb.traces import Trace
from eplb.workloads import WorkloadConfig, generate

MODEL = MoEModelConfig(num_layers=4, num_experts=16, top_k=4, hidden=8, intermediate=4)
"""The "tiny" preset's shape, with small expert weights so a swap costs next to nothing."""
BYTES_PER_EXPERT = 3 * MODEL.hidden * MODEL.intermediate * 4
"""w13 [2I, H] and w2 [H, I] in float32: what the manager reads off the slot buffers."""
NUM_STEPS = 245
"""Not a multiple of either interval: the manager's last check has passes after it, as the simulator's has."""
UNIFORM_STEPS = (170, 210)
"""Steps [a, b) of prefill where every expert gets the same tokens: a window inside balances on any
placement, so the utilization threshold skips it whatever the planner would do."""
UNIFORM_COUNT = 2048
"""Tokens per expert and layer in each of those steps."""
SHIFT_AT = 100
"""From this step every layer's experts are relabelled: a domain shift."""
POPULARITY_SIGMA = 1.6
"""The preset's 0.8 makes the shift a drop of 0.09 on 2 GPUs, under ``SolveOptions.shift_decline``
(0.1): no plan would spend the shift burst."""
IDLE_STEPS = (50, 75)
"""Steps [a, b) without tokens in the trace with idle passes: one periodic window of no load."""


@dataclass(frozen=True)
class PlanCall:
    """One plan of the Decider: what its planner was given and what was decided."""

    planner: Any
    """The planner as the rebalance prepared it (its options carry the move budgets of this plan)."""
    window_passes: int
    window_LE: tuple[tuple[float, ...], ...]
    """The window summed over its passes (and over ranks: the manager plans on the reduced window)."""
    current: tuple[tuple[int, ...], ...]
    """phy2log of the placement it planned from."""
    target: tuple[tuple[int, ...], ...]
    """phy2log of the placement it proposed."""
    apply: bool
    reason: str
    predicted: float | None
    now: int | None
    """``history.now`` where the caller passes a history (the simulator: the first step served)."""


Recorded = tuple[int, bool, float]
"""What the Decider recorded of a rebalance (``Rebalance.close``): its counted pass, applied, copies."""


@dataclass(frozen=True)
class Decision:
    """One rebalance, as either caller took it."""

    at: int
    """The pass count at the check (manager), the first step the plan serves (simulator): equal
    when both check after the same pass."""
    outcome: str
    """applied | skipped | failed."""
    why: str
    """planner (the planner was asked and decided), threshold or empty (skipped before planning)."""
    reason: str
    balancedness: float
    """The window's balancedness under the live placement (NaN where the caller reports none)."""
    copies: int
    """Expert copies across GPUs the rebalance moved."""
    plan: PlanCall | None
    recorded: Recorded
    """What the caller's Decider recorded of it."""
    after: tuple[tuple[int, ...], ...] | None = None
    """phy2log the manager serves once the rebalance finished (None: the simulator's record)."""


def _rows(a: np.ndarray) -> tuple[tuple[Any, ...], ...]:
    return tuple(tuple(row) for row in np.asarray(a).tolist())


@contextlib.contextmanager
def recording_decisions(
    calls: list[PlanCall], records: list[Recorded], done: threading.Event | None = None
) -> Iterator[None]:
    """Append every plan the Decider makes in this process to ``calls`` (and set ``done`` after
    each) and every rebalance it records to ``records``; the decisions themselves are untouched."""
    plan, close = Rebalance.plan, Rebalance.close

    def planned(self: Rebalance, request: Request) -> Outcome:
        outcome = plan(self, request)
        assert request.current is not None and outcome.placement is not None
        calls.append(
            PlanCall(
                planner=outcome.planner,
                window_passes=int(request.window_WLE.shape[0]),
                window_LE=_rows(np.asarray(request.window_WLE, dtype=np.float64).sum(axis=0)),
                current=_rows(request.current.phy2log_LP),
                target=_rows(outcome.placement.phy2log_LP),
                apply=outcome.applied,
                reason=outcome.reason,
                predicted=outcome.predicted,
                now=getattr(request.history, "now", None),
            )
        )
        if done is not None:
            done.set()
        return outcome

    def closed(self: Rebalance, *, applied: bool, copies: float) -> None:
        records.append((self.counted_pass, applied, float(copies)))
        close(self, applied=applied, copies=copies)

    Rebalance.plan, Rebalance.close = planned, closed  # type: ignore[method-assign]
    try:
        yield
    finally:
        Rebalance.plan, Rebalance.close = plan, close  # type: ignore[method-assign]


# ---- the trace and the flags ---------------------------------------------------------------------
def decision_trace(*, idle: bool = False) -> Trace:
    """The "tiny" preset with skewed routing and slow drift, uniform routing in ``UNIFORM_STEPS``
    and a domain shift at ``SHIFT_AT``; ``idle``: also no tokens in ``IDLE_STEPS``."""
    base = generate(
        WorkloadConfig(
            preset="tiny",
            num_steps=NUM_STEPS,
            seed=0,
            mean_steps_between_shifts=0,  # the one shift is SHIFT_AT's
            drift_sigma=0.5,
            drift_timescale_steps=300,
            # Skewed routing: relabelling the experts at SHIFT_AT is then a jump of the fitted
            # placement's score (0.2) past the solver's shift threshold even on 2 GPUs.
            popularity_sigma=POPULARITY_SIGMA,
        )
    )
    counts_FLE, tokens_F = base.counts_FLE.copy(), base.num_tokens_F.copy()
    counts_FLE[slice(*UNIFORM_STEPS)] = UNIFORM_COUNT
    tokens_F[slice(*UNIFORM_STEPS)] = UNIFORM_COUNT * MODEL.num_experts // MODEL.top_k
    is_prefill_F = base.is_prefill_F.copy()
    is_prefill_F[slice(*UNIFORM_STEPS)] = True
    rng = np.random.default_rng(99)
    for layer in range(MODEL.num_layers):
        counts_FLE[SHIFT_AT:, layer] = counts_FLE[SHIFT_AT:, layer][:, rng.permutation(MODEL.num_experts)]
    if idle:
        counts_FLE[slice(*IDLE_STEPS)] = 0
        tokens_F[slice(*IDLE_STEPS)] = 0
    meta = {**base.meta, "bytes_per_expert": BYTES_PER_EXPERT}
    return Trace(counts_FLE, is_prefill_F, tokens_F, meta)


def server_flags(mode: str, **overrides: Any) -> EplbConfig:
    """The flags both callers run with: 2 ranks, static dispatch, a threshold some windows pass."""
    fields: dict[str, Any] = {
        "enable_eplb": True,
        "ep_size": 2,
        "ep_num_redundant_experts": 2,
        "ep_dispatch_algorithm": "static",
        "eplb_min_rebalancing_utilization_threshold": 0.99,
        "eplb_rebalance_mode": mode,
    }
    if mode == "continuous":
        fields.update(
            eplb_rebalance_num_iterations=10,
            expert_distribution_recorder_buffer_size=40,
            eplb_max_moved_experts=2,
            eplb_shift_burst=4,
        )
    else:
        fields.update(eplb_rebalance_num_iterations=25)
    return EplbConfig(**{**fields, **overrides})


def simulation_config(flags: EplbConfig) -> SimulationConfig:
    """The simulator's configuration for a server with ``flags`` (the one place that builds it)."""
    return SimulationConfig(eplb=flags, bytes_per_expert=BYTES_PER_EXPERT)


# ---- the simulator -------------------------------------------------------------------------------
def simulator_decisions(trace: Trace, flags: EplbConfig) -> tuple[list[Decision], Placement]:
    """Every rebalance of the simulator's run of the flags' planner, and its final placement."""
    calls: list[PlanCall] = []
    records: list[Recorded] = []
    with recording_decisions(calls, records):
        result = simulate(
            trace, [RunSpec(flags.eplb_algorithm, flags.dispatch_algorithm)], simulation_config(flags)
        )
    run = result.runs[0]
    by_step = {call.now: call for call in calls}
    assert len(by_step) == len(calls), "one plan per rebalance step"
    decisions = []
    for event, recorded in zip(run.events, records, strict=True):  # every rebalance recorded once
        plan = by_step.pop(event.step, None)
        decisions.append(
            Decision(
                at=event.step,
                outcome="applied" if event.applied else "skipped",
                why=why(plan is not None, event.reason),
                reason=event.reason,
                balancedness=float(event.window_balancedness),
                copies=event.experts_moved_across_gpus,
                plan=plan,
                recorded=recorded,
            )
        )
    assert not by_step, f"plans at steps without a rebalance event: {list(by_step)}"
    assert run.final_placement is not None
    return decisions, run.final_placement


def why(planned: bool, reason: str) -> str:
    """The reason class of a decision: the planner's, the threshold's, or an empty window's."""
    if planned:
        return "planner"
    return "threshold" if "threshold" in reason else "empty"


# ---- the manager, on every rank ------------------------------------------------------------------
def feed(manager: EplbManager, model: MoEModel, counts_LE: np.ndarray, mode: str) -> None:
    """Route one pass of this rank's logical counts through the recorder (one id per token choice)."""
    experts = np.arange(counts_LE.shape[1], dtype=np.int32)
    remaps = manager.recorder.prepare(model.tables, mode=mode, backend="torch")
    for layer, counts_E in enumerate(counts_LE):
        ids_T1 = np.ascontiguousarray(np.repeat(experts, counts_E)[:, None])
        remaps[layer](torch.from_numpy(ids_T1))


def manager_run(
    ctx: RankContext, flags: EplbConfig, counts_FLE: np.ndarray, is_prefill_F: np.ndarray
) -> dict[str, Any]:
    """Replay the trace through this rank's manager; rank 0 also returns its planner's calls.

    Rank 0 waits for each solve before the next pass, so every plan is adopted (and, unpaced and
    in one chunk, applied) on the pass after its check: the timing cannot move a check.
    """
    calls: list[PlanCall] = []
    records: list[Recorded] = []
    solved = threading.Event()
    half_FLE = counts_FLE // 2
    mine_FLE = half_FLE if ctx.rank == 0 else counts_FLE - half_FLE
    with recording_decisions(calls, records, solved):
        L, E = counts_FLE.shape[1:]
        placement = Placement.trivial(L, E, ctx.world_size, num_redundant=flags.ep_num_redundant_experts)
        model = MoEModel(MODEL, placement, rank=ctx.rank, device=ctx.device, remap_backend="torch")
        manager = EplbManager(flags, model, placement, device=ctx.device)
        checks: list[tuple[int, float, bool]] = []
        after: list[tuple[tuple[int, ...], ...]] = []
        for t in range(counts_FLE.shape[0]):
            manager.on_forward_pass_begin(
                is_prefill=bool(is_prefill_F[t]), num_tokens=int(mine_FLE[t, 0].sum())
            )
            feed(manager, model, mine_FLE[t], flags.dispatch_algorithm)
            manager.on_forward_pass_end()
            state = manager.state()
            if len(state.windows) > len(checks):
                at, balancedness = state.windows[-1]
                checks.append((at, balancedness, state.phase == "solving"))
                if ctx.rank == 0 and state.phase == "solving":
                    assert solved.wait(60), "the solve did not finish"
                    solved.clear()
                    time.sleep(0.02)  # the future completes just after the planner returns
            while len(after) < len(state.history):  # a rebalance finished on this pass
                after.append(_rows(state.placement.phy2log_LP))
        state = manager.state()
        manager.close()
    return {
        "checks": checks,
        "history": [(r.at_pass, r.outcome, r.reason, r.experts_moved) for r in state.history],
        "after": after,
        "calls": calls,
        "records": records,
        "phase": state.phase,
        "placement": state.placement.phy2log_LP.tolist(),
        "bytes_per_expert": sum(t[0].numel() * t.element_size() for t in model.slot_tensors(0).values()),
    }


def manager_decisions(rank0: dict[str, Any]) -> list[Decision]:
    """Rank 0's rebalances (its reasons are the full ones): each check with the record it ended in."""
    checks, history, after = rank0["checks"], rank0["history"], rank0["after"]
    assert len(history) == len(checks), f"{len(checks)} checks but {len(history)} records: one still open"
    calls = iter(rank0["calls"])
    decisions = []
    for (at, balancedness, planned), (_, outcome, reason, moved), placement, recorded in zip(
        checks, history, after, rank0["records"], strict=True
    ):
        plan = next(calls, None) if planned else None
        assert plan is not None or not planned, f"pass {at}: planned, but the Decider recorded no plan"
        decisions.append(
            Decision(
                at=at,
                outcome=outcome,
                why=why(planned, reason),
                reason=reason,
                balancedness=float(balancedness),
                copies=int(moved),
                plan=plan,
                recorded=recorded,
                after=placement,
            )
        )
    assert next(calls, None) is None, "more plans than planned checks"
    return decisions
