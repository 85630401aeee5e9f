"""Command-line options shared by ``eplb simulate``, ``eplb sweep`` and ``eplb solve``.

Flags that mean what SGLang's mean keep SGLang's names (``--ep-size``, ``--nnodes``,
``--ep-num-redundant-experts``, ``--eplb-rebalance-num-iterations``,
``--expert-distribution-recorder-buffer-size``, ``--eplb-record-prefill-only``,
``--eplb-min-rebalancing-utilization-threshold``, ``--ep-dispatch-algorithm``,
``--init-expert-location``), as do eplb's own server flags (``--eplb-rebalance-mode``,
``--eplb-max-moved-experts``, ``--eplb-transfer-gbps``), and they become the
``eplb.config.EplbConfig`` the simulation holds (``SimulationConfig.eplb``): their combinations are
checked by it, so an invalid one fails with the same message a server would give, and every
value derived from them (interval, window, budget, initial full plan, dispatch) is its. Periodic
defaults differ from SGLang's where an offline study needs it (EP32 over 4 nodes, 32 redundant
experts, interval 500).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from eplb.config import DISPATCH_ALGORITHMS, REBALANCE_MODES, SHIFT_BURST, EplbConfig
from eplb.placement.model import Placement
from eplb.policy.cost_model import DEEPSEEK_V3_BYTES_PER_EXPERT, TRANSFER_KINDS, CostModel
from eplb.simulate.config import SimulationConfig
from eplb.simulate.planners import parse_solver_options
from eplb.traces import Trace

DEFAULT_STEPS = 4000
DEFAULT_INTERVAL = 500
"""Periodic mode's interval here (SGLang's server default, 1000, leaves fewer rebalances in a short trace)."""
DEFAULT_MODE = "periodic"


def add_input_arguments(parser: argparse.ArgumentParser, default_steps: int = DEFAULT_STEPS) -> None:
    """``--trace`` files, or a built-in workload (``--preset``, ``--steps``, ``--prefill-fraction``)."""
    from eplb.traces import FORMATS
    from eplb.workloads import PRESETS

    g = parser.add_argument_group("input (a trace, or a built-in synthetic workload)")
    g.add_argument(
        "--trace",
        nargs="+",
        type=Path,
        default=None,
        help="trace file(s): eplb safetensors/npz, SGLang stat dump, SGLang per_pass dumps (one per rank), "
        "OpenEvolve JSON",
    )
    g.add_argument("--trace-format", choices=FORMATS, default="auto", help="input format (default: detect)")
    g.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="deepseek-v3",
        help="workload preset (default: %(default)s)",
    )
    g.add_argument(
        "--steps",
        type=int,
        default=default_steps,
        help="workload steps (forward passes) (default: %(default)s)",
    )
    g.add_argument("--prefill-fraction", type=float, default=None, help="workload share of prefill passes")


def add_topology_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("expert parallelism (SGLang flag names)")
    g.add_argument(
        "--ep-size", type=int, default=None, help="EP ranks (GPUs) (default: the preset's; 32 for a trace)"
    )
    g.add_argument(
        "--nnodes",
        type=int,
        default=None,
        help="nodes the EP ranks span (default: the preset's; 4 for a trace)",
    )
    g.add_argument(
        "--ep-num-redundant-experts",
        type=int,
        default=None,
        help="physical slots beyond one per logical expert (default: the preset's; 32 for a trace)",
    )
    g.add_argument(
        "--num-groups",
        type=int,
        default=None,
        help="expert groups of the model (default: from the trace or preset, else 1)",
    )
    g.add_argument(
        "--bytes-per-expert",
        type=int,
        default=None,
        help=f"bytes of one expert in one layer (default: from the trace or preset, else {DEEPSEEK_V3_BYTES_PER_EXPERT})",
    )


def add_schedule_arguments(parser: argparse.ArgumentParser, schedule: bool = True) -> None:
    """Recording, dispatch and initial placement; with ``schedule`` also the interval and threshold."""
    from eplb.config import CONTINUOUS_INTERVAL, CONTINUOUS_MAX_MOVED_EXPERTS

    g = parser.add_argument_group("rebalancing (SGLang's flag names, and eplb's server flags)")
    if schedule:
        g.add_argument(
            "--eplb-rebalance-mode",
            choices=REBALANCE_MODES,
            default=DEFAULT_MODE,
            help="periodic: SGLang's schedule, the transfer stalls serving; continuous: budgeted moves "
            "every few passes, each swap sent beside the following passes (default: %(default)s)",
        )
        g.add_argument(
            "--eplb-rebalance-num-iterations",
            type=int,
            default=None,
            help=f"rebalance every N recorded passes (default: {DEFAULT_INTERVAL}, SGLang's server default "
            f"is 1000; continuous: {CONTINUOUS_INTERVAL})",
        )
        g.add_argument(
            "--eplb-max-moved-experts",
            type=int,
            default=None,
            help="budget of one rebalance in cross-GPU expert copies, for the solver-backed runs "
            f"(default: none; continuous: {CONTINUOUS_MAX_MOVED_EXPERTS}, on average: see --eplb-shift-burst)",
        )
        g.add_argument(
            "--eplb-shift-burst",
            type=int,
            default=SHIFT_BURST,
            help="continuous mode: on a domain shift a plan may move up to this many rebalances' "
            f"budgets, repaid by the following ones; 1: never (default: {SHIFT_BURST})",
        )
        g.add_argument(
            "--eplb-initial-full-plan",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="continuous mode: the first plan from the trivial placement moves without the budget "
            "(default: on)",
        )
        g.add_argument(
            "--eplb-transfer-gbps",
            type=float,
            default=None,
            help="continuous mode: pace of a swap beside the passes, GB/s into one GPU (default: unpaced)",
        )
        g.add_argument(
            "--eplb-min-rebalancing-utilization-threshold",
            type=float,
            default=1.0,
            help="skip a rebalance when the window's balancedness is above this (default: %(default)s)",
        )
        g.add_argument(
            "--score-from",
            type=int,
            default=None,
            metavar="N",
            help="score every run from pass N on, so runs whose first rebalances differ compare on the "
            "same passes (default: the first rebalance)",
        )
    g.add_argument(
        "--expert-distribution-recorder-buffer-size",
        type=int,
        default=None,
        help="window the planner sees, in recorded passes (default: "
        + (
            "the rebalance interval; continuous mode's from eplb.config, and only it may exceed the interval)"
            if schedule
            else "the whole trace)"
        ),
    )
    g.add_argument(
        "--eplb-record-prefill-only", action="store_true", help="record and count only prefill passes"
    )
    g.add_argument(
        "--ep-dispatch-algorithm",
        choices=DISPATCH_ALGORITHMS,
        default="static",
        help="dispatch of the baseline and of --algorithms entries without ':mode' (default: %(default)s)",
    )
    g.add_argument(
        "--solver-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an eplb.solver SolveOptions field for the solver-backed runs, e.g. prediction=robust "
        "or time_budget_s=0.2 (repeatable)",
    )
    g.add_argument(
        "--init-expert-location",
        default="trivial",
        help="placement before the first rebalance: 'trivial', an SGLang JSON with physical_to_logical_map, "
        "or a placement .safetensors from 'eplb solve' (default: %(default)s)",
    )


def add_cost_arguments(parser: argparse.ArgumentParser) -> None:
    d = CostModel()
    g = parser.add_argument_group("cost model (defaults: DeepSeek-V3 dims on an H200, docs/simulate.md)")
    g.add_argument(
        "--cost-base-us", type=float, default=d.base_us, help="a: µs per GPU per layer (%(default)s)"
    )
    g.add_argument(
        "--cost-per-expert-us",
        type=float,
        default=d.per_expert_us,
        help="b: µs per active expert (%(default)s)",
    )
    g.add_argument(
        "--cost-per-token-us", type=float, default=d.per_token_us, help="c: µs per routed token (%(default)s)"
    )
    g.add_argument(
        "--nvlink-gbps", type=float, default=d.nvlink_gbps, help="intra-node GB/s per GPU (%(default)s)"
    )
    g.add_argument(
        "--internode-gbps", type=float, default=d.internode_gbps, help="inter-node GB/s per GPU (%(default)s)"
    )
    g.add_argument(
        "--cost-transfer-kind",
        choices=TRANSFER_KINDS,
        default=d.transfer_kind,
        help="continuous mode: a swap beside the passes goes by paced copy-engine copies or SM copy "
        "kernels (%(default)s)",
    )
    g.add_argument(
        "--cost-interference",
        type=float,
        default=None,
        help="continuous mode: slowdown of a pass while a swap runs beside it, e.g. 0.03 (default: "
        "from H200 figures by transfer kind and pace, docs/simulate.md)",
    )


def load_input(args: argparse.Namespace, quiet: bool = False) -> Trace:
    """The trace named by ``--trace``, or the built-in workload ``--preset`` / ``--steps`` / ``--seed``."""
    if args.trace:
        from eplb.traces import load_trace

        return load_trace(args.trace, args.trace_format)
    from eplb.workloads import WorkloadConfig, generate

    if args.steps < 2:
        raise ValueError(f"--steps must be >= 2, got {args.steps}")
    cfg = WorkloadConfig(preset=args.preset, num_steps=args.steps, seed=args.seed)
    if args.prefill_fraction is not None:
        cfg = cfg.with_(prefill_fraction=args.prefill_fraction)
    if not quiet:
        print(f"generating the {args.preset} workload: {args.steps} steps, seed {args.seed}", file=sys.stderr)
    return generate(cfg)


TRACE_TOPOLOGY = {"ep_size": 32, "nnodes": 4, "ep_num_redundant_experts": 32}
"""EP32 over 4 nodes with 32 redundant experts: the topology a recorded trace is replayed on by default."""


def default_topology(args: argparse.Namespace) -> dict[str, int]:
    """The EP topology flags not given take: the preset's serving topology (eplb.workloads.PRESETS;
    a preset's experts must spread over its ranks), or :data:`TRACE_TOPOLOGY` for a trace."""
    if getattr(args, "trace", None) or not hasattr(args, "preset"):
        return dict(TRACE_TOPOLOGY)
    from eplb.workloads import PRESETS

    preset = PRESETS[args.preset]
    return {"ep_size": preset.ep_size, "nnodes": preset.nnodes, "ep_num_redundant_experts": preset.redundant}


