"""``auto`` dispatch against static and ``lp``, net of what their kernels cost, on every workload.

Shape legend: F steps.

Workloads: bench_forecast's (the eight deepseek-v3 variants and the deepseek-v3 and qwen3-235b-a22b
presets), each cut to its first ``--layers`` layers (the budget scaled to them, 160 x layers / L
copies), EP32 on 4 nodes, 32 redundant slots, one trace per workload (seed 0), every run scored
from pass 1000. Schedules: ``continuous`` (every 50 passes on 200, paced at 100 GB/s, the first
plan unbudgeted) and ``periodic`` (every 500 passes on 500). Runs, each planned by scipy:
``static``, ``lp``, ``auto``, and the per-pass ``oracle``: on the plans ``auto`` serves (packed for
static's maps), each pass takes whichever of static and ``lp`` the model times lower with its
kernels, which no rule that sees only the pass's size can beat. The kernels are charged by
``--eplb-dispatch-cost`` (default ``h200``: 58 layers in one CUDA graph).

Columns: modeled speed-up over no balancing net of every run's kernels, prefill balancedness, the
share of prefill passes ``auto`` ran ``lp`` on, and the issue's two checks: ``auto`` >= the better
of static and ``lp`` - 0.005, and ``auto``'s prefill balancedness within 0.005 of ``lp``'s.

    python -m benchmarks.bench_auto_dispatch --jobs 2 --json benchmarks/results/bench_auto_dispatch_auto_cpu.json
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from benchmarks.bench_forecast import WORKLOADS
from benchmarks.harness import write_result
from eplb.config import CONTINUOUS_INTERVAL, CONTINUOUS_MAX_MOVED_EXPERTS, EplbConfig
from eplb.simulate import RunSpec, SimulationConfig, simulate
from eplb.simulate.planners import make_planner
from eplb.simulate.results import RunResult
from eplb.traces import Trace
from eplb.workloads import PRESETS, generate

TOPOLOGY: dict[str, Any] = {"ep_size": 32, "nnodes": 4, "ep_num_redundant_experts": 32}
SCORE_FROM = 1000
PERIODIC_INTERVAL = 500
MARGIN = 0.005
ORACLE = RunSpec("auto", "lp")
"""The oracle's lp half: lp dispatch on the plans packed for static maps (planner replaced)."""


def workload_trace(name: str, steps: int, layers: int) -> Trace:
    """The workload's trace (seed 0), cut to its first ``layers`` layers."""
    trace = generate(WORKLOADS[name].with_(num_steps=steps, seed=0))
    if layers >= trace.num_layers:
        return trace
    counts = np.ascontiguousarray(trace.counts_FLE[:, :layers])
    return Trace(counts, trace.is_prefill_F, trace.num_tokens_F, trace.meta)


def run_case(name: str, schedule: str, steps: int, layers: int, cost: str) -> dict[str, Any]:
    """One workload under one schedule: every run's figures and the two checks."""
    started = time.perf_counter()
    trace = workload_trace(name, steps, layers)
    full_layers = PRESETS[WORKLOADS[name].preset].num_layers
    continuous = schedule == "continuous"
    flags = EplbConfig(
        enable_eplb=True,
        eplb_rebalance_mode=schedule,
        eplb_rebalance_num_iterations=CONTINUOUS_INTERVAL if continuous else PERIODIC_INTERVAL,
        eplb_max_moved_experts=(
            round(CONTINUOUS_MAX_MOVED_EXPERTS * trace.num_layers / full_layers) if continuous else None
        ),
        eplb_transfer_gbps=100.0 if continuous else None,
        eplb_dispatch_cost=cost,
        **TOPOLOGY,
    )
    config = SimulationConfig.for_trace(trace, eplb=flags, score_from=SCORE_FROM)
    runs = [RunSpec("scipy", "static"), RunSpec("scipy", "lp"), RunSpec("scipy", "auto"), ORACLE]
    planner = make_planner(RunSpec("scipy", "auto"), config)
    assert planner is not None
    planners = {ORACLE.name: planner}
    with threadpool_limits(limits=1):
        result = simulate(trace, runs, config, planners=planners)
    by_name = {s["name"]: s for s in result.summaries()}
    static, lp, auto = (by_name[f"scipy:{m}"] for m in ("static", "lp", "auto"))
    s0 = result.scored_from
    oracle_speedup = result.baseline.total_seconds(s0) / _oracle_seconds(
        result.run("scipy:auto"), result.run(ORACLE.name), s0
    )
    best = max(static["speedup_vs_none"], lp["speedup_vs_none"])
    row = {
        "workload": name,
        "schedule": schedule,
        "layers": trace.num_layers,
        "steps": steps,
        "cost": cost,
        "speedup": {m: by_name[f"scipy:{m}"]["speedup_vs_none"] for m in ("static", "lp", "auto")},
        "speedup_oracle": oracle_speedup,
        "balancedness_prefill": {
            m: by_name[f"scipy:{m}"]["balancedness_prefill_mean"] for m in ("static", "lp", "auto")
        },
        "dispatch_seconds": {m: by_name[f"scipy:{m}"]["dispatch_seconds"] for m in ("static", "lp", "auto")},
        "auto_lp_prefill_fraction": auto["lp_prefill_fraction"],
        "auto_lp_pass_fraction": auto["lp_pass_fraction"],
        "speedup_ok": auto["speedup_vs_none"] >= best - MARGIN,
        "prefill_ok": abs(auto["balancedness_prefill_mean"] - lp["balancedness_prefill_mean"]) <= MARGIN,
        "wall_s": time.perf_counter() - started,
    }
    print(_line(row), flush=True)
    return row


