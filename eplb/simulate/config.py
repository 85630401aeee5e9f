"""What a simulation replays: a server's EPLB flags (``EplbConfig``) and what only a replay needs.

The server's flags (topology, schedule, window, move budget, recording, dispatch) are an
``eplb.config.EplbConfig``, validated by it and read only through its properties, so a server
given the same flags rebalances on the schedule that was simulated. Two schedules share one
clock (plan after every ``rebalance_interval``-th recorded step) and differ in how a plan reaches
the GPUs:

- ``periodic`` (SGLang's): the window holds at most the steps since the last rebalance, and the
  transfer stalls serving for all of its link time; the new placement serves from the next step.
- ``continuous``: small plans, at most ``max_moved_experts`` copies each, from a window that may
  be longer than the interval; the swap is sent beside the following passes at
  ``--eplb-transfer-gbps`` and the maps switch at the first pass boundary after it arrives
  (``eplb.policy.cost_model``).

Inside an engine the swap is the engine's own (``SimulationConfig.engine_swap``, either schedule):

- ``sglang``: SGLang 0.5.23's ``ExpertLocationUpdater``, synchronous: serving waits for each
  chunk of ``--eplb-rebalance-layers-per-chunk`` layers (all at once by default), one chunk per
  pass; the stall is the sum of each chunk's busiest GPU's link time
  (``CostModel.chunk_transfer_seconds``). The new placement serves from the next step.
- ``vllm``: vLLM 0.33's asynchronous EPLB (its default): a worker thread moves one layer per pass
  beside the passes (``rearrange_expert_weights_inplace``'s ``transfer_layer``), so a swap takes
  at least one pass per layer; no stall, the passes lose the interference. A rearrangement due
  while one is in flight is skipped (vLLM's ``step`` waits for it instead of stalling).

The rest (the cost model, the model's bytes per expert and expert groups, seeds, solver options,
the first scored step, the engine's swap) exists only offline.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from eplb.config import EplbConfig
from eplb.policy.cost_model import DEEPSEEK_V3_BYTES_PER_EXPERT, CostModel

if TYPE_CHECKING:
    from eplb.traces import Trace

ENGINE_SWAPS = ("eplb", "sglang", "vllm")
"""SimulationConfig.engine_swap choices: eplb's own swap, SGLang's synchronous one, vLLM's asynchronous one."""


@dataclass(frozen=True, kw_only=True)
class SimulationConfig:
    """A simulated server's EPLB flags and the offline-only settings of the replay."""

    eplb: EplbConfig
    """The server's flags, with ``enable_eplb=True`` (``EplbConfig``'s checks of the window and
    ``--ep-size`` apply only then): ``ep_size``, ``nnodes``, ``ep_num_redundant_experts``,
    ``eplb_rebalance_mode``, ``eplb_rebalance_num_iterations``,
    ``expert_distribution_recorder_buffer_size``, ``eplb_max_moved_experts``, ``eplb_shift_burst``,
    ``eplb_initial_full_plan``, ``eplb_transfer_gbps``, ``eplb_record_prefill_only``,
    ``eplb_min_rebalancing_utilization_threshold``, ``ep_dispatch_algorithm`` (the no-balancing
    baseline's dispatch, and that of runs without one). Its properties give the interval, window,
    budget and initial full plan the simulation uses."""
    bytes_per_expert: int = DEEPSEEK_V3_BYTES_PER_EXPERT
    """Bytes of one expert's weights in one layer (transfer cost)."""
    num_groups: int = 1
    """Expert groups of the model (the hierarchical algorithm packs groups onto nodes)."""
    seed: int = 0
    """Seed of the planners and of fake dispatch."""
    cost: CostModel = field(default_factory=CostModel)
    """Modeled MoE time of a pass and of a transfer (eplb.policy.cost_model)."""
    solver_options: Mapping[str, Any] = field(default_factory=dict)
    """Extra ``eplb.solver.SolveOptions`` fields for the solver-backed runs (--solver-option)."""
    score_from: int | None = None
    """--score-from: first scored step (None: the first rebalance). Runs of different schedules
    compare only on the same scored steps."""
    engine_swap: str = "eplb"
    """Whose swap moves the weights (ENGINE_SWAPS): eplb's own (periodic: one stall for the whole
    transfer; continuous: beside the passes at ``--eplb-transfer-gbps``), SGLang's synchronous
    one, or vLLM's asynchronous one (module docstring)."""

    def __post_init__(self) -> None:
        if self.engine_swap not in ENGINE_SWAPS:
            raise ValueError(
                f"SimulationConfig.engine_swap: unknown swap {self.engine_swap!r}; choose from {ENGINE_SWAPS}"
            )
        if not self.eplb.enable_eplb:
            raise ValueError(
                "SimulationConfig.eplb: a simulation rebalances, so build it with "
                "EplbConfig(enable_eplb=True, ...) (as a server with --enable-eplb)"
            )
        if self.score_from is not None and self.score_from < 0:
            raise ValueError(
                f"--score-from (SimulationConfig.score_from) must be >= 0, got {self.score_from}"
            )
        if self.bytes_per_expert < 0:
            raise ValueError(f"--bytes-per-expert must be >= 0, got {self.bytes_per_expert}")
        if self.num_groups < 1:
            raise ValueError(f"--num-groups must be >= 1, got {self.num_groups}")

    @classmethod
    def for_trace(cls, trace: Trace, *, eplb: EplbConfig, **fields: Any) -> SimulationConfig:
        """A replay of ``trace`` with its model's facts from its meta (``num_groups``,
        ``bytes_per_expert``; 1 group and DeepSeek-V3's bytes where it has none); ``fields`` set
        the other offline settings or override those two."""
        facts: dict[str, Any] = {
            "num_groups": int(trace.meta.get("num_groups", 1)),
            "bytes_per_expert": int(trace.meta.get("bytes_per_expert", DEEPSEEK_V3_BYTES_PER_EXPERT)),
        }
        return cls(eplb=eplb, **{**facts, **fields})

    def on_layers_of(self, trace: Trace) -> SimulationConfig:
        """This config on ``trace``'s model: its MoE layers set (``EplbConfig.for_layers``; they size
        continuous mode's default move budget)."""
        return replace(self, eplb=self.eplb.for_layers(trace.num_layers))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the flags as given (``eplb``), the offline fields, and the schedule the flags
        resolve to, under the keys results files have always carried (``interval``,
        ``window_size``, ``move_budget``, ...)."""
        flags = self.eplb
        return {
            "eplb": asdict(flags),
            "bytes_per_expert": self.bytes_per_expert,
            "num_groups": self.num_groups,
            "seed": self.seed,
            "cost": asdict(self.cost),
            "solver_options": dict(self.solver_options),
            "score_from": self.score_from,
            "engine_swap": self.engine_swap,
            "num_gpus": flags.ep_size,
            "num_nodes": flags.nnodes,
            "num_redundant": flags.ep_num_redundant_experts,
            "rebalance_mode": flags.eplb_rebalance_mode,
            "interval": flags.rebalance_interval,
            "window_size": flags.recorder_buffer_size,
            "move_budget": flags.max_moved_experts,
            "shift_burst": flags.eplb_shift_burst,
            "initial_full_plan": flags.initial_full_plan,
            "transfer_gbps": flags.eplb_transfer_gbps,
            "record_prefill_only": flags.eplb_record_prefill_only,
            "utilization_threshold": flags.eplb_min_rebalancing_utilization_threshold,
            "default_dispatch": flags.dispatch_algorithm,
        }