def simulation_config(args: argparse.Namespace, trace: Trace, **overrides: Any) -> SimulationConfig:
    """The server's flags as an ``EplbConfig`` (checked against ``trace`` as a server would check
    them), with the offline flags, as the simulation config; ``overrides`` replace flags by
    ``EplbConfig`` field name."""
    unknown = set(overrides) - {f.name for f in fields(EplbConfig)}
    if unknown:
        raise TypeError(f"unknown overrides {sorted(unknown)}")
    values = {**vars(args), **overrides, "enable_eplb": True, "num_experts": trace.num_experts}
    for name, value in default_topology(args).items():
        if values.get(name) is None:
            values[name] = value
    periodic = values.get("eplb_rebalance_mode", DEFAULT_MODE) == "periodic"
    if periodic and values.get("eplb_rebalance_num_iterations") is None:
        values["eplb_rebalance_num_iterations"] = DEFAULT_INTERVAL  # continuous: EplbConfig's default
    server = EplbConfig.from_namespace(argparse.Namespace(**values))
    if server.eplb_record_prefill_only and not trace.is_prefill_F.any():
        raise ValueError("--eplb-record-prefill-only: the trace has no prefill steps")
    given = {"bytes_per_expert": args.bytes_per_expert, "num_groups": args.num_groups}
    return SimulationConfig.for_trace(
        trace,
        eplb=server,
        **{name: value for name, value in given.items() if value is not None},
        seed=args.seed,
        cost=cost_model(args),
        solver_options=parse_solver_options(args.solver_option),
        score_from=getattr(args, "score_from", None),
    )


