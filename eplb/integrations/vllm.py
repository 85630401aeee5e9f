"""vLLM plugin: eplb's solver as vLLM's EPLB policy, only when ``EPLB_VLLM_POLICY`` asks for it.

Shape legend: W window (the windows kept, one row each), L layers, E logical experts, P physical
slots.

vLLM 0.33 runs every ``vllm.general_plugins`` entry point in every process. Ours, :func:`register`,
does nothing unless ``EPLB_VLLM_POLICY`` is set (``1``: eplb's default algorithm; or a name from
``eplb.policy.policy_names()``). Then it installs :class:`EplbVllmPolicy` as
``EPLB_POLICIES["default"]``: ``EPLBConfig.policy`` accepts no other name, and vLLM's async EPLB
(its default) runs only that one, so ``--enable-eplb`` then plans with eplb, sync or async.

vLLM hands a policy one window already summed to [L, E] per rebalance; the policy keeps the last
``EPLB_VLLM_HISTORY`` windows per model shape (1 by default) and plans from them as a window of
windows [W, L, E] (recent windows weigh more), migration-aware from the live map (``old_global_expert_indices``,
-1 for an empty slot). vLLM runs the policy on every rank and each rank applies its own answer, so
the answer depends only on what vLLM passes and on the history, which every rank builds from the
same all-reduced windows; a change of EP size starts a new history on every rank alike.

``EPLB_REBALANCE_MODE=continuous`` (eplb.integrations.engine_env; pair it with
``--eplb-config '{"step_interval": 50, "window_size": 50}'``) makes each rebalance a budgeted
continuous-mode step through the same :class:`~eplb.policy.decision.Decider` as eplb's manager,
planned from the last ``EPLB_VLLM_HISTORY`` windows (default there: 4). ``EPLB_METRICS_PORT`` makes
rank 0 export eplb's metrics from the windows vLLM hands over (eplb.integrations.engine_metrics),
with vLLM's steps counted and its weight transfers timed (:func:`hook_vllm`). Every ``EPLB_*``
variable is checked at :func:`register` (eplb.integrations.engine_env.check_engine_env). The
per-rebalance log line speaks vLLM's units: windows of ``window_size`` passes, and intervals of
``step_interval`` steps for the horizon (:func:`reason_in_intervals`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.abc
import importlib.util
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from eplb.config import even_nodes
from eplb.integrations.engine_env import METRICS_PORT_ENV as METRICS_ENV
from eplb.integrations.engine_env import (
    MODE_ENV,
    SHARED_ENV,
    VLLM,
    VLLM_DUMP_ENV,
    VLLM_HISTORY_ENV,
    VLLM_POLICY_ENV,
    EngineEnv,
    check_engine_env,
    engine_vars,
    env_int,
    read_engine_env,
)
from eplb.integrations.engine_metrics import EngineMetrics
from eplb.integrations.engine_plan import EngineDecisions, EnginePlan, engine_placement, make_planner
from eplb.placement.model import Placement
from eplb.policy import check_policy_name
from eplb.solver.planner import SolverPlanner
from eplb.traces.window_log import WindowLogs

if TYPE_CHECKING:
    import torch

POLICY_ENV = VLLM_POLICY_ENV
"""Turns the plugin on: ``1`` or an eplb algorithm name; unset/``0``: off (eplb.integrations.engine_env)."""
HISTORY_ENV = VLLM_HISTORY_ENV
"""How many past rebalance windows the forecast uses (default 1)."""
DEFAULT_HISTORY = 1
"""One window per rebalance, as vLLM's own policy plans: drifting load makes older windows stale
(on the tests' drifting input, 4 windows balanced the next one 0.01-0.03 worse than the latest
alone); more windows only smooth windows too short to say much."""
CONTINUOUS_HISTORY = 4
"""Continuous mode's default: 4 windows of ``step_interval`` 50 passes, the 200 passes eplb's own
continuous mode plans from (eplb.config.CONTINUOUS_BUFFER_SIZE)."""
VLLM_POLICY_NAME = "default"
"""The key of ``vllm.distributed.eplb.policy.EPLB_POLICIES`` that vLLM's config can select."""
SOLVER_DEFAULTS: dict[str, Any] = {"decay_half_life": 0.5}
"""Solver options for vLLM: one window of the history is one rebalance interval (thousands of
steps), so with a longer history an older window weighs a quarter of the next newer one."""

