"""The manager's types and plan helpers: the engine protocol, the serving world, records, state,
swap jobs, the default planner and the plan's broadcast from rank 0.

Shape legend: W window (passes), L layers, E logical experts, P physical slots, R max replicas.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
import torch.distributed as dist

from eplb.config import EplbConfig
from eplb.hotswap.control import Cause
from eplb.hotswap.swap import PreparedSwap
from eplb.manager.collectives import RankAgreement
from eplb.manager.pacing import Pacer
from eplb.manager.plan_check import check_plan, plan_problems, refused_by_the_diff
from eplb.metrics.names import ManagerPhase
from eplb.metrics.sink import MetricsSink, RebalanceOutcome
from eplb.placement.model import Placement
from eplb.policy.base import Planner
from eplb.policy.decision import Outcome
from eplb.policy.plan_check import SHAPE as SHAPE_CAUSE
from eplb.policy.plan_check import shape_reason

if TYPE_CHECKING:
    from eplb.manager.recovery import RecoveryRecord
    from eplb.placement.degraded import DegradedPlacement
    from eplb.recorder.recorder import ExpertDistributionRecorder


class ExpertEngine(Protocol):
    """The serving engine's side: slot buffers to swap and maps to update (eplb.moe.model.MoEModel).

    To serve on after a rank is lost, an engine also needs ``set_world(world: ServingWorld)``:
    from the next pass on, serve on ``world.group`` as its rank ``world.rank`` with
    ``world.placement`` (over the survivors; the slot buffers keep their rows, which hold it
    already) and record through ``world.recorder``. The manager calls it once the survivors
    reloaded what the lost ranks alone held; an engine without it makes a lost rank stop the
    manager (eplb.manager.recovery).
    """

    def slot_tensors(self, layer: int) -> Mapping[str, torch.Tensor]: ...

    def set_placement(self, placement: Placement, dispatch_weights_LER: np.ndarray | None = None) -> None: ...


@dataclass(frozen=True, kw_only=True)
class ServingWorld:
    """The ranks that serve on after a rank was lost, as an engine's ``set_world`` receives them."""

    group: dist.ProcessGroup
    """The survivors' process group: the model's collectives (all-to-all) run on it from now on."""
    rank: int
    """This rank's rank in ``group`` (its index among ``ranks``)."""
    ranks: tuple[int, ...]
    """The survivors' global ranks, ascending: survivor i holds slots [i*S, (i+1)*S) of ``placement``."""
    placement: Placement
    """The live placement over the survivors (G' GPUs, P' = G' * S slots; this rank's slots are
    its slot buffers' rows, unchanged in number)."""
    dispatch_weights_LER: np.ndarray | None
    """Per-replica dispatch weights of ``placement`` (None: uniform)."""
    recorder: ExpertDistributionRecorder
    """The recorder over ``placement`` that the layers record into from now on (a new one: its
    count buffers have P' slots)."""


@dataclass(frozen=True)
class RebalanceRecord:
    """One rebalance decision and its outcome (all ranks hold the same numbers; reason on rank 0)."""

    at_pass: int
    outcome: RebalanceOutcome
    reason: str
    balancedness_before: float
    balancedness_after: float
    predicted_balancedness: float | None
    solve_seconds: float
    transfer_seconds: float
    experts_moved: int
    bytes_moved: int
    cause: Cause | None = None
    """Why a failed rebalance failed, in the hot-swap's words (eplb.hotswap.control.Cause:
    ``shape``, ``timeout``, ``peer lost``, ``checksum``, ``error``), the same on every rank; None
    when it was not failed, or failed for another reason (the planner, the watchdog). The
    metrics count it under their own label (``failed_shape`` ..., eplb.metrics.causes)."""

    def report_to(self, sink: MetricsSink) -> None:
        """Hand this record to ``sink.on_rebalance`` (its fields carry the same names)."""
        sink.on_rebalance(
            outcome=self.outcome,
            reason=self.reason,
            solve_seconds=self.solve_seconds,
            transfer_seconds=self.transfer_seconds,
            experts_moved=self.experts_moved,
            bytes_moved=self.bytes_moved,
            balancedness_before=self.balancedness_before,
            balancedness_after=self.balancedness_after,
        )


