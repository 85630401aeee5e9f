"""Very hot experts: max/mean GPU load and solve time of fresh plans, eplb against DeepSeek's algorithm.

Shape legend: L layers, E logical experts, P physical slots, G GPUs, N nodes.

Cases: vLLM's ``extreme_weight_imbalance`` input (one expert 1000x the seven others, 12 slots on 4
GPUs over 2 nodes: the numbers of vLLM's own test, restated here), and seeded DeepSeek-like
layers (gamma loads) where one or two experts carry 0.5-3x the rest of the layer's load, at the
shapes of the engine adapters' checks (64 experts on 8 GPUs) and of DeepSeek-V3 at EP32. Each
row: the mean and worst per-layer max/mean GPU load under an even split, and the median solve
seconds (``eplb.solver.solve``, no current placement). The ``scipy budgeted`` rows plan from
DeepSeek's plan of the same load (as a continuous server would after a periodic one) under a move
budget of ``--budget`` copies per layer (``max_moved_experts = budget x L``).

    python -m benchmarks.bench_hot_expert [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from eplb.placement.balance import gpu_load
from eplb.solver import SolveOptions, Topology, solve

CASES = (
    ("vLLM extreme_weight_imbalance", 8, 4, 2, 12, 0),
    ("1 hot expert, E64 G8", 64, 8, 2, 80, 1),
    ("2 hot experts, E64 G8", 64, 8, 2, 80, 2),
    ("1 hot expert, E256 EP32", 256, 32, 4, 288, 1),
    ("2 hot experts, E256 EP32", 256, 32, 4, 288, 2),
)


def _load(E: int, hot: int, layers: int, seed: int) -> np.ndarray:
    if hot == 0:
        return np.array([[1000.0] + [1.0] * (E - 1)])
    rng = np.random.default_rng(seed)
    load_LE = rng.gamma(2.0, 10.0, (layers, E))
    for layer in range(layers):
        experts = rng.choice(E, hot, replace=False)
        load_LE[layer, experts] = load_LE[layer].sum() * rng.uniform(0.5, 3.0, hot)
    return load_LE


def run(layers: int = 8, seed: int = 0, budget: int = 1) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for name, E, G, N, P, hot in CASES:
        load_LE = _load(E, hot, layers, seed)
        topology = Topology(num_gpus=G, num_nodes=N, num_physical=P)
        deepseek = solve(load_LE, topology, None, SolveOptions(algorithm="deepseek")).placement
        runs = (
            ("scipy", None, SolveOptions(algorithm="scipy")),
            ("deepseek", None, SolveOptions(algorithm="deepseek")),
            (
                "scipy budgeted",
                deepseek,
                SolveOptions(algorithm="scipy", max_moved_experts=budget * load_LE.shape[0]),
            ),
        )
        for algorithm, current, options in runs:
            seconds = []
            started = time.perf_counter()
            plan = solve(load_LE, topology, current, options)
            seconds.append(time.perf_counter() - started)
            g = gpu_load(load_LE, plan.placement)
            ratio_L = g.max(axis=-1) / g.mean(axis=-1)
            rows.append(
                {
                    "case": name,
                    "algorithm": algorithm,
                    "mean_max_over_mean": float(ratio_L.mean()),
                    "worst_max_over_mean": float(ratio_L.max()),
                    "solve_seconds": float(np.median(seconds)),
                    "recounted_layers": plan.stats.get("recounted_layers", 0.0),
                }
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--budget", type=int, default=1, help="budgeted rows: copies per layer")
    args = parser.parse_args(argv)
    rows = run(budget=args.budget)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    print(f"{'case':32} {'algorithm':14} {'max/mean':>9} {'worst':>7} {'solve s':>8} {'recounted':>9}")
    for row in rows:
        print(
            f"{row['case']!s:32} {row['algorithm']!s:14} {row['mean_max_over_mean']:9.3f} "
            f"{row['worst_max_over_mean']:7.3f} {row['solve_seconds']:8.2f} {row['recounted_layers']:9.0f}"
        )


if __name__ == "__main__":
    main()
