"""Every flag that more than one parser takes, once: the server's and the offline commands' own.

:data:`FLAGS` is the one table ``eplb``'s subcommands add their shared flags from (:func:`add`):
the server's EPLB flags (``eplb.config.SERVER_FLAGS``, SGLang's names, the server's defaults) and,
beside them, the offline ones (the input, the model's facts, the first scored pass, solver options,
the cost model, plots, seeds, progress bars, JSON). Where one of eplb's commands cannot take a
flag's default, this table says so in the flag's record (``Flag.elsewhere``), with the reason: the
replays take their topology from the trace or preset, the demo runs eplb's continuous mode on a
tiny model, ``eplb workload`` reports its imbalance at EP32. A flag that only one subcommand takes
stays in that subcommand (``--algorithms``, ``--nproc``, ...); ``--out`` names each command's own
output (:data:`OWN_PER_COMMAND`). ``tests/test_flags.py`` checks every parser against this table.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

from eplb.config import CONTINUOUS_INTERVAL, SERVER_FLAGS
from eplb.flags import Default, Flag, add_flags, float_in, int_in
from eplb.policy.cost_model import DEEPSEEK_V3_BYTES_PER_EXPERT, TRANSFER_KINDS, CostModel
from eplb.simulate.options import TRACE_TOPOLOGY
from eplb.traces import FORMATS
from eplb.workloads import PRESETS

OFFLINE = ("simulate", "sweep", "solve")
"""The commands that replay or plan from a trace or a built-in workload."""

DEFAULT_STEPS = 5000
"""``--steps``: forward passes of the built-in workload; at the server's interval of 1000 a replay
of any preset (``eplb simulate``, the main job, included) rebalances four times within them."""
SWEEP_STEPS = 2000
"""``eplb sweep``'s ``--steps``."""
DEMO_STEPS = 300
"""``eplb demo``'s ``--steps``: forward passes per rank."""
DEMO_PRESET = "tiny"
"""``eplb demo``'s ``--preset``: its model runs on CPU ranks."""
DEMO_MODE = "continuous"
"""``eplb demo``'s ``--eplb-rebalance-mode``."""
DEMO_PERIODIC_INTERVAL = 100
"""``eplb demo``'s ``--eplb-rebalance-num-iterations`` in periodic mode (continuous: the server's)."""
WORKLOAD_EP_SIZE = 32
"""``eplb workload``'s ``--ep-size``, for its reported imbalance: DeepSeek-V3's EP32 (or less for
presets with fewer experts)."""

MAX_SEED = 2**32 - 1
"""``--seed``: NumPy's legacy seeds' range (the demo seeds torch with seed x 1000 + rank)."""
MAX_BYTES_PER_EXPERT = 1 << 48
"""``--bytes-per-expert``: 256 TiB of one expert in one layer, far past any model, so byte counts
summed over every move of a replay stay within int64."""

_INPUT_TOPOLOGY = (
    "a replay's topology is an input, not a flag default: the preset's serving topology (its "
    "experts must spread over its ranks) or, for a recorded trace, EP32 over 4 nodes with 32 "
    "redundant experts (eplb.simulate.options.default_topology)"
)


def _from_input(key: str) -> Default:
    return Default(
        commands=OFFLINE,
        value=None,
        shown=f"the preset's; {TRACE_TOPOLOGY[key]} for a trace",
        why=_INPUT_TOPOLOGY,
    )


