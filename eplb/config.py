"""EPLB configuration: one frozen dataclass and the SGLang-compatible command-line flags.

Flag names and meanings follow SGLang's server arguments, so an operator who
knows ``--enable-eplb --expert-distribution-recorder-mode stat`` needs nothing new. Every invalid
combination fails when the flags are parsed, with a message that names the flag.

eplb adds ``--eplb-rebalance-mode``: ``periodic`` (the default) is SGLang's schedule, so a config
built from SGLang's flags behaves as SGLang does; ``continuous`` makes small budgeted moves often
(``--eplb-max-moved-experts`` per rebalance, from a window that may be longer than the interval)
and sends each swap beside the following passes, paced by ``--eplb-transfer-gbps``. Continuous
mode's defaults are the named constants below.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from eplb.flags import Flag, add_flags, dest_of, float_in, int_in
from eplb.policy.cost_model import (
    DEFAULT_DISPATCH_COST,
    DISPATCH_KERNEL_TABLES,
    DispatchKernelCost,
    dispatch_kernel_cost,
)
from eplb.policy.dispatch import dispatch_mode, dispatch_mode_names
from eplb.policy.registry import policy_names
from eplb.traces.checks import MAX_EXPERTS, MAX_LAYERS, MAX_SLOTS

SHIFT_BURST = 8
"""Default of ``--eplb-shift-burst``: a domain shift may spend up to 8 rebalances' budgets at once."""


def continuous_move_budget(num_layers: int) -> int:
    """Continuous mode's default move budget on a model of ``num_layers`` MoE layers: 160 copies
    per 58 layers, rounded, at least one. DeepSeek's periodic plans move a share of every layer, so
    its bytes (what the default is sized against) scale with the layers; one model-wide figure
    would starve a 94-layer model and let a 6-layer one move 9 copies a layer."""
    assert num_layers >= 1, num_layers
    return max(1, round(CONTINUOUS_MAX_MOVED_EXPERTS * num_layers / CONTINUOUS_BUDGET_LAYERS))


def initial_full_plan_on(*, continuous: bool, enabled: bool, budget: int | None) -> bool:
    """Whether the first plan since start-up moves without the budget: continuous mode,
    ``--eplb-initial-full-plan``, and a move budget above 0 (a budget of 0 means nothing moves,
    the first plan included).

    A server starts on a placement nobody fitted to its load (SGLang's trivial one, unless
    ``--init-expert-location`` gives one). Budgeted plans then need dozens of rebalances to get
    anywhere good, and the placement they reach is worse than one unbudgeted plan gives (on the
    deepseek-v3 preset at EP32, 0.873 against 0.881 prefill balancedness over passes 1000-3999,
    docs/benchmarks.md, "Continuous rebalancing"); the gate still judges that plan.
    """
    return continuous and enabled and budget is not None and budget > 0


def even_nodes(num_gpus: int, num_nodes: int = 0, *, gpus_per_node: int = 0) -> int:
    """The nodes a placement over ``num_gpus`` GPUs is planned on, from an engine's node count (or
    its GPUs per node): nodes that do not divide the GPUs count as one node, as vLLM and SGLang
    treat such a layout (no node structure to pack for). :class:`EplbConfig` refuses such an
    ``--nnodes``; the engine adapters, which take what the engine reports, fold it to one here."""
    if gpus_per_node >= 1:
        num_nodes = num_gpus // gpus_per_node if num_gpus % gpus_per_node == 0 else 0
    return num_nodes if num_nodes >= 1 and num_gpus % num_nodes == 0 else 1


def effective_dispatch(ep_dispatch_algorithm: str | None) -> str:
    """The dispatch mode ``--ep-dispatch-algorithm`` means: the one named, else static (SGLang's
    when EPLB is on)."""
    return ep_dispatch_algorithm or "static"


