"""The forecast's ablation: what each forecast (``SolveOptions.prediction``) gives continuous and
periodic plans on drifting load, against a planner that sees the future.

Shape legend: F steps, W window (passes), L layers, E logical experts.

Workloads (``WORKLOADS``): variants of the deepseek-v3 shape made with ``eplb.workloads``' own
knobs (slow and fast AR drift without shifts, hot-expert churn, domain shifts every ~250 and ~1000
passes, decode-heavy and prefill-heavy mixes, ``bench_continuous``'s drifting workload), on which
the forecast was chosen, and the deepseek-v3 and qwen3-235b-a22b presets, on which it was not. EP32
on 4 nodes, 32 redundant slots, one trace per workload, every run scored from pass 1000 (the
slowest schedule's first rebalance):

- ``continuous-static`` / ``continuous-lp``: eplb's continuous defaults (every 50 passes, window
  200, 160 copies per rebalance, burst 8, swaps paced at 100 GB/s, first plan unbudgeted), scipy,
  with each forecast, under static (SGLang's with EPLB on) or ``lp`` dispatch (``lp`` only on
  ``--lp-workloads``: its per-batch split takes minutes to simulate); ``oracle`` plans each
  rebalance on the next 50 passes themselves (the same budget and decisions): the ceiling no
  forecast reaches; ``latent`` on the generator's hidden popularity of the window's passes
  (``eplb.workloads.latent``): what knowing the present exactly, but not the future, gives;
- ``periodic-static``: scipy every 1000 passes on a window of 1000;
- ``periodic-200``: scipy every 200 passes on 200, and its ``oracle`` (the same solver on the next
  200 passes);
- ``deepseek-1000``: eplb's port of DeepSeek's EPLB every 1000 passes on 1000, applying every plan:
  the bytes every row is compared with (the target: continuous steady-state bytes <= 1/4 of it);
  ``deepseek-200``: the same every 200 passes, periodic-200's yardstick.

With ``--variant-layers N`` the variants keep their first N layers and the budget is scaled to
them (160 x N / L copies per rebalance), so that a sweep fits in minutes on a shared machine; the
presets always run whole. Columns: prefill balancedness, bytes moved across GPUs per 1000 scored
passes and their fraction of ``deepseek-1000``'s, mean |predicted - realized| balancedness of
the applied plans and its signed mean (bias), solve wall seconds per rebalance in the simulation. Then (unless
``--no-timing``; alone with ``--timing-only``) the CPU time (one thread, ``time.thread_time``) of
one budgeted continuous solve per forecast on deepseek-v3 windows at EP32 and EP64 (targets: 50
and 150 ms).

    python -m benchmarks.bench_forecast --json benchmarks/results/bench_forecast_cpu.json
    python -m benchmarks.bench_forecast --workloads churn --modes continuous-static --variant-layers 8 --no-timing
    python -m benchmarks.bench_forecast --timing-only --timing-solves 20 --json /tmp/timing.json

The smallest run that still shows the gaps (oracle - continuous 0.01-0.09 on 4 layers), about
95 s on one core; periodic at interval 1000 needs ``--steps 5000`` (4 scored plans, not 2) for its
ties and losses to DeepSeek (churn, mixed-decode) to show:

    python -m benchmarks.bench_forecast --workloads ar-slow ar-fast churn shifts-1000 shifts-250 \
        mixed-decode mixed-prefill drifting --modes continuous-static periodic-static periodic-200 \
        deepseek-1000 deepseek-200 --forecasts auto decay oracle sum --variant-layers 4 --steps 3000 \
        --no-timing --json benchmarks/results/bench_forecast_forecast.json
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from benchmarks.harness import write_result
from eplb.config import CONTINUOUS_INTERVAL, CONTINUOUS_MAX_MOVED_EXPERTS, EplbConfig
from eplb.placement.model import Placement
from eplb.policy.base import LoadHistory
from eplb.policy.decision import Pricing
from eplb.simulate import RunSpec, SimulationConfig, simulate
from eplb.solver import Plan, SolveOptions, Topology, solve
from eplb.solver.planner import SolverPlanner
from eplb.solver.predict import predict
from eplb.traces import Trace
from eplb.workloads import PRESETS, Latent, WorkloadConfig, generate, latent

DS = WorkloadConfig(preset="deepseek-v3")
VARIANTS: dict[str, WorkloadConfig] = {
    "ar-slow": DS.with_(mean_steps_between_shifts=0.0),
    "ar-fast": DS.with_(mean_steps_between_shifts=0.0, drift_sigma=0.5, drift_timescale_steps=500.0),
    "churn": DS.with_(
        mean_steps_between_shifts=0.0, drift_sigma=0.7, drift_timescale_steps=250.0, drift_knot_steps=5
    ),
    "shifts-1000": DS.with_(mean_steps_between_shifts=1000.0, domain_sigma=0.6),
    "shifts-250": DS.with_(mean_steps_between_shifts=250.0, domain_sigma=0.6),
    "mixed-decode": DS.with_(prefill_fraction=0.1, drift_sigma=0.5, drift_timescale_steps=600.0),
    "mixed-prefill": DS.with_(prefill_fraction=0.7, drift_sigma=0.5, drift_timescale_steps=600.0),
    "drifting": DS.with_(
        num_domains=4,
        domain_sigma=0.7,
        mean_steps_between_shifts=900.0,
        drift_sigma=0.5,
        drift_timescale_steps=600.0,
    ),
}
"""The workloads the forecast was chosen on (seed 0)."""
WORKLOADS: dict[str, WorkloadConfig] = {
    **VARIANTS,
    "deepseek-v3": DS,
    "qwen3-235b-a22b": WorkloadConfig(preset="qwen3-235b-a22b"),
}
FORECASTS: dict[str, dict[str, Any]] = {
    "sum": {"prediction": "sum"},
    "recent": {"prediction": "recent"},
    "decay": {"prediction": "decay"},
    "robust": {"prediction": "robust"},
    "track": {"prediction": "track"},
    "track-reset": {"prediction": "track", "track_shift": 0.05},
}
"""Each forecast as ``--solver-option`` fields (docs/solver.md, Load prediction)."""
MODES: dict[str, tuple[str, ...]] = {
    "continuous-static": (*FORECASTS, "latent", "oracle"),
    "continuous-lp": ("decay", "track"),
    "periodic-static": ("auto", "track"),
    "periodic-200": ("auto", "oracle"),
    "deepseek-1000": ("sum",),
    "deepseek-200": ("sum",),
}
"""The forecasts each mode runs (``auto``: the default for that mode)."""
TOPOLOGY: dict[str, Any] = {"ep_size": 32, "nnodes": 4, "ep_num_redundant_experts": 32}
SCORE_FROM = 1000
PERIODIC_INTERVAL = 1000
MODE_INTERVALS = {"periodic-200": 200, "deepseek-200": 200}
"""Periodic modes whose interval (and window) is not ``PERIODIC_INTERVAL``."""
TARGET_BALANCEDNESS = 0.88
TARGET_BYTES_FRACTION = 0.25
TIMING_EP = {32: 4, 64: 8}


@dataclass(frozen=True, kw_only=True)
class OraclePlanner(SolverPlanner):
    """Plans on the next ``ahead`` passes of the trace, which no server can see: the ceiling."""

    counts_FLE: np.ndarray
    """The whole trace's counts."""
    ahead: int = CONTINUOUS_INTERVAL
    """Passes from the rebalance on that it plans for (the interval the plan serves)."""

    def __call__(
        self, window_WLE: np.ndarray, current: Placement, history: LoadHistory | None = None
    ) -> Plan:
        assert history is not None, "the oracle reads the trace from the simulator's clock"
        now = int(history.now)
        future_WLE = self.counts_FLE[now : now + self.ahead]
        topology = Topology(
            num_gpus=current.num_gpus,
            num_nodes=current.num_nodes,
            num_physical=current.num_physical,
            num_groups=self.num_groups,
        )
        return solve(future_WLE, topology, current, replace(self.options, prediction="sum"))


