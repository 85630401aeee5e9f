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
``EPLB_SGLANG_LP=1`` serves ``--ep-dispatch-algorithm lp`` with eplb's ``lp`` kernels, ``auto``
also picks each pass's mode (``lp`` or static, priced by ``EPLB_DISPATCH_COST``), modeled on the
window of each rebalance (eplb.integrations.sglang_lp);
``EPLB_SGLANG=0`` (or an ``SGLANG_PLUGINS`` list without ``eplb``) keeps the plugin out entirely.

``EPLB_REBALANCE_MODE=continuous`` (eplb.integrations.engine_env) makes every eplb rebalance a
budgeted continuous-mode step: SGLang calls the planner every ``--eplb-rebalance-num-iterations``
passes with a window of ``--expert-distribution-recorder-buffer-size`` passes (SGLang asserts the
window is not longer than the interval), so the adapter keeps its own history of the last
``EPLB_WINDOW_PASSES`` passes and plans from it, through the same
:class:`~eplb.policy.decision.Decider` as eplb's manager. ``EPLB_METRICS_PORT`` makes rank 0
export eplb's metrics from the windows SGLang hands over (eplb.integrations.engine_metrics),
starting when SGLang builds its ``EPLBManager``, with its passes (``on_forward_pass_end``) counted
and its weight transfers (``ExpertLocationUpdater.update``) timed. SGLang's window reaches the
planner oldest pass first (:func:`sglang_time_order`). Every ``EPLB_*`` variable is read and
checked when SGLang loads the plugin (eplb.integrations.engine_env.check_engine_env): a bad value
stops SGLang at start-up, naming the variable.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from eplb.config import even_nodes
from eplb.integrations.engine_env import (
    DISPATCH_COST_ENV,
    SGLANG,
    SGLANG_BACKEND_ENV,
    SGLANG_FUSED_ENV,
    SGLANG_PLUGIN_ENV,
    SHARED_ENV,
    EngineEnv,
    check_engine_env,
    dispatch_cost_from_env,
    engine_vars,
    env_flag,
    read_engine_env,
    sglang_lp_mode,
)
from eplb.integrations.engine_metrics import EngineMetrics
from eplb.integrations.engine_plan import EngineDecisions, EnginePlan, engine_placement, make_planner
from eplb.placement.model import Placement
from eplb.policy import check_policy_name, policy_names, resolve_policy_name
from eplb.solver.types import as_load_array

if TYPE_CHECKING:
    import torch

    from eplb.placement.degraded import DegradedPlacement
    from eplb.solver.planner import SolverPlanner

PLUGIN_ENV = SGLANG_PLUGIN_ENV
"""``0`` keeps the whole plugin out of SGLang (default: on, inert until asked)."""
FUSED_ENV = SGLANG_FUSED_ENV
"""``1`` replaces SGLang's ``eplb_map_and_record_fused`` with eplb's kernel."""
BACKEND_ENV = SGLANG_BACKEND_ENV
"""The fused replacement's remap backend (eplb.integrations.sglang_remap)."""
SGLANG_ENV = tuple(var for var in engine_vars(SGLANG) if var not in SHARED_ENV)
"""The ``EPLB_*`` variables of this plugin (beside eplb.integrations.engine_env.SHARED_ENV), the
weight updater's (eplb.integrations.sglang_updater) included: eplb.integrations.engine_env.ENV_VARS."""
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
    """A boolean variable; anything but 1/0/true/false/on/off/yes/no raises ValueError naming it."""
    return env_flag(os.environ, var, default)


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
_STATE: dict[str, Any] = {}
"""This process's settings (``settings``: the checked environment) and metrics (``metrics``)."""


def settings() -> EngineEnv:
    """The adapter's settings: read and checked at :func:`register` (or at first use)."""
    found = _STATE.get("settings")
    if found is None:
        found = _STATE["settings"] = read_engine_env(known=SGLANG_ENV)
    assert isinstance(found, EngineEnv)
    return found


