"""Periodic rebalancing against SGLang's DeepSeek EPLB on drifting load, and how well every prediction holds.

Shape legend: F steps, L layers, E logical experts.

Periodic cases (``--periodic``): each workload below (the deepseek-v3 preset and drifting
deepseek-v3-shaped variants made with ``eplb.workloads``' knobs: AR drift without shifts, domain
shifts every ~250 and ~1000 passes, a prefill-heavy mix) at each interval (1000 and 200 passes,
window = interval as SGLang requires), EP32 on 4 nodes, 32 redundant experts, static dispatch,
on one trace: eplb's default (scipy) against SGLang 0.5.23's own ``rebalance_experts``
(``benchmarks.peers``, fetched from PyPI) applying every plan, as SGLang does. Both are scored on
the same passes, from the second rebalance on (the first plan of each run, from the trivial
placement, is warm-up): prefill balancedness, modeled MoE speed-up net of stalls, bytes moved
across GPUs per 1000 passes. The checks: scipy >= DeepSeek + 0.01 balancedness, with
at most a quarter of its bytes, and a speed-up at least as good.

Calibration cases (``--calibration``): the same workloads in continuous mode (every 50 passes,
window 200, budget 160, swaps paced at 100 GB/s) under static, dynamic and lp dispatch, and
periodic at 200 and 1000 passes under dynamic and lp dispatch. For every plan applied after the
warm-up: |predicted - realized| balancedness over the passes it served (the simulator's realized
figure, what the prediction estimates). A plan whose horizon a domain shift hit (the workload's
``domain_change_steps``) could not have foreseen it from its window: errors are reported for
plans without one (the check: mean <= 0.03) and over all plans.

    python -m benchmarks.bench_periodic --jobs 16                   # everything, in parallel
    python -m benchmarks.bench_periodic --periodic --workloads ar-drift --intervals 200
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.harness import write_result
from eplb.config import EplbConfig
from eplb.simulate import RunSpec, SimulationConfig, simulate
from eplb.simulate.results import RunResult
from eplb.traces import Trace
from eplb.workloads import WorkloadConfig, generate

WORKLOADS: dict[str, WorkloadConfig] = {
    "deepseek-v3": WorkloadConfig(preset="deepseek-v3"),
    "ar-drift": WorkloadConfig(
        preset="deepseek-v3", mean_steps_between_shifts=0.0, drift_sigma=0.5, drift_timescale_steps=600.0
    ),
    "shifts-250": WorkloadConfig(
        preset="deepseek-v3",
        num_domains=4,
        domain_sigma=0.7,
        mean_steps_between_shifts=250.0,
        drift_sigma=0.4,
        drift_timescale_steps=1000.0,
    ),
    "shifts-1000": WorkloadConfig(
        preset="deepseek-v3",
        num_domains=4,
        domain_sigma=0.7,
        mean_steps_between_shifts=1000.0,
        drift_sigma=0.4,
        drift_timescale_steps=1000.0,
    ),
    "mixed": WorkloadConfig(
        preset="deepseek-v3",
        prefill_fraction=0.6,
        prefill_tokens=(256, 8192),
        decode_tokens=(16, 1024),
        mean_steps_between_shifts=600.0,
        drift_sigma=0.45,
        drift_timescale_steps=800.0,
    ),
}
INTERVALS = (1000, 200)
TOPOLOGY: dict[str, Any] = {"ep_size": 32, "nnodes": 4, "ep_num_redundant_experts": 32}
TARGET_MARGIN = 0.01
TARGET_BYTES_FRACTION = 0.25
TARGET_PREDICTION_ERROR = 0.03


def workload_trace(name: str, steps: int, seed: int) -> Trace:
    return generate(WORKLOADS[name].with_(num_steps=steps, seed=seed))


def flags(mode: str, interval: int, dispatch: str) -> EplbConfig:
    continuous = mode == "continuous"
    return EplbConfig(
        enable_eplb=True,
        eplb_rebalance_mode=mode,
        eplb_rebalance_num_iterations=interval,
        eplb_transfer_gbps=100.0 if continuous else None,
        ep_dispatch_algorithm=dispatch,
        **TOPOLOGY,
    )


def prediction_errors(run: RunResult, trace: Trace, scored_from: int) -> dict[str, Any]:
    """|predicted - realized| of the applied plans from ``scored_from`` on, split by whether a
    domain shift landed in the passes each plan served (eplb.simulate.results.RunResult.prediction_errors)."""
    return run.prediction_errors(trace.meta.get("domain_change_steps", []), scored_from)


def periodic_case(workload: str, interval: int, steps: int, seed: int) -> dict[str, Any]:
    """eplb's scipy against SGLang's DeepSeek at one interval, scored from the second rebalance."""
    from benchmarks.bench_simulate import SGLangDeepSeekPlanner

    started = time.perf_counter()
    trace = workload_trace(workload, steps, seed)
    groups = int(trace.meta["num_groups"])
    config = SimulationConfig.for_trace(
        trace,
        eplb=flags("periodic", interval, "static"),
        seed=seed,
        score_from=2 * interval,
    )
    peer = SGLangDeepSeekPlanner(num_groups=groups, hierarchical=False)
    runs = [RunSpec("sglang_deepseek", "static"), RunSpec("scipy", "static")]
    result = simulate(trace, runs, config, planners={"sglang_deepseek:static": peer})
    rows = {s["algorithm"]: s for s in result.summaries()}
    ours, theirs = rows["scipy"], rows["sglang_deepseek"]
    fraction = ours["bytes_moved_per_1000_passes"] / max(theirs["bytes_moved_per_1000_passes"], 1.0)
    margin = ours["balancedness_prefill_mean"] - theirs["balancedness_prefill_mean"]
    scipy_run = next(r for r in result.runs if r.spec.algorithm == "scipy")
    out = {
        "kind": "periodic",
        "workload": workload,
        "interval": interval,
        "seed": seed,
        "steps": steps,
        "scored_from": result.scored_from,
        "domain_shifts": len(trace.meta.get("domain_change_steps", [])),
        "scipy": _row(ours),
        "sglang_deepseek": _row(theirs),
        "balancedness_margin": margin,
        "bytes_fraction": fraction,
        "prediction_error": prediction_errors(scipy_run, trace, result.scored_from),
        "wall_s": time.perf_counter() - started,
    }
    out["checks"] = {
        f"balancedness >= DeepSeek + {TARGET_MARGIN}": margin >= TARGET_MARGIN,
        f"bytes <= {TARGET_BYTES_FRACTION} of DeepSeek's": fraction <= TARGET_BYTES_FRACTION,
        "speed-up >= DeepSeek's": ours["speedup_vs_none"] >= theirs["speedup_vs_none"],
    }
    return out


def calibration_case(
    workload: str, mode: str, interval: int, dispatch: str, steps: int, seed: int
) -> dict[str, Any]:
    """Every applied plan's prediction against what it realized, after the warm-up."""
    started = time.perf_counter()
    trace = workload_trace(workload, steps, seed)
    warmup = 1000 if mode == "continuous" else 2 * interval
    config = SimulationConfig.for_trace(
        trace,
        eplb=flags(mode, interval, dispatch),
        seed=seed,
        score_from=warmup,
    )
    result = simulate(trace, [RunSpec("scipy", dispatch)], config)
    summary = result.summaries()[0]
    errors = prediction_errors(result.runs[0], trace, result.scored_from)
    clean = errors["no_shift"]["mean_abs"]
    return {
        "kind": "calibration",
        "workload": workload,
        "mode": mode,
        "interval": interval,
        "dispatch": dispatch,
        "seed": seed,
        "steps": steps,
        "scored_from": result.scored_from,
        "scipy": _row(summary),
        "prediction_error": errors,
        "checks": {
            f"prediction error <= {TARGET_PREDICTION_ERROR} without a shift": clean is not None
            and clean <= TARGET_PREDICTION_ERROR
        },
        "wall_s": time.perf_counter() - started,
    }


