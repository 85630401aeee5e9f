"""SGLang plugin: eplb's solver behind ``--eplb-algorithm``, SGLang's own algorithms untouched.

Shape legend: W window (passes), L layers, E logical experts, P physical slots.

SGLang 0.5.23 runs every ``sglang.srt.plugins`` entry point (those ``SGLANG_PLUGINS`` lists, or all
when it is unset) in each of its processes. Ours, :func:`register`, wraps two functions of
``sglang.srt.eplb.eplb_algorithms`` through SGLang's ``HookRegistry`` (AROUND hooks):

- ``compute_algorithm``: ``--eplb-algorithm`` is a free string that SGLang looks up in its
  ``EplbAlgorithm`` enum, so ``scipy`` raised ``KeyError`` at the first rebalance. Names SGLang does
  not know but eplb does (``scipy``), ``eplb`` (eplb's default) and ``eplb:NAME`` (any eplb
  algorithm, e.g. ``eplb:deepseek``) become an :class:`EplbSolverAlgorithm`; every SGLang name,
  ``auto`` included, goes to SGLang's own code unchanged.
- ``rebalance_experts``: an :class:`EplbSolverAlgorithm` plans with eplb's solver from the whole
  window [W, L, E] SGLang passes and from the live placement
  (``get_global_expert_location_metadata()``), so plans are migration-aware; anything else runs
  SGLang's code. SGLang runs this on every rank; the plan depends only on those inputs.

So nothing changes until ``--eplb-algorithm`` names an eplb algorithm. ``EPLB_SGLANG_FUSED_REMAP=1``
also puts eplb's remap kernel behind SGLang's fused map+record (eplb.integrations.sglang_remap);
``EPLB_SGLANG=0`` (or an ``SGLANG_PLUGINS`` list without ``eplb``) keeps the plugin out entirely.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from eplb.integrations.engine_plan import EngineDecisions, EnginePlan, engine_placement, make_planner
from eplb.policy import check_policy_name, policy_names, resolve_policy_name

if TYPE_CHECKING:
    import torch

    from eplb.placement.model import Placement
    from eplb.solver.planner import SolverPlanner

PLUGIN_ENV = "EPLB_SGLANG"
"""Environment variable: ``0`` keeps the whole plugin out of SGLang (default: on, inert until asked)."""
FUSED_ENV = "EPLB_SGLANG_FUSED_REMAP"
"""Environment variable: ``1`` replaces SGLang's ``eplb_map_and_record_fused`` with eplb's kernel."""
PREFIX = "eplb:"
"""``--eplb-algorithm eplb:NAME`` runs eplb's algorithm NAME even where SGLang has one of that name."""
SGLANG_ALGORITHMS = (
    "auto",
    "deepseek",
    "deepseek_hierarchical",
    "deepseek_vec",
    "deepseek_vec_hierarchical",
    "elasticity_aware",
    "elasticity_aware_hierarchical",
)
"""SGLang 0.5.23's own ``--eplb-algorithm`` names (at run time the live enum is read as well)."""
_TARGET = "sglang.srt.eplb.eplb_algorithms"

_LOG = logging.getLogger(__name__)


@dataclass(frozen=True)
class EplbSolverAlgorithm:
    """What ``compute_algorithm`` returns for an eplb name: the eplb algorithm to plan with."""

    name: str
    """A registered eplb policy name (eplb.policy.policy_names())."""


def _enabled(var: str, default: bool) -> bool:
    raw = os.environ.get(var, "").strip().lower()
    if not raw:
        return default
    return raw not in ("0", "false", "off", "no")


def route_algorithm(
    raw: str, sglang_names: Collection[str] = SGLANG_ALGORITHMS
) -> EplbSolverAlgorithm | None:
    """The eplb algorithm ``--eplb-algorithm raw`` asks for, or None when it is SGLang's business.

    ``eplb:NAME`` with an unknown NAME raises ValueError listing eplb's names.
    """
    if raw.startswith(PREFIX):
        name = raw[len(PREFIX) :]
        check_policy_name(name, "--eplb-algorithm")
        return EplbSolverAlgorithm(name)
    if raw == "eplb":
        return EplbSolverAlgorithm("auto")
    if raw in sglang_names or raw not in policy_names():
        return None
    return EplbSolverAlgorithm(raw)