@dataclass(frozen=True, kw_only=True)
class LatentPlanner(SolverPlanner):
    """Plans on the generator's hidden popularity of the window's passes instead of their counts
    (``eplb.workloads.latent``), weighted like the counts: what a forecast that knew the present
    exactly would give, without seeing the future (the oracle) or guessing the next shift."""

    hidden: Latent
    num_layers: int
    """Layers of the trace (the variants keep the first ones)."""

    def __call__(
        self, window_WLE: np.ndarray, current: Placement, history: LoadHistory | None = None
    ) -> Plan:
        assert history is not None, "the latent planner reads the trace's steps from the simulator's clock"
        now = int(history.now)
        steps_W = np.arange(now - window_WLE.shape[0], now)
        # Each pass's expected counts: its popularity times its routed choices (the counts' total).
        total_WL = window_WLE.sum(axis=-1, dtype=np.float64)
        expected_WLE = self.hidden.shares(steps_W)[:, : self.num_layers] * total_WL[..., None]
        topology = Topology(
            num_gpus=current.num_gpus,
            num_nodes=current.num_nodes,
            num_physical=current.num_physical,
            num_groups=self.num_groups,
        )
        # The present: a decay of one pass (the popularity moves at drift knots and shifts only).
        return solve(
            expected_WLE, topology, current, replace(self.options, prediction="decay", decay_half_life=1.0)
        )