def metrics() -> EngineMetrics:
    """This process's metrics (rank 0 exports when ``EPLB_METRICS_PORT`` is set)."""
    found = _STATE.get("metrics")
    if found is None:
        found = _STATE["metrics"] = EngineMetrics(settings(), _LOG)
    assert isinstance(found, EngineMetrics)
    return found


def reset() -> None:
    """Forget this process's decisions, planners and settings (a fresh process's state; tests)."""
    _DECISIONS.clear()
    _PLANNERS.clear()
    old = _STATE.pop("metrics", None)
    if isinstance(old, EngineMetrics):
        old.close()
    _STATE.clear()


def _planner(name: str) -> SolverPlanner:
    planner = _PLANNERS.get(name)
    if planner is None:
        planner = _PLANNERS[name] = make_planner(name, "--eplb-algorithm", settings=settings())
    return planner


def _sglang_interval(default: int) -> int:
    """SGLang's ``--eplb-rebalance-num-iterations`` where its runtime context has it, else ``default``
    (the window's passes: the interval when, as recommended, the buffer equals it)."""
    try:
        from sglang.srt.runtime_context import get_exec

        interval = int(get_exec().moe.eplb_rebalance_num_iterations)
    except Exception:  # no runtime context (start-up, tests): the window is the interval
        return default
    return interval if interval >= default else default


