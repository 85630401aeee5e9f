"""Every ``EPLB_*`` environment variable the engine adapters read, parsed and checked in one place.

vLLM and SGLang give a plugin no flags of its own, so the adapters are configured through the
environment. :data:`ENV_VARS` is the one table of every variable (name, kind, bound, engines);
:func:`check_engine_env` checks each variable an engine's adapter lists, whatever else is on (a
transfer rate with the weight updater off, a metrics host without a port), probes the metrics
endpoint by binding it, and raises ValueError naming the variable (and a solver option's field);
the plugins call it when the engine registers them, so a typo stops the engine at start-up, not
at its first rebalance. :func:`read_engine_env` reads the settings both adapters share. The mode's meaning and defaults are
``eplb.config``'s (``--eplb-rebalance-mode``, ``--eplb-max-moved-experts``,
``--eplb-shift-burst``, ``--eplb-initial-full-plan``): :meth:`EngineEnv.decision_config` builds the
:class:`~eplb.config.EplbConfig` the adapters' :class:`~eplb.policy.decision.Decider` holds.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

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
from eplb.policy.cost_model import (
    DEFAULT_DISPATCH_COST,
    DISPATCH_KERNEL_TABLES,
    DispatchKernelCost,
    dispatch_kernel_cost,
)

MODE_ENV = flag_env("--eplb-rebalance-mode")
MAX_MOVED_ENV = flag_env("--eplb-max-moved-experts")
SHIFT_BURST_ENV = flag_env("--eplb-shift-burst")
INITIAL_FULL_PLAN_ENV = flag_env("--eplb-initial-full-plan")
WINDOW_PASSES_ENV = "EPLB_WINDOW_PASSES"
SOLVER_OPTIONS_ENV = "EPLB_SOLVER_OPTIONS"
METRICS_PORT_ENV = "EPLB_METRICS_PORT"
METRICS_HOST_ENV = "EPLB_METRICS_HOST"
MODEL_NAME_ENV = "EPLB_MODEL_NAME"
METRICS_ENGINE_ENV = "EPLB_METRICS_ENGINE"
VLLM_POLICY_ENV = "EPLB_VLLM_POLICY"
VLLM_HISTORY_ENV = "EPLB_VLLM_HISTORY"
VLLM_DUMP_ENV = "EPLB_VLLM_DUMP_DIR"
SGLANG_PLUGIN_ENV = "EPLB_SGLANG"
SGLANG_FUSED_ENV = "EPLB_SGLANG_FUSED_REMAP"
SGLANG_BACKEND_ENV = "EPLB_SGLANG_REMAP_BACKEND"
SGLANG_LP_ENV = "EPLB_SGLANG_LP"
DISPATCH_COST_ENV = "EPLB_DISPATCH_COST"
SGLANG_UPDATER_ENV = "EPLB_SGLANG_WEIGHT_UPDATER"
SGLANG_GBPS_ENV = "EPLB_SGLANG_TRANSFER_GBPS"
SGLANG_TIMEOUT_ENV = "EPLB_SGLANG_SWAP_TIMEOUT_S"

VLLM = "vllm"
SGLANG = "sglang"
ENGINES = (VLLM, SGLANG)
"""The engines whose adapters read the environment (TensorRT-LLM reads a file instead)."""

EnvKind = Literal[
    "choice", "int", "float", "flag", "json", "label", "host", "port", "policy", "backend", "dir",
    "dispatch_cost",
]  # fmt: skip

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")
SglangLpMode = Literal["off", "lp", "auto"]
SGLANG_LP_MODES: tuple[SglangLpMode, ...] = get_args(SglangLpMode)
"""What ``EPLB_SGLANG_LP`` asks for (:func:`sglang_lp_mode`): nothing, eplb's ``lp`` on every pass,
or ``auto`` (each pass ``lp`` or static, whichever eplb.policy.auto_dispatch prices lower)."""


@dataclass(frozen=True, kw_only=True)
class EnvVar:
    """One ``EPLB_*`` variable of the engine adapters: what it takes and where it is checked."""

    name: str
    kind: EnvKind
    """How its value is parsed and checked (:func:`check_var`)."""
    bound: str
    """The values it accepts, in words (the docs' table shows it)."""
    engines: tuple[str, ...]
    """The adapters that read it and check it at start-up (:func:`check_engine_env`)."""
    default: str
    """What unset means, in words."""
    help: str
    """What it does."""
    bad: str
    """A value the start-up check refuses (the tests set each one)."""
    low: float | None = None
    """Least value of an ``int`` or ``float`` (``float``: strictly above it)."""
    high: int | None = None
    """Greatest value of an ``int``."""
    choices: tuple[str, ...] = ()
    """The values of a ``choice`` (any case)."""


_BOTH = ENGINES
ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar(name=MODE_ENV, kind="choice", choices=REBALANCE_MODES, bound=" or ".join(REBALANCE_MODES),
           engines=_BOTH, default="periodic", bad="sometimes",
           help="periodic: plan at the engine's cadence; continuous: budgeted continuous-mode steps"),
    EnvVar(name=MAX_MOVED_ENV, kind="int", low=0, bound="integer >= 0", engines=_BOTH,
           default="the mode's (continuous: 160 per 58 MoE layers, scaled to the model's)", bad="-3",
           help="cross-GPU expert copies per rebalance, on average"),
    EnvVar(name=SHIFT_BURST_ENV, kind="int", low=1, bound="integer >= 1", engines=_BOTH, default="8",
           bad="0", help="continuous: a plan on a domain shift may spend this many budgets, repaid later"),
    EnvVar(name=INITIAL_FULL_PLAN_ENV, kind="flag", bound="boolean", engines=_BOTH, default="1",
           bad="perhaps", help="continuous: 1 the first plan moves without the budget, 0 it is budgeted too"),
    EnvVar(name=WINDOW_PASSES_ENV, kind="int", low=1, high=MAX_WINDOW_PASSES,
           bound=f"integer in [1, {MAX_WINDOW_PASSES}]", engines=_BOTH, default=str(CONTINUOUS_BUFFER_SIZE),
           bad="0", help="continuous mode under SGLang: passes of load the adapter plans from, its own history"),
    EnvVar(name=SOLVER_OPTIONS_ENV, kind="json", bound="JSON object of SolveOptions fields", engines=_BOTH,
           default="none", bad='{"decay_half_life": "x"}', help="solver options of the adapters"),
    EnvVar(name=METRICS_PORT_ENV, kind="port", low=0, high=65535,
           bound="integer in [0, 65535], free on the host", engines=_BOTH, default="no metrics", bad="70000",
           help="rank 0 serves eplb's metrics on this port (0: a free one, logged)"),
    EnvVar(name=METRICS_HOST_ENV, kind="host", bound="an address of this host", engines=_BOTH,
           default="127.0.0.1", bad="203.0.113.7", help="the address the metrics endpoint binds"),
    EnvVar(name=MODEL_NAME_ENV, kind="label", bound=f"label value, <= {names.MAX_LABEL_CHARS} characters",
           engines=_BOTH, default=names.DEFAULT_MODEL_NAME, bad="a\x01b",
           help="the model_name label of eplb's series (use the engine's served name)"),
    EnvVar(name=METRICS_ENGINE_ENV, kind="label", bound=f"label value, <= {names.MAX_LABEL_CHARS} characters",
           engines=_BOTH, default=names.DEFAULT_ENGINE, bad="x" * 300,
           help="the engine label of eplb's series (vLLM's first engine is 0)"),
    EnvVar(name=VLLM_POLICY_ENV, kind="policy", bound="1/0 or an eplb algorithm name", engines=(VLLM,),
           default="off", bad="magic", help="turns eplb's vLLM policy on"),
    EnvVar(name=VLLM_HISTORY_ENV, kind="int", low=1, bound="integer >= 1", engines=(VLLM,),
           default="periodic: 1; continuous: 4", bad="0", help="windows the forecast uses"),
    EnvVar(name=VLLM_DUMP_ENV, kind="dir", bound="a folder (made if missing)", engines=(VLLM,),
           default="none", bad="/proc/version", help="rank 0 keeps every window vLLM hands over as an eplb trace"),
    EnvVar(name=SGLANG_PLUGIN_ENV, kind="flag", bound="boolean", engines=(SGLANG,), default="1",
           bad="maybe", help="0 keeps the plugin out entirely"),
    EnvVar(name=SGLANG_FUSED_ENV, kind="flag", bound="boolean", engines=(SGLANG,), default="0", bad="maybe",
           help="1 replaces the MegaMoE fused map+record with eplb's kernel"),
    EnvVar(name=SGLANG_BACKEND_ENV, kind="backend", bound="auto or a remap backend usable in the process",
           engines=(SGLANG,), default="auto", bad="magic", help="that kernel's backend"),
    EnvVar(name=SGLANG_LP_ENV, kind="choice", choices=("auto", *_TRUE, *_FALSE), bound="boolean or auto",
           engines=(SGLANG,), default="0", bad="2",
           help="1 serves --ep-dispatch-algorithm lp with eplb's lp kernels instead of SGLang's LP solver; "
           "auto: each pass by lp or statically, whichever eplb's cost model prices lower"),
    EnvVar(name=DISPATCH_COST_ENV, kind="dispatch_cost", bound="a --eplb-dispatch-cost table: "
           f"{', '.join(DISPATCH_KERNEL_TABLES)}, JSON or a JSON file", engines=(SGLANG,),
           default=DEFAULT_DISPATCH_COST, bad="h300",
           help="EPLB_SGLANG_LP=auto: the dispatch kernels' µs per layer it prices each pass with"),
    EnvVar(name=SGLANG_UPDATER_ENV, kind="flag", bound="boolean", engines=(SGLANG,), default="0", bad="sure",
           help="1 moves the expert weights with eplb's hot-swap instead of SGLang's updater"),
    EnvVar(name=SGLANG_GBPS_ENV, kind="float", low=0.0, bound="finite number > 0", engines=(SGLANG,),
           default="as fast as the link", bad="-10", help="the weight updater's pace, GB/s into the busiest GPU"),
    EnvVar(name=SGLANG_TIMEOUT_ENV, kind="float", low=0.0, bound="finite number > 0", engines=(SGLANG,),
           default="60", bad="0", help="the weight updater's deadline for every wait of a swap, seconds"),
)  # fmt: skip
"""Every ``EPLB_*`` variable the engine adapters read: each is checked at start-up by every adapter
that lists it (:func:`check_engine_env`), whatever else is on; docs/integrations.md lists them."""
ENV_BY_NAME = {var.name: var for var in ENV_VARS}


