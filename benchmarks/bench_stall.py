"""Stall per rebalance inside SGLang and vLLM: eplb continuous against the engine's default.

Shape legend: F steps, L layers, E logical experts, G GPUs.

One drifting deepseek-v3-shaped trace per topology (EP32 on 4 nodes, EP64 on 8, as many redundant
slots as GPUs, DeepSeek-V3's 44 MB per expert copy), replayed by ``eplb.simulate`` under each
engine's own swap (``SimulationConfig.engine_swap``) at each link rate (GB/s into one GPU, every
byte, intra- or inter-node):

- ``sglang``: SGLang 0.5.23's synchronous ``ExpertLocationUpdater``; serving waits for each chunk
  of layers (its default: all layers in one chunk). Its default: DeepSeek every 1000 passes from a
  1000-pass window.
- ``vllm``: vLLM 0.33's asynchronous EPLB (its default), one layer per pass beside the passes: no
  stall, the passes lose interference (copy-engine at the link's rate: NIXL or Gloo, not NCCL
  kernels). Its default: its ``default`` policy (DeepSeek's algorithm; the simulator's
  ``deepseek`` planner) every 3000 passes from a 1000-pass window.
- eplb continuous, in either engine: eplb.config's continuous defaults (every 50 passes, 160
  copies, 200-pass window, shift burst, unbudgeted first plan), scipy planner, static dispatch.

Reported per run: stall per applied rebalance (mean, max, the first plan alone), the longest
single pause, interference per rebalance, and stall and interference per 1000 passes over the
whole trace; with balancedness from pass 1000 on and bytes per rebalance for context.

    python -m benchmarks.bench_stall --json benchmarks/results/bench_stall_cpu.json
    python -m benchmarks.bench_stall --steps 1200 --topologies EP32 --rates 50   # quick look
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.bench_continuous import TOPOLOGIES, WORKLOADS
from benchmarks.harness import Stopwatch, write_result
from eplb.config import CONTINUOUS_INTERVAL, CONTINUOUS_MAX_MOVED_EXPERTS, EplbConfig
from eplb.policy.cost_model import DEEPSEEK_V3_BYTES_PER_EXPERT, CostModel
from eplb.simulate import RunResult, RunSpec, SimulationConfig, simulate
from eplb.traces import Trace
from eplb.workloads import generate

# Drift and domain shifts faster than the preset's calibration; EP32 on 4 nodes, EP64 on 8.
DRIFTING = WORKLOADS["drifting"]
ENGINE_DEFAULTS = {
    # (label, interval, window): SGLang's --eplb-rebalance-num-iterations default and its window;
    # vLLM's EPLBConfig step_interval and window_size defaults.
    "sglang": ("SGLang default: deepseek every 1000", 1000, 1000),
    "vllm": ("vLLM default: deepseek every 3000", 3000, 1000),
}
BALANCE_FROM = 1000
"""First pass of the steady-state columns (every schedule has rebalanced by then but vLLM's)."""


def stall_figures(run: RunResult, num_steps: int, interval: int) -> dict[str, Any]:
    """Stall and interference of ``run``'s rebalances, per rebalance and per 1000 passes (over the
    trace, from pass 1000 on, and at the schedule's cadence: per rebalance due, skipped ones 0)."""
    applied = [e for e in run.events if e.applied]
    stall = np.array([e.stall_seconds for e in applied])
    interference = np.array([e.interference_seconds for e in applied])
    per_1000 = 1000.0 / num_steps
    later = [e for e in applied if e.step >= BALANCE_FROM]
    later_1000 = 1000.0 / (num_steps - BALANCE_FROM)
    # Per rebalance due (a skipped one costs nothing), times the rebalances due per 1000 passes.
    at_cadence = 1000.0 / interval / max(len(run.events), 1)
    pass_seconds = float(run.moe_us_F.mean()) * 1e-6
    return {
        "rebalances_applied": len(applied),
        "rebalances_skipped": len(run.events) - len(applied),
        "skip_reasons": sorted({e.reason for e in run.events if not e.applied}),
        "stall_per_rebalance_mean_s": float(stall.mean()) if stall.size else 0.0,
        "stall_per_rebalance_max_s": float(stall.max(initial=0.0)),
        "stall_first_plan_s": float(stall[0]) if stall.size else 0.0,
        "stall_per_rebalance_after_first_s": float(stall[1:].mean()) if stall.size > 1 else 0.0,
        "longest_pause_s": float(max((e.longest_stall_seconds for e in applied), default=0.0)),
        "interference_per_rebalance_mean_s": float(interference.mean()) if interference.size else 0.0,
        "stall_per_1000_passes_s": float(stall.sum()) * per_1000,
        "interference_per_1000_passes_s": float(interference.sum()) * per_1000,
        # From pass 1000 on: the first unbudgeted plans left out, as bench_continuous scores.
        "stall_per_1000_passes_from_1000_s": float(sum(e.stall_seconds for e in later)) * later_1000,
        "interference_per_1000_passes_from_1000_s": float(sum(e.interference_seconds for e in later))
        * later_1000,
        "stall_per_1000_passes_at_cadence_s": float(stall.sum()) * at_cadence,
        "interference_per_1000_passes_at_cadence_s": float(interference.sum()) * at_cadence,
        "overhead_fraction": float(stall.sum() + interference.sum()) / max(pass_seconds * num_steps, 1e-12),
        "pass_seconds_mean": pass_seconds,
        "bytes_per_rebalance_mean": float(np.mean([e.bytes_moved for e in applied])) if applied else 0.0,
        "switch_delay_passes_mean": float(
            np.mean([e.switch_step - e.step for e in applied if e.switch_step is not None])
        )
        if applied
        else 0.0,
        "balancedness_mean_from_1000": float(run.balancedness_F[BALANCE_FROM:].mean()),
    }


def run_point(
    trace: Trace, topology: str, engine: str, rate: float, seed: int, dispatch: str
) -> list[dict[str, Any]]:
    """eplb continuous and the engine's default under ``engine``'s swap at ``rate`` GB/s per GPU."""
    num_gpus, num_nodes = TOPOLOGIES[topology]
    cost = CostModel(nvlink_gbps=rate, internode_gbps=rate)
    label, interval, window = ENGINE_DEFAULTS[engine]
    topology_flags = EplbConfig(
        enable_eplb=True, ep_size=num_gpus, nnodes=num_nodes, ep_num_redundant_experts=num_gpus
    )
    schedules = [
        ("eplb continuous", "scipy", replace(topology_flags, eplb_rebalance_mode="continuous")),
        (
            label,
            "deepseek",
            replace(
                topology_flags,
                eplb_rebalance_num_iterations=interval,
                expert_distribution_recorder_buffer_size=window,
            ),
        ),
    ]
    rows = []
    for name, algorithm, flags in schedules:
        config = SimulationConfig(
            eplb=flags,
            bytes_per_expert=DEEPSEEK_V3_BYTES_PER_EXPERT,
            num_groups=int(trace.meta.get("num_groups", 1)),
            seed=seed,
            cost=cost,
            engine_swap=engine,
        )
        with Stopwatch() as clock:
            result = simulate(trace, [RunSpec(algorithm, dispatch)], config)
        row = {
            "topology": topology,
            "engine": engine,
            "link_gbps_per_gpu": rate,
            "schedule": name,
            "algorithm": algorithm,
            "interval": flags.rebalance_interval,
            "window": flags.recorder_buffer_size,
            "move_budget": flags.for_layers(trace.num_layers).max_moved_experts,
            **stall_figures(result.runs[0], trace.num_steps, flags.rebalance_interval),
            "wall_seconds": clock.wall_s,
        }
        print(
            f"  {topology} {engine:6s} {rate:5.0f} GB/s  {name:38s} "
            f"stall/rebalance {row['stall_per_rebalance_mean_s'] * 1e3:9.2f} ms  "
            f"stall/1000 passes {row['stall_per_1000_passes_s'] * 1e3:9.2f} ms  "
            f"interference/1000 {row['interference_per_1000_passes_s'] * 1e3:8.2f} ms  "
            f"({row['rebalances_applied']} applied, {clock.wall_s:.0f} s)",
            flush=True,
        )
        rows.append(row)
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The markdown table of docs/benchmarks.md."""
    head = (
        "| EP | engine swap | link GB/s per GPU | schedule | applied (skipped) | stall per rebalance, mean "
        "(first plan) | longest pause | stall per 1000 passes: trace (from pass 1000; at cadence) | "
        "interference per 1000 passes: trace (from pass 1000; at cadence) | overhead of serving time | "
        "balancedness from pass 1000 |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r['topology']} | {r['engine']} | {r['link_gbps_per_gpu']:g} | {r['schedule']} | "
            f"{r['rebalances_applied']} ({r['rebalances_skipped']}) | "
            f"{r['stall_per_rebalance_mean_s'] * 1e3:.1f} ms ({r['stall_first_plan_s'] * 1e3:.1f} ms) | "
            f"{r['longest_pause_s'] * 1e3:.1f} ms | {r['stall_per_1000_passes_s'] * 1e3:.1f} ms "
            f"({r['stall_per_1000_passes_from_1000_s'] * 1e3:.1f}; "
            f"{r['stall_per_1000_passes_at_cadence_s'] * 1e3:.1f} ms) | "
            f"{r['interference_per_1000_passes_s'] * 1e3:.1f} ms "
            f"({r['interference_per_1000_passes_from_1000_s'] * 1e3:.1f}; "
            f"{r['interference_per_1000_passes_at_cadence_s'] * 1e3:.1f} ms) | "
            f"{r['overhead_fraction'] * 100:.3f}% | "
            f"{r['balancedness_mean_from_1000']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4000, help="passes of the trace (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--topologies", nargs="+", choices=sorted(TOPOLOGIES), default=list(TOPOLOGIES))
    parser.add_argument(
        "--engines", nargs="+", choices=sorted(ENGINE_DEFAULTS), default=list(ENGINE_DEFAULTS)
    )
    parser.add_argument(
        "--rates", nargs="+", type=float, default=[50.0, 200.0], help="link GB/s per GPU (default: 50 200)"
    )
    parser.add_argument("--dispatch", default="static")
    parser.add_argument("--json", type=Path, default=None, help="write the rows and the table here")
    args = parser.parse_args(argv)
    if args.steps <= BALANCE_FROM:
        print(f"bench_stall: --steps must exceed {BALANCE_FROM}, got {args.steps}", file=sys.stderr)
        return 2
    if any(not (0 < r < float("inf")) for r in args.rates):
        print(f"bench_stall: --rates must be positive, got {args.rates}", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    with Stopwatch() as gen:
        trace = generate(DRIFTING.with_(num_steps=args.steps, seed=args.seed))
    print(
        f"drifting deepseek-v3: {trace.num_steps} passes x {trace.num_layers} layers x "
        f"{trace.num_experts} experts (generated in {gen.wall_s:.0f} s)",
        flush=True,
    )
    for topology in args.topologies:
        for engine in args.engines:
            for rate in args.rates:
                rows.extend(run_point(trace, topology, engine, rate, args.seed, args.dispatch))
    text = table(rows)
    print(text)
    if args.json is not None:
        payload = {
            "benchmark": "bench_stall",
            "command": " ".join(["python -m benchmarks.bench_stall", *(argv or sys.argv[1:])]),
            "workload": {"config": repr(DRIFTING), "steps": args.steps, "seed": args.seed},
            "bytes_per_expert": DEEPSEEK_V3_BYTES_PER_EXPERT,
            "continuous_defaults": {"interval": CONTINUOUS_INTERVAL, "budget": CONTINUOUS_MAX_MOVED_EXPERTS},
            "engine_defaults": {k: {"interval": v[1], "window": v[2]} for k, v in ENGINE_DEFAULTS.items()},
            "rows": rows,
            "table": text,
        }
        write_result(args.json, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