_OFF = ("", "0", "false", "off", "no")
_ON = ("1", "true", "on", "yes", "eplb")

# vLLM's logger tree is configured by vLLM with a handler at INFO, eplb's is not: under "vllm."
# these lines land in vLLM's log beside its own EPLB lines.
_LOG = logging.getLogger("vllm.eplb_plugin")
DUMP_ENV = VLLM_DUMP_ENV
"""A folder; rank 0 keeps every rebalance window there as an eplb trace."""
VLLM_ENV = tuple(var for var in engine_vars(VLLM) if var not in SHARED_ENV)
"""The ``EPLB_*`` variables of this plugin (beside eplb.integrations.engine_env.SHARED_ENV)."""
_WINDOWS = WindowLogs("vllm", DUMP_ENV, _LOG)


def requested_algorithm(environ: Mapping[str, str] | None = None) -> str | None:
    """The eplb algorithm ``EPLB_VLLM_POLICY`` asks for, or None when the plugin stays off."""
    env = os.environ if environ is None else environ
    raw = env.get(POLICY_ENV, "").strip()
    if raw.lower() in _OFF:
        return None
    if raw.lower() in _ON:
        return "auto"
    check_policy_name(raw, POLICY_ENV)
    return raw


def history_from_env(environ: Mapping[str, str] | None = None, *, continuous: bool = False) -> int:
    """``EPLB_VLLM_HISTORY`` as a window count >= 1 (ValueError otherwise); unset: the mode's default."""
    env = os.environ if environ is None else environ
    value = env_int(env, HISTORY_ENV, low=1)
    if value is None:
        return CONTINUOUS_HISTORY if continuous else DEFAULT_HISTORY
    return value