_ENGINE_NAMES = {VLLM: "vLLM", SGLANG: "SGLang"}


def env_table_markdown() -> str:
    """The table of :data:`ENV_VARS` as docs/integrations.md shows it (a test checks the page has it)."""
    rows = ["| variable | engines | values | unset | what it does |", "|---|---|---|---|---|"]
    for var in ENV_VARS:
        engines = (
            "both" if set(var.engines) == set(ENGINES) else ", ".join(_ENGINE_NAMES[e] for e in var.engines)
        )
        rows.append(f"| `{var.name}` | {engines} | {var.bound} | {var.default} | {var.help} |")
    return "\n".join(rows) + "\n"


def engine_vars(engine: str) -> tuple[str, ...]:
    """The names of the variables ``engine``'s adapter reads."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    return tuple(var.name for var in ENV_VARS if engine in var.engines)


SHARED_ENV = tuple(var.name for var in ENV_VARS if set(var.engines) == set(ENGINES))
"""The variables both adapters read."""
OTHER_EPLB_ENV = ("EPLB_ENGINES_DIR", "EPLB_DASHBOARDS_DIR")
"""``EPLB_*`` variables of eplb's tests and tools, not of the adapters (never warned about)."""

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


def sglang_lp_mode(environ: Mapping[str, str] | None = None) -> SglangLpMode:
    """What ``EPLB_SGLANG_LP`` asks for under SGLang (:data:`SGLANG_LP_MODES`): a boolean's
    ``off`` or ``lp``, or ``auto``; ValueError naming the variable for anything else."""
    env = os.environ if environ is None else environ
    raw = env.get(SGLANG_LP_ENV, "").strip().lower()
    if raw == "auto":
        return "auto"
    if raw and raw not in (*_TRUE, *_FALSE):
        raise ValueError(
            f"{SGLANG_LP_ENV} must be a boolean {_TRUE + _FALSE} or auto, got {env[SGLANG_LP_ENV]!r}"
        )
    return "lp" if env_flag(env, SGLANG_LP_ENV, False) else "off"


