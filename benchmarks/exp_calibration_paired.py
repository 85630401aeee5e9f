"""Experiment (reverted after measuring): solve CPU time, calibrating on the older plan against
calibrating on the live placement (``EPLB_EXP_CAL=current``), solve by solve in one process.

Each variant keeps its own trajectory (its live placement and age) on bench_forecast's timing
trace: static dispatch, 160 copies, a 200-pass window every 50 passes.

    python -m benchmarks.exp_calibration_paired 32 20
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any

import numpy as np

from benchmarks import bench_forecast as bf
from eplb.solver.solve import solve
from eplb.solver.types import SolveOptions, Topology


def main() -> None:
    ep = int(sys.argv[1])
    solves = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    counts = bf.generate(bf.DS.with_(num_steps=250 + solves * 50, seed=0)).counts_FLE
    preset = bf.PRESETS["deepseek-v3"]
    topology = Topology(num_gpus=ep, num_nodes=ep // 8, num_physical=preset.num_experts + ep, num_groups=8)
    first = solve(counts[:200], topology, None, SolveOptions(dispatch="static")).placement
    options = SolveOptions.from_mapping(
        bf.FORECASTS["decay"],
        dispatch="static",
        max_moved_experts=bf.CONTINUOUS_MAX_MOVED_EXPERTS,
        bytes_per_expert=preset.bytes_per_expert,
        pricing=bf.Pricing(horizon_passes=bf.CONTINUOUS_INTERVAL),
    )
    state: dict[str, dict[str, Any]] = {
        v: {"current": first, "fitted": 200, "ms": [], "on": 0, "applied": 0} for v in ("older", "current")
    }
    for t in range(250, 250 + solves * 50, 50):
        for variant, st in state.items():
            os.environ["EPLB_EXP_CAL"] = variant
            pricing = dataclasses.replace(options.pricing, current_age_passes=t - st["fitted"])
            started = time.thread_time()
            plan = solve(
                counts[t - 200 : t], topology, st["current"], dataclasses.replace(options, pricing=pricing)
            )
            st["ms"].append((time.thread_time() - started) * 1e3)
            st["on"] += int(plan.stats.get("calibrated_on_current", 0))
            if plan.apply:
                st["current"], st["fitted"] = plan.placement, t
                st["applied"] += 1
    out = {
        v: {
            "median_ms": float(np.median(st["ms"])),
            "min_ms": float(np.min(st["ms"])),
            "on_current": st["on"],
            "applied": st["applied"],
        }
        for v, st in state.items()
    }
    print(json.dumps({"ep": ep, **out}))


if __name__ == "__main__":
    main()