_ELSEWHERE: dict[str, tuple[Default, ...]] = {
    "--ep-size": (
        _from_input("ep_size"),
        Default(
            commands=("workload",),
            value=None,
            shown=f"{WORKLOAD_EP_SIZE}, or the largest divisor of the preset's expert count below it",
            why="eplb workload only reports an imbalance: at DeepSeek-V3's serving size unless told",
        ),
        Default(
            commands=("demo",),
            value=None,
            shown="follows --nproc",
            why="the demo's ranks are its EP ranks: they are what --nproc starts",
        ),
    ),
    "--nnodes": (_from_input("nnodes"),),
    "--ep-num-redundant-experts": (
        _from_input("ep_num_redundant_experts"),
        Default(
            commands=("demo",),
            value=None,
            shown="one per rank",
            why="the demo's slots must divide over however many ranks --nproc starts: one redundant "
            "slot per rank always does",
        ),
    ),
    "--expert-distribution-recorder-buffer-size": (
        Default(
            commands=("solve",),
            value=None,
            shown="the whole trace",
            why="eplb solve plans once, from all the recorded load unless told less",
        ),
    ),
    "--enable-eplb": (
        Default(
            commands=("demo",),
            value=True,
            shown="on",
            why="the demo is EPLB at work (with one rank it runs on, every rebalance skipped)",
        ),
    ),
    "--eplb-rebalance-mode": (
        Default(
            commands=("demo",),
            value=DEMO_MODE,
            shown=DEMO_MODE,
            why="the demo runs eplb's own manager, whose mode continuous is; SGLang's periodic stays a "
            "flag away",
        ),
    ),
    "--eplb-rebalance-num-iterations": (
        Default(
            commands=("demo",),
            value=None,
            shown=f"{DEMO_PERIODIC_INTERVAL} in periodic mode; continuous: {CONTINUOUS_INTERVAL}",
            why=f"a demo of {DEMO_STEPS} passes would never reach SGLang's interval",
        ),
    ),
}
"""The commands that take another default than a server flag's, and why."""
assert set(_ELSEWHERE) <= {flag.name for flag in SERVER_FLAGS}

_COST = CostModel()


def _cost_flag(name: str, field: str, help: str, **spec: Any) -> Flag:
    """A cost-model flag: its default is ``CostModel``'s ``field`` (a finite float >= 0 unless
    ``spec`` says)."""
    return Flag.named(name, help=help, default=getattr(_COST, field), **{"parse": float_in(0), **spec})


COMMAND_FLAGS: tuple[Flag, ...] = (
    Flag.named(
        "--trace",
        nargs="+",
        parse=Path,
        shown="a built-in workload",
        help="trace file(s): eplb safetensors/npz, SGLang stat dump, SGLang per_pass dumps (one per "
        "rank), OpenEvolve JSON",
    ),
    Flag.named(
        "--trace-format",
        choices=FORMATS,
        default="auto",
        shown="detect",
        help="input format",
    ),
    Flag.named(
        "--preset",
        choices=tuple(sorted(PRESETS)),
        default="deepseek-v3",
        help="workload preset: the model's shape and its load",
        elsewhere=(
            Default(
                commands=("demo",),
                value=DEMO_PRESET,
                shown=DEMO_PRESET,
                why="the demo runs the model itself on CPU ranks: the tiny preset's keeps a pass "
                "within milliseconds",
            ),
        ),
    ),
    Flag.named(
        "--steps",
        parse=int_in(0),
        default=DEFAULT_STEPS,
        help="forward passes of the workload",
        elsewhere=(
            Default(
                commands=("sweep",),
                value=SWEEP_STEPS,
                shown=str(SWEEP_STEPS),
                why="a sweep simulates once per point, up to one per redundant count and interval: half "
                "the workload keeps the default sweep within a minute",
            ),
            Default(
                commands=("demo",),
                value=DEMO_STEPS,
                shown=f"{DEMO_STEPS} per rank",
                why="the demo runs a real model on every rank: a few hundred passes take seconds",
            ),
        ),
    ),
    Flag.named(
        "--prefill-fraction",
        parse=float_in(0, 1),
        shown="the preset's",
        help="share of prefill passes in the workload",
    ),
    Flag.named(
        "--num-groups",
        parse=int_in(1),
        shown="from the trace or preset, else 1",
        help="expert groups of the model",
    ),
    Flag.named(
        "--bytes-per-expert",
        parse=int_in(0, MAX_BYTES_PER_EXPERT),
        shown=f"from the trace or preset, else {DEEPSEEK_V3_BYTES_PER_EXPERT}",
        help="bytes of one expert in one layer",
    ),
    Flag.named(
        "--score-from",
        parse=int_in(0),
        metavar="N",
        shown="the first rebalance",
        help="score every run from pass N on, so runs whose first rebalances differ compare on the "
        "same passes",
    ),
    Flag.named(
        "--solver-option",
        action="append",
        default=[],  # argparse appends to a copy
        metavar="KEY=VALUE",
        shown="",
        help="an eplb.solver SolveOptions field for the solver-backed runs, e.g. prediction=robust "
        "or time_budget_s=0.2 (repeatable)",
    ),
    _cost_flag("--cost-base-us", "base_us", "a: µs per GPU per layer"),
    _cost_flag("--cost-per-expert-us", "per_expert_us", "b: µs per active expert"),
    _cost_flag("--cost-per-token-us", "per_token_us", "c: µs per routed token"),
    _cost_flag("--nvlink-gbps", "nvlink_gbps", "intra-node GB/s per GPU", parse=float_in(0, above=True)),
    _cost_flag(
        "--internode-gbps", "internode_gbps", "inter-node GB/s per GPU", parse=float_in(0, above=True)
    ),
    _cost_flag(
        "--cost-transfer-kind",
        "transfer_kind",
        "continuous mode: a swap beside the passes goes by paced copy-engine copies or SM copy kernels",
        parse=None,
        choices=TRANSFER_KINDS,
    ),
    _cost_flag(
        "--cost-interference",
        "interference",
        "continuous mode: slowdown of a pass while a swap runs beside it, e.g. 0.03",
        shown="from H200 figures by transfer kind and pace, docs/simulate.md",
    ),
    Flag.named(
        "--plots",
        parse=Path,
        metavar="DIR",
        shown="",
        help="write PNG plots into DIR (eplb sweep: with --tradeoff, DIR/tradeoff.png)",
    ),
    Flag.named("--seed", parse=int_in(0, MAX_SEED), default=0, help="random seed"),
    Flag.named(
        "--disable-tqdm",
        action="store_true",
        default=False,
        shown="",
        help="no progress bars",
    ),
    Flag.named(
        "--json",
        dest="json_out",
        parse=Path,
        shown="",
        help="also write the results as JSON to this file ('-' for stdout)",
    ),
)
"""The offline commands' shared flags (not the server's)."""