def workload_trace(name: str, steps: int, seed: int, layers: int | None) -> Trace:
    """The workload's trace, cut to its first ``layers`` layers when given."""
    trace = generate(WORKLOADS[name].with_(num_steps=steps, seed=seed))
    if layers is None or layers >= trace.num_layers:
        return trace
    counts = np.ascontiguousarray(trace.counts_FLE[:, :layers])
    return Trace(counts, trace.is_prefill_F, trace.num_tokens_F, trace.meta)


def run_one(trace: Trace, mode: str, forecast: str, budget: int) -> dict[str, Any]:
    """One simulated run, its summary row."""
    continuous = mode.startswith("continuous")
    dispatch = "lp" if mode == "continuous-lp" else "static"
    algorithm = "deepseek" if mode.startswith("deepseek") else "scipy"
    interval = CONTINUOUS_INTERVAL if continuous else MODE_INTERVALS.get(mode, PERIODIC_INTERVAL)
    flags = EplbConfig(
        enable_eplb=True,
        eplb_rebalance_mode="continuous" if continuous else "periodic",
        eplb_rebalance_num_iterations=interval,
        eplb_max_moved_experts=budget if continuous else None,
        eplb_transfer_gbps=100.0 if continuous else None,
        ep_dispatch_algorithm=dispatch,
        **TOPOLOGY,
    )
    fields = {} if forecast in ("auto", "oracle", "latent") or algorithm != "scipy" else FORECASTS[forecast]
    config = SimulationConfig.for_trace(
        trace,
        eplb=flags,
        score_from=SCORE_FROM,
        solver_options=fields,
    )
    spec = RunSpec(algorithm, dispatch)
    planners = None
    if forecast in ("oracle", "latent"):
        options = SolveOptions.from_mapping(
            {},
            algorithm=algorithm,
            dispatch=dispatch,
            bytes_per_expert=config.bytes_per_expert,
            max_moved_experts=budget if continuous else None,
        )
        if forecast == "oracle":
            planner: SolverPlanner = OraclePlanner(
                options=options, num_groups=config.num_groups, counts_FLE=trace.counts_FLE, ahead=interval
            )
        else:
            planner = LatentPlanner(
                options=options,
                num_groups=config.num_groups,
                hidden=latent(WorkloadConfig.of_trace(trace)),
                num_layers=trace.num_layers,
            )
        planners = {spec.name: planner}
    started = time.perf_counter()
    summary = simulate(trace, [spec], config, planners=planners).summaries()[0]
    return {
        "mode": mode,
        "forecast": forecast,
        "budget": budget if continuous else None,
        "balancedness_prefill": summary["balancedness_prefill_mean"],
        "speedup": summary["speedup_vs_none"],
        "bytes_per_1000_passes": summary["bytes_moved_per_1000_passes"],
        "prediction_error": summary["prediction_error_mean"],
        "prediction_bias": summary["prediction_bias_mean"],
        "solve_seconds_mean": summary["solve_seconds_mean"],
        "rebalances_applied": summary["rebalances_applied"],
        "wall_s": time.perf_counter() - started,
    }


