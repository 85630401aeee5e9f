"""Solver quality and speed against SGLang 0.5.23's DeepSeek EPLB, plan on window i, score on window i+1.

Shape legend: T steps, W window (passes), L layers, E logical experts, P physical slots, G GPUs, N nodes.

For every EP size (DeepSeek-V3 shape: 58 layers x 256 experts, 32 redundant slots, 64 at EP64 where
288 slots do not divide; EP 8/16/32/64 on
1/2/4/8 nodes) a synthetic deepseek-v3 trace (eplb.workloads: drift and workload shifts) is cut
into windows of W passes. Each planner sees window i and its own current placement, plans, and is
scored on window i+1:

- balancedness per prefill pass of window i+1 (mean over those passes of the model balancedness,
  mean/max GPU load averaged over layers), the headline;
- balancedness of window i+1's prefill passes summed (the figure design.md §5 quotes);
- expert copies moved across GPUs per rebalance (eplb.placement.diff), counted from the second
  rebalance on (the first one starts from the trivial placement for everyone);
- whole-model solve time (median over rebalances).

Peers (same run, same windows): SGLang's ``rebalance_experts`` on the window's sum, hierarchical
(what SGLang's ``--eplb-algorithm auto`` picks for DeepSeek-V3: 8 groups divisible by the nodes)
and global. Ours: ``eplb.solver.solve`` variants (see VARIANTS).

    python -m benchmarks.bench_solver                      # the full table (about 10 min on 2 cores)
    python -m benchmarks.bench_solver --quick              # EP32 only, fewer windows
    python -m benchmarks.bench_solver --timing             # solve time vs EP and layers
    OMP_NUM_THREADS=1 python -m benchmarks.bench_solver --continuous   # budgeted solves every 50 passes

``--continuous``: after a fresh plan on the first window, ``solve`` with a move budget every
``--interval`` passes on the last ``--window`` passes (EP32 and EP64); per solve its CPU time and
its predicted balancedness against what the next interval's passes get (load-weighted mean, and
the prefill passes' mean), its predicted gain against the realised one, and the copies it moves.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np

from benchmarks.harness import Stopwatch, write_result
from benchmarks.peers import load_sglang_deepseek
from eplb.config import EplbConfig
from eplb.placement.balance import model_balancedness
from eplb.placement.diff import diff_placements
from eplb.placement.model import Placement
from eplb.placement.share import static_weights
from eplb.policy.decision import Decider
from eplb.solver import Plan, SolveOptions, SolverPlanner, Topology, solve
from eplb.workloads import PRESETS, WorkloadConfig, generate

NODES_FOR_EP = {8: 1, 16: 2, 32: 4, 64: 8}


def num_physical(num_experts: int, redundant: int, ep: int) -> int:
    """E + redundant, rounded up to a multiple of EP (EP64: 256 + 32 = 288 does not divide, 320 does)."""
    return -(-(num_experts + redundant) // ep) * ep


VARIANTS: dict[str, dict[str, Any]] = {
    # The default: incremental from the current placement; auto forecast (robust on windows of
    # 500+ passes, decay on shorter ones).
    "scipy": {},
    "scipy decay": {"prediction": "decay"},
    "scipy robust": {"prediction": "robust"},
    # Planning on the plain window sum (isolates the forecast's contribution).
    "scipy sum": {"prediction": "sum"},
    # A fresh plan each time (GPUs relabelled to the current placement): best balance, more moves.
    "scipy fresh": {"incremental": False},
    # Fewer or more moves.
    "scipy copy_cost=0.005": {"copy_cost": 0.005},
    "scipy copy_cost=0.001": {"copy_cost": 0.001},
    # Dispatch weights from the LP split, scored with those weights.
    "scipy weighted": {"weighted": True},
}

Planner = Callable[[np.ndarray, Placement], tuple[Placement, np.ndarray | None, bool]]


def peer_planner(topology: Topology, hierarchical: bool) -> Planner:
    """SGLang 0.5.23's DeepSeek ``rebalance_experts`` on the window's summed load."""
    import torch

    module = load_sglang_deepseek()

    def plan(window_WLE: np.ndarray, current: Placement) -> tuple[Placement, np.ndarray | None, bool]:
        weight = torch.from_numpy(window_WLE.sum(axis=0).astype(np.float32))
        phy2log, log2phy, logcnt = module.rebalance_experts(
            weight,
            topology.num_physical,
            topology.num_groups,
            topology.num_nodes,
            topology.num_gpus,
            hierarchical,
        )
        placement = Placement.from_deepseek(phy2log, log2phy, logcnt, topology.num_gpus, topology.num_nodes)
        return placement, None, True

    return plan


def our_planner(topology: Topology, bytes_per_expert: int, **fields: Any) -> Planner:
    options = SolveOptions(bytes_per_expert=bytes_per_expert, **fields)

    def plan(window_WLE: np.ndarray, current: Placement) -> tuple[Placement, np.ndarray | None, bool]:
        result = solve(window_WLE, topology, current, options)
        return result.placement, result.dispatch_weights_LER, result.apply

    return plan


def evaluate(
    planner: Planner, counts_FLE: np.ndarray, is_prefill_F: np.ndarray, window: int, start: Placement
) -> dict[str, float]:
    """Roll ``planner`` over the windows; mean scores over rebalances (moves from the second one on)."""
    current, weights = start, None
    per_pass, summed, moved, seconds, applied = [], [], [], [], []
    for i in range(counts_FLE.shape[0] // window - 1):
        window_WLE = counts_FLE[i * window : (i + 1) * window]
        with Stopwatch() as clock:
            placement, new_weights, apply = planner(window_WLE, current)
        seconds.append(clock.wall_s)
        if apply:
            if i > 0:
                moved.append(diff_placements(current, placement).experts_moved_across_gpus)
            current, weights = placement, new_weights
        elif i > 0:
            moved.append(0)
        applied.append(apply)
        nxt = slice((i + 1) * window, (i + 2) * window)
        prefill = counts_FLE[nxt][is_prefill_F[nxt]]
        per_pass.append(float(model_balancedness(prefill, current, weights).mean()))
        summed.append(float(model_balancedness(prefill.sum(axis=0), current, weights)))
    return {
        "per_pass": float(np.mean(per_pass)),
        "summed": float(np.mean(summed)),
        "copies_moved": float(np.mean(moved)) if moved else 0.0,
        "solve_s": float(np.median(seconds)),
        "applied": float(np.mean(applied)),
        "rebalances": float(len(per_pass)),
    }


def run_quality(args: argparse.Namespace) -> list[dict[str, Any]]:
    preset = PRESETS["deepseek-v3"]
    rows = []
    for seed in args.seeds:
        for window in args.windows:
            steps = window * (args.rebalances + 1)
            trace = generate(WorkloadConfig(num_steps=steps, seed=seed))
            counts = trace.counts_FLE.astype(np.float64)
            for ep in args.ep:
                P = num_physical(preset.num_experts, args.redundant, ep)
                topology = Topology(
                    num_gpus=ep, num_nodes=NODES_FOR_EP[ep], num_physical=P, num_groups=preset.num_groups
                )
                start = Placement.trivial(
                    preset.num_layers, preset.num_experts, ep, P - preset.num_experts, NODES_FOR_EP[ep]
                )
                planners: dict[str, Planner] = {}
                if "hierarchical" in args.peers:
                    planners["peer sglang (hierarchical = auto)"] = peer_planner(topology, True)
                if "global" in args.peers:
                    planners["peer sglang (global)"] = peer_planner(topology, False)
                for name in args.variants:
                    planners[name] = our_planner(topology, preset.bytes_per_expert, **VARIANTS[name])
                for name, planner in planners.items():
                    result = evaluate(planner, counts, trace.is_prefill_F, window, start)
                    row = {
                        "seed": seed,
                        "window": window,
                        "ep": ep,
                        "nodes": NODES_FOR_EP[ep],
                        "planner": name,
                    }
                    rows.append({**row, **result})
                    print(_format_row(rows[-1]), flush=True)
    return rows


def run_timing(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Whole-model solve time of one fresh and one incremental solve vs EP and layer count."""
    import torch

    module = load_sglang_deepseek()
    preset = PRESETS["deepseek-v3"]
    trace = generate(WorkloadConfig(num_steps=2 * args.timing_window, seed=0))
    counts = trace.counts_FLE.astype(np.float64)
    rows = []
    for layers in args.timing_layers:
        for ep in args.ep:
            topology = Topology(
                num_gpus=ep,
                num_nodes=NODES_FOR_EP[ep],
                num_physical=num_physical(preset.num_experts, args.redundant, ep),
                num_groups=preset.num_groups,
            )
            w0 = counts[: args.timing_window, :layers]
            w1 = counts[args.timing_window :, :layers]
            weight = torch.from_numpy(w0.sum(axis=0).astype(np.float32))
            with Stopwatch() as clock:
                module.rebalance_experts(
                    weight, topology.num_physical, preset.num_groups, topology.num_nodes, ep, True
                )
            peer_s = clock.wall_s
            first = solve(w0, topology, None, SolveOptions())
            second = solve(w1, topology, first.placement, SolveOptions())
            no_milp = solve(w1, topology, first.placement, SolveOptions(milp_max_solves=0))
            row = {
                "layers": layers,
                "ep": ep,
                "peer_s": peer_s,
                "fresh_s": first.stats["solve_seconds"],
                "incremental_s": second.stats["solve_seconds"],
                "incremental_no_milp_s": no_milp.stats["solve_seconds"],
                "milp_s": first.stats.get("milp_seconds", 0.0),
            }
            rows.append(row)
            print(
                json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
                flush=True,
            )
    return rows


