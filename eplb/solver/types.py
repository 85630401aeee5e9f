"""The solver's public types: topology, options, the plan it returns, and input checks.

Shape legend: W window (passes), L layers, E logical experts, P physical slots, G GPUs, N nodes,
R max replicas.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from eplb.placement.diff import PlacementDiff
from eplb.placement.model import Placement
from eplb.policy.registry import check_policy_name, get_policy

PREDICTIONS = ("auto", "sum", "decay", "recent", "robust")


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Where the physical expert slots live."""

    num_gpus: int
    """G, EP ranks; GPU g owns slots [g*S, (g+1)*S) with S = P / G."""
    num_nodes: int = 1
    """N, nodes (divides G); GPUs [n*G/N, (n+1)*G/N) sit on node n."""
    num_physical: int
    """P = E + redundant slots, divisible by G."""
    num_groups: int = 1
    """Expert groups (group-limited routing); the hierarchical algorithm packs whole groups onto nodes."""

    def __post_init__(self) -> None:
        if self.num_gpus < 1:
            raise ValueError(f"num_gpus must be >= 1, got {self.num_gpus}")
        if self.num_nodes < 1 or self.num_gpus % self.num_nodes:
            raise ValueError(
                f"num_nodes ({self.num_nodes}) must be >= 1 and divide num_gpus ({self.num_gpus})"
            )
        if self.num_physical < 1 or self.num_physical % self.num_gpus:
            raise ValueError(
                f"num_physical slots ({self.num_physical}) must be >= 1 and divisible by num_gpus ({self.num_gpus})"
            )
        if self.num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {self.num_groups}")

    @property
    def slots_per_gpu(self) -> int:
        return self.num_physical // self.num_gpus

    def hierarchical_ok(self, num_logical: int) -> bool:
        """Whether the hierarchical algorithm applies: groups split evenly over experts and nodes."""
        return num_logical % self.num_groups == 0 and self.num_groups % self.num_nodes == 0


