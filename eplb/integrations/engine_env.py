"""Every ``EPLB_*`` environment variable the engine adapters read, parsed and checked in one place.

vLLM and SGLang give a plugin no flags of its own, so the adapters are configured through the
environment. :func:`read_engine_env` reads the variables both adapters share (the rebalance mode
and its move budget, the solver options, the metrics endpoint) and raises ValueError naming the
variable for any bad value; the plugins call it when the engine registers them, so a typo stops
the engine at start-up, not at its first rebalance. The mode's meaning and defaults are
``eplb.config``'s (``--eplb-rebalance-mode``, ``--eplb-max-moved-experts``,
``--eplb-shift-burst``, ``--eplb-initial-full-plan``): :meth:`EngineEnv.decision_config` builds the
:class:`~eplb.config.EplbConfig` the adapters' :class:`~eplb.policy.decision.Decider` holds.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from eplb.config import (
    CONTINUOUS_BUFFER_SIZE,
    MAX_WINDOW_PASSES,
    REBALANCE_MODES,
    SERVER_FLAG,
    SERVER_FLAGS,
    ConfigError,
    EplbConfig,
    even_nodes,
    flag_env,
)
from eplb.metrics import names

MODE_ENV = flag_env("--eplb-rebalance-mode")
"""``periodic`` (default: plan at the engine's cadence) or ``continuous``."""
MAX_MOVED_ENV = flag_env("--eplb-max-moved-experts")
"""Cross-GPU expert copies per rebalance, on average (continuous default: eplb.config's 160)."""
SHIFT_BURST_ENV = flag_env("--eplb-shift-burst")
"""Continuous mode: a plan on a domain shift may spend up to this many budgets (default 8)."""
INITIAL_FULL_PLAN_ENV = flag_env("--eplb-initial-full-plan")
"""Continuous mode: ``0`` budgets the first plan too (default ``1``: it moves without the budget)."""
WINDOW_PASSES_ENV = "EPLB_WINDOW_PASSES"
"""Continuous mode under SGLang: passes of load the adapter plans from, its own history of the
windows SGLang hands it (SGLang's own buffer must not exceed its interval); default 200."""
SOLVER_OPTIONS_ENV = "EPLB_SOLVER_OPTIONS"
"""A JSON object of ``SolveOptions`` fields for the engine adapters."""
METRICS_PORT_ENV = "EPLB_METRICS_PORT"
"""Rank 0 serves eplb's metrics on this port (0: a free one, logged); unset: no metrics."""
METRICS_HOST_ENV = "EPLB_METRICS_HOST"
"""The address the metrics endpoint binds (default 127.0.0.1)."""
MODEL_NAME_ENV = "EPLB_MODEL_NAME"
"""The ``model_name`` label of eplb's series (use the engine's served model name)."""
METRICS_ENGINE_ENV = "EPLB_METRICS_ENGINE"
"""The ``engine`` label of eplb's series (default ``0``, vLLM's first engine)."""

SGLANG_LP_ENV = "EPLB_SGLANG_LP"
"""SGLang only: ``1`` serves ``--ep-dispatch-algorithm lp`` with eplb's ``lp`` kernels
(eplb.integrations.sglang_lp); ``0`` or unset: SGLang's own LP solver (default)."""

SHARED_ENV = (
    MODE_ENV,
    MAX_MOVED_ENV,
    SHIFT_BURST_ENV,
    INITIAL_FULL_PLAN_ENV,
    WINDOW_PASSES_ENV,
    SOLVER_OPTIONS_ENV,
    METRICS_PORT_ENV,
    METRICS_HOST_ENV,
    MODEL_NAME_ENV,
    METRICS_ENGINE_ENV,
)
"""The variables both adapters read."""
OTHER_EPLB_ENV = ("EPLB_ENGINES_DIR", "EPLB_DASHBOARDS_DIR")
"""``EPLB_*`` variables of eplb's tests and tools, not of the adapters (never warned about)."""

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")
_FLAG_TO_ENV = {flag.name: flag.env for flag in SERVER_FLAGS if flag.env is not None}
"""The variable of each flag the adapters mirror (eplb.config.SERVER_FLAGS), to name in errors."""

_LOG = logging.getLogger(__name__)


def env_flag(environ: Mapping[str, str], var: str, default: bool) -> bool:
    """A boolean variable: 1/true/on/yes or 0/false/off/no (any case); unset or empty: ``default``."""
    raw = environ.get(var, "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{var} must be one of {_TRUE + _FALSE}, got {environ[var]!r}")


def sglang_lp_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``EPLB_SGLANG_LP`` asks for eplb's ``lp`` dispatch under SGLang (ValueError naming
    the variable for a value that is not a boolean)."""
    return env_flag(os.environ if environ is None else environ, SGLANG_LP_ENV, False)


def env_int(environ: Mapping[str, str], var: str, *, low: int, high: int | None = None) -> int | None:
    """An integer variable within [low, high]; unset or empty: None."""
    raw = environ.get(var, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{var} must be an integer, got {raw!r}") from None
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{var} must be {bound}, got {value}")
    return value


def solver_options_from_env(
    defaults: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """``defaults`` overridden by the JSON object in ``EPLB_SOLVER_OPTIONS`` (ValueError if malformed)."""
    env = os.environ if environ is None else environ
    merged = dict(defaults or {})
    raw = env.get(SOLVER_OPTIONS_ENV, "").strip()
    if not raw:
        return merged
    try:
        user = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{SOLVER_OPTIONS_ENV} is not JSON: {exc}") from None
    if not isinstance(user, dict):
        raise ValueError(f"{SOLVER_OPTIONS_ENV} must be a JSON object of solver options, got {raw!r}")
    return {**merged, **user}


@dataclass(frozen=True, kw_only=True)
class EngineEnv:
    """The shared adapter settings, as the environment gave them (checked)."""

    mode: str = SERVER_FLAG["--eplb-rebalance-mode"].default
    """``periodic`` or ``continuous`` (eplb.config.REBALANCE_MODES)."""
    max_moved_experts: int | None = None
    """``EPLB_MAX_MOVED_EXPERTS``; None: the mode's default (eplb.config)."""
    shift_burst: int | None = None
    """``EPLB_SHIFT_BURST``; None: eplb.config's default."""
    initial_full_plan: bool = SERVER_FLAG["--eplb-initial-full-plan"].default
    """``EPLB_INITIAL_FULL_PLAN``."""
    window_passes: int = CONTINUOUS_BUFFER_SIZE
    """``EPLB_WINDOW_PASSES``: continuous mode's history under SGLang, in passes."""
    solver_options: dict[str, Any] = field(default_factory=dict)
    """``EPLB_SOLVER_OPTIONS``, parsed (each field checked against ``SolveOptions``)."""
    metrics_port: int | None = None
    """``EPLB_METRICS_PORT``; None: no metrics."""
    metrics_host: str = "127.0.0.1"
    """``EPLB_METRICS_HOST``."""
    model_name: str = names.DEFAULT_MODEL_NAME
    """``EPLB_MODEL_NAME``: the ``model_name`` label."""
    metrics_engine: str = names.DEFAULT_ENGINE
    """``EPLB_METRICS_ENGINE``: the ``engine`` label."""

    @property
    def continuous(self) -> bool:
        return self.mode == "continuous"

    def decision_config(self, *, num_gpus: int, num_nodes: int, interval: int) -> EplbConfig:
        """The flags a :class:`~eplb.policy.decision.Decider` of ``num_gpus`` EP ranks on
        ``num_nodes`` nodes decides by, rebalancing every ``interval`` counted passes (nodes that do
        not divide the GPUs count as one: eplb.config.even_nodes)."""
        kwargs: dict[str, Any] = {}
        if self.shift_burst is not None:
            kwargs["eplb_shift_burst"] = self.shift_burst
        return EplbConfig(
            ep_size=max(num_gpus, 1),
            nnodes=even_nodes(num_gpus, num_nodes),
            eplb_rebalance_mode=self.mode,
            eplb_rebalance_num_iterations=min(max(interval, 1), MAX_WINDOW_PASSES),
            eplb_max_moved_experts=self.max_moved_experts,
            eplb_initial_full_plan=self.initial_full_plan,
            **kwargs,
        )