def _oracle_seconds(served: RunResult, lp_on_it: RunResult, scored_from: int) -> float:
    """Seconds when each pass of ``served``'s plans takes the faster of its static and lp times."""
    assert served.dispatch_us_F is not None and lp_on_it.dispatch_us_F is not None
    assert served.lp_F is not None
    static_us_F = np.where(served.lp_F, np.inf, served.moe_us_F + served.dispatch_us_F)
    # auto's own lp passes: their static time is unknown here, so the lp run's time (as fast).
    static_us_F = np.where(served.lp_F, lp_on_it.moe_us_F + lp_on_it.dispatch_us_F, static_us_F)
    best_us_F = np.minimum(static_us_F, lp_on_it.moe_us_F + lp_on_it.dispatch_us_F)
    events = served.scored_events(scored_from)
    overhead = sum(e.stall_seconds + e.interference_seconds for e in events)
    return float(best_us_F[scored_from:].sum()) * 1e-6 + overhead


def _line(row: dict[str, Any]) -> str:
    sp, bal = row["speedup"], row["balancedness_prefill"]
    return (
        f"{row['workload']:<16} {row['schedule']:<10} speed-up static/lp/auto/oracle "
        f"{sp['static']:.3f}/{sp['lp']:.3f}/{sp['auto']:.3f}/{row['speedup_oracle']:.3f}  prefill bal "
        f"{bal['static']:.3f}/{bal['lp']:.3f}/{bal['auto']:.3f}  auto lp on {row['auto_lp_prefill_fraction']:.0%} "
        f"of prefill  checks {'ok' if row['speedup_ok'] else 'FAIL'}/{'ok' if row['prefill_ok'] else 'FAIL'}"
        f"  ({row['wall_s']:.0f} s)"
    )


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of every case."""
    lines = [
        "| workload | schedule | speed-up static / lp / **auto** / oracle | prefill bal static / lp / **auto** "
        "| auto's lp passes (of prefill) | auto >= best - 0.005 | prefill within 0.005 of lp |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sp, bal = r["speedup"], r["balancedness_prefill"]
        lines.append(
            f"| {r['workload']} | {r['schedule']} | {sp['static']:.3f} / {sp['lp']:.3f} / **{sp['auto']:.3f}** / "
            f"{r['speedup_oracle']:.3f} | {bal['static']:.3f} / {bal['lp']:.3f} / **{bal['auto']:.3f}** | "
            f"{r['auto_lp_prefill_fraction']:.0%} | {'yes' if r['speedup_ok'] else 'no'} | "
            f"{'yes' if r['prefill_ok'] else 'no'} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--schedules", nargs="+", default=["continuous", "periodic"])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--eplb-dispatch-cost", dest="cost", default="h200")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    cases = [(w, s) for w in args.workloads for s in args.schedules]
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            futures = [pool.submit(run_case, w, s, args.steps, args.layers, args.cost) for w, s in cases]
            rows = [f.result() for f in futures]
    else:
        rows = [run_case(w, s, args.steps, args.layers, args.cost) for w, s in cases]
    print(table(rows))
    if args.json is not None:
        write_result(args.json, {"command": " ".join(sys.argv), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
