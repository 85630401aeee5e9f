"""What a simulation replays: topology, rebalance schedule (periodic or continuous) and costs.

Two schedules share one clock (plan after every ``interval``-th recorded step) and differ in how
a plan reaches the GPUs:

- ``periodic`` (SGLang's): the window holds at most the steps since the last rebalance, and the
  transfer stalls serving for all of its link time; the new placement serves from the next step.
- ``continuous``: small plans, at most ``max_moved_experts`` copies each, from a window that may
  be longer than the interval; the swap is sent beside the following passes at ``transfer_gbps``
  and the maps switch at the first pass boundary after it arrives (``eplb.policy.cost_model``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from eplb.config import CONTINUOUS_BUFFER_SIZE, CONTINUOUS_MAX_MOVED_EXPERTS
from eplb.policy.cost_model import DEEPSEEK_V3_BYTES_PER_EXPERT, CostModel
from eplb.policy.schedule import SHIFT_BURST
from eplb.simulate.dispatch import DISPATCH_MODES

REBALANCE_MODES = ("periodic", "continuous")
"""--eplb-rebalance-mode choices."""


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
    """--expert-distribution-recorder-buffer-size: recorded steps the planner sees (None: the
    interval; continuous mode: ``eplb.config.CONTINUOUS_BUFFER_SIZE`` or the interval if longer).
    At most the interval in periodic mode; any length in continuous mode."""
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
    rebalance_mode: str = "periodic"
    """--eplb-rebalance-mode: periodic (the transfer stalls serving) or continuous (sent beside the passes)."""
    max_moved_experts: int | None = None
    """--eplb-max-moved-experts: budget of expert copies across GPUs per rebalance, given to the
    solver-backed runs as ``SolveOptions.max_moved_experts`` (None: no budget in periodic mode,
    ``eplb.config.CONTINUOUS_MAX_MOVED_EXPERTS`` in continuous mode, as a server has)."""
    shift_burst: int = SHIFT_BURST
    """--eplb-shift-burst: in continuous mode, a plan made on a domain shift may move up to this
    many rebalances' budgets, repaid by the following ones (eplb.policy.schedule.MoveAllowance);
    1: never more than one budget."""
    initial_full_plan: bool = True
    """--eplb-initial-full-plan: in continuous mode, the first plan of a run that starts from the
    trivial placement moves without the budget (eplb.policy.schedule; not with a budget of 0)."""
    transfer_gbps: float | None = None
    """--eplb-transfer-gbps: pace of a swap sent beside the passes, GB/s into one GPU
    (continuous mode; None: as fast as the links go)."""
    score_from: int | None = None
    """First scored step (None: the first rebalance). Runs of different schedules compare only on
    the same scored steps."""

    def __post_init__(self) -> None:
        if self.num_gpus < 1 or self.num_nodes < 1 or self.num_gpus % self.num_nodes:
            raise ValueError(
                f"--nnodes ({self.num_nodes}) must divide --ep-size ({self.num_gpus}), both >= 1"
            )
        if self.num_redundant < 0:
            raise ValueError(f"--ep-num-redundant-experts must be >= 0, got {self.num_redundant}")
        if self.interval < 1:
            raise ValueError(f"--eplb-rebalance-num-iterations must be >= 1, got {self.interval}")
        if self.rebalance_mode not in REBALANCE_MODES:
            raise ValueError(
                f"--eplb-rebalance-mode: unknown mode {self.rebalance_mode!r}; choose from {REBALANCE_MODES}"
            )
        if self.window is not None and self.window < 1:
            raise ValueError(f"--expert-distribution-recorder-buffer-size must be >= 1, got {self.window}")
        if self.window is not None and self.rebalance_mode == "periodic" and self.window > self.interval:
            raise ValueError(
                f"--expert-distribution-recorder-buffer-size ({self.window}) must lie in "
                f"[1, --eplb-rebalance-num-iterations ({self.interval})] in periodic mode"
            )
        if self.shift_burst < 1:
            raise ValueError(f"--eplb-shift-burst must be >= 1, got {self.shift_burst}")
        if self.max_moved_experts is not None and self.max_moved_experts < 0:
            raise ValueError(f"--eplb-max-moved-experts must be >= 0, got {self.max_moved_experts}")
        if self.transfer_gbps is not None and not (
            np.isfinite(self.transfer_gbps) and self.transfer_gbps > 0
        ):
            raise ValueError(f"--eplb-transfer-gbps must be a finite number > 0, got {self.transfer_gbps}")
        if self.score_from is not None and self.score_from < 0:
            raise ValueError(f"score_from must be >= 0, got {self.score_from}")
        if not 0.0 <= self.utilization_threshold <= 1.0:
            raise ValueError("--eplb-min-rebalancing-utilization-threshold must lie in [0, 1]")
        if self.default_dispatch not in DISPATCH_MODES:
            raise ValueError(f"unknown dispatch {self.default_dispatch!r}; choose from {DISPATCH_MODES}")
        if self.bytes_per_expert < 0 or self.num_groups < 1:
            raise ValueError("bytes_per_expert must be >= 0 and num_groups >= 1")

    @property
    def window_size(self) -> int:
        if self.window is not None:
            return self.window
        return max(CONTINUOUS_BUFFER_SIZE, self.interval) if self.continuous else self.interval

    @property
    def move_budget(self) -> int | None:
        """Expert copies a rebalance may move (the mode's default unless given; None: no budget)."""
        if self.max_moved_experts is None and self.continuous:
            return CONTINUOUS_MAX_MOVED_EXPERTS
        return self.max_moved_experts

    @property
    def continuous(self) -> bool:
        return self.rebalance_mode == "continuous"

    def to_dict(self) -> dict[str, Any]:
        """The fields, and the window and budget they resolve to."""
        return {
            **asdict(self),
            "solver_options": dict(self.solver_options),
            "window_size": self.window_size,
            "move_budget": self.move_budget,
        }
