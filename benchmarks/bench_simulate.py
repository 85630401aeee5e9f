"""Simulator speed: how long ``eplb.simulate.simulate`` takes, and how it grows with steps, layers, EP.

Shape legend: T steps, L layers, E logical experts.

The target: 10,000 steps x 58 layers x 256 experts, interval 200, three algorithms, at
most 60 s on 2 cores; workload generation is timed separately. The peer is SGLang 0.5.23's
DeepSeek EPLB (``benchmarks.peers``), run as a planner inside the same simulation as ours, so
balancedness, moves and solve time compare side by side.

    python -m benchmarks.bench_simulate                 # everything (a few minutes on 2 cores)
    python -m benchmarks.bench_simulate --quick         # smaller scaling grid
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import Stopwatch, write_result
from eplb.config import EplbConfig
from eplb.placement.model import Placement
from eplb.policy import LoadHistory, Proposal
from eplb.simulate import RunSpec, SimulationConfig, parse_runs, simulate
from eplb.traces import Trace
from eplb.workloads import WorkloadConfig, generate


class SGLangDeepSeekPlanner:
    """SGLang 0.5.23's vendored DeepSeek ``rebalance_experts`` on the window's summed load."""

    def __init__(self, num_groups: int, hierarchical: bool) -> None:
        from benchmarks.peers import load_sglang_deepseek

        self.module = load_sglang_deepseek()
        self.num_groups = num_groups
        self.hierarchical = hierarchical

    def __call__(
        self, window_WLE: np.ndarray, current: Placement, history: LoadHistory | None = None
    ) -> Proposal:
        import torch

        weight = torch.from_numpy(window_WLE.sum(axis=0, dtype=np.int64).astype(np.float32))
        phy2log, log2phy, logcnt = self.module.rebalance_experts(
            weight,
            current.num_physical,
            self.num_groups,
            current.num_nodes,
            current.num_gpus,
            self.hierarchical,
        )
        return Proposal(
            Placement.from_deepseek(phy2log, log2phy, logcnt, current.num_gpus, current.num_nodes)
        )


def third_algorithm() -> str:
    """The third algorithm compared: eplb's scipy policy."""
    return "scipy"


def timed_simulation(
    trace: Trace, runs: list[RunSpec], config: SimulationConfig, **kw: Any
) -> dict[str, Any]:
    with Stopwatch() as clock:
        result = simulate(trace, runs, config, **kw)
    summaries = result.summaries()
    return {
        "wall_s": clock.wall_s,
        "cpu_s": clock.cpu_s,
        "eval_s": sum(r.eval_seconds for r in [*result.runs, result.baseline] if r is not None),
        "solve_s": sum(s["solve_seconds_total"] for s in summaries),
        "apply_s": sum(s["apply_seconds"] for s in summaries),
        "runs": summaries,
    }