@dataclass(frozen=True)
class ManagerState:
    """A snapshot for metrics, logs and tests."""

    phase: ManagerPhase
    """idle | solving | applying | stopped (eplb.metrics.names.ManagerPhase)."""
    passes: int
    counted_passes: int
    next_rebalance_at: int
    """Counted-pass number of the next rebalance."""
    window_passes: int
    layers_pending: tuple[int, ...]
    placement: Placement
    history: tuple[RebalanceRecord, ...] = field(default_factory=tuple)
    windows: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    """(pass, balancedness of the window summed over ranks under the live placement) at each check."""
    in_flight_seconds: float = 0.0
    """How long the rebalance in progress has run on this rank's clock (0: none is)."""
    seconds_since_rebalance: float = 0.0
    """Since the last rebalance ended (any outcome), or since the manager started."""
    swap_groups: int = 0
    """Hot-swap process groups made so far (one at start with several ranks, one per renewal)."""
    stopped: str | None = None
    """Why rebalancing stopped for good (phase ``stopped``); None while it runs."""
    ranks: tuple[int, ...] = ()
    """Global ranks the manager serves with now, ascending (fewer after a rank was lost)."""
    degraded: DegradedPlacement | None = None
    """After a rank was lost: the live placement in the numbering of the ranks the manager
    started with, the lost ranks' slots -1 (eplb.placement.degraded); None before."""
    recoveries: tuple[RecoveryRecord, ...] = field(default_factory=tuple)
    """One record per recovery from a lost rank (eplb.manager.recovery)."""


FAILED, SKIP, APPLY, SHAPE = 0.0, 1.0, 2.0, 3.0
"""Statuses of the plan's broadcast; SHAPE: failed, rank 0's plan does not fit the model."""


@dataclass
class SwapJob:
    """One adopted plan, applied a chunk of layers per pass (``steps[i]``: live maps after chunk i)."""

    original: Placement
    original_weights_LER: np.ndarray | None
    target: Placement
    target_weights_LER: np.ndarray | None
    pending: list[int]
    reason: str
    predicted: float
    solve_seconds: float
    done: list[int] = field(default_factory=list)
    transfer_seconds: float = 0.0
    experts_moved: int = 0
    bytes_moved: int = 0
    chunks: list[list[int]] = field(default_factory=list)
    steps: list[tuple[Placement, np.ndarray | None]] = field(default_factory=list)
    prepared: dict[int, Future[PreparedSwap]] = field(default_factory=dict)
    """Chunk index -> its swap, being prepared on the manager's helper thread."""
    next_chunk: int = 0
    costs: list[int] = field(default_factory=list)
    """Per chunk: the most bytes one GPU receives (what pacing charges)."""
    pacer: Pacer | None = None
    """The transfer credit when paced (continuous mode with --eplb-transfer-gbps), else None."""


def default_planner(config: EplbConfig, *, num_groups: int, bytes_per_expert: int) -> Planner:
    """The solver the flags ask for (algorithm, dispatch mode, move budget: SolveOptions.from_config)."""
    from eplb.solver.planner import SolverPlanner  # SciPy only where the default planner is used
    from eplb.solver.types import SolveOptions

    options = SolveOptions.from_config(config, bytes_per_expert=bytes_per_expert)
    return SolverPlanner(options=options, num_groups=num_groups)


def chunk_steps(
    live: Placement,
    live_weights_LER: np.ndarray | None,
    target: Placement,
    target_weights_LER: np.ndarray | None,
    changed: list[int],
    per_chunk: int,
) -> tuple[list[list[int]], list[tuple[Placement, np.ndarray | None]]]:
    """The changed layers cut into chunks of ``per_chunk``, and the maps after each chunk."""
    chunks = [changed[i : i + per_chunk] for i in range(0, len(changed), per_chunk)] or [[]]
    steps = []
    for chunk in chunks:
        live, live_weights_LER = with_layers(live, live_weights_LER, target, target_weights_LER, chunk)
        steps.append((live, live_weights_LER))
    return chunks, steps


def encode_plan(
    future: Future[Outcome],
    header: torch.Tensor,
    phy2log: torch.Tensor,
    weights: torch.Tensor,
    current: Placement,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """Rank 0: the rebalance's outcome (or the planner's failure) as the tensors it broadcasts,
    plus the reason. A plan that does not fit the model served on ``current`` is never copied
    into the buffers: it is sent as SHAPE (eplb.manager.plan_check)."""
    refused: str | None = None  # why the plan does not fit the model (None: it does)
    try:
        outcome = future.result()
        if outcome.cause == SHAPE_CAUSE:  # the Decider refused it (eplb.policy.plan_check)
            refused = outcome.reason
        elif outcome.plan is not None:
            check_plan(outcome.plan, current)
    except Exception as exc:
        if getattr(exc, "cause", None) == SHAPE_CAUSE:
            refused = str(exc)
        elif refused_by_the_diff(exc):
            refused = shape_reason([str(exc)])
        else:
            header[:] = torch.tensor([FAILED, 0.0, float("nan"), 0.0], dtype=torch.float64)
            return header, phy2log, weights, f"planner failed: {type(exc).__name__}: {exc}"
    if refused is not None:
        header[:] = torch.tensor([SHAPE, 0.0, float("nan"), 0.0], dtype=torch.float64)
        return header, phy2log, weights, refused
    placement = outcome.placement
    assert placement is not None, "a planned rebalance has a plan"
    status = APPLY if outcome.applied else SKIP
    w = outcome.weights_LER
    predicted = float("nan") if outcome.predicted is None else outcome.predicted
    header[:] = torch.tensor(
        [status, float(w is not None), predicted, outcome.solve_seconds], dtype=torch.float64
    )
    phy2log.copy_(torch.from_numpy(np.ascontiguousarray(placement.phy2log_LP, dtype=np.int32)))
    if w is not None:
        weights.zero_()
        weights[:, :, : w.shape[2]] = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))
    return header, phy2log, weights, outcome.reason