RECORDER_MODES = ("stat", "per_pass", "per_token")
DISPATCH_ALGORITHMS = dispatch_mode_names(flags_only=True)
"""--ep-dispatch-algorithm choices, from the one registry of dispatch modes."""
EPLB_ALGORITHMS = policy_names()
"""--eplb-algorithm choices, from the one registry of placement policies."""
REBALANCE_MODES = ("periodic", "continuous")
"""--eplb-rebalance-mode choices."""

PERIODIC_INTERVAL = 1000
"""SGLang's --eplb-rebalance-num-iterations default (periodic mode)."""
CONTINUOUS_INTERVAL = 50
"""Continuous mode's default --eplb-rebalance-num-iterations."""
CONTINUOUS_MAX_MOVED_EXPERTS = 160
"""Continuous mode's default --eplb-max-moved-experts on a model of :data:`CONTINUOUS_BUDGET_LAYERS`
MoE layers (cross-GPU expert copies per rebalance; chosen by benchmarks/bench_continuous.py: at most
a quarter of the bytes periodic DeepSeek moves every 1000 passes); other models scale it by their
layers (:func:`continuous_move_budget`)."""
CONTINUOUS_BUDGET_LAYERS = 58
"""The MoE layers :data:`CONTINUOUS_MAX_MOVED_EXPERTS` was chosen on (DeepSeek-V3's)."""
CONTINUOUS_BUFFER_SIZE = 200
"""Continuous mode's default --expert-distribution-recorder-buffer-size (at least the interval)."""
SERVER_GROUP = "expert-parallel load balancing"
"""The title of the server flags' group in a parser's help."""
MAX_WINDOW_PASSES = 1_000_000
"""Upper bound of --eplb-rebalance-num-iterations and --expert-distribution-recorder-buffer-size:
both size the recorder's window, which is allocated up front ([W, L, P] int32; DeepSeek-V3 at
EP32 takes 67 kB per pass, so the bound is already 67 GB there)."""
MAX_MOVED_EXPERTS = MAX_LAYERS * MAX_SLOTS
"""Upper bound of --eplb-max-moved-experts: every slot of the largest placement a trace may have
(eplb.traces.checks.MAX_LAYERS x MAX_SLOTS); a larger budget moves no more than this one."""
MAX_SHIFT_BURST = MAX_WINDOW_PASSES
"""Upper bound of --eplb-shift-burst: a burst to repay over more rebalances than a window may
hold passes is never repaid; the bound keeps burst x budget a modest integer."""