def slice_layers(trace: Trace, num_layers: int) -> Trace:
    return Trace(
        np.ascontiguousarray(trace.counts_FLE[:, :num_layers]),
        trace.is_prefill_F,
        trace.num_tokens_F,
        trace.meta,
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--interval", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="scaling grid on fewer steps")
    parser.add_argument("--json", type=Path, default=None, help="write every measurement here")
    args = parser.parse_args()

    third = third_algorithm()
    names = ["none", "deepseek", third]
    runs = parse_runs(names, "static")
    server = EplbConfig(
        enable_eplb=True,
        ep_size=32,
        nnodes=4,
        ep_num_redundant_experts=32,
        eplb_rebalance_num_iterations=args.interval,
    )
    base = SimulationConfig(eplb=server, num_groups=8)
    out: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "loadavg_start": os.getloadavg(),
        "algorithms": names,
    }

    with Stopwatch() as clock:
        trace = generate(WorkloadConfig(preset="deepseek-v3", num_steps=args.steps, seed=0))
    out["generate_s"] = clock.wall_s
    print(f"workload: {args.steps} steps x 58 x 256 generated in {out['generate_s']:.1f} s", flush=True)

    main_run = timed_simulation(trace, runs, base)
    out["target"] = main_run
    print(
        f"target: {args.steps} steps, interval {args.interval}, {names}: {main_run['wall_s']:.1f} s wall, "
        f"{main_run['cpu_s']:.1f} s CPU "
        f"(evaluation {main_run['eval_s']:.1f} s, planning {main_run['solve_s']:.1f} s, "
        f"applying plans {main_run['apply_s']:.1f} s)",
        flush=True,
    )
    for s in main_run["runs"]:
        print(
            f"  {s['name']:<32} prefill bal {s['balancedness_prefill_mean']:.3f}  speed-up {s['speedup_vs_none']:.3f}x"
            f"  moved/rebalance {s['experts_moved_per_rebalance']:.0f}  solve {s['solve_seconds_mean']:.3f} s",
            flush=True,
        )

    # Peer, same trace and schedule: SGLang's DeepSeek code against ours.
    peer_runs = [
        RunSpec("sglang_deepseek", "static"),
        RunSpec("sglang_deepseek_hierarchical", "static"),
        *parse_runs(["deepseek", "deepseek_hierarchical"], "static"),
    ]
    peer_planners = {
        "sglang_deepseek:static": SGLangDeepSeekPlanner(num_groups=8, hierarchical=False),
        "sglang_deepseek_hierarchical:static": SGLangDeepSeekPlanner(num_groups=8, hierarchical=True),
    }
    peer = timed_simulation(trace, peer_runs, base, planners=peer_planners)
    out["peer"] = peer
    for s in peer["runs"]:
        print(
            f"  peer run {s['name']:<24} prefill bal {s['balancedness_prefill_mean']:.3f}  speed-up "
            f"{s['speedup_vs_none']:.3f}x  moved/rebalance {s['experts_moved_per_rebalance']:.0f}  "
            f"solve {s['solve_seconds_mean']:.3f} s",
            flush=True,
        )

    grid_steps = (
        max(args.steps // 4, 2 * args.interval)
        if not args.quick
        else max(args.steps // 10, 2 * args.interval)
    )
    scaling: list[dict[str, Any]] = []

    def point(kind: str, value: int, tr: Trace, cfg: SimulationConfig) -> None:
        m = timed_simulation(tr, runs, cfg)
        row = {"kind": kind, "value": value, "steps": tr.num_steps, "layers": tr.num_layers, "ep": cfg.eplb.ep_size,
               "wall_s": m["wall_s"], "cpu_s": m["cpu_s"], "eval_s": m["eval_s"], "solve_s": m["solve_s"], "apply_s": m["apply_s"]}  # fmt: skip
        scaling.append(row)
        print(
            f"  {kind:>6} {value:>6}: {row['wall_s']:6.2f} s wall, {row['cpu_s']:6.2f} s CPU (evaluation {row['eval_s']:.2f}, planning "
            f"{row['solve_s']:.2f}, applying {row['apply_s']:.2f})",
            flush=True,
        )

    print("scaling (three algorithms + baseline):", flush=True)
    for steps in (grid_steps // 2, grid_steps, 2 * grid_steps, 4 * grid_steps):
        if steps <= args.steps:
            point("steps", steps, trace.slice(0, steps), base)
    for layers in (15, 29, 58):
        point("layers", layers, slice_layers(trace.slice(0, grid_steps), layers), base)
    for ep, nodes in ((8, 1), (16, 2), (32, 4), (64, 8)):
        point(
            "ep",
            ep,
            trace.slice(0, grid_steps),
            replace(base, eplb=replace(server, ep_size=ep, nnodes=nodes, ep_num_redundant_experts=ep)),
        )
    out["scaling"] = scaling
    out["loadavg_end"] = os.getloadavg()
    print(f"load average start {out['loadavg_start']}, end {out['loadavg_end']}")
    if args.json:
        write_result(args.json, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