def read_engine_env(environ: Mapping[str, str] | None = None, *, known: tuple[str, ...] = ()) -> EngineEnv:
    """The shared adapter settings from ``environ`` (default ``os.environ``); ValueError naming the
    variable for any bad value. ``known``: the engine's own ``EPLB_*`` variables; any other
    ``EPLB_*`` variable is logged as unknown (a typo would otherwise go unnoticed)."""
    from eplb.solver.types import SolveOptions  # SciPy's package only where an adapter runs

    env = os.environ if environ is None else environ
    mode = env.get(MODE_ENV, "").strip().lower() or EngineEnv.mode
    if mode not in REBALANCE_MODES:
        raise ValueError(f"{MODE_ENV} must be one of {REBALANCE_MODES}, got {env[MODE_ENV]!r}")
    options = solver_options_from_env(environ=env)
    try:
        SolveOptions.from_mapping(options)
    except ValueError as exc:
        raise ValueError(f"{SOLVER_OPTIONS_ENV}: {exc}") from None
    settings = EngineEnv(
        mode=mode,
        max_moved_experts=env_int(env, MAX_MOVED_ENV, low=0),
        shift_burst=env_int(env, SHIFT_BURST_ENV, low=1),
        initial_full_plan=env_flag(env, INITIAL_FULL_PLAN_ENV, EngineEnv.initial_full_plan),
        window_passes=env_int(env, WINDOW_PASSES_ENV, low=1, high=MAX_WINDOW_PASSES)
        or CONTINUOUS_BUFFER_SIZE,
        solver_options=options,
        metrics_port=env_int(env, METRICS_PORT_ENV, low=0, high=65535),
        metrics_host=env.get(METRICS_HOST_ENV, "").strip() or "127.0.0.1",
        model_name=env.get(MODEL_NAME_ENV, "").strip() or names.DEFAULT_MODEL_NAME,
        metrics_engine=env.get(METRICS_ENGINE_ENV, "").strip() or names.DEFAULT_ENGINE,
    )
    try:
        names.engine_labels(engine=settings.metrics_engine, model_name=settings.model_name)
    except ValueError as exc:
        var = METRICS_ENGINE_ENV if str(exc).startswith("engine") else MODEL_NAME_ENV
        raise ValueError(f"{var}: {exc}") from None
    try:
        settings.decision_config(num_gpus=1, num_nodes=1, interval=1)
    except ConfigError as exc:  # eplb.config names its flag: name the variable instead
        flag, _, message = str(exc).partition(": ")
        raise ValueError(f"{_FLAG_TO_ENV.get(flag, flag)}: {message}") from None
    unknown = sorted(
        k for k in env if k.startswith("EPLB_") and k not in (*SHARED_ENV, *OTHER_EPLB_ENV, *known)
    )
    if unknown:
        _LOG.warning("eplb: unknown environment variable(s) %s are ignored (a typo?)", unknown)
    return settings