def run_continuous(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Budgeted incremental solves every ``args.interval`` passes: solve time and prediction error."""
    preset = PRESETS["deepseek-v3"]
    rows = []
    for seed in args.seeds:
        trace = generate(WorkloadConfig(num_steps=args.continuous_steps, seed=seed))
        counts = trace.counts_FLE
        for ep in [e for e in args.ep if e in (32, 64)]:
            P = num_physical(preset.num_experts, args.redundant, ep)
            topology = Topology(num_gpus=ep, num_nodes=NODES_FOR_EP[ep], num_physical=P, num_groups=8)
            current = solve(counts[: args.window_passes], topology, None, SolveOptions()).placement
            options = SolveOptions(
                max_moved_experts=args.budget,
                bytes_per_expert=preset.bytes_per_expert,
                holdout_passes=args.holdout_passes,
                dispatch="static" if args.static_dispatch else "dynamic",
            )
            # The decisions a server in continuous mode takes (eplb.policy.decision): the interval
            # as the horizon, the current placement's age, swaps paced at 100 GB/s beside the passes.
            flags = EplbConfig(
                ep_size=ep,
                nnodes=NODES_FOR_EP[ep],
                eplb_rebalance_mode="continuous",
                eplb_rebalance_num_iterations=args.interval,
                eplb_max_moved_experts=args.budget,
                eplb_shift_burst=1,
                eplb_transfer_gbps=100.0,
            )
            decider = Decider(flags, fitted=True)
            decider.fitted_at = args.window_passes
            planner = SolverPlanner(options=options, num_groups=8)

            def served(load_nLE: np.ndarray, placement: Placement) -> np.ndarray:
                """Per-pass balancedness as the passes are dispatched (static maps or an even split)."""
                weights = static_weights(placement) if args.static_dispatch else None
                return model_balancedness(load_nLE, placement, weights)

            keys = ("cpu_s", "err", "err_prefill", "gain_err", "copies", "ran_prefill")
            samples: dict[str, list[float]] = {k: [] for k in keys}
            applied = []
            for t in range(args.window_passes, counts.shape[0] - args.interval + 1, args.interval):
                with Stopwatch() as clock:
                    window = counts[t - args.window_passes : t]
                    plan = cast(Plan, decider.planner(planner, counted_pass=t)(window, current))
                moved = plan.stats["copies_moved"] if plan.apply else 0.0
                decider.record(counted_pass=t, applied=plan.apply, copies=moved)
                nxt = slice(t, t + args.interval)
                load = counts[nxt].astype(np.float64)
                weights = load.sum(axis=(1, 2))
                plan_F = served(load, plan.placement)
                current_F = served(load, current)
                realised = float(np.average(plan_F, weights=weights))
                samples["cpu_s"].append(clock.cpu_s)
                samples["err"].append(plan.predicted_balancedness - realised)
                samples["err_prefill"].append(
                    plan.predicted_balancedness - float(plan_F[trace.is_prefill_F[nxt]].mean())
                )
                samples["gain_err"].append(
                    plan.stats["predicted_gain"] - (realised - float(np.average(current_F, weights=weights)))
                )
                samples["copies"].append(plan.stats["copies_moved"] if plan.apply else 0.0)
                ran_F = plan_F if plan.apply else current_F
                samples["ran_prefill"].append(float(ran_F[trace.is_prefill_F[nxt]].mean()))
                applied.append(plan.apply)
                if plan.apply:
                    current = plan.placement
            row = {
                "seed": seed,
                "ep": ep,
                "budget": args.budget,
                "interval": args.interval,
                "window": args.window_passes,
                "holdout_passes": args.holdout_passes,
                "static_dispatch": args.static_dispatch,
                "solves": len(applied),
                "solve_cpu_s_median": float(np.median(samples["cpu_s"])),
                "solve_cpu_s_max": float(np.max(samples["cpu_s"])),
                "prediction_error_mean": float(np.mean(samples["err"])),
                "prediction_error_abs": float(np.mean(np.abs(samples["err"]))),
                "prediction_error_prefill_abs": float(np.mean(np.abs(samples["err_prefill"]))),
                "gain_error_abs": float(np.mean(np.abs(samples["gain_err"]))),
                "applied": float(np.mean(applied)),
                "prefill_balancedness": float(np.mean(samples["ran_prefill"])),
                "copies_per_1000_passes": float(
                    np.sum(samples["copies"]) / (len(applied) * args.interval) * 1000
                ),
            }
            rows.append(row)
            print(
                json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}),
                flush=True,
            )
    return rows


def _format_row(row: dict[str, Any]) -> str:
    return (
        f"seed {row['seed']} W {row['window']:5d} EP{row['ep']:<3d} {row['planner']:36s} "
        f"per-pass {row['per_pass']:.4f} summed {row['summed']:.4f} "
        f"copies {row['copies_moved']:8.1f} solve {row['solve_s']:.3f}s applied {row['applied']:.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ep", type=int, nargs="+", default=[8, 16, 32, 64], choices=sorted(NODES_FOR_EP))
    parser.add_argument(
        "--windows", type=int, nargs="+", default=[200, 1000], help="window = interval, passes"
    )
    parser.add_argument("--rebalances", type=int, default=10, help="windows scored per run")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--redundant", type=int, default=32)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--quick", action="store_true", help="EP32, window 200, 6 rebalances")
    parser.add_argument(
        "--peers", nargs="*", default=["hierarchical", "global"], choices=["hierarchical", "global"]
    )
    parser.add_argument("--timing", action="store_true", help="only the solve-time sweep")
    parser.add_argument("--timing-layers", type=int, nargs="+", default=[15, 29, 58])
    parser.add_argument("--timing-window", type=int, default=200)
    parser.add_argument("--continuous", action="store_true", help="only the budgeted continuous solves")
    parser.add_argument("--budget", type=int, default=256, help="--continuous: max_moved_experts per solve")
    parser.add_argument("--interval", type=int, default=50, help="--continuous: passes between solves")
    parser.add_argument("--window-passes", type=int, default=200, help="--continuous: window, passes")
    parser.add_argument("--continuous-steps", type=int, default=2000, help="--continuous: trace length")
    parser.add_argument(
        "--holdout-passes", type=int, default=None, help="--continuous: SolveOptions.holdout_passes"
    )
    parser.add_argument(
        "--static-dispatch",
        action="store_true",
        help="--continuous: the passes are served by static dispatch maps and the solver is told so",
    )
    parser.add_argument("--json", type=Path, default=None, help="write all rows here")
    args = parser.parse_args(argv)
    if args.quick:
        args.ep, args.windows, args.rebalances = [32], [200], 6
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "python": platform.python_version(),
        "numpy": np.__version__,
    }
    import scipy

    meta["scipy"] = scipy.__version__
    print(json.dumps(meta), flush=True)
    result: dict[str, Any] = {"meta": meta, "args": vars(args) | {"json": str(args.json)}}
    if args.continuous:
        result["continuous"] = run_continuous(args)
    elif args.timing:
        result["timing"] = run_timing(args)
    else:
        result["quality"] = run_quality(args)
    result["meta"]["load_average_end"] = os.getloadavg()
    if args.json is not None:
        write_result(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