@dataclass(frozen=True, kw_only=True)
class EplbConfig:
    """Everything a serving engine needs to run EPLB. Build with keywords or :func:`parse_config`."""

    enable_eplb: bool = False
    """Record expert load and rebalance the placement periodically."""
    expert_distribution_recorder_mode: str | None = None
    """stat | per_pass | per_token; None records nothing unless EPLB is on (then stat)."""
    expert_distribution_recorder_buffer_size: int | None = None
    """Window of the stat recorder, in passes; None: the rebalance interval (periodic) or
    ``CONTINUOUS_BUFFER_SIZE`` (continuous). Only continuous mode may exceed the interval."""
    eplb_rebalance_mode: str = "periodic"
    """periodic (SGLang's schedule) | continuous (budgeted moves every few passes, paced swaps)."""
    eplb_rebalance_num_iterations: int | None = None
    """Rebalance every this many (counted) forward passes; None: the mode's default
    (``PERIODIC_INTERVAL``, SGLang's, or ``CONTINUOUS_INTERVAL``)."""
    eplb_rebalance_layers_per_chunk: int | None = None
    """Hot-swap this many layers per chunk; None: all layers at once, or one when paced. Unpaced,
    one chunk runs per pass; paced, as many as the transfer credit covers."""
    eplb_max_moved_experts: int | None = None
    """Budget of one rebalance in cross-GPU expert copies, passed to the solver; None: no budget
    (periodic) or :func:`continuous_move_budget` of the model's layers (continuous: 160 on 58).
    0 moves nothing."""
    eplb_shift_burst: int = SHIFT_BURST
    """Continuous mode: a plan made when the window shows a domain shift may move up to this many
    rebalances' budgets at once, repaid by the following rebalances (their budgets shrink by what
    it moved beyond one); 1: every plan within one budget (eplb.policy.decision.MoveAllowance)."""
    eplb_initial_full_plan: bool = True
    """Continuous mode: the first plan since start-up moves without the move budget (it still
    must pay for its copies), unless the server started from ``--init-expert-location`` or the
    budget is 0 (eplb.policy.decision)."""
    eplb_transfer_gbps: float | None = None
    """Continuous mode: pacing cap of a swap, in GB/s per GPU (the most bytes one GPU receives);
    each pass earns its duration times the cap and a chunk goes once earned. None: unpaced."""
    eplb_min_rebalancing_utilization_threshold: float = 1.0
    """Skip a rebalance when the windowed balancedness is above this (1.0: never skip)."""
    eplb_record_prefill_only: bool = False
    """Record and count only passes that carry prefill tokens on some rank."""
    eplb_host_backup: bool = False
    """Keep a host copy (pinned on CUDA) of every logical expert's weights, each on two ranks (of
    different nodes when there are several), so that after a rank is lost the survivors reload the
    experts it alone held from a survivor's host memory instead of the caller's loader
    (eplb.manager.backup; per rank: 2 x layers x experts / ranks experts of host memory)."""
    ep_num_redundant_experts: int = 0
    """Physical slots beyond one per logical expert."""
    ep_dispatch_algorithm: str | None = None
    """static | dynamic | fake | weighted | lp | auto; None means static when EPLB is on."""
    eplb_dispatch_cost: str = DEFAULT_DISPATCH_COST
    """µs per layer of each dispatch mode's kernels by tokens: a table of
    ``eplb.policy.cost_model.DISPATCH_KERNEL_TABLES`` by name, JSON, or a JSON file. ``auto`` picks
    each pass's mode by it; the simulator charges every pass its mode's cost."""
    eplb_algorithm: str = "auto"
    """auto | deepseek | deepseek_hierarchical | scipy; auto picks scipy (docs/solver.md)."""
    init_expert_location: str = "trivial"
    """'trivial', or an SGLang JSON file/string with physical_to_logical_map or logical_count."""
    ep_size: int = 1
    """EP ranks (GPUs) the experts are spread over."""
    nnodes: int = 1
    """Nodes the EP ranks span."""
    num_experts: int | None = None
    """Logical experts per layer, when known at parse time (checks that slots divide evenly)."""
    num_layers: int | None = None
    """MoE layers of the model, when known (the manager, the simulator and the engine adapters set
    it from the placement, trace or window): continuous mode's default move budget scales with them
    (:func:`continuous_move_budget`); None: :data:`CONTINUOUS_BUDGET_LAYERS`."""

    def for_layers(self, num_layers: int) -> EplbConfig:
        """These flags on a model of ``num_layers`` MoE layers (ValueError where they name another)."""
        if self.num_layers is None:
            return replace(self, num_layers=num_layers)
        if self.num_layers != num_layers:
            raise ValueError(f"the flags are for {self.num_layers} MoE layers, the model has {num_layers}")
        return self

    def __post_init__(self) -> None:
        _check(self.ep_size >= 1, "--ep-size", f"must be >= 1, got {self.ep_size}")
        _check(self.nnodes >= 1, "--nnodes", f"must be >= 1, got {self.nnodes}")
        _check(
            self.ep_size % self.nnodes == 0,
            "--nnodes",
            f"({self.nnodes}) must divide --ep-size ({self.ep_size})",
        )
        _check(
            self.expert_distribution_recorder_mode in (None, *RECORDER_MODES),
            "--expert-distribution-recorder-mode",
            f"unknown mode {self.expert_distribution_recorder_mode!r}; choose from {RECORDER_MODES}",
        )
        _check(
            self.ep_dispatch_algorithm in (None, *DISPATCH_ALGORITHMS),
            "--ep-dispatch-algorithm",
            f"unknown algorithm {self.ep_dispatch_algorithm!r}; choose from {DISPATCH_ALGORITHMS}",
        )
        try:
            _cost_table(self.eplb_dispatch_cost)
        except ValueError as exc:
            raise ConfigError(f"--eplb-dispatch-cost: {exc}") from None
        _check(
            self.eplb_algorithm in EPLB_ALGORITHMS,
            "--eplb-algorithm",
            f"unknown algorithm {self.eplb_algorithm!r}; choose from {EPLB_ALGORITHMS}",
        )
        _check(
            self.eplb_rebalance_mode in REBALANCE_MODES,
            "--eplb-rebalance-mode",
            f"unknown mode {self.eplb_rebalance_mode!r}; choose from {REBALANCE_MODES}",
        )
        interval = self.eplb_rebalance_num_iterations
        _check(
            interval is None or 1 <= interval <= MAX_WINDOW_PASSES,
            "--eplb-rebalance-num-iterations",
            f"must lie in [1, {MAX_WINDOW_PASSES}], got {interval} (it sizes the recorder's window)",
        )
        layers = self.num_layers
        _check(
            layers is None or 1 <= layers <= MAX_LAYERS,
            "--num-layers",
            f"must lie in [1, {MAX_LAYERS}], got {layers}",
        )
        budget = self.eplb_max_moved_experts
        _check(budget is None or budget >= 0, "--eplb-max-moved-experts", f"must be >= 0, got {budget}")
        burst = self.eplb_shift_burst
        _check(burst >= 1, "--eplb-shift-burst", f"must be >= 1, got {burst}")
        gbps = self.eplb_transfer_gbps
        _check(
            gbps is None or 0.0 < gbps < float("inf"),
            "--eplb-transfer-gbps",
            f"must be a positive number, got {gbps}",
        )
        _check(
            gbps is None or self.continuous,
            "--eplb-transfer-gbps",
            "paces swaps sent beside the passes: needs --eplb-rebalance-mode continuous "
            "(periodic mode keeps SGLang's one chunk per pass)",
        )
        _check(
            self.ep_num_redundant_experts >= 0,
            "--ep-num-redundant-experts",
            f"must be >= 0, got {self.ep_num_redundant_experts}",
        )
        size = self.expert_distribution_recorder_buffer_size
        _check(
            size is None or 1 <= size <= MAX_WINDOW_PASSES,
            "--expert-distribution-recorder-buffer-size",
            f"must lie in [1, {MAX_WINDOW_PASSES}], got {size} (the window is allocated up front)",
        )
        _check(
            not self.enable_eplb or self.continuous or size is None or size <= self.rebalance_interval,
            "--expert-distribution-recorder-buffer-size",
            f"({size}) must not exceed --eplb-rebalance-num-iterations ({self.rebalance_interval}) in "
            "periodic mode: the window would hold passes from before the last rebalance "
            "(--eplb-rebalance-mode continuous plans from a longer window)",
        )
        chunk = self.eplb_rebalance_layers_per_chunk
        _check(chunk is None or chunk >= 1, "--eplb-rebalance-layers-per-chunk", f"must be >= 1, got {chunk}")
        threshold = self.eplb_min_rebalancing_utilization_threshold
        _check(
            0.0 <= threshold <= 1.0,
            "--eplb-min-rebalancing-utilization-threshold",
            f"must lie in [0, 1], got {threshold}",
        )
        _check(
            not self.enable_eplb or self.recorder_mode in ("stat", "per_pass"),
            "--expert-distribution-recorder-mode",
            f"{self.recorder_mode} keeps token ids, not the window of counts the rebalancer "
            "plans from: with --enable-eplb use stat (the default) or per_pass",
        )
        _check(
            not self.enable_eplb or self.ep_size > 1,
            "--enable-eplb",
            "needs expert parallelism: --ep-size must be > 1 (with one rank there is nothing to balance)",
        )
        _check(
            self.ep_dispatch_algorithm is None
            or not dispatch_mode(self.ep_dispatch_algorithm).needs_weights
            or self.enable_eplb,
            "--ep-dispatch-algorithm",
            "weighted dispatch needs --enable-eplb (the weights come from the rebalancer)",
        )
        if self.num_experts is not None:
            _check(self.num_experts >= 1, "--num-experts", f"must be >= 1, got {self.num_experts}")
            slots = self.num_experts + self.ep_num_redundant_experts
            _check(
                slots % self.ep_size == 0,
                "--ep-num-redundant-experts",
                f"{self.num_experts} experts + {self.ep_num_redundant_experts} redundant = {slots} slots "
                f"do not divide evenly over --ep-size {self.ep_size}",
            )

    # ---- effective values (SGLang's defaults when EPLB is on) --------------------------------
    @property
    def recorder_mode(self) -> str | None:
        if self.expert_distribution_recorder_mode is None and self.enable_eplb:
            return "stat"
        return self.expert_distribution_recorder_mode

    @property
    def continuous(self) -> bool:
        return self.eplb_rebalance_mode == "continuous"

    @property
    def rebalance_interval(self) -> int:
        """Counted passes between rebalances (the mode's default unless given)."""
        interval = self.eplb_rebalance_num_iterations
        if interval is not None:
            return interval
        return CONTINUOUS_INTERVAL if self.continuous else PERIODIC_INTERVAL

    @property
    def recorder_buffer_size(self) -> int:
        size = self.expert_distribution_recorder_buffer_size
        if size is not None:
            return size
        return (
            max(CONTINUOUS_BUFFER_SIZE, self.rebalance_interval)
            if self.continuous
            else self.rebalance_interval
        )

    @property
    def max_moved_experts(self) -> int | None:
        """The solver's move budget per rebalance (the mode's default unless given)."""
        budget = self.eplb_max_moved_experts
        if budget is None and self.continuous:
            return continuous_move_budget(self.num_layers or CONTINUOUS_BUDGET_LAYERS)
        return budget

    @property
    def initial_full_plan(self) -> bool:
        """Whether the first plan since start-up moves without the budget (continuous mode, a
        budget above 0, no fitted placement at start-up)."""
        on = initial_full_plan_on(
            continuous=self.continuous, enabled=self.eplb_initial_full_plan, budget=self.max_moved_experts
        )
        return on and self.init_expert_location == "trivial"

    @property
    def dispatch_algorithm(self) -> str:
        return effective_dispatch(self.ep_dispatch_algorithm)

    @property
    def dispatch_cost(self) -> DispatchKernelCost:
        """The dispatch kernels' cost table ``--eplb-dispatch-cost`` gives."""
        return _cost_table(self.eplb_dispatch_cost)

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> EplbConfig:
        """Build from parsed flags (those :func:`add_cli_args` added)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})


@functools.lru_cache(maxsize=16)
def _cost_table(value: str) -> DispatchKernelCost:
    """``--eplb-dispatch-cost`` read once per value (a file is read when first named)."""
    return dispatch_kernel_cost(value)


class ConfigError(ValueError):
    """An invalid flag or flag combination; the message starts with the flag's name."""


