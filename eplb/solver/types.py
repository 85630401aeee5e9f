"""The solver's public types: topology, options, the plan it returns, and input checks.

Shape legend: W window (passes), L layers, E logical experts, P physical slots, G GPUs, N nodes,
R max replicas.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

from eplb.placement.degraded import RELOAD_SOURCES, DegradedPlacement, ReloadReport
from eplb.placement.diff import PlacementDiff
from eplb.placement.model import Placement
from eplb.policy.decision import Pricing
from eplb.policy.dispatch import dispatch_mode
from eplb.policy.registry import check_policy_name, get_policy

if TYPE_CHECKING:
    from eplb.config import EplbConfig

PREDICTIONS = ("auto", "sum", "decay", "recent", "robust", "track")
FAILURE_DOMAINS = ("none", "gpu", "node")


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
    """How a window [W, L, E] becomes the load to plan for: auto | sum | decay | recent | robust |
    track (eplb.solver.predict; track: eplb.solver.forecast). auto, for scipy: robust on windows of
    at least ``robust_from_passes`` passes, decay on shorter ones (the benchmark's best for each),
    decay whenever a move budget is set (continuous plans: robust costs four times the search for
    no measured gain, and track, opt-in, was not better in every mode: docs/benchmarks.md
    "Forecast"); for the DeepSeek algorithms: sum, as SGLang runs them."""
    robust_from_passes: int = 500
    """auto prediction: the window length (passes) from which scipy plans robustly."""
    decay_half_life: float = 8.0
    """decay/robust: half-life of a pass's weight, in recorded passes (recent passes weigh more); track: the
    half-life on windows too short to backtest."""
    recent_fraction: float = 0.25
    """recent: plan on the sum of this last fraction of the window."""
    track_half_lives: tuple[float, ...] = (2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)
    """track: the half-lives (passes) the window's own backtest chooses from (eplb.solver.forecast);
    one value: ``decay`` with it (and the reset, if ``track_shift`` is set)."""
    track_shift: float | None = None
    """track: reset the forecast to the passes after the newest domain shift in the window, a jump
    of the experts' shares by more than this total variation beyond sampling noise (mean over
    layers; 0.05 finds the variants' shifts, docs/benchmarks.md "Forecast"); None (default): no
    reset, which continuous plans measured at least as well (bench_forecast)."""
    num_scenarios: int = 4
    """robust: sub-windows of the window used as scenarios of the next window's load shape."""
    dispatch: str = "dynamic"
    """How the server splits an expert's tokens over its replicas (``--ep-dispatch-algorithm``,
    eplb.solver.scoring.dispatch): ``static`` scores placements with the static maps' shares (and packs
    fresh plans for them), ``weighted`` also returns LP per-replica weights [L, E, R], ``lp``
    predicts with the per-batch rule; the others split evenly."""
    milp_max_solves: int = 8
    """MILP repacking (fresh scipy plans): subproblem solves for the whole model (0 disables it).
    A count, not seconds, so every rank and every run computes the same plan."""
    time_budget_s: float | None = None
    """Optional wall-clock cap on the MILP repacking, in seconds (0 disables it). None (default):
    only ``milp_max_solves`` limits it; a wall-clock cap makes plans depend on the machine's speed."""
    incremental: bool = True
    """scipy with ``current``: change the current placement only where it pays, instead of repacking."""
    copy_cost: float | None = None
    """scipy with ``current``: balancedness of its layer that one expert copy across GPUs must buy
    (0: move freely). None: priced in seconds by ``pricing`` (eplb.policy.decision.copy_price: an
    expert's transfer time against what the layer's balancedness saves over the horizon)."""
    noise_price_passes: float = 0.1
    """With ``copy_cost`` None, a move must pay for its copies in seconds and also beat the noise of
    the forecast it was found on (a decayed window of about a dozen passes): at least this many
    balancedness-passes per copy, divided by the horizon (clamped to 50-250 passes). A move that chases
    noise is moved back at a later rebalance. At continuous mode's 50 passes that is 0.002 per
    copy, the price the budgeted search was tuned with (deepseek-v3 EP32: 0.877 prefill
    balancedness, against 0.863 with the price in seconds alone); 0.0005 at 200 passes. The first
    plan from an unfitted placement drops it (its gains are far above any noise)."""
    pricing: Pricing = field(default_factory=Pricing)
    """The horizon the plan serves, the current placement's age and the transfer model: the
    prediction's horizon, the copy price and the apply/skip gate (eplb.policy.decision)."""
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
    allowance (eplb.policy.decision.MoveAllowance), whose later budgets repay what it spends."""
    shift_decline: float = 0.1
    """A shift: the current placement's load-weighted balancedness fell by more than this from
    the passes just before some pass to those from it (eplb.solver.scoring.horizon.find_shift, blocks of
    up to 25 passes, in the newer half of the window). Drift moves it by a few hundredths per
    block on the presets; the shifts there by 0.2-0.3."""
    cross_node_weight: float = 1.0
    """What one expert copy across nodes counts against ``max_moved_experts``: the slower link's
    cost relative to a copy inside a node."""
    holdout_passes: int | None = None
    """Passes after the older plan's cut that calibrate the prediction (eplb.solver.scoring.horizon). None:
    half of the passes since the last domain shift in the window (of the whole window without
    one); 0 (or a window of one pass): score the forecast itself (optimistic)."""
    min_gain: float = 0.0
    """Skip (apply=False) a priced policy's plan whose predicted balancedness gain over ``current``
    is below this, whatever it saves (0: only the gate in seconds decides)."""
    alive_ranks: tuple[bool, ...] | None = None
    """One flag per EP rank, False for a rank lost: ``solve`` returns the degraded plan
    (eplb.solver.degraded), a placement over the live ranks only that keeps every logical expert
    served and every survivor's replica where balance allows; ``Plan.degraded`` holds it with dead
    slots -1, ``Plan.reload`` what must be reloaded. None: every rank serves."""
    reload_source: str = "checkpoint"
    """Degraded plans: where an expert whose every replica was on a lost rank is reloaded from
    (peer | host | checkpoint), as ``Plan.reload`` reports its bytes."""
    failure_domain: str = "none"
    """Opt-in failure-aware placement (eplb.solver.search.spread): ``gpu`` or ``node`` gives the
    hottest experts with one replica a second one, taken from experts whose replicas can spare it
    (no replica may then carry more than a GPU's mean load), puts each expert's replicas in
    different GPUs or nodes and splits the experts left with one replica evenly over them, so
    losing one rank or node reloads as few experts as the slots allow; its cost in forecast
    balancedness is in ``Plan.stats`` (``spread_cost``). Not with a move budget."""
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
        half_lives = tuple(self.track_half_lives)
        if not half_lives or not all(
            isinstance(h, (int, float)) and not isinstance(h, bool) and 0 < h < float("inf")
            for h in half_lives
        ):
            raise ValueError(
                f"track_half_lives must be finite half-lives > 0 passes, got {self.track_half_lives}"
            )
        object.__setattr__(self, "track_half_lives", tuple(float(h) for h in half_lives))
        if self.track_shift is not None and not 0 < self.track_shift <= 1:
            raise ValueError(f"track_shift must be None or lie in (0, 1], got {self.track_shift}")
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
        if not (np.isfinite(self.noise_price_passes) and self.noise_price_passes >= 0):
            raise ValueError(f"noise_price_passes must be finite and >= 0, got {self.noise_price_passes}")
        if self.copy_cost is not None and not self.copy_cost >= 0:
            raise ValueError(f"copy_cost must be None or >= 0, got {self.copy_cost}")
        if self.bytes_per_expert < 0:
            raise ValueError(f"bytes_per_expert must be >= 0, got {self.bytes_per_expert}")
        if self.max_bytes_moved is not None and (self.max_bytes_moved < 0 or self.bytes_per_expert <= 0):
            raise ValueError("max_bytes_moved needs bytes_per_expert > 0 and must be >= 0")
        dispatch_mode(self.dispatch)  # ValueError listing the modes
        if not np.isfinite(self.min_gain):
            raise ValueError(f"min_gain must be finite, got {self.min_gain}")
        if self.alive_ranks is not None:
            alive = tuple(self.alive_ranks)
            if not alive or not all(isinstance(a, bool) or a in (0, 1) for a in alive):
                raise ValueError("alive_ranks must be None or one boolean per EP rank")
            object.__setattr__(self, "alive_ranks", tuple(bool(a) for a in alive))
        if self.reload_source not in RELOAD_SOURCES:
            raise ValueError(f"unknown reload_source {self.reload_source!r}; choose from {RELOAD_SOURCES}")
        if self.failure_domain not in FAILURE_DOMAINS:
            raise ValueError(f"unknown failure_domain {self.failure_domain!r}; choose from {FAILURE_DOMAINS}")
        if self.failure_domain != "none" and self.budgeted:
            raise ValueError("failure_domain spreads replicas beyond a move budget: use it without one")

    @classmethod
    def from_config(
        cls,
        config: EplbConfig,
        *,
        algorithm: str | None = None,
        dispatch: str | None = None,
        bytes_per_expert: int = 0,
        seed: int = 0,
        copy_cost: float | None = None,
        move_budget: bool = True,
        fields: Mapping[str, Any] | None = None,
    ) -> SolveOptions:
        """The options a server with ``config``'s flags plans with: its algorithm, dispatch mode
        and move budget (``config.max_moved_experts``; ``move_budget=False``: none, where the
        budget is the Decider's allowance alone), unless ``algorithm`` or ``dispatch`` name
        another; ``bytes_per_expert`` and ``seed`` of the model and run; ``copy_cost`` (None:
        priced in seconds); then the user's string-keyed ``fields`` (``--solver-option``,
        ``EPLB_SOLVER_OPTIONS``) over all of these but a move budget the flags give. An unknown
        field or a bad value raises ValueError naming it."""
        given: dict[str, Any] = {
            "algorithm": config.eplb_algorithm if algorithm is None else algorithm,
            "dispatch": config.dispatch_algorithm if dispatch is None else dispatch,
            "bytes_per_expert": bytes_per_expert,
            "seed": seed,
            "copy_cost": copy_cost,
        }
        chosen = dict(fields or {})
        budget = config.max_moved_experts if move_budget else None
        if budget is not None:
            chosen["max_moved_experts"] = budget
        return cls.from_mapping(chosen, **given)

    @classmethod
    def from_mapping(cls, fields: Mapping[str, Any], **given: Any) -> SolveOptions:
        """Options from string-keyed ``fields`` (``EPLB_SOLVER_OPTIONS``, ``--solver-option``) over
        ``given`` (:meth:`from_config` builds a server's); an unknown field or a bad value raises
        ValueError naming it."""
        known = {f.name for f in dataclasses.fields(cls)} - {"pricing"}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"solver option: unknown field(s) {unknown}; choose from {sorted(known)}")
        try:
            return cls(**{**given, **dict(fields)})
        except TypeError as exc:
            raise ValueError(f"solver option: {exc}") from None

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
    def weighted(self) -> bool:
        """Whether plans carry per-replica dispatch weights (``weighted`` dispatch)."""
        return dispatch_mode(self.dispatch).needs_weights

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
    """The transfer from ``current`` (None without one, and for a degraded plan: see ``reload``)."""
    predicted_balancedness: float
    """What ``placement`` will get over the passes it serves (``pricing.horizon_passes``): the mean
    over them (weighted by load) of the model balancedness as the server dispatches, calibrated on
    the window (eplb.solver.scoring.horizon); on a window too short to calibrate (or ``holdout_passes=0``),
    its per-pass balancedness on the newest passes it was fitted to."""
    apply: bool
    """False when the modeled time the plan saves does not pay for its transfer, or another case
    of eplb.policy.decision.judge keeps ``current``."""
    reason: str
    """Why the plan is applied or skipped, in words (judge's)."""
    stats: Mapping[str, float] = field(default_factory=dict)
    """Numbers about the solve, for reports only (read-only: nothing decides on them). Always: solve_seconds, algorithm_scipy (1.0 or 0.0),
    forecast_balancedness (the plan scored on the load it was fitted to), calibration_passes,
    horizon_passes, copy_price. With current: current_balancedness (predicted over the horizon,
    under current), predicted_gain, saved_seconds and transfer_seconds (the gate's), copies_moved,
    weighted_copies_moved, changed_slots, shift / shift_drop / passes_since_shift. Calibrated:
    decline_level, decline_slope, plan_recent, older_recent, current_recent (eplb.solver.scoring.horizon).
    scipy: fresh_swaps, milp_improved_layers / milp_solves / milp_seconds, fresh_layers (layers
    where the fresh plan won); searched: budget_swaps, budget_replica_changes, budget_rounds.
    Degraded: lost_ranks, reload_experts, reloads, survivor_copies, kept_slots, rebalanced.
    failure_domain: spread_covered (replicas moved to experts that had one), spread_swaps,
    spread_changed_slots (against the policy's plan), spread_fresh_layers, spread_cost,
    lost_load_before / lost_load_after, lost_experts_before / lost_experts_after (the most
    (layer, expert) pairs one domain's loss leaves with no replica)."""
    degraded: DegradedPlacement | None = None
    """With ``alive_ranks``: the plan in the engine's slot numbering (dead slots -1); ``placement``
    is then its survivors' part (G' live GPUs)."""
    reload: ReloadReport | None = None
    """With ``alive_ranks``: the experts to reload and the bytes from each source."""
    repaired: Placement | None = None
    """With ``alive_ranks``: the survivors' placement the plan starts from, each lost expert in
    one donor's slot (eplb.solver.degraded; what the reloads fill)."""

    def __post_init__(self) -> None:
        if not isinstance(self.stats, MappingProxyType):
            object.__setattr__(self, "stats", MappingProxyType(dict(self.stats)))


def as_load_array(load: Any) -> np.ndarray:
    """float64 [W, L, E] from a window [W, L, E] or an aggregated [L, E] (numpy, torch or lists).

    Raises ValueError for a wrong shape, an empty axis, or NaN, infinite or negative loads.
    """
    return load_window(load).load_WLE


def load_window(load: Any) -> LoadWindow:
    """:func:`as_load_array`'s checked window, with the integer counts it came from where they
    give its reductions exactly (:class:`LoadWindow`)."""
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
        return LoadWindow(out * (_LARGEST_EXACT / float(high)))
    exact = np.issubdtype(arr.dtype, np.integer) and float(high) * arr.size <= _EXACT_SUM
    return LoadWindow(out, arr if exact else None)


@dataclass(frozen=True)
class LoadWindow:
    """A checked window and the reductions of it that several steps of one solve read (the
    prediction, the pass scores, the pass-time model), each computed once: at DeepSeek-V3's shape
    a window of 200 passes is 3 million values, and each pass over it costs milliseconds."""

    load_WLE: np.ndarray
    """float64 [W, L, E]: the checked load (:func:`as_load_array`)."""
    counts_WLE: np.ndarray | None = None
    """The integer [W, L, E] array ``load_WLE`` holds exactly, when no sum of it reaches 2**53
    (None: none such). Its reductions are read from it: the same numbers (float64 sums of integers
    below 2**53 are exact in any order, and integers convert to float32 with the one rounding the
    float64 values get), from half the bytes or fewer."""

    @cached_property
    def layer_load_WL(self) -> np.ndarray:
        """float64 [W, L]: each layer's load per pass."""
        if self.counts_WLE is not None:
            return self.counts_WLE.sum(axis=-1, dtype=np.int64).astype(np.float64)
        return self.load_WLE.sum(axis=-1)

    @cached_property
    def total_W(self) -> np.ndarray:
        """float64 [W]: each pass's load."""
        if self.counts_WLE is not None:
            return self.layer_load_WL.sum(axis=1)  # exact: from the exact layer sums
        return self.load_WLE.sum(axis=(1, 2))

    @cached_property
    def loaded_WL(self) -> np.ndarray:
        """int [W, L]: experts with load per pass and layer (loads are never negative)."""
        return np.count_nonzero(self.load_WLE if self.counts_WLE is None else self.counts_WLE, axis=-1)

    @cached_property
    def load32_WLE(self) -> np.ndarray:
        """float32 [W, L, E]: the load in float32."""
        return (self.load_WLE if self.counts_WLE is None else self.counts_WLE).astype(np.float32)


_LARGEST_EXACT = float(2**40)
"""Loads above this are scaled to it before planning (ratios kept, sums stay finite)."""
_EXACT_SUM = float(2**53)
"""Integers up to this are exact in float64, and so is every partial sum of loads below it."""


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