class EplbVllmPolicy:
    """vLLM's policy interface (the ``rebalance_experts`` classmethod) over eplb's solver.

    The state is on the class because vLLM calls the class, never an instance. :func:`register`
    makes the subclass vLLM sees (also a subclass of vLLM's ``AbstractEplbPolicy``).
    """

    algorithm: ClassVar[str] = "auto"
    """The eplb algorithm it plans with."""
    history_windows: ClassVar[int] = DEFAULT_HISTORY
    """Windows kept per model shape for the forecast."""
    planner: ClassVar[SolverPlanner | None] = None
    """Built by :meth:`configure`; None until then (a default planner is made on first use)."""
    vllm_default: ClassVar[type | None] = None
    """vLLM's own policy that this one replaced (for comparison and for turning eplb off in code)."""
    last_plan: ClassVar[EnginePlan | None] = None
    """The most recent plan, for logs and checks."""
    settings: ClassVar[EngineEnv | None] = None
    """The checked environment (eplb.integrations.engine_env), set by :meth:`configure`."""
    metrics: ClassVar[EngineMetrics | None] = None
    """Rank 0's metrics with ``EPLB_METRICS_PORT`` (started at the first rebalance)."""
    _decisions: ClassVar[dict[tuple[int, ...], EngineDecisions]] = {}
    """Per model shape: the rebalance decisions (eplb.policy.decision) and the kept windows, one
    window per call."""
    _lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def configure(
        cls,
        *,
        algorithm: str = "auto",
        history_windows: int = DEFAULT_HISTORY,
        settings: EngineEnv | None = None,
    ) -> None:
        """Set the algorithm, history length and settings (default: read from the environment now);
        options come from ``EPLB_SOLVER_OPTIONS``."""
        if history_windows < 1:
            raise ValueError(f"history_windows must be >= 1, got {history_windows}")
        config = settings or read_engine_env(known=VLLM_ENV)
        cls.planner = make_planner(algorithm, POLICY_ENV, SOLVER_DEFAULTS, settings=config)
        cls.algorithm = algorithm
        cls.history_windows = history_windows
        if cls.metrics is not None:
            cls.metrics.close()
        # Rebalances wait for their transfer only where vLLM's transfers are hooked (_patch_vllm).
        metrics = EngineMetrics(config, _LOG, transfers_follow=_HOOKS.get("patched", False))
        cls.settings, cls.metrics = config, metrics
        cls.reset()

    @classmethod
    def reset(cls) -> None:
        """Forget every kept window and decision (a fresh process's state)."""
        with cls._lock:
            cls._decisions.clear()
            cls.last_plan = None

    @classmethod
    def rebalance_experts(
        cls,
        weight: torch.Tensor,
        num_replicas: int,
        num_groups: int,
        num_nodes: int,
        num_ranks: int,
        old_global_expert_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """vLLM's entry point: load [L, E] of the last window -> phy2log int64 [L, P] on the CPU."""
        import torch

        load_LE = np.asarray(weight.detach().cpu().numpy(), dtype=np.float64)
        if load_LE.ndim != 2:
            raise ValueError(f"vLLM's load window must be [L, E], got shape {tuple(load_LE.shape)}")
        L, E = load_LE.shape
        key = (L, E, num_replicas, num_ranks, num_nodes)
        if cls.planner is None or cls.settings is None:
            cls.configure(algorithm=cls.algorithm, history_windows=cls.history_windows)
        planner, config = cls.planner, cls.settings
        assert planner is not None and config is not None
        with cls._lock:
            if load_LE.any():  # an empty window (a profile run) says nothing about the future
                _WINDOWS.record(load_LE)  # with EPLB_VLLM_DUMP_DIR set (eplb.traces.window_log)
            decisions = cls._decisions.get(key)
            if decisions is None:
                decisions = cls._decisions[key] = EngineDecisions(
                    num_gpus=num_ranks,
                    num_nodes=num_nodes,
                    num_layers=L,
                    passes_per_rebalance=1,
                    settings=config,
                    history_rows=cls.history_windows,
                    metrics=cls.metrics,
                )
        nodes = even_nodes(num_ranks, num_nodes)
        current, alive = None, None
        if old_global_expert_indices is not None:
            # The live map's empty slots are filled from the newest window's load.
            current, alive = elastic_current(
                old_global_expert_indices, load_LE, num_replicas, num_ranks, nodes
            )
        if alive is not None:
            # Scale-down: the leaving ranks still serve their experts to the survivors (vLLM moves
            # the weights before it shuts them down), so nothing comes from the checkpoint.
            planner = dataclasses.replace(
                planner, options=dataclasses.replace(planner.options, reload_source="peer")
            )
        plan = decisions.rebalance(
            load_LE,
            num_physical=num_replicas,
            num_gpus=num_ranks,
            num_nodes=nodes,
            num_groups=num_groups,
            planner=planner,
            current=current,
            alive=alive,
        )
        cls.last_plan = plan
        window, interval = _CADENCE.get("window_size"), _CADENCE.get("step_interval")
        _LOG.info(
            "eplb %s (%s): %s, %s, %d copies (%s)",
            cls.algorithm,
            config.mode,
            history_words(decisions.kept_rows, window),
            "new placement" if plan.applied else "placement kept",
            plan.copies,
            reason_in_intervals(plan.reason, interval),
        )
        return torch.from_numpy(plan.phy2log_int64())


_CADENCE: dict[str, int] = {}
"""vLLM's ``window_size`` and ``step_interval`` (``--eplb-config``), read when vLLM builds its
``EplbState`` (:func:`hook_vllm`); empty until then."""


def history_words(windows: int, window_size: int | None) -> str:
    """The history a plan is made from, in vLLM's units: windows of ``window_size`` passes each."""
    if window_size is None:
        return f"{windows} windows of vLLM's window_size passes kept"
    return f"{windows} windows of {window_size} passes kept ({windows * window_size} passes)"


def reason_in_intervals(reason: str, step_interval: int | None) -> str:
    """The Decider's reason in vLLM's units. The policy sees one summed window per rebalance, so
    its Decider counts a rebalance interval (``step_interval`` steps) as one "pass": its
    ``predicted next 1 passes`` is the next interval, which serves ``step_interval`` steps."""

    def interval(match: re.Match[str]) -> str:
        n = int(match[2])
        words = f"{n} rebalance interval{'' if n == 1 else 's'}"
        if step_interval is not None:
            words += f" ({n * step_interval} steps)"
        return f"{match[1]} {words}"

    return re.sub(r"(predicted next|over) (\d+) passes", interval, reason)


def elastic_current(
    old_phy2log: Any, load_LE: np.ndarray, num_replicas: int, num_ranks: int, num_nodes: int
) -> tuple[Placement | None, np.ndarray | None]:
    """The live placement vLLM's map ``old_phy2log`` [L, P_old] stands for, and which of its ranks live.

    vLLM 0.33's elastic EP hands the policy the new sizes with the old map. Scale-down
    (``rank_mapping`` {r: r if r < new size else -1}, elastic_execute's only form): the old map is
    wider than ``num_replicas``; its ranks from ``num_ranks`` on are leaving, so the plan is the
    degraded plan over the first ``num_ranks`` (bool [G_old] returned), numbered as vLLM numbers
    them. Scale-up: the new ranks' slots hold -1 (``reconfigure_physical_expert_slots``), or the map
    is the old ranks' only and is padded so, as vLLM's ``_map_old_expert_indices_with_rank_mapping``
    does; the -1 slots are filled as any empty slot (:func:`engine_placement`). (None, None) when
    the map fits neither: a fresh plan.
    """
    if hasattr(old_phy2log, "detach"):
        old_phy2log = old_phy2log.detach().cpu().numpy()
    old_LP = np.asarray(old_phy2log, dtype=np.int64)
    if old_LP.ndim != 2 or num_ranks < 1 or num_replicas % num_ranks:
        return None, None
    S = num_replicas // num_ranks
    width = old_LP.shape[1]
    if width < num_replicas and width % S == 0:  # scale-up: the joining ranks' slots are empty
        old_LP = np.pad(old_LP, ((0, 0), (0, num_replicas - width)), constant_values=-1)
    if old_LP.shape[1] <= num_replicas:
        return engine_placement(old_LP, load_LE, num_ranks, num_nodes), None
    if width % S:
        return None, None
    old_ranks = width // S
    old_nodes = even_nodes(old_ranks, gpus_per_node=num_ranks // num_nodes)
    current = engine_placement(old_LP, load_LE, old_ranks, old_nodes)
    return (None, None) if current is None else (current, np.arange(old_ranks) < num_ranks)


_POLICY_CLASS: type[EplbVllmPolicy] | None = None


def policy_class() -> type[EplbVllmPolicy]:
    """The class installed into vLLM: :class:`EplbVllmPolicy` and vLLM's ``AbstractEplbPolicy`` (imports vLLM)."""
    global _POLICY_CLASS
    if _POLICY_CLASS is None:
        from vllm.distributed.eplb.policy.abstract import AbstractEplbPolicy

        _POLICY_CLASS = type(
            "EplbPolicy",
            (EplbVllmPolicy, AbstractEplbPolicy),
            {"__module__": __name__, "__doc__": EplbVllmPolicy.__doc__},
        )
    return _POLICY_CLASS


def register() -> None:
    """The ``vllm.general_plugins`` entry point: install eplb's policy if ``EPLB_VLLM_POLICY`` asks.

    Runs in every vLLM process, maybe more than once: the second call changes nothing. A bad
    value of any ``EPLB_*`` variable (``EPLB_VLLM_POLICY``, ``EPLB_VLLM_HISTORY``, those of
    eplb.integrations.engine_env) raises ValueError naming it, which stops vLLM at start-up; so
    does asking for continuous mode or metrics with the policy off.
    """
    config = check_engine_env(VLLM)  # every variable of the table, the metrics endpoint probed
    algorithm = requested_algorithm()
    history = history_from_env(continuous=config.continuous)
    if algorithm is None:
        asked = [
            var
            for var, on in ((MODE_ENV, config.continuous), (METRICS_ENV, config.metrics_port is not None))
            if on
        ]
        if asked:
            raise ValueError(
                f"{', '.join(asked)} set, but eplb's vLLM policy is off: set {POLICY_ENV}=1 (or unset {asked[0]})"
            )
        _LOG.debug("eplb: %s is not set; vLLM's EPLB policy is unchanged", POLICY_ENV)
        return
    from vllm.distributed.eplb.policy import EPLB_POLICIES

    policy = policy_class()
    if policy.settings != config or policy.algorithm != algorithm or policy.history_windows != history:
        policy.configure(algorithm=algorithm, history_windows=history, settings=config)
    hook_vllm(metrics=config.metrics_port is not None)
    current = EPLB_POLICIES[VLLM_POLICY_NAME]
    if current is not policy:
        policy.vllm_default = current
        EPLB_POLICIES[VLLM_POLICY_NAME] = policy
    _LOG.info(
        "eplb: vLLM's EPLB policy %r is eplb's %r (%s=%s, %s mode, %d windows); unset %s to use vLLM's own",
        VLLM_POLICY_NAME,
        algorithm,
        POLICY_ENV,
        os.environ.get(POLICY_ENV, ""),
        config.mode,
        history,
        POLICY_ENV,
    )


def _metrics() -> EngineMetrics | None:
    return None if _POLICY_CLASS is None else _POLICY_CLASS.metrics


def _count_pass(original: Any) -> Any:
    """``EplbState.step`` that also counts the pass (eplb_forward_passes_total). vLLM's step says
    only whether a pass is a dummy (or the profile run, not counted), not whether it prefilled, so
    every pass counts as ``decode``; ``recorded``: whether vLLM adds this pass to its load window."""

    @functools.wraps(original)
    def step(self: Any, is_dummy: bool = False, is_profile: bool = False, log_stats: bool = False) -> Any:
        recorded = False
        if not (is_dummy or is_profile):
            try:  # read before the step, which advances the count it depends on
                recorded = bool(self._should_record_current_step(log_stats=log_stats))
            except Exception:  # another vLLM: say it recorded what was not a dummy
                recorded = True
        result = original(self, is_dummy=is_dummy, is_profile=is_profile, log_stats=log_stats)
        metrics = _metrics()
        if metrics is not None and not is_profile:
            try:
                metrics.forward_pass(kind="decode", recorded=recorded)
            except Exception:  # metrics must not end serving
                _LOG.exception("eplb: counting a forward pass failed")
        return result

    return step


def _time_transfer(original: Any, last_of: Any) -> Any:
    """vLLM's weight transfer (``rearrange_expert_weights_inplace``, or the async worker's
    ``transfer_layer``), timed for eplb_rebalance_transfer_seconds; ``last_of(args, kwargs)`` says
    whether the call moved the plan's last layer (True, False, or the layer index)."""

    @functools.wraps(original)
    def transfer(*args: Any, **kwargs: Any) -> Any:
        metrics = _metrics()
        if metrics is None or not metrics.exporting or kwargs.get("is_profile"):
            return original(*args, **kwargs)
        _synchronize(kwargs.get("stream"))
        start = time.perf_counter()
        result = original(*args, **kwargs)
        _synchronize(kwargs.get("stream"))  # what vLLM's rank 0 waits for right after, too
        seconds, last = time.perf_counter() - start, last_of(args, kwargs)
        try:
            if isinstance(last, bool):
                metrics.transfer(seconds, last=last)
            else:
                metrics.transfer(seconds, layer=int(last))
        except Exception:  # metrics must not end serving
            _LOG.exception("eplb: timing a weight transfer failed")
        return result

    return transfer


def _synchronize(stream: Any) -> None:
    """Wait for the device work queued so far (a no-op on the CPU)."""
    import torch

    if stream is not None and hasattr(stream, "synchronize"):
        stream.synchronize()
    elif torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _record_cadence(original: Any) -> Any:
    @functools.wraps(original)
    def init(self: Any, parallel_config: Any, *args: Any, **kwargs: Any) -> None:
        original(self, parallel_config, *args, **kwargs)
        config = getattr(parallel_config, "eplb_config", None)
        for name in ("window_size", "step_interval"):
            value = getattr(config, name, None)
            if isinstance(value, int):
                _CADENCE[name] = value

    return init


_STATE_MODULE = "vllm.distributed.eplb.eplb_state"


def hook_vllm(*, metrics: bool) -> None:
    """Wrap vLLM's ``EplbState`` (its cadence, for the logs; with ``metrics``, each step counted) and
    its weight transfers (timed), once per process, when vLLM imports ``eplb_state`` (its model
    runner does, with ``--enable-eplb``; importing it at plugin registration would pull vLLM's model
    stack into every process). vLLM calls these through the names wrapped here (the class
    attribute, ``eplb_state``'s and ``async_worker``'s module globals); each wrapper's
    ``__wrapped__`` is vLLM's function, and each does what vLLM's does."""
    _HOOKS["metrics"] = _HOOKS.get("metrics", False) or metrics
    module = sys.modules.get(_STATE_MODULE)
    if module is not None:
        _patch_vllm(module)
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


_HOOKS: dict[str, bool] = {}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches ``eplb_state`` right after vLLM's import of it has run its body."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _STATE_MODULE:
            return None
        sys.meta_path.remove(self)  # the real finders find it; this finder is done
        spec = importlib.util.find_spec(fullname)
        loader = None if spec is None else spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            _patch_vllm(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def _patch_vllm(eplb_state: Any) -> None:
    state = eplb_state.EplbState
    if not getattr(state.__init__, "__eplb__", False):
        state.__init__ = _record_cadence(state.__init__)
        state.__init__.__eplb__ = True
    if not _HOOKS.get("metrics") or getattr(state.step, "__eplb__", False):
        return
    from vllm.distributed.eplb import async_worker  # imported by eplb_state already

    state.step = _count_pass(state.step)
    state.step.__eplb__ = True
    _HOOKS["patched"] = True
    metrics = _metrics()
    if metrics is not None:
        metrics.transfers_follow = True
    eplb_state.rearrange_expert_weights_inplace = _time_transfer(  # the sync rearrangement: every layer
        eplb_state.rearrange_expert_weights_inplace, lambda args, kwargs: True
    )
    async_worker.transfer_layer = _time_transfer(  # the async worker: one layer per call
        async_worker.transfer_layer, lambda args, kwargs: kwargs.get("layer_idx", 0)
    )


def launch_flags(num_redundant: int) -> str:
    """The environment and flags that run vLLM with eplb's policy and ``num_redundant`` extra slots."""
    config = f'{{"num_redundant_experts": {num_redundant}}}'
    return f"{POLICY_ENV}=1 vllm serve MODEL --enable-expert-parallel --enable-eplb --eplb-config '{config}'"