def sglang_algorithm_name(eplb_name: str) -> str:
    """The ``--eplb-algorithm`` value that runs eplb's ``eplb_name`` through this plugin."""
    concrete = resolve_policy_name(eplb_name)
    return concrete if concrete not in SGLANG_ALGORITHMS else f"{PREFIX}{concrete}"


_PLANNERS: dict[str, SolverPlanner] = {}
_DECISIONS: dict[tuple[Any, ...], EngineDecisions] = {}
"""Per algorithm and model shape: this process's rebalance decisions (eplb.policy.decision);
SGLang passes a window of its ``--expert-distribution-recorder-buffer-size`` passes per call."""


def _planner(name: str) -> SolverPlanner:
    planner = _PLANNERS.get(name)
    if planner is None:
        planner = _PLANNERS[name] = make_planner(name, "--eplb-algorithm")
    return planner


def rebalance_with_eplb(
    tokens_per_expert: torch.Tensor,
    num_physical_experts: int,
    num_local_physical_experts: int,
    num_groups: int | None,
    num_nodes: int,
    algorithm: EplbSolverAlgorithm,
    current_phy2log: Any = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGLang's ``rebalance_experts`` contract with eplb's solver behind it.

    ``tokens_per_expert`` is the window [W, L, E] (or [L, E]); ``current_phy2log`` the live map
    [L, P] (None: read SGLang's live placement, where there is one). Returns int64 CPU tensors
    ``(phy2log [L, P], log2phy [L, E, R], logcnt [L, E])``, the layout and dtypes of SGLang's
    DeepSeek algorithm.
    """
    import torch

    window = np.asarray(tokens_per_expert.detach().cpu().numpy(), dtype=np.float64)
    if window.ndim == 2:
        window = window[None]
    if num_local_physical_experts < 1 or num_physical_experts % num_local_physical_experts:
        raise ValueError(
            f"{num_physical_experts} physical experts do not split into {num_local_physical_experts} per GPU"
        )
    num_gpus = num_physical_experts // num_local_physical_experts
    nodes = num_nodes if num_nodes >= 1 and num_gpus % num_nodes == 0 else 1
    live = live_phy2log() if current_phy2log is None else current_phy2log
    current: Placement | None = None
    if live is not None:
        current = engine_placement(live, window.sum(axis=0), num_gpus, nodes)
    key = (algorithm.name, *window.shape[1:], num_physical_experts, num_gpus, nodes)
    decisions = _DECISIONS.get(key)
    if decisions is None or decisions.decider.config.rebalance_interval != window.shape[0]:
        # A window of another length (SGLang's buffer size changed) starts the count afresh.
        decisions = _DECISIONS[key] = EngineDecisions(
            num_gpus=num_gpus, num_nodes=nodes, passes_per_rebalance=window.shape[0]
        )
    plan: EnginePlan = decisions.rebalance(
        window,
        num_physical=num_physical_experts,
        num_gpus=num_gpus,
        num_nodes=nodes,
        num_groups=num_groups,
        planner=_planner(algorithm.name),
        current=current,
    )
    _LOG.info(
        "eplb %s: %d passes, %s (%s)",
        algorithm.name,
        window.shape[0],
        "new placement" if plan.applied else "placement kept",
        plan.reason,
    )
    return (
        torch.from_numpy(plan.phy2log_int64()),
        torch.from_numpy(plan.log2phy_int64()),
        torch.from_numpy(plan.logcnt_int64()),
    )


def live_phy2log() -> Any:
    """SGLang's live ``physical_to_logical_map`` [L, P] (CPU copy), or None where there is none yet.

    At start-up (``--init-expert-location`` with a load file) SGLang plans before any placement
    exists, and its runtime context may not be set up: that is a fresh plan, not an error.
    """
    try:
        from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

        metadata = get_global_expert_location_metadata()
    except Exception as exc:  # SGLang raises its own errors before its runtime context exists
        _LOG.debug("eplb: no live SGLang placement (%s: %s); planning fresh", type(exc).__name__, exc)
        return None
    return None if metadata is None else metadata.physical_to_logical_map_cpu


def compute_algorithm_hook(
    original: Callable[..., Any], raw_algorithm: str, num_groups: int | None, num_nodes: int
) -> Any:
    """AROUND ``compute_algorithm``: eplb's names to an :class:`EplbSolverAlgorithm`, others to SGLang."""
    from sglang.srt.eplb.eplb_algorithms import EplbAlgorithm

    choice = route_algorithm(raw_algorithm, (*SGLANG_ALGORITHMS, *EplbAlgorithm.__members__))
    if choice is not None:
        return choice
    return original(raw_algorithm=raw_algorithm, num_groups=num_groups, num_nodes=num_nodes)


def rebalance_experts_hook(
    original: Callable[..., Any],
    tokens_per_expert: torch.Tensor,
    num_physical_experts: int,
    num_local_physical_experts: int,
    num_groups: int | None,
    num_nodes: int,
    algorithm: Any,
) -> Any:
    """AROUND ``rebalance_experts``: eplb's solver for an :class:`EplbSolverAlgorithm`, SGLang's code otherwise."""
    if isinstance(algorithm, EplbSolverAlgorithm):
        return rebalance_with_eplb(
            tokens_per_expert,
            num_physical_experts,
            num_local_physical_experts,
            num_groups,
            num_nodes,
            algorithm,
        )
    return original(
        tokens_per_expert=tokens_per_expert,
        num_physical_experts=num_physical_experts,
        num_local_physical_experts=num_local_physical_experts,
        num_groups=num_groups,
        num_nodes=num_nodes,
        algorithm=algorithm,
    )


_REGISTERED: list[str] = []


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: register the hooks (SGLang applies them after).

    Idempotent. ``EPLB_SGLANG=0`` registers nothing; ``EPLB_SGLANG_FUSED_REMAP=1`` also replaces
    the fused map+record kernel.
    """
    if not _enabled(PLUGIN_ENV, default=True):
        _LOG.info("eplb: %s=0, the eplb SGLang plugin registers nothing", PLUGIN_ENV)
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if "algorithms" not in _REGISTERED:
        HookRegistry.register(f"{_TARGET}.compute_algorithm", compute_algorithm_hook, HookType.AROUND)
        HookRegistry.register(f"{_TARGET}.rebalance_experts", rebalance_experts_hook, HookType.AROUND)
        _REGISTERED.append("algorithms")
        _LOG.info(
            "eplb: --eplb-algorithm %s (or eplb:NAME for any of %s) plans with eplb's solver",
            ", ".join(n for n in policy_names() if n not in SGLANG_ALGORITHMS),
            policy_names(),
        )
    if _enabled(FUSED_ENV, default=False) and "fused" not in _REGISTERED:
        from eplb.integrations.sglang_remap import register_fused

        register_fused(HookRegistry, HookType)
        _REGISTERED.append("fused")


def launch_flags(placement: Placement, json_path: str, algorithm: str) -> dict[str, str]:
    """SGLang flags for a placement written to ``json_path``: eplb's solver online, or EPLB off.

    ``plugin``: start from the placement and rebalance with eplb's ``algorithm`` through this
    plugin. ``static``: EPLB off (no ``--enable-eplb``), the placement fixed for the whole run.
    """
    common = (
        f"--ep-size {placement.num_gpus} --ep-num-redundant-experts {placement.num_redundant} "
        f"--init-expert-location {json_path}"
    )
    if placement.num_nodes > 1:
        common += f" --nnodes {placement.num_nodes}"
    return {
        "plugin": f"--enable-eplb --eplb-algorithm {sglang_algorithm_name(algorithm)} {common}",
        "static": common,
    }