def _row(summary: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "balancedness_prefill_mean",
        "speedup_vs_none",
        "bytes_moved_per_1000_passes",
        "experts_moved_per_rebalance",
        "rebalances_applied",
        "rebalances_skipped",
        "stall_seconds",
        "solve_seconds_mean",
    )
    return {k: summary[k] for k in keys}


def _run(job: tuple[str, tuple[Any, ...]]) -> dict[str, Any]:
    kind, args = job
    return periodic_case(*args) if kind == "periodic" else calibration_case(*args)


def _line(r: dict[str, Any]) -> str:
    e = r["prediction_error"]["no_shift"]
    err = "-" if e["mean_abs"] is None else f"{e['mean_abs']:.3f} ({e['plans']} plans)"
    allerr = r["prediction_error"]["all"]
    alls = "-" if allerr["mean_abs"] is None else f"{allerr['mean_abs']:.3f}/{allerr['bias']:+.3f}"
    ok = ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in r["checks"].items())
    s = r["scipy"]
    if r["kind"] == "periodic":
        d = r["sglang_deepseek"]
        return (
            f"{r['workload']:<12} periodic {r['interval']:>5}: scipy {s['balancedness_prefill_mean']:.3f} "
            f"{s['speedup_vs_none']:.3f}x {s['bytes_moved_per_1000_passes'] / 1e9:7.1f} GB/1000 | SGLang "
            f"{d['balancedness_prefill_mean']:.3f} {d['speedup_vs_none']:.3f}x "
            f"{d['bytes_moved_per_1000_passes'] / 1e9:7.1f} GB/1000 | margin {r['balancedness_margin']:+.3f} "
            f"bytes {r['bytes_fraction']:.2f} | pred. error {err}, all {alls} | {ok}"
        )
    return (
        f"{r['workload']:<12} {r['mode']:<10} {r['interval']:>5} {r['dispatch']:<7}: scipy "
        f"{s['balancedness_prefill_mean']:.3f} {s['speedup_vs_none']:.3f}x | pred. error {err}, all {alls} | {ok}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--periodic", action="store_true", help="only the periodic cases")
    parser.add_argument("--calibration", action="store_true", help="only the calibration cases")
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=("periodic", "continuous"),
        default=["periodic", "continuous"],
        help="calibration cases of these modes",
    )
    parser.add_argument(
        "--dispatches",
        nargs="+",
        choices=("static", "dynamic", "lp"),
        default=["static", "dynamic", "lp"],
        help="dispatch modes of the calibration cases (periodic ones: dynamic and lp; static is the periodic cases')",
    )
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--intervals", type=int, nargs="+", default=list(INTERVALS))
    parser.add_argument("--steps", type=int, default=8000, help="steps of the periodic cases")
    parser.add_argument(
        "--continuous-steps", type=int, default=4000, help="steps of the continuous calibration cases"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="cases run in parallel processes")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/bench_periodic_cpu.json"))
    args = parser.parse_args()
    both = not (args.periodic or args.calibration)
    jobs: list[tuple[str, tuple[Any, ...]]] = []
    if both or args.periodic:
        jobs += [
            ("periodic", (w, i, args.steps, args.seed))
            for w, i in itertools.product(args.workloads, args.intervals)
        ]
    if both or args.calibration:
        if "continuous" in args.modes:
            jobs += [
                ("calibration", (w, "continuous", 50, d, args.continuous_steps, args.seed))
                for w, d in itertools.product(args.workloads, args.dispatches)
            ]
        if "periodic" in args.modes:
            jobs += [
                ("calibration", (w, "periodic", i, d, args.steps, args.seed))
                for w, i, d in itertools.product(
                    args.workloads, args.intervals, [d for d in args.dispatches if d != "static"]
                )
            ]
    # The per-batch rule makes lp cases the longest: start them first.
    jobs.sort(key=lambda job: "lp" not in job[1])
    out: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
        "cpus": os.cpu_count(),
        "cases": [],
    }
    # One BLAS thread per process: many small products, and the processes share the cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with ProcessPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
        for result in pool.map(_run, jobs):
            print(_line(result), flush=True)
            out["cases"].append(result)
            write_result(args.json, {**out, "loadavg": [round(x, 2) for x in os.getloadavg()]})
    failed = [c for c in out["cases"] if not all(c["checks"].values())]
    print(f"{len(out['cases']) - len(failed)} of {len(out['cases'])} cases meet every check")
    return 0


if __name__ == "__main__":
    sys.exit(main())