FLAGS: tuple[Flag, ...] = (
    *(replace(flag, elsewhere=_ELSEWHERE.get(flag.name, ())) for flag in SERVER_FLAGS),
    *COMMAND_FLAGS,
)
"""Every shared flag, once: the server's (with the defaults eplb's commands take instead) and the
offline commands'."""

FLAG = {flag.name: flag for flag in FLAGS}
"""The table by flag name."""

OWN_PER_COMMAND = {
    "--out": "each command's own output: a folder (solve, dashboards) or a file (trace, workload)"
}
"""Option strings several commands declare on their own, each with its own meaning, and why."""

SERVER_NAMES = tuple(flag.name for flag in SERVER_FLAGS)
"""The server's flags, in its parser's order."""
INPUT = (
    "input (a trace, or a built-in synthetic workload)",
    ("--trace", "--trace-format", "--preset", "--steps", "--prefill-fraction"),
)
TOPOLOGY = (
    "expert parallelism (SGLang flag names)",
    ("--ep-size", "--nnodes", "--ep-num-redundant-experts", "--num-groups", "--bytes-per-expert"),
)
RECORDING = (
    "--expert-distribution-recorder-buffer-size",
    "--eplb-record-prefill-only",
    "--ep-dispatch-algorithm",
    "--solver-option",
    "--init-expert-location",
)
"""The window, recording, dispatch, solver options and start of a replay or a solve."""
SCHEDULE = (
    "rebalancing (SGLang's flag names, and eplb's server flags)",
    (
        "--eplb-rebalance-mode",
        "--eplb-rebalance-num-iterations",
        "--eplb-max-moved-experts",
        "--eplb-shift-burst",
        "--eplb-initial-full-plan",
        "--eplb-transfer-gbps",
        "--eplb-min-rebalancing-utilization-threshold",
        "--score-from",
        *RECORDING,
    ),
)
COST = (
    "cost model (defaults: DeepSeek-V3 dims on an H200, docs/simulate.md)",
    ("--cost-base-us", "--cost-per-expert-us", "--cost-per-token-us", "--nvlink-gbps", "--internode-gbps",
     "--cost-transfer-kind", "--cost-interference", "--eplb-dispatch-cost"),
)  # fmt: skip
"""The groups of the replays' flags: (title, flag names)."""


def add(parser: argparse._ActionsContainer, command: str, *names: str, title: str | None = None) -> None:
    """Add the flags ``names`` of :data:`FLAGS` to ``command``'s parser (in a group titled ``title``)."""
    target = parser.add_argument_group(title) if title else parser
    add_flags(target, (FLAG[name] for name in names), command)


def add_groups(parser: argparse.ArgumentParser, command: str, *groups: tuple[str, tuple[str, ...]]) -> None:
    """Add each group of flags, ``(title, names)``, to ``command``'s parser."""
    for title, names in groups:
        add(parser, command, *names, title=title)
