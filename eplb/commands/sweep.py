"""``eplb sweep``: how few redundant experts, and how long an interval, reach a target balancedness.

With ``--tradeoff`` it instead compares periodic repacking at several intervals with continuous
budgeted moves at several budgets, on the same trace and scored steps: prefill balancedness and
modeled speed-up against bytes moved per 1000 passes, as a table and ``--plots DIR/tradeoff.png``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from typing import Any

from eplb.commands import flags
from eplb.commands.common import (
    check_output_folder,
    check_outputs,
    write_json,
)
from eplb.commands.sizes import check_slots, check_workload
from eplb.config import MAX_WINDOW_PASSES, effective_dispatch
from eplb.flags import float_in, int_in

HELP = "find the fewest redundant experts and the longest rebalance interval that reach a target balancedness"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from eplb.simulate.sweep import METRICS

    parser.add_argument(
        "--target",
        type=float_in(0, 1, above=True),
        default=0.85,
        help="balancedness to reach (default: %(default)s)",
    )
    parser.add_argument(
        "--metric",
        choices=sorted(METRICS),
        default="prefill",
        help="which balancedness: mean over prefill steps, over all steps, or the 5th percentile "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--algorithm",
        default="auto",
        metavar="ALGO[:DISPATCH]",
        help="the run to sweep (default: %(default)s)",
    )
    parser.add_argument(
        "--redundant",
        type=int_in(0),
        nargs="+",
        default=None,
        help="redundant-expert counts to try (default: every count up to 2 x --ep-size that divides evenly)",
    )
    parser.add_argument(
        "--intervals",
        type=int_in(1, MAX_WINDOW_PASSES),
        nargs="+",
        default=[100, 200, 500, 1000, 2000],
        help="rebalance intervals to try, longest first (default: %(default)s)",
    )
    from eplb.simulate.tradeoff import CONTINUOUS_BUDGETS, PERIODIC_INTERVALS

    t = parser.add_argument_group("--tradeoff: periodic vs continuous against bytes moved")
    t.add_argument(
        "--tradeoff",
        action="store_true",
        help="compare --periodic-algorithm every --periodic-intervals with --algorithm in continuous mode "
        "(--eplb-rebalance-num-iterations, --expert-distribution-recorder-buffer-size) at each of --budgets",
    )
    t.add_argument("--periodic-algorithm", default="deepseek", help="the periodic run (default: %(default)s)")
    t.add_argument(
        "--periodic-intervals",
        type=int_in(1, MAX_WINDOW_PASSES),
        nargs="+",
        default=list(PERIODIC_INTERVALS),
        help="its intervals (default: %(default)s)",
    )
    t.add_argument(
        "--budgets",
        type=int_in(0),
        nargs="+",
        default=list(CONTINUOUS_BUDGETS),
        help="continuous budgets, expert copies per rebalance (default: %(default)s)",
    )
    flags.add(t, "sweep", "--plots")
    flags.add_groups(parser, "sweep", flags.INPUT, flags.TOPOLOGY, flags.SCHEDULE, flags.COST)
    flags.add(parser, "sweep", "--seed", "--disable-tqdm", "--json")


def run(args: argparse.Namespace) -> int:
    from eplb.simulate.options import load_input, simulation_config
    from eplb.simulate.planners import RunSpec
    from eplb.simulate.sweep import SweepPoint, redundant_candidates, sweep

    check_outputs(args.json_out)  # an unwritable output fails now, not after the sweep
    if args.plots is not None and not args.tradeoff:
        raise ValueError("--plots: only --tradeoff draws a plot")
    if args.init_expert_location != "trivial":
        # Each point has its own redundant count or schedule: no one placement starts them all.
        raise ValueError("--init-expert-location: eplb sweep starts every point from the trivial placement")
    check_slots(args, redundant=args.redundant)
    check_workload(args)
    if args.tradeoff:
        return _tradeoff(args)
    if not 0.0 < args.target <= 1.0:
        raise ValueError(f"--target must lie in (0, 1], got {args.target}")
    spec = RunSpec.parse(args.algorithm, effective_dispatch(args.ep_dispatch_algorithm))
    if spec.algorithm == "none":
        raise ValueError("--algorithm none never rebalances: sweep a planner (deepseek, scipy, auto)")
    trace = load_input(args, quiet=args.disable_tqdm)
    config = simulation_config(args, trace)
    ep_size = config.eplb.ep_size
    redundant = args.redundant or redundant_candidates(trace.num_experts, ep_size, 2 * ep_size)
    for r in redundant:
        # Each candidate is checked as a server would check it (slots must divide over the GPUs).
        simulation_config(args, trace, ep_num_redundant_experts=r)
    intervals = [i for i in args.intervals if i < trace.num_steps]
    if not intervals:
        raise ValueError(f"every --intervals value is >= the trace's {trace.num_steps} steps")
    to_stdout = args.json_out is not None and str(args.json_out) == "-"

    def report(point: SweepPoint) -> None:
        if not args.disable_tqdm:
            mark = "reached" if point.reached else "below"
            print(
                f"  redundant {point.num_redundant:>4}  interval {point.interval:>5}: "
                f"{args.metric} balancedness {point.value:.3f} ({mark}), "
                f"speed-up {point.summary['speedup_vs_none']:.3f}x",
                file=sys.stderr,
            )

    result = sweep(
        trace,
        spec,
        config,
        target=args.target,
        redundant=redundant,
        intervals=intervals,
        metric=args.metric,
        on_point=report,
    )
    if not to_stdout:
        print(
            f"{spec.name}, target {args.metric} balancedness {args.target}: "
            + verdict(result, config.eplb.rebalance_interval)
        )
    write_json(
        {
            "run": spec.name,
            "target": args.target,
            "metric": args.metric,
            "redundant": result["redundant"],
            "interval": result["interval"],
            "redundant_used_for_intervals": result["redundant_used_for_intervals"],
            "points": [asdict(p) for p in result["points"]],
        },
        args.json_out,
    )
    return 0


def verdict(result: dict[str, Any], interval: int) -> str:
    """The sweep's answer in words: the interval sweep runs with the redundant count found, or,
    when none reached the target, with the largest one tried; say which."""
    r, i, used = result["redundant"], result["interval"], result["redundant_used_for_intervals"]
    if r is not None:
        first = f"fewest redundant experts {r} (at interval {interval})"
        if i is None:
            return first + f"; no interval tried reaches it with {r} redundant"
        return first + f"; longest interval {i} (with {r} redundant)"
    first = f"no redundant count tried reaches it at interval {interval}"
    if i is None:
        return first + f", and no interval tried does with the most tried ({used} redundant)"
    return first + f"; with the most tried ({used} redundant) a shorter interval does: longest {i}"


def _tradeoff(args: argparse.Namespace) -> int:
    from eplb.simulate.options import load_input, simulation_config
    from eplb.simulate.planners import RunSpec
    from eplb.simulate.tradeoff import default_settings, tradeoff, tradeoff_table

    check_output_folder(args.plots)
    dispatch = effective_dispatch(args.ep_dispatch_algorithm)
    periodic = RunSpec.parse(args.periodic_algorithm, dispatch)
    continuous = RunSpec.parse(args.algorithm, dispatch)
    if "none" in (periodic.algorithm, continuous.algorithm):
        raise ValueError("--tradeoff compares planners: none never rebalances")
    trace = load_input(args, quiet=args.disable_tqdm)
    # The schedule flags describe the continuous runs; the periodic ones take --periodic-intervals.
    args.eplb_rebalance_mode = "continuous"
    base = simulation_config(args, trace)
    settings = default_settings(
        periodic_algorithm=periodic.algorithm,
        continuous_algorithm=continuous.algorithm,
        dispatch=continuous.dispatch,
        periodic_intervals=args.periodic_intervals,
        continuous_interval=base.eplb.rebalance_interval,
        continuous_window=base.eplb.expert_distribution_recorder_buffer_size,
        budgets=args.budgets,
    )
    to_stdout = args.json_out is not None and str(args.json_out) == "-"

    def report(row: dict[str, object]) -> None:
        if not args.disable_tqdm:
            print(f"  {row['label']}: done", file=sys.stderr)

    rows = tradeoff(trace, settings, base, on_row=report)
    out: dict[str, object] = {"config": base.to_dict(), "rows": rows}
    if not to_stdout:
        flags = base.eplb
        print(
            f"{trace.num_steps} steps, EP{flags.ep_size} on {flags.nnodes} node(s), "
            f"{flags.ep_num_redundant_experts} redundant; scored from step {rows[0]['scored_from']}"
        )
        print(tradeoff_table(rows))
    if args.plots is not None:
        from eplb.simulate.plots import write_tradeoff_plot

        out["plots"] = [str(write_tradeoff_plot(rows, args.plots / "tradeoff.png"))]
        if not to_stdout:
            print(f"plot: {out['plots'][0]}")  # type: ignore[index]
    write_json(out, args.json_out)
    return 0