def run_workload(
    name: str,
    modes: Sequence[str],
    steps: int,
    seed: int,
    variant_layers: int | None,
    lp: Sequence[str],
    forecasts: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Every mode and forecast on one workload's trace (``continuous-lp`` only if ``name`` is in
    ``lp``; only the ``forecasts`` named, where given)."""
    layers = variant_layers if name in VARIANTS else None
    trace = workload_trace(name, steps, seed, layers)
    full_layers = PRESETS[WORKLOADS[name].preset].num_layers
    budget = round(CONTINUOUS_MAX_MOVED_EXPERTS * trace.num_layers / full_layers)
    rows = []
    for mode in modes:
        if mode == "continuous-lp" and name not in lp:
            continue
        for forecast in MODES[mode]:
            if forecasts is not None and forecast not in forecasts:
                continue
            row = run_one(trace, mode, forecast, budget)
            rows.append(row)
            print(
                f"  {name:<16} {mode:<18} {forecast:<15} bal {row['balancedness_prefill']:.4f}  "
                f"{row['bytes_per_1000_passes'] / 1e9:7.1f} GB/1000  err {row['prediction_error'] or 0:.3f} "
                f"bias {row['prediction_bias'] or 0:+.3f}  solve {row['solve_seconds_mean']:.3f} s",
                flush=True,
            )
    reference = next((r for r in rows if r["mode"] == "deepseek-1000"), None)
    for row in rows:
        ref_bytes = reference["bytes_per_1000_passes"] if reference else 0.0
        row["bytes_fraction_of_deepseek_1000"] = (
            row["bytes_per_1000_passes"] / ref_bytes if ref_bytes else None
        )
    return {
        "workload": name,
        "chosen_on": name in VARIANTS,
        "seed": seed,
        "steps": steps,
        "layers": trace.num_layers,
        "domain_shifts": len(trace.meta.get("domain_change_steps", [])),
        "generator": dict(trace.meta["generator"]),
        "rows": rows,
    }


def solve_timing(forecasts: Sequence[str], steps: int, solves: int) -> list[dict[str, Any]]:
    """CPU ms of one budgeted continuous solve (static dispatch) per forecast at EP32 and EP64."""
    trace = generate(DS.with_(num_steps=steps, seed=0))
    counts = trace.counts_FLE
    preset = PRESETS["deepseek-v3"]
    out = []
    for ep, nodes in TIMING_EP.items():
        topology = Topology(num_gpus=ep, num_nodes=nodes, num_physical=preset.num_experts + ep, num_groups=8)
        first = solve(counts[:200], topology, None, SolveOptions(dispatch="static")).placement
        for forecast in forecasts:
            options = SolveOptions.from_mapping(
                FORECASTS[forecast],
                dispatch="static",
                max_moved_experts=CONTINUOUS_MAX_MOVED_EXPERTS,
                bytes_per_expert=preset.bytes_per_expert,
                pricing=Pricing(horizon_passes=CONTINUOUS_INTERVAL),
            )
            current, cpu_ms, forecast_ms = first, [], []
            for t in range(250, 250 + solves * CONTINUOUS_INTERVAL, CONTINUOUS_INTERVAL):
                window = counts[t - 200 : t]
                started = time.thread_time()
                plan = solve(window, topology, current, options)
                cpu_ms.append((time.thread_time() - started) * 1e3)
                if plan.apply:
                    current = plan.placement
                checked = window.astype(np.float64)
                started = time.thread_time()
                predict(checked, options, options.prediction)
                forecast_ms.append((time.thread_time() - started) * 1e3)
            row = {
                "ep": ep,
                "forecast": forecast,
                "solves": len(cpu_ms),
                "cpu_ms_median": float(np.median(cpu_ms)),
                "cpu_ms_max": float(np.max(cpu_ms)),
                "forecast_ms_median": float(np.median(forecast_ms)),
            }
            out.append(row)
            print(
                f"  timing EP{ep} {forecast:<15} solve {row['cpu_ms_median']:.1f} ms median, "
                f"{row['cpu_ms_max']:.1f} max; forecast alone {row['forecast_ms_median']:.1f} ms (called twice per solve)",
                flush=True,
            )
    return out


def table(cases: Sequence[dict[str, Any]]) -> str:
    """Markdown: one line per workload and mode/forecast."""
    lines = [
        "| workload | mode | forecast | prefill balancedness | vs decay | GB / 1000 passes | of DeepSeek-1000 | prediction error | bias | solve s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        base = {
            r["mode"]: r["balancedness_prefill"] for r in case["rows"] if r["forecast"] in ("decay", "auto")
        }
        for r in case["rows"]:
            ref = base.get(r["mode"])
            delta = (
                ""
                if ref is None or r["forecast"] in ("decay", "auto")
                else f"{r['balancedness_prefill'] - ref:+.4f}"
            )
            frac = r["bytes_fraction_of_deepseek_1000"]
            err = r["prediction_error"]
            bias = r.get("prediction_bias")
            lines.append(
                f"| {case['workload']} | {r['mode']} | {r['forecast']} | {r['balancedness_prefill']:.4f} | {delta} | "
                f"{r['bytes_per_1000_passes'] / 1e9:.1f} | {'' if frac is None else f'{frac:.3f}'} | "
                f"{'' if err is None else f'{err:.3f}'} | {'' if bias is None else f'{bias:+.3f}'} | "
                f"{r['solve_seconds_mean']:.3f} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument(
        "--lp-workloads",
        nargs="+",
        default=["deepseek-v3", "drifting", "churn", "shifts-250"],
        help="workloads that also run continuous-lp (lp's per-batch split is slow to simulate)",
    )
    parser.add_argument(
        "--forecasts", nargs="+", default=None, help="run only these forecasts of each mode (default: all)"
    )
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--variant-layers",
        type=int,
        default=16,
        help="first layers of the variants (0: all; presets run whole)",
    )
    parser.add_argument("--jobs", type=int, default=1, help="workloads simulated in parallel")
    parser.add_argument("--no-timing", action="store_true", help="skip the solve CPU timing")
    parser.add_argument(
        "--timing-only", action="store_true", help="only the solve CPU timing (no simulations, no table)"
    )
    parser.add_argument("--timing-solves", type=int, default=12)
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/bench_forecast_cpu.json"))
    args = parser.parse_args()
    if args.timing_only and args.no_timing:
        parser.error("--timing-only and --no-timing exclude each other")
    layers = args.variant_layers or None
    out: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
        "score_from": SCORE_FROM,
        "topology": TOPOLOGY,
        "forecasts": FORECASTS,
        "cases": [],
    }
    with threadpool_limits(limits=1, user_api="blas"):
        if args.timing_only:
            pass
        elif args.jobs > 1:
            with ProcessPoolExecutor(args.jobs) as pool:
                futures = [
                    pool.submit(
                        run_workload,
                        w,
                        args.modes,
                        args.steps,
                        args.seed,
                        layers,
                        args.lp_workloads,
                        args.forecasts,
                    )
                    for w in args.workloads
                ]
                out["cases"] = [f.result() for f in futures]
        else:
            for w in args.workloads:
                out["cases"].append(
                    run_workload(
                        w, args.modes, args.steps, args.seed, layers, args.lp_workloads, args.forecasts
                    )
                )
                write_result(args.json, out)  # after every workload: a run cut short keeps what it measured
        if not args.no_timing:
            out["timing"] = solve_timing(
                ["decay", "track", "robust"], 250 + args.timing_solves * 50, args.timing_solves
            )
    if not args.timing_only:
        out["table"] = table(out["cases"])
    write_result(args.json, out)
    if not args.timing_only:
        print(out["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