def rebalance_with_eplb(
    tokens_per_expert: torch.Tensor,
    num_physical_experts: int,
    num_local_physical_experts: int,
    num_groups: int | None,
    num_nodes: int,
    algorithm: EplbSolverAlgorithm,
    current_phy2log: Any = None,
    active_ranks: Any = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGLang's ``rebalance_experts`` contract with eplb's solver behind it.

    ``tokens_per_expert`` is the window [W, L, E] (or [L, E]); ``current_phy2log`` the live map
    [L, P] (None: read SGLang's live placement, where there is one); ``active_ranks`` the live EP
    ranks (None: SGLang's elastic EP mask, :func:`sglang_active_ranks`). Returns int64 CPU tensors
    ``(phy2log [L, P], log2phy [L, E, R], logcnt [L, E])``, the layout and dtypes of SGLang's
    DeepSeek algorithm; with a rank lost, the degraded plan in SGLang's form
    (:func:`sglang_degraded_maps`).
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
    nodes = even_nodes(num_gpus, num_nodes)
    live = live_phy2log() if current_phy2log is None else current_phy2log
    current: Placement | None = None
    if live is not None:
        current = engine_placement(live, window.sum(axis=0), num_gpus, nodes)
    alive = sglang_active_ranks(num_gpus) if active_ranks is None else alive_mask(active_ranks, num_gpus)
    if alive is not None and current is None:
        # No live map to keep (SGLang always has one once serving): plan from the trivial layout.
        _LOG.warning("eplb: ranks %s lost but no live placement; planning from the trivial one", alive)
        L, E = window.shape[1:]
        current = Placement.trivial(L, E, num_gpus, num_physical_experts - E, nodes)
    key = (algorithm.name, *window.shape[1:], num_physical_experts, num_gpus, nodes)
    decisions = _DECISIONS.get(key)
    passes = _sglang_interval(window.shape[0])
    if decisions is None or decisions.decider.config.rebalance_interval != passes:
        # A window of another length (SGLang's buffer size changed) starts the count afresh.
        config = settings()
        decisions = _DECISIONS[key] = EngineDecisions(
            num_gpus=num_gpus,
            num_nodes=nodes,
            num_layers=window.shape[1],
            passes_per_rebalance=passes,
            settings=config,
            # Continuous: the adapter's own history; periodic: SGLang's window alone, as before.
            history_rows=config.window_passes if config.continuous else window.shape[0],
            metrics=metrics(),
        )
    plan: EnginePlan = decisions.rebalance(
        window,
        num_physical=num_physical_experts,
        num_gpus=num_gpus,
        num_nodes=nodes,
        num_groups=num_groups,
        planner=_planner(algorithm.name),
        current=current,
        alive=alive,
    )
    _LOG.info(
        "eplb %s (%s): %d passes (%d kept), %s, %d copies (%s)",
        algorithm.name,
        decisions.settings.mode,
        window.shape[0],
        decisions.kept_rows,
        "new placement" if plan.applied else "placement kept",
        plan.copies,
        plan.reason,
    )
    if plan.degraded is not None:
        return tuple(torch.from_numpy(m) for m in sglang_degraded_maps(plan.degraded))  # type: ignore[return-value]
    return (
        torch.from_numpy(plan.phy2log_int64()),
        torch.from_numpy(plan.log2phy_int64()),
        torch.from_numpy(plan.logcnt_int64()),
    )


def alive_mask(active_ranks: Any, num_gpus: int) -> np.ndarray | None:
    """bool [G] from SGLang's ``active_ranks`` (int32, 1 = alive), or None when every rank is alive.

    SGLang sizes the mask by ``--max-ep-size``: entries past the ``num_gpus`` ranks planned for are
    slots reserved for ranks that may join, not ranks of this plan. ValueError for a shorter mask.
    """
    if hasattr(active_ranks, "detach"):
        active_ranks = active_ranks.detach().cpu().numpy()
    arr = np.asarray(active_ranks)
    if arr.ndim != 1 or arr.size < num_gpus:
        raise ValueError(f"active_ranks must flag at least the {num_gpus} EP ranks, got shape {arr.shape}")
    alive_G = arr[:num_gpus] != 0
    return None if alive_G.all() else alive_G


def sglang_active_ranks(num_gpus: int) -> np.ndarray | None:
    """SGLang's live EP ranks (``ElasticEPStateManager``'s ``active_ranks``, the mask SGLang hands
    its ``elasticity_aware``), or None without elastic EP or with every rank alive."""
    try:
        from sglang.srt.elastic_ep.elastic_ep import ElasticEPStateManager

        state = ElasticEPStateManager.instance()
    except ImportError:
        return None
    if state is None or state.active_ranks is None:
        return None
    return alive_mask(state.active_ranks, num_gpus)


def sglang_degraded_maps(degraded: DegradedPlacement) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A degraded plan in SGLang's form: int64 ``(phy2log [L, P], log2phy [L, E, R], logcnt [L, E])``.

    Dead ranks' slots hold expert 0, not eplb's -1, as SGLang's ``elasticity_aware`` fills them:
    SGLang's recorder scatters slot counts by phy2log and ``init_by_mapping`` indexes by it, where -1
    fails or lands on the last expert. Dispatch reads log2phy, which lists live slots only (R = the
    most replicas of any expert), and logcnt counts live replicas, so no token goes to a dead rank.
    """
    phy2log_LP = np.where(degraded.phy2log_LP < 0, 0, degraded.phy2log_LP).astype(np.int64)
    width = int(degraded.logcnt_LE.max())
    log2phy_LER = degraded.log2phy_LER[:, :, :width].astype(np.int64)
    return phy2log_LP, log2phy_LER, degraded.logcnt_LE.astype(np.int64)


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


def sglang_time_order(tokens_per_expert: Any, buffer: Any = None) -> Any:
    """SGLang's window [W, L, E] with its passes oldest first, as eplb's forecast weighs them.

    SGLang 0.5.23's stat recorder keeps the passes in a circular buffer (``_CircularBuffer``): pass
    k goes to row ``k mod W``, and dumping the window zeroes the rows but keeps the write index. Its
    ``EPLBManager`` rebalances after ``--eplb-rebalance-num-iterations`` + 1 recorded passes the
    first time and every interval after, so with the buffer equal to the interval the newest pass
    sits in row 0 at every rebalance, and in general at the row before the write index. The index
    (``buffer``: the recorder's, read when None) is the oldest row: the window is rolled to start
    there. Rows not written since the last dump (fewer passes than rows) are zero and come first.
    Anything else (a load file at start-up, an unbounded buffer, no recorder) is returned as given.
    """
    if buffer is None:
        try:
            from sglang.srt.eplb.expert_distribution import get_global_expert_distribution_recorder

            accumulator = getattr(get_global_expert_distribution_recorder(), "_accumulator", None)
            buffer = getattr(accumulator, "_global_physical_count_of_buffered_step", None)
        except Exception:  # no recorder in this process (start-up, tests): as given
            return tokens_per_expert
    rows = getattr(buffer, "_buffer", None)
    index = getattr(buffer, "_curr_index", None)
    if rows is None or not isinstance(index, int) or getattr(tokens_per_expert, "ndim", 0) != 3:
        return tokens_per_expert  # SGLang's unbounded buffer is in time order already
    if len(rows) != tokens_per_expert.shape[0] or not 0 <= index < len(rows):
        return tokens_per_expert
    import torch

    return torch.roll(tokens_per_expert, shifts=-index, dims=0)


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
    """AROUND ``rebalance_experts``: eplb's solver for an :class:`EplbSolverAlgorithm`, SGLang's code
    otherwise; either way, ``EPLB_SGLANG_LP=auto`` then models its choice on the window planned
    from (:func:`hand_window_to_auto`)."""
    if isinstance(algorithm, EplbSolverAlgorithm):
        result = rebalance_with_eplb(
            sglang_time_order(tokens_per_expert),
            num_physical_experts,
            num_local_physical_experts,
            num_groups,
            num_nodes,
            algorithm,
        )
    else:
        result = original(
            tokens_per_expert=tokens_per_expert,
            num_physical_experts=num_physical_experts,
            num_local_physical_experts=num_local_physical_experts,
            num_groups=num_groups,
            num_nodes=num_nodes,
            algorithm=algorithm,
        )
    hand_window_to_auto(tokens_per_expert)
    return result


def hand_window_to_auto(tokens_per_expert: Any) -> None:
    """``EPLB_SGLANG_LP=auto``: the window a rebalance planned from ([W, L, E] or [L, E] global
    logical counts, the same on every rank: SGLang's recorder sums them over the ranks) becomes the
    load auto's choice is modeled on; SGLang then applies the plan and ``init_lplb_solvers`` models
    the new placement on it (eplb.integrations.sglang_lp.set_window). Nothing without auto."""
    if "auto" not in _REGISTERED:
        return
    from eplb.integrations import sglang_lp

    try:
        sglang_lp.set_window(as_load_array(tokens_per_expert))
    except Exception:  # the choice falls back to the replica counts; serving goes on
        _LOG.exception("eplb: handing the rebalance window to auto dispatch failed")


def eplb_manager_init_hook(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """AROUND ``EPLBManager.__init__``: SGLang's own construction, then rank 0's metrics endpoint
    (with ``EPLB_METRICS_PORT``), so the time since the last rebalance shows from start-up."""
    result = original(*args, **kwargs)
    metrics().start()
    return result


def forward_pass_hook(original: Callable[..., Any], manager: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``EPLBManager.on_forward_pass_end``, which SGLang's model runner calls once per forward
    pass it counts towards a rebalance: one pass for eplb_forward_passes_total (SGLang does not hand
    the manager the batch, so every pass counts as ``decode``; its recorder records each one)."""
    result = original(manager, *args, **kwargs)
    try:
        metrics().forward_pass(kind="decode", recorded=True)
    except Exception:  # metrics must not end serving
        _LOG.exception("eplb: counting a forward pass failed")
    return result


def _transferred(seconds: float, last: bool) -> None:
    metrics().transfer(seconds, last=last)


_MANAGER = "sglang.srt.eplb.eplb_manager.EPLBManager"
_REGISTERED: list[str] = []


class SettingsExit(SystemExit):
    """A bad ``EPLB_*`` value at plugin registration: ends the SGLang process with the message
    (the variable's name first), as SGLang's loader lets a ``SystemExit`` through."""

    def __init__(self, error: ValueError) -> None:
        super().__init__(f"eplb: {error}")
        self.error = error


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: check every ``EPLB_*`` variable, register the hooks
    (SGLang applies them after).

    Idempotent. ``EPLB_SGLANG=0`` registers nothing; ``EPLB_SGLANG_FUSED_REMAP=1`` also replaces
    the fused map+record kernel; ``EPLB_SGLANG_LP=1`` the ``lp`` solver and map, ``auto`` also
    hooks the model runner's forward and graph capture to begin each pass. A bad value of any
    variable stops SGLang at start-up with a message naming it: SGLang's ``load_plugins`` logs a
    plugin's ``Exception`` and goes on, so the ValueError leaves as :class:`SettingsExit` (a
    ``SystemExit``), which it does not catch.
    """
    from eplb.integrations import sglang_updater

    try:
        if not _enabled(PLUGIN_ENV, default=True):
            _LOG.info("eplb: %s=0, the eplb SGLang plugin registers nothing", PLUGIN_ENV)
            return
        # Every variable of eplb.integrations.engine_env.ENV_VARS, used or not; the metrics endpoint probed.
        _STATE["settings"] = config = check_engine_env(SGLANG)
        fused = _enabled(FUSED_ENV, default=False)
        lp = sglang_lp_mode()  # EPLB_SGLANG_LP (off, lp or auto): eplb.integrations.sglang_lp
        kernels = dispatch_cost_from_env()  # EPLB_DISPATCH_COST: auto's kernel table
        if os.environ.get(BACKEND_ENV, "").strip() and not fused:
            _LOG.warning("eplb: %s has no effect without %s=1", BACKEND_ENV, FUSED_ENV)
        if os.environ.get(DISPATCH_COST_ENV, "").strip() and lp != "auto":
            _LOG.warning("eplb: %s has no effect without EPLB_SGLANG_LP=auto", DISPATCH_COST_ENV)
        make_planner("auto", "--eplb-algorithm", settings=config)  # EPLB_SOLVER_OPTIONS checked now
        updater_config = sglang_updater.UpdaterConfig.from_env()  # checked with the updater off too
    except ValueError as exc:
        raise SettingsExit(exc) from exc
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    # -- EPLB_SGLANG_WEIGHT_UPDATER=1: eplb's hot-swap moves the expert weights (sglang_updater) --
    if sglang_updater.requested() and "weight_updater" not in _REGISTERED:
        sglang_updater.install(updater_config, sink=lambda: metrics().start())
        _REGISTERED.append("weight_updater")
    # -- end of EPLB_SGLANG_WEIGHT_UPDATER --

    if "algorithms" not in _REGISTERED:
        HookRegistry.register(f"{_TARGET}.compute_algorithm", compute_algorithm_hook, HookType.AROUND)
        HookRegistry.register(f"{_TARGET}.rebalance_experts", rebalance_experts_hook, HookType.AROUND)
        _REGISTERED.append("algorithms")
        _LOG.info(
            "eplb: --eplb-algorithm %s (or eplb:NAME for any of %s) plans with eplb's solver (%s mode)",
            ", ".join(n for n in policy_names() if n not in SGLANG_ALGORITHMS),
            policy_names(),
            config.mode,
        )
    if config.metrics_port is not None and "metrics" not in _REGISTERED:
        HookRegistry.register(f"{_MANAGER}.__init__", eplb_manager_init_hook, HookType.AROUND)
        HookRegistry.register(f"{_MANAGER}.on_forward_pass_end", forward_pass_hook, HookType.AROUND)
        # Each weight transfer (SGLang's updater or eplb's), timed: eplb_rebalance_transfer_seconds.
        sglang_updater.hook_update(HookRegistry, _transferred)
        metrics().transfers_follow = True
        _REGISTERED.append("metrics")
    if fused and "fused" not in _REGISTERED:
        from eplb.integrations.sglang_remap import register_fused

        try:
            register_fused(HookRegistry, HookType)
        except ValueError as exc:
            raise SettingsExit(exc) from exc
        _REGISTERED.append("fused")
    if lp != "off" and "lp" not in _REGISTERED:
        from eplb.integrations.sglang_lp import register_lp

        register_lp(HookRegistry, HookType)
        _REGISTERED.append("lp")
    if lp == "auto" and "auto" not in _REGISTERED:
        from eplb.integrations.sglang_lp import register_auto

        register_auto(HookRegistry, HookType, kernels)  # every pass begun before its first layer
        _REGISTERED.append("auto")
    # Further opt-in hooks register here, each behind its own variable and _REGISTERED name.


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