def sglang_lp_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``EPLB_SGLANG_LP`` asks for eplb's ``lp`` dispatch under SGLang, ``auto`` included
    (ValueError naming the variable for a value that is neither a boolean nor ``auto``)."""
    return sglang_lp_mode(environ) != "off"


def dispatch_cost_from_env(environ: Mapping[str, str] | None = None) -> DispatchKernelCost:
    """The dispatch kernels' cost table ``EPLB_DISPATCH_COST`` names (``--eplb-dispatch-cost``'s
    names, JSON or a JSON file, read by the flag's own parser; unset: the flag's default);
    ValueError naming the variable."""
    env = os.environ if environ is None else environ
    raw = env.get(DISPATCH_COST_ENV, "").strip() or DEFAULT_DISPATCH_COST
    try:
        return dispatch_kernel_cost(raw)
    except ValueError as exc:
        raise ValueError(f"{DISPATCH_COST_ENV}: {exc}") from None


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


def check_solver_options(options: Mapping[str, Any]) -> None:
    """ValueError naming ``EPLB_SOLVER_OPTIONS`` and the bad field (or the fields that clash)."""
    from eplb.solver.types import SolveOptions  # SciPy's package only where an adapter runs

    try:
        SolveOptions.from_mapping(options)
        return
    except ValueError as exc:
        whole = exc
    for name, value in options.items():  # the field that is wrong on its own, if any
        try:
            SolveOptions.from_mapping({name: value})
        except ValueError as exc:
            raise ValueError(f"{SOLVER_OPTIONS_ENV}: field {name!r} = {value!r}: {exc}") from None
    raise ValueError(f"{SOLVER_OPTIONS_ENV}: fields {sorted(options)} together: {whole}") from None


def probe_metrics_endpoint(host: str, port: int | None) -> None:
    """Bind what the metrics exporter will bind, and let go: ValueError naming ``EPLB_METRICS_HOST``
    when ``host`` is no address of this host, ``EPLB_METRICS_PORT`` when ``port`` is taken.

    The socket is bound as the exporter binds it (SO_REUSEADDR, so every process of one host may
    probe at once and only a listening socket makes the port busy), then closed: the exporter
    binds again on rank 0 at its start, and a port taken in between is logged there.
    """
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for var, address in ((METRICS_HOST_ENV, (host, 0)), (METRICS_PORT_ENV, (host, port))):
        if address[1] is None or (var == METRICS_PORT_ENV and address[1] == 0):
            continue
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(address)
            except (OSError, OverflowError) as exc:
                what = "no address of this host" if var == METRICS_HOST_ENV else f"port {port} is taken"
                raise ValueError(
                    f"{var}: cannot serve metrics on {host}:{address[1]}: {what} ({exc})"
                ) from None


def check_var(var: EnvVar, environ: Mapping[str, str]) -> None:
    """ValueError naming ``var`` when its value in ``environ`` is bad (unset or empty: fine).
    The metrics host and port are probed together (:func:`probe_metrics_endpoint`)."""
    raw = environ.get(var.name, "").strip()
    if not raw:
        return
    kind = var.kind
    if kind in ("int", "port"):
        env_int(environ, var.name, low=int(var.low or 0), high=var.high)
    elif kind == "float":
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{var.name} must be a number, got {raw!r}") from None
        if not (math.isfinite(value) and value > (var.low or 0.0)):
            raise ValueError(f"{var.name} must be a {var.bound}, got {raw!r}")
    elif kind == "flag":
        env_flag(environ, var.name, False)
    elif kind == "choice":
        if raw.lower() not in var.choices:
            raise ValueError(f"{var.name} must be one of {var.choices}, got {raw!r}")
    elif kind == "dispatch_cost":
        dispatch_cost_from_env({var.name: raw})
    elif kind == "json":
        check_solver_options(solver_options_from_env(environ=environ))
    elif kind == "label":
        given = {"engine": names.DEFAULT_ENGINE, "model_name": names.DEFAULT_MODEL_NAME}
        given["engine" if var.name == METRICS_ENGINE_ENV else "model_name"] = raw
        try:
            names.engine_labels(**given)
        except ValueError as exc:
            raise ValueError(f"{var.name}: {exc}") from None
    elif kind == "policy":
        if raw.lower() not in (*_TRUE, *_FALSE, "eplb"):
            from eplb.policy import check_policy_name

            check_policy_name(raw, var.name)
    elif kind == "backend":
        from eplb.remap import available_backends

        usable = ("auto", *available_backends())
        if raw not in usable:
            raise ValueError(f"{var.name}={raw!r}: choose from {usable} (usable in this process)")
    elif kind == "dir":
        path = Path(raw)
        if path.exists() and not path.is_dir():
            raise ValueError(f"{var.name}={raw!r} is not a folder")
        if path.is_dir() and not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"{var.name}={raw!r}: the folder is not writable")
    # "host": probed with the port, below


def check_engine_env(engine: str, environ: Mapping[str, str] | None = None) -> EngineEnv:
    """Every variable of ``engine``'s adapter (:data:`ENV_VARS`) checked, whatever else is on, and
    the shared settings read (:func:`read_engine_env`); the metrics endpoint is probed when either
    of its variables is set. ValueError naming the variable (and a solver option's field)."""
    env = os.environ if environ is None else environ
    for var in ENV_VARS:
        if engine in var.engines:
            check_var(var, env)
    settings = read_engine_env(env, known=engine_vars(engine))
    if env.get(METRICS_HOST_ENV, "").strip() or settings.metrics_port is not None:
        probe_metrics_endpoint(settings.metrics_host, settings.metrics_port)
    return settings


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

    def decision_config(
        self, *, num_gpus: int, num_nodes: int, interval: int, num_layers: int | None
    ) -> EplbConfig:
        """The flags a :class:`~eplb.policy.decision.Decider` of ``num_gpus`` EP ranks on
        ``num_nodes`` nodes decides by, rebalancing every ``interval`` counted passes (nodes that do
        not divide the GPUs count as one: eplb.config.even_nodes), for a model of ``num_layers``
        MoE layers (they size continuous mode's default budget; None: a config read for its
        algorithm and mode alone)."""
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
            num_layers=num_layers,
            **kwargs,
        )