def _check(ok: bool, flag: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{flag}: {message}")


_DEFAULTS = {f.name: f.default for f in fields(EplbConfig)}


def _server_flag(*names: str, **spec: Any) -> Flag:
    """A server flag: its destination is the EplbConfig field of its name, its default that
    field's, so the dataclass states each default once."""
    return Flag.named(*names, default=_DEFAULTS[dest_of(names[0])], **spec)


SERVER_FLAGS: tuple[Flag, ...] = (
    _server_flag(
        "--enable-eplb", action="store_true", shown="", help="record expert load and rebalance periodically"
    ),
    _server_flag(
        "--expert-distribution-recorder-mode",
        choices=RECORDER_MODES,
        shown="stat when EPLB is on",
        help="what the recorder keeps; per_token keeps ids and cannot drive --enable-eplb",
    ),
    _server_flag(
        "--expert-distribution-recorder-buffer-size",
        parse=int_in(1, MAX_WINDOW_PASSES),
        shown=f"the rebalance interval; continuous: {CONTINUOUS_BUFFER_SIZE} or the interval if longer",
        help=f"recorder window in passes, at most {MAX_WINDOW_PASSES:,}; only continuous mode may exceed "
        "the interval",
    ),
    _server_flag(
        "--eplb-rebalance-mode",
        choices=REBALANCE_MODES,
        env="EPLB_REBALANCE_MODE",
        help="periodic: SGLang's schedule, the transfer stalls serving; continuous: small budgeted moves "
        "every few passes, each swap sent beside the following passes",
    ),
    _server_flag(
        "--eplb-rebalance-num-iterations",
        parse=int_in(1, MAX_WINDOW_PASSES),
        shown=f"{PERIODIC_INTERVAL}, SGLang's; continuous: {CONTINUOUS_INTERVAL}",
        help=f"rebalance every N counted forward passes, at most {MAX_WINDOW_PASSES:,}",
    ),
    _server_flag(
        "--eplb-rebalance-layers-per-chunk",
        parse=int_in(1, MAX_LAYERS),
        shown="all at once; paced: 1",
        help="layers hot-swapped per chunk, one chunk per pass unless paced",
    ),
    _server_flag(
        "--eplb-max-moved-experts",
        parse=int_in(0, MAX_MOVED_EXPERTS),
        env="EPLB_MAX_MOVED_EXPERTS",
        shown=f"none; continuous: {CONTINUOUS_MAX_MOVED_EXPERTS} per {CONTINUOUS_BUDGET_LAYERS} MoE layers, "
        "on average: see --eplb-shift-burst",
        help="cross-GPU expert copies per rebalance, a solver budget",
    ),
    _server_flag(
        "--eplb-shift-burst",
        parse=int_in(1, MAX_SHIFT_BURST),
        env="EPLB_SHIFT_BURST",
        help="continuous mode: on a domain shift a plan may move up to this many rebalances' "
        "--eplb-max-moved-experts, repaid by the following ones; 1: never",
    ),
    _server_flag(
        "--eplb-initial-full-plan",
        action=argparse.BooleanOptionalAction,
        env="EPLB_INITIAL_FULL_PLAN",
        shown="on",
        help="continuous mode: the first plan since start-up moves without --eplb-max-moved-experts "
        "(not from --init-expert-location, not with a budget of 0)",
    ),
    _server_flag(
        "--eplb-transfer-gbps",
        parse=float_in(0, above=True),
        shown="unpaced",
        help="continuous mode: pace each swap beside the passes at this many GB/s per GPU",
    ),
    _server_flag(
        "--eplb-min-rebalancing-utilization-threshold",
        parse=float_in(0, 1),
        help="skip a rebalance when the window's balancedness is above this",
    ),
    _server_flag(
        "--eplb-record-prefill-only",
        action="store_true",
        shown="",
        help="record and count only passes that carry prefill tokens",
    ),
    _server_flag(
        "--eplb-host-backup",
        action="store_true",
        shown="the caller's loader",
        help="keep every expert's weights in host memory on two ranks, so the survivors of a lost "
        "rank reload the experts it alone held from there",
    ),
    _server_flag(
        "--ep-num-redundant-experts",
        parse=int_in(0, MAX_SLOTS),
        help="physical slots beyond one per logical expert",
    ),
    _server_flag(
        "--ep-dispatch-algorithm",
        choices=DISPATCH_ALGORITHMS,
        shown="static when EPLB is on",
        help="how tokens pick a replica (offline, also the no-balancing baseline's and that of runs "
        "named without ':MODE')",
    ),
    _server_flag(
        "--eplb-dispatch-cost",
        metavar="TABLE",
        help="µs per layer of each dispatch mode's kernels by tokens: "
        f"{' | '.join(DISPATCH_KERNEL_TABLES)}, JSON "
        '(\'{"tokens": [64, 4096], "static": [1.4, 2.2], "lp": [30, 33]}\', or {"decode": ..., '
        '"prefill": ...}) or a JSON file; auto dispatch picks by it, the simulator charges it',
    ),
    _server_flag("--eplb-algorithm", choices=EPLB_ALGORITHMS, help="placement solver; auto picks scipy"),
    _server_flag(
        "--init-expert-location",
        help="the placement before the first rebalance: 'trivial', an SGLang expert-location JSON "
        "(file or string: physical_to_logical_map or logical_count), or offline a placement "
        ".safetensors from 'eplb solve'",
    ),
    _server_flag("--ep-size", "--expert-parallel-size", parse=int_in(1, MAX_SLOTS), help="EP ranks (GPUs)"),
    _server_flag("--nnodes", parse=int_in(1, MAX_SLOTS), help="nodes the EP ranks span"),
    _server_flag(
        "--num-experts",
        parse=int_in(1, MAX_EXPERTS),
        shown="",
        help="logical experts per layer, to check the slot layout at parse time",
    ),
    _server_flag(
        "--num-layers",
        parse=int_in(1, MAX_LAYERS),
        shown=f"from the model; else {CONTINUOUS_BUDGET_LAYERS}",
        help="MoE layers of the model: continuous mode's default --eplb-max-moved-experts scales with them",
    ),
)
"""The server's EPLB flags (SGLang's names, one per EplbConfig field), each with one help text."""

SERVER_FLAG = {flag.name: flag for flag in SERVER_FLAGS}
"""The server's flags by name."""


def flag_env(name: str) -> str:
    """The ``EPLB_*`` variable through which the engine adapters take the server flag ``name``."""
    env = SERVER_FLAG[name].env
    assert env is not None, f"{name} has no engine variable"
    return env


def add_cli_args(parser: argparse.ArgumentParser, *, check: bool = True) -> argparse.ArgumentParser:
    """Add the EPLB flags (SGLang names, :data:`SERVER_FLAGS`) to ``parser``; defaults come from
    :class:`EplbConfig`.

    With ``check`` (the default) parsing also validates the combination, so an engine that calls
    only ``parser.parse_args()`` gets an invalid combination refused there, naming the flag (exit
    2). ``check=False`` is for callers that adjust the parsed namespace first and then build the
    config with :func:`config_from_args`, which validates.
    """
    add_flags(parser.add_argument_group(SERVER_GROUP), SERVER_FLAGS)
    if check:
        _check_when_parsed(parser)
    return parser


def _check_when_parsed(parser: argparse.ArgumentParser) -> None:
    """Validate the EPLB flags each time ``parser`` parses (``parse_args`` goes through
    ``parse_known_args``, on the instance, for top-level parsers and subparsers alike)."""
    parse_known_args = parser.parse_known_args

    def checked(
        args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = parse_known_args(args, namespace)
        config_from_args(parser, parsed)
        return parsed, extras

    parser.parse_known_args = checked  # type: ignore[method-assign,assignment]


def config_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> EplbConfig:
    """Build the config from parsed flags; an invalid combination exits through ``parser.error``."""
    try:
        return EplbConfig.from_namespace(args)
    except ConfigError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def parse_config(argv: Sequence[str] | None = None, **parser_kwargs: Any) -> EplbConfig:
    """Parse EPLB flags alone (for engines and tests)."""
    parser = add_cli_args(argparse.ArgumentParser(**parser_kwargs))
    return config_from_args(parser, parser.parse_args(argv))