@dataclass(frozen=True)
class SharedPlan:
    """Rank 0's plan as every rank received it; ``target`` None: nothing to apply (``outcome`` says why)."""

    outcome: RebalanceOutcome
    reason: str
    """Rank 0's reason (empty on the other ranks, but for a plan of the wrong shape)."""
    predicted: float
    solve_seconds: float
    target: Placement | None
    weights_LER: np.ndarray | None
    cause: Cause | None = None
    """``shape`` when the plan does not fit the model (on every rank), else None."""


def share_plan(agree: RankAgreement, future: Future[Outcome] | None, current: Placement) -> SharedPlan:
    """Collective: rank 0 (holding the solve's ``future``) broadcasts its decision, then the maps.

    Every rank checks what it received against the model alike (the same bytes everywhere): a
    plan that does not fit fails the rebalance with cause ``shape`` on every rank, nothing moved.
    """
    L, P, E = current.num_layers, current.num_physical, current.num_logical
    R = P - E + 1
    header = torch.zeros(4, dtype=torch.float64)
    phy2log = torch.zeros(L, P, dtype=torch.int32)
    weights = torch.zeros(L, E, R, dtype=torch.float32)
    reason = ""
    if future is not None:
        header, phy2log, weights, reason = encode_plan(future, header, phy2log, weights, current)
    status, has_weights, predicted, solve_s = agree.broadcast(header).tolist()
    if status == SHAPE:
        reason = reason or "shape: rank 0's plan does not fit the model (rank 0's log names the sizes)"
        return SharedPlan("failed", reason, predicted, solve_s, None, None, cause="shape")
    if status != APPLY:
        outcome: RebalanceOutcome = "failed" if status == FAILED else "skipped"
        return SharedPlan(outcome, reason, predicted, solve_s, None, None)
    phy2log = agree.broadcast(phy2log)
    weights_LER = agree.broadcast(weights).numpy() if has_weights else None
    try:
        target = Placement.from_phy2log(phy2log.numpy(), current.num_gpus, current.num_nodes, max_replicas=R)
        problems = plan_problems(target, weights_LER, current)
    except ValueError as exc:  # not a placement at all (an expert with too many replicas, ...)
        problems = [f"{type(exc).__name__}: {exc}"]
    if problems:
        why = "shape: the plan received does not fit the model: " + "; ".join(problems)
        return SharedPlan("failed", why, predicted, solve_s, None, None, cause="shape")
    return SharedPlan("applied", reason, predicted, solve_s, target, weights_LER)


def with_layers(
    live: Placement,
    live_weights_LER: np.ndarray | None,
    target: Placement,
    target_weights_LER: np.ndarray | None,
    layers: list[int],
) -> tuple[Placement, np.ndarray | None]:
    """``live`` with ``layers`` taken from ``target`` (maps and dispatch weights)."""
    phy2log = live.phy2log_LP.copy()
    phy2log[layers] = target.phy2log_LP[layers]
    mixed = Placement.from_phy2log(phy2log, live.num_gpus, live.num_nodes, max_replicas=target.max_replicas)
    if live_weights_LER is None and target_weights_LER is None:
        return mixed, None
    weights = uniform_weights(mixed) if live_weights_LER is None else live_weights_LER.copy()
    if target_weights_LER is not None:
        weights[layers] = target_weights_LER[layers]
    else:
        weights[layers] = uniform_weights(mixed)[layers]
    return mixed, weights


def uniform_weights(placement: Placement) -> np.ndarray:
    """float32 [L, E, R]: 1/count on each used replica (what uniform dispatch means)."""
    R = placement.max_replicas
    used = np.arange(R)[None, None, :] < placement.logcnt_LE[:, :, None]
    return np.where(used, 1.0 / placement.logcnt_LE[:, :, None], 0.0).astype(np.float32)
