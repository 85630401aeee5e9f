"""``eplb simulate``: replay a trace (or the built-in DeepSeek-V3 workload) under several planners.

With no arguments it generates the deepseek-v3 synthetic workload and compares no balancing with
DeepSeek's algorithm and the SciPy solver at EP32 over 4 nodes with 32 redundant experts, on
SGLang's periodic schedule; ``--eplb-rebalance-mode continuous`` replays eplb's continuous one.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from eplb.commands.common import (
    add_json_out,
    add_progress,
    add_seed,
    check_output_folder,
    check_outputs,
    progress,
    require_extra,
    write_json,
)

HELP = "simulate rebalancing offline on a trace or a built-in workload: balance, speed-up, moves"

DEFAULT_ALGORITHMS = ("none", "deepseek", "scipy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from eplb.simulate.options import (
        add_cost_arguments,
        add_input_arguments,
        add_schedule_arguments,
        add_topology_arguments,
    )

    parser.add_argument(
        "--algorithms",
        nargs="+",
        default=list(DEFAULT_ALGORITHMS),
        metavar="ALGO[:DISPATCH]",
        help="runs to compare: none | deepseek | deepseek_hierarchical | scipy | auto, each optionally "
        f"with :static | :dynamic | :weighted | :fake (default: {' '.join(DEFAULT_ALGORITHMS)})",
    )
    add_input_arguments(parser)
    add_topology_arguments(parser)
    add_schedule_arguments(parser)
    add_cost_arguments(parser)
    parser.add_argument("--plots", type=Path, default=None, metavar="DIR", help="write PNG plots into DIR")
    parser.add_argument(
        "--no-timeline", action="store_true", help="leave per-step balancedness and time out of the JSON"
    )
    add_seed(parser)
    add_progress(parser)
    add_json_out(parser)


def run(args: argparse.Namespace) -> int:
    from eplb.simulate import parse_runs, simulate
    from eplb.simulate.options import initial_placement, load_input, simulation_config

    runs = parse_runs(args.algorithms, args.ep_dispatch_algorithm)
    if args.plots is not None:
        require_extra("matplotlib", "plots", "--plots")  # before the simulation, not after it
    check_outputs(args.json_out)  # an unwritable output fails now, not after the simulation
    check_output_folder(args.plots)
    trace = load_input(args, quiet=args.disable_tqdm)
    config = simulation_config(args, trace)
    initial = initial_placement(args, trace, config)
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
