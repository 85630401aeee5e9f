"""``eplb simulate``: replay a trace (or the built-in DeepSeek-V3 workload) under several planners.

With no arguments it generates the deepseek-v3 synthetic workload and compares no balancing with
DeepSeek's algorithm and the SciPy solver at EP32 over 4 nodes with 32 redundant experts, on
SGLang's periodic schedule; ``--eplb-rebalance-mode continuous`` replays eplb's continuous one.
``--rank-failure STEP:RANK`` (repeatable) loses ranks at given steps and reports, per loss, each
run's balance over the survivors and the bytes reloaded and moved (eplb.simulate.failure): the
solver runs' degraded plans, SGLang's ``elasticity_aware`` (with ``--sglang-peer``) and ``none``
(no replanning).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from eplb.commands import flags
from eplb.commands.common import (
    check_output_folder,
    check_outputs,
    progress,
    require_extra,
    write_json,
)
from eplb.commands.sizes import check_slots, check_workload
from eplb.config import DISPATCH_ALGORITHMS, effective_dispatch

if TYPE_CHECKING:
    from eplb.placement.model import Placement
    from eplb.simulate.config import SimulationConfig
    from eplb.simulate.planners import RunSpec
    from eplb.traces import Trace

HELP = "simulate rebalancing offline on a trace or a built-in workload: balance, speed-up, moves"

DEFAULT_ALGORITHMS = ("none", "deepseek", "scipy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--algorithms",
        nargs="+",
        default=list(DEFAULT_ALGORITHMS),
        metavar="ALGO[:DISPATCH]",
        help="runs to compare: none | deepseek | deepseek_hierarchical | scipy | auto, each optionally "
        f"with :{' | :'.join(DISPATCH_ALGORITHMS)} (default: {' '.join(DEFAULT_ALGORITHMS)})",
    )
    flags.add_groups(parser, "simulate", flags.INPUT, flags.TOPOLOGY, flags.SCHEDULE, flags.COST)
    g = parser.add_argument_group("lost ranks (eplb.simulate.failure)")
    g.add_argument(
        "--rank-failure",
        action="append",
        default=[],
        metavar="STEP:RANK",
        help="lose EP rank RANK (or FIRST-LAST) before step STEP (repeatable); compares the runs' plans over "
        "the survivors, 'none' meaning no replanning, instead of the usual table",
    )
    g.add_argument(
        "--sglang-peer",
        type=Path,
        default=None,
        metavar="DIR",
        help="with --rank-failure: also run SGLang's elasticity_aware from DIR/sglang/srt/eplb/eplb_algorithms "
        "(python -m benchmarks.peers unpacks SGLang 0.5.23 into .peers/sglang-0.5.23)",
    )
    g.add_argument(
        "--reload-source",
        choices=("peer", "host", "checkpoint"),
        default="checkpoint",
        help="with --rank-failure: where experts lost with every replica are reloaded from (default: %(default)s)",
    )
    parser.add_argument(
        "--no-timeline", action="store_true", help="leave per-step balancedness and time out of the JSON"
    )
    flags.add(parser, "simulate", "--plots", "--seed", "--disable-tqdm", "--json")


def run(args: argparse.Namespace) -> int:
    from eplb.simulate import parse_runs, simulate
    from eplb.simulate.options import initial_placement, load_input, simulation_config

    runs = parse_runs(args.algorithms, effective_dispatch(args.ep_dispatch_algorithm))
    if args.plots is not None:
        require_extra("matplotlib", "plots", "--plots")  # before the simulation, not after it
    check_outputs(args.json_out)  # an unwritable output fails now, not after the simulation
    check_output_folder(args.plots)
    if args.sglang_peer is not None and not args.rank_failure:
        raise ValueError("--sglang-peer needs --rank-failure")
    if args.rank_failure:
        from eplb.simulate.failure import parse_rank_failures

        if args.plots is not None:
            raise ValueError("--plots: not with --rank-failure")
        # Checked before the trace is generated: the flags alone give the topology.
        parse_rank_failures(args.rank_failure, 1 << 62, args.ep_size or 1 << 30)
    check_slots(args)
    check_workload(args)
    trace = load_input(args, quiet=args.disable_tqdm)
    config = simulation_config(args, trace)
    initial = initial_placement(args, trace, config)
    if args.rank_failure:
        return _run_failures(args, runs, trace, config, initial)
    result = simulate(
        trace,
        runs,
        config,
        initial=initial,
        progress=lambda chunks: progress(
            chunks, disable=args.disable_tqdm, desc="simulate", total=len(chunks)
        ),
    )
    to_stdout = args.json_out is not None and str(args.json_out) == "-"
    if not to_stdout:
        flags = config.eplb
        print(
            f"{trace.num_steps} steps x {trace.num_layers} layers x {trace.num_experts} experts, "
            f"EP{flags.ep_size} on {flags.nnodes} node(s), {flags.ep_num_redundant_experts} redundant, "
            f"{flags.eplb_rebalance_mode} rebalancing every {flags.rebalance_interval} recorded steps "
            f"(window {flags.recorder_buffer_size}"
            + (
                f", at most {flags.max_moved_experts} expert copies, swaps paced at "
                + (f"{flags.eplb_transfer_gbps:g} GB/s" if flags.eplb_transfer_gbps else "link speed")
                if flags.continuous
                else ""
            )
            + f"); scored from step {result.scored_from}"
        )
        print(result.table())
        for note in result.notes:
            print(f"note: {note}")
    out = result.to_dict(timeline=not args.no_timeline)
    if args.plots is not None:
        from eplb.simulate.plots import write_plots

        out["plots"] = [str(p) for p in write_plots(result, args.plots)]
        if not to_stdout:
            print("plots: " + ", ".join(out["plots"]))
    write_json(out, args.json_out)
    return 0


def _run_failures(
    args: argparse.Namespace,
    runs: list[RunSpec],
    trace: Trace,
    config: SimulationConfig,
    initial: Placement | None,
) -> int:
    """``--rank-failure``: the replay with lost ranks (eplb.simulate.failure), its table and JSON."""
    from eplb.simulate.failure import parse_rank_failures, simulate_rank_failures
    from eplb.simulate.sglang_peer import load_elasticity_aware

    flags = config.eplb
    failures = parse_rank_failures(args.rank_failure, trace.num_steps, flags.ep_size)
    sglang = None if args.sglang_peer is None else load_elasticity_aware(args.sglang_peer)
    result = simulate_rank_failures(
        trace,
        runs,
        config,
        failures,
        initial=initial,
        sglang=sglang,
        reload_source=args.reload_source,
        progress=lambda chunks: progress(
            chunks, disable=args.disable_tqdm, desc="simulate", total=len(chunks)
        ),
    )
    if not (args.json_out is not None and str(args.json_out) == "-"):
        print(
            f"{trace.num_steps} steps x {trace.num_layers} layers x {trace.num_experts} experts, "
            f"EP{flags.ep_size} on {flags.nnodes} node(s), {flags.ep_num_redundant_experts} redundant, "
            f"{flags.eplb_rebalance_mode} rebalancing every {flags.rebalance_interval} recorded steps; "
            f"reloads from {args.reload_source}"
        )
        print(result.table())
        for note in result.notes:
            print(f"note: {note}")
    write_json(result.to_dict(), args.json_out)
    return 0