@dataclass(frozen=True, kw_only=True)
class SolveOptions:
    """How :func:`eplb.solver.solve` plans. The defaults are the ones docs/benchmarks.md supports."""

    algorithm: str = "auto"
    """A registered policy (eplb.policy.policy_names(): auto | deepseek | deepseek_hierarchical | scipy)."""
    prediction: str = "auto"
    """How a window [W, L, E] becomes the load to plan for: auto | sum | decay | recent | robust.
    auto, for scipy: robust on windows of at least ``robust_from_passes`` passes, decay on shorter
    ones (the benchmark's best for each), decay whenever a move budget is set (continuous plans:
    robust costs four times the search for no measured gain); for the DeepSeek algorithms: sum,
    as SGLang runs them."""
    robust_from_passes: int = 500
    """auto prediction: the window length (passes) from which scipy plans robustly."""
    decay_half_life: float = 8.0
    """decay/robust: half-life of a pass's weight, in recorded passes (recent passes weigh more)."""
    recent_fraction: float = 0.25
    """recent: plan on the sum of this last fraction of the window."""
    num_scenarios: int = 4
    """robust: sub-windows of the window used as scenarios of the next window's load shape."""
    weighted: bool = False
    """Also return LP per-replica dispatch weights [L, E, R] (for weighted dispatch)."""
    static_dispatch: bool = False
    """The server dispatches statically (each rank sends an expert's tokens to the one replica its
    map picks, eplb.placement.dispatch_map): the budgeted search and the held-out prediction score
    placements with the shares those maps give (eplb.solver.static_share) instead of an even split
    over replicas. Not with ``weighted``."""
    milp_max_solves: int = 8
    """MILP repacking (fresh scipy plans): subproblem solves for the whole model (0 disables it).
    A count, not seconds, so every rank and every run computes the same plan."""
    time_budget_s: float | None = None
    """Optional wall-clock cap on the MILP repacking, in seconds (0 disables it). None (default):
    only ``milp_max_solves`` limits it; a wall-clock cap makes plans depend on the machine's speed."""
    incremental: bool = True
    """scipy with ``current``: change the current placement only where it pays, instead of repacking."""
    copy_cost: float = 0.002
    """scipy with ``current``: predicted balancedness of its layer that one expert copy across GPUs
    must buy (0: move freely; larger: fewer moves, see docs/benchmarks.md)."""
    bytes_per_expert: int = 0
    """Bytes of one expert's weights in one layer, for byte counts and ``max_bytes_moved``."""
    max_bytes_moved: int | None = None
    """Budget of bytes moved across GPUs per plan (needs bytes_per_expert > 0): the best plan within
    it, as for ``max_moved_experts``; None: no byte budget."""
    max_moved_experts: int | None = None
    """Budget per plan: expert copies across GPUs (relative to ``current``), a copy to a node that
    held no replica of the expert counting ``cross_node_weight``. ``solve`` returns the best plan
    within it, never over it; 0 moves nothing; None: no budget."""
    shift_max_moved_experts: int | None = None
    """Budget per plan when the window shows a domain shift (``shift_decline``), counted as
    ``max_moved_experts`` is; None: no separate budget. Continuous mode sets it from its move
    allowance (eplb.policy.schedule.MoveAllowance), whose later budgets repay what it spends."""
    shift_decline: float = 0.1
    """A shift: the current placement's balancedness fell by more than this from the window's
    older hold-out block to its newest (the held-out scores, eplb.solver.holdout). Drift moves it
    by at most 0.03 per 50 passes on the presets; the shifts there by 0.2-0.3."""
    cross_node_weight: float = 1.0
    """What one expert copy across nodes counts against ``max_moved_experts`` (and in the transfer
    price of the apply/skip gate): the slower link's cost relative to a copy inside a node."""
    holdout_passes: int | None = None
    """Passes held out at the end of the window to calibrate the prediction: the plan made without
    them is scored on them (see eplb.solver.holdout). None: a quarter of the window; 0 (or a
    window of one pass): score on the forecast itself (optimistic)."""
    min_gain: float = 0.002
    """Skip (apply=False) when the predicted model balancedness gain over ``current`` is below this
    (plus, for scipy, the transfer's price: ``copy_cost`` per weighted copy, per layer)."""
    seed: int = 0
    """Seed for randomised steps. Every algorithm here is deterministic today, so the same input
    gives the same plan whatever the seed; the field keeps callers stable if one is added."""

    def __post_init__(self) -> None:
        check_policy_name(self.algorithm)
        if self.prediction not in PREDICTIONS:
            raise ValueError(f"unknown prediction {self.prediction!r}; choose from {PREDICTIONS}")
        if not self.decay_half_life > 0:
            raise ValueError(f"decay_half_life must be > 0 passes, got {self.decay_half_life}")
        if not 0 < self.recent_fraction <= 1:
            raise ValueError(f"recent_fraction must lie in (0, 1], got {self.recent_fraction}")
        if self.robust_from_passes < 1:
            raise ValueError(f"robust_from_passes must be >= 1, got {self.robust_from_passes}")
        if self.num_scenarios < 1:
            raise ValueError(f"num_scenarios must be >= 1, got {self.num_scenarios}")
        if self.time_budget_s is not None and not self.time_budget_s >= 0:
            raise ValueError(f"time_budget_s must be None or >= 0, got {self.time_budget_s}")
        if self.milp_max_solves < 0:
            raise ValueError(f"milp_max_solves must be >= 0, got {self.milp_max_solves}")
        if self.max_moved_experts is not None and self.max_moved_experts < 0:
            raise ValueError(f"max_moved_experts must be None or >= 0, got {self.max_moved_experts}")
        if self.shift_max_moved_experts is not None and self.shift_max_moved_experts < 0:
            raise ValueError(
                f"shift_max_moved_experts must be None or >= 0, got {self.shift_max_moved_experts}"
            )
        if not 0 < self.shift_decline <= 1:
            raise ValueError(f"shift_decline must lie in (0, 1], got {self.shift_decline}")
        if not (np.isfinite(self.cross_node_weight) and self.cross_node_weight > 0):
            raise ValueError(f"cross_node_weight must be finite and > 0, got {self.cross_node_weight}")
        if self.holdout_passes is not None and self.holdout_passes < 0:
            raise ValueError(f"holdout_passes must be None or >= 0, got {self.holdout_passes}")
        if not self.copy_cost >= 0:
            raise ValueError(f"copy_cost must be >= 0, got {self.copy_cost}")
        if self.bytes_per_expert < 0:
            raise ValueError(f"bytes_per_expert must be >= 0, got {self.bytes_per_expert}")
        if self.max_bytes_moved is not None and (self.max_bytes_moved < 0 or self.bytes_per_expert <= 0):
            raise ValueError("max_bytes_moved needs bytes_per_expert > 0 and must be >= 0")
        if self.static_dispatch and self.weighted:
            raise ValueError("static_dispatch and weighted exclude each other: a server dispatches one way")
        if not np.isfinite(self.min_gain):
            raise ValueError(f"min_gain must be finite, got {self.min_gain}")

    def resolved_prediction(self, algorithm: str, num_passes: int) -> str:
        """The forecast ``prediction`` stands for with policy ``algorithm`` and a window of ``num_passes``."""
        return get_policy(algorithm).prediction(self, num_passes)

    @property
    def max_copies(self) -> int | None:
        """Cap on expert copies across GPUs per rebalance, from ``max_bytes_moved``."""
        if self.max_bytes_moved is None:
            return None
        return self.max_bytes_moved // self.bytes_per_expert

    @property
    def budgeted(self) -> bool:
        """Whether a move budget applies (``max_moved_experts`` or ``max_bytes_moved``)."""
        return self.max_moved_experts is not None or self.max_bytes_moved is not None


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What the solver proposes, and why."""

    placement: Placement
    """The new placement (validated, int32; R = P - E + 1 so buffers keep one shape across plans)."""
    dispatch_weights_LER: np.ndarray | None
    """float32 [L, E, R]: share of each expert's tokens per replica (sum 1, 0 on padding); None unless weighted."""
    diff: PlacementDiff | None
    """The transfer from ``current`` (None without one)."""
    predicted_balancedness: float
    """What ``placement`` will get on the next window: the mean over its passes (weighted by load)
    of the model balancedness, predicted from held-out passes (eplb.solver.holdout); on a window of
    one pass (or ``holdout_passes=0``), the balancedness of the forecast load under ``placement``."""
    apply: bool
    """False when the predicted gain does not pay for the transfer (keep ``current``)."""
    reason: str
    """Why the plan is applied or skipped, in words."""
    stats: dict[str, float] = field(default_factory=dict)
    """Numbers about the solve. Always: solve_seconds, algorithm_scipy (1.0 or 0.0),
    forecast_balancedness (the plan scored on the load it was fitted to), holdout_passes. With
    current: current_balancedness (predicted, under current), predicted_gain (predicted_balancedness
    minus current_balancedness), transfer_price, copies_moved, weighted_copies_moved, changed_slots.
    Held out: held_plan, held_older, tail_older (raw scores, see eplb.solver.holdout). scipy:
    fresh_swaps, milp_improved_layers / milp_solves / milp_seconds; incremental also retarget_copies,
    swaps, fresh_layers (layers where the fresh plan won); budgeted: budget_swaps,
    budget_replica_changes, budget_rounds."""


