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
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from eplb.integrations.engine_plan import EngineDecisions, EnginePlan, engine_placement, make_planner
from eplb.policy import check_policy_name
from eplb.solver.planner import SolverPlanner
from eplb.traces.window_log import WindowLogs

if TYPE_CHECKING:
    import torch

POLICY_ENV = "EPLB_VLLM_POLICY"
"""Environment variable that turns the plugin on: ``1`` or an eplb algorithm name; unset/``0``: off."""
HISTORY_ENV = "EPLB_VLLM_HISTORY"
"""Environment variable: how many past rebalance windows the forecast uses (default 1)."""
DEFAULT_HISTORY = 1
"""One window per rebalance, as vLLM's own policy plans: drifting load makes older windows stale
(on the tests' drifting input, 4 windows balanced the next one 0.01-0.03 worse than the latest
alone); more windows only smooth windows too short to say much."""
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
DUMP_ENV = "EPLB_VLLM_DUMP_DIR"
"""Environment variable: a folder; rank 0 keeps every rebalance window there as an eplb trace."""
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


def history_from_env(environ: Mapping[str, str] | None = None) -> int:
    """``EPLB_VLLM_HISTORY`` as a window count >= 1 (ValueError otherwise)."""
    env = os.environ if environ is None else environ
    raw = env.get(HISTORY_ENV, "").strip()
    if not raw:
        return DEFAULT_HISTORY
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{HISTORY_ENV} must be an integer >= 1, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"{HISTORY_ENV} must be >= 1, got {value}")
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
    _history: ClassVar[dict[tuple[int, ...], list[np.ndarray]]] = {}
    _decisions: ClassVar[dict[tuple[int, ...], EngineDecisions]] = {}
    """Per model shape: the rebalance decisions (eplb.policy.decision), one window per call."""
    _lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def configure(cls, *, algorithm: str = "auto", history_windows: int = DEFAULT_HISTORY) -> None:
        """Set the algorithm and history length; options come from ``EPLB_SOLVER_OPTIONS``."""
        if history_windows < 1:
            raise ValueError(f"history_windows must be >= 1, got {history_windows}")
        cls.planner = make_planner(algorithm, POLICY_ENV, SOLVER_DEFAULTS)
        cls.algorithm = algorithm
        cls.history_windows = history_windows

    @classmethod
    def reset(cls) -> None:
        """Forget every kept window (a fresh process's state)."""
        with cls._lock:
            cls._history.clear()
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
        with cls._lock:
            kept = cls._history.setdefault(key, [])
            if load_LE.any():  # an empty window (a profile run) says nothing about the future
                kept.append(load_LE)
                del kept[: -cls.history_windows]
                _WINDOWS.record(load_LE)  # with EPLB_VLLM_DUMP_DIR set (eplb.traces.window_log)
            window_WLE = np.stack(kept) if kept else load_LE[None]
            decisions = cls._decisions.setdefault(
                key, EngineDecisions(num_gpus=num_ranks, num_nodes=num_nodes, passes_per_rebalance=1)
            )
        planner = cls.planner or make_planner(cls.algorithm, POLICY_ENV, SOLVER_DEFAULTS)
        nodes = num_nodes if num_nodes >= 1 and num_ranks % num_nodes == 0 else 1
        current = None
        if old_global_expert_indices is not None:
            current = engine_placement(old_global_expert_indices, window_WLE.sum(axis=0), num_ranks, nodes)
        plan = decisions.rebalance(
            window_WLE,
            num_physical=num_replicas,
            num_gpus=num_ranks,
            num_nodes=nodes,
            num_groups=num_groups,
            planner=planner,
            current=current,
        )
        cls.last_plan = plan
        _LOG.info(
            "eplb %s: %s windows, %s (%s)",
            cls.algorithm,
            window_WLE.shape[0],
            "new placement" if plan.applied else "placement kept",
            plan.reason,
        )
        return torch.from_numpy(plan.phy2log_int64())


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
    ``EPLB_VLLM_POLICY``, ``EPLB_VLLM_HISTORY`` or ``EPLB_SOLVER_OPTIONS`` raises ValueError, which
    stops vLLM at start-up.
    """
    algorithm = requested_algorithm()
    if algorithm is None:
        _LOG.debug("eplb: %s is not set; vLLM's EPLB policy is unchanged", POLICY_ENV)
        return
    from vllm.distributed.eplb.policy import EPLB_POLICIES

    policy = policy_class()
    policy.configure(algorithm=algorithm, history_windows=history_from_env())
    current = EPLB_POLICIES[VLLM_POLICY_NAME]
    if current is not policy:
        policy.vllm_default = current
        EPLB_POLICIES[VLLM_POLICY_NAME] = policy
    _LOG.info(
        "eplb: vLLM's EPLB policy %r is eplb's %r (%s=%s); unset %s to use vLLM's own",
        VLLM_POLICY_NAME,
        algorithm,
        POLICY_ENV,
        os.environ.get(POLICY_ENV, ""),
        POLICY_ENV,
    )


def launch_flags(num_redundant: int) -> str:
    """The environment and flags that run vLLM with eplb's policy and ``num_redundant`` extra slots."""
    config = f'{{"num_redundant_experts": {num_redundant}}}'
    return f"{POLICY_ENV}=1 vllm serve MODEL --enable-expert-parallel --enable-eplb --eplb-config '{config}'"