def read_engine_env(environ: Mapping[str, str] | None = None, *, known: tuple[str, ...] = ()) -> EngineEnv:
    """The shared adapter settings from ``environ`` (default ``os.environ``); ValueError naming the
    variable for any bad value. ``known``: the engine's own ``EPLB_*`` variables; any other
    ``EPLB_*`` variable is logged as unknown (a typo would otherwise go unnoticed)."""
    env = os.environ if environ is None else environ
    mode = env.get(MODE_ENV, "").strip().lower() or EngineEnv.mode
    if mode not in REBALANCE_MODES:
        raise ValueError(f"{MODE_ENV} must be one of {REBALANCE_MODES}, got {env[MODE_ENV]!r}")
    options = solver_options_from_env(environ=env)
    check_solver_options(options)
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
        settings.decision_config(num_gpus=1, num_nodes=1, interval=1, num_layers=None)
    except ConfigError as exc:  # eplb.config names its flag: name the variable instead
        flag, _, message = str(exc).partition(": ")
        raise ValueError(f"{_FLAG_TO_ENV.get(flag, flag)}: {message}") from None
    unknown = sorted(
        k for k in env if k.startswith("EPLB_") and k not in (*SHARED_ENV, *OTHER_EPLB_ENV, *known)
    )
    if unknown:
        _LOG.warning("eplb: unknown environment variable(s) %s are ignored (a typo?)", unknown)
    return settings