def as_load_array(load: Any) -> np.ndarray:
    """float64 [W, L, E] from a window [W, L, E] or an aggregated [L, E] (numpy, torch or lists).

    Raises ValueError for a wrong shape, an empty axis, or NaN, infinite or negative loads.
    """
    if hasattr(load, "detach"):  # torch tensor, without importing torch
        load = load.detach().cpu().numpy()
    arr = np.asarray(load)
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
        raise ValueError(f"load must be numeric, got dtype {arr.dtype}")
    if arr.ndim == 2:
        arr = arr[None]
    if arr.ndim != 3:
        raise ValueError(f"load must be [W, L, E] or [L, E], got shape {arr.shape}")
    if 0 in arr.shape:
        raise ValueError(f"load has an empty axis: shape {arr.shape} (need W, L, E >= 1)")
    # Two reductions instead of three masks: min() is NaN when any value is (a window of
    # DeepSeek-V3 counts is millions of values, and solve has tens of milliseconds).
    low, high = arr.min(), arr.max()
    if np.issubdtype(arr.dtype, np.floating):
        if np.isnan(low):
            raise ValueError("load contains NaN")
        if np.isinf(low) or np.isinf(high):
            raise ValueError("load contains inf")
    if low < 0:
        raise ValueError("load contains negative values")
    out = np.asarray(arr, dtype=np.float64)
    if high > _LARGEST_EXACT:
        # Plans depend on load ratios only; huge counts (up to float64's max) would overflow the
        # sums and the float32 the DeepSeek path uses, so they are scaled down first.
        out = out * (_LARGEST_EXACT / float(high))
    return out


_LARGEST_EXACT = float(2**40)
"""Loads above this are scaled to it before planning (ratios kept, sums stay finite)."""


def check_shapes(num_layers: int, num_logical: int, topology: Topology, current: Placement | None) -> None:
    """Raise ValueError when the load, topology and current placement do not fit together."""
    P = topology.num_physical
    if num_logical > P:
        raise ValueError(f"fewer physical slots ({P}) than logical experts ({num_logical})")
    if current is None:
        return
    if (current.num_layers, current.num_logical, current.num_physical) != (num_layers, num_logical, P):
        raise ValueError(
            f"current placement is [L={current.num_layers}, E={current.num_logical}, P={current.num_physical}] "
            f"but load and topology give [L={num_layers}, E={num_logical}, P={P}]"
        )
    if (current.num_gpus, current.num_nodes) != (topology.num_gpus, topology.num_nodes):
        raise ValueError(
            f"current placement spans {current.num_gpus} GPUs / {current.num_nodes} nodes, "
            f"topology {topology.num_gpus} / {topology.num_nodes} (Placement.trivial takes num_nodes, "
            "default 1)"
        )