def cost_model(args: argparse.Namespace) -> CostModel:
    """The cost model of the ``--cost-*`` / ``--*-gbps`` flags (defaults where a command has none)."""
    if not hasattr(args, "cost_base_us"):
        return CostModel()
    return CostModel(
        base_us=args.cost_base_us,
        per_expert_us=args.cost_per_expert_us,
        per_token_us=args.cost_per_token_us,
        nvlink_gbps=args.nvlink_gbps,
        internode_gbps=args.internode_gbps,
        transfer_kind=args.cost_transfer_kind,
        interference=args.cost_interference,
    )


def initial_placement(args: argparse.Namespace, trace: Trace, config: SimulationConfig) -> Placement | None:
    """``--init-expert-location``: None for trivial, else the placement the file holds."""
    source = args.init_expert_location
    if source == "trivial":
        return None
    flags = config.eplb
    if str(source).endswith(".safetensors"):
        from eplb.placement.io import load_placement

        placement, _ = load_placement(source)
    else:
        placement = Placement.from_sglang(source, flags.ep_size, flags.nnodes)
    if (placement.num_layers, placement.num_logical, placement.num_gpus, placement.num_nodes) != (
        trace.num_layers,
        trace.num_experts,
        flags.ep_size,
        flags.nnodes,
    ) or placement.num_redundant != flags.ep_num_redundant_experts:
        raise ValueError(
            f"--init-expert-location: the placement is [L={placement.num_layers}, E={placement.num_logical}, "
            f"P={placement.num_physical}] on {placement.num_gpus} GPUs / {placement.num_nodes} nodes, but the trace "
            f"and flags need [L={trace.num_layers}, E={trace.num_experts}, "
            f"P={trace.num_experts + flags.ep_num_redundant_experts}] on {flags.ep_size} / {flags.nnodes}"
        )
    return placement
