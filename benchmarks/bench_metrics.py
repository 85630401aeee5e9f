"""Does scraping the metrics slow the serving process? Step time with and without a 20 Hz scrape.

Shape legend: T tokens per pass, K top-k, L layers, E logical experts, P physical slots, G GPUs.

The process under test does what a serving process holding the manager does on its host thread,
at DeepSeek-V3 size (L=58, E=256, EP32 with 32 redundant slots): every step counts a pass's
routed ids per layer on the host (``np.bincount`` of int32 ``topk_ids [T, K]`` into E bins for
each of L layers: numpy holding the GIL, the worst case for a scraping thread) and reports
``on_forward_pass``; every ``--window-every`` steps it hands the sink the window ([L, E] logical
load and [L, G] GPU load under the placement, from eplb.balance), every ``--rebalance-every``
steps a rebalance. The exporter serves ``/metrics`` from its own thread in the same process.

A separate scraper process GETs ``/metrics`` at ``--rate`` Hz during alternating "on" blocks
(``--blocks`` pairs of off/on blocks of ``--duration / --blocks`` seconds each, so drift in the
machine's load hits both phases alike). The table gives step-time statistics per phase and the
change of the mean and median; the target is < 5%. Micro-costs of each sink call and of
rendering a scrape are timed separately.

    python benchmarks/bench_metrics.py --json bench_metrics.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eplb.balance import gpu_load
from eplb.metrics import PrometheusSink
from eplb.metrics_exporter import MetricsExporter
from eplb.placement import Placement
from eplb.workloads import PRESETS

SCRAPER = r"""
import http.client, json, sys, time, urllib.parse
url, rate, schedule = sys.argv[1], float(sys.argv[2]), json.loads(sys.argv[3])
parts = urllib.parse.urlsplit(url)
conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=5)  # kept alive, as Prometheus does
latencies, sizes = [], []
for start, end in schedule:
    while time.time() < start:
        time.sleep(min(0.05, max(0.0, start - time.time())))
    next_at = time.time()
    while time.time() < end:
        t0 = time.perf_counter()
        conn.request("GET", parts.path)
        sizes.append(len(conn.getresponse().read()))
        latencies.append(time.perf_counter() - t0)
        next_at += 1.0 / rate
        time.sleep(max(0.0, next_at - time.time()))
print(json.dumps({"scrapes": len(latencies), "latencies": latencies, "bytes": sizes}))
"""


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def micro_costs(logical_LE: np.ndarray, gpu_LG: np.ndarray) -> dict[str, float]:
    """Median seconds of each sink call and of a scrape's render (fresh window vs cached)."""
    sink = PrometheusSink(min_render_interval_s=0.0)  # every render after a new window is fresh

    def timed(fn: Any, repeat: int) -> float:
        samples = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    def fresh() -> None:
        sink.on_window(logical_load_LE=logical_LE, gpu_load_LG=gpu_LG)
        sink.render()

    return {
        "on_forward_pass": timed(lambda: sink.on_forward_pass(kind="decode", recorded=True), 2000),
        "on_window": timed(lambda: sink.on_window(logical_load_LE=logical_LE, gpu_load_LG=gpu_LG), 200),
        "on_window_plus_fresh_render": timed(fresh, 30),
        "cached_render": timed(sink.render, 200),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    preset = PRESETS["deepseek-v3"]
    L, E, K, G = preset.num_layers, preset.num_experts, preset.top_k, args.num_gpus
    rng = np.random.default_rng(args.seed)
    placement = Placement.trivial(L, E, num_gpus=G, num_redundant=args.num_redundant)
    popularity_E = rng.pareto(1.2, size=E) + 0.05
    popularity_E /= popularity_E.sum()
    # A pool of passes' routed ids to cycle through (drawing them would dominate the step).
    pool = [rng.choice(E, size=(args.tokens, K), p=popularity_E).astype(np.int32) for _ in range(8)]

    sink = PrometheusSink(min_render_interval_s=args.min_render_interval)
    sink.on_topology(
        num_layers=L, num_logical=E, num_physical=placement.num_physical, num_gpus=G, num_nodes=max(1, G // 8)
    )
    window_LE = np.zeros((L, E), dtype=np.float64)

    def step(i: int) -> None:
        ids_TK = pool[i % len(pool)]
        for layer in range(L):
            window_LE[layer] += np.bincount(ids_TK[:, (layer % K)], minlength=E)
        sink.on_forward_pass(kind="prefill" if i % 4 == 0 else "decode", recorded=True)
        if i % args.window_every == 0:
            sink.on_window(logical_load_LE=window_LE, gpu_load_LG=gpu_load(window_LE, placement))
        if i % args.rebalance_every == 0:
            sink.on_rebalance(
                outcome="applied",
                reason="bench",
                solve_seconds=0.5,
                transfer_seconds=2.0,
                experts_moved=100,
                bytes_moved=100 * preset.bytes_per_expert,
                balancedness_before=0.7,
                balancedness_after=0.9,
            )
            window_LE[:] = 0

    with MetricsExporter(sink) as exporter:
        block = args.duration / args.blocks
        t0 = time.time() + args.warmup + 1.0  # the scraper needs a moment to start
        phases = [("off", "on")[j % 2] for j in range(2 * args.blocks)]
        bounds = [(t0 + j * block, t0 + (j + 1) * block) for j in range(2 * args.blocks)]
        schedule = [b for b, p in zip(bounds, phases, strict=True) if p == "on"]
        scraper = subprocess.Popen(
            [sys.executable, "-c", SCRAPER, exporter.url, str(args.rate), json.dumps(schedule)],
            stdout=subprocess.PIPE,
            text=True,
        )
        load_before = os.getloadavg()
        times: dict[str, list[float]] = {"off": [], "on": []}
        blocks: list[dict[str, Any]] = []
        i = 0
        for (_start, end), phase in zip([(time.time(), t0), *bounds], ["warmup", *phases], strict=True):
            block_times = []
            wall0, cpu0, thread0 = time.perf_counter(), time.process_time(), time.thread_time()
            while time.time() < end:
                s = time.perf_counter()
                step(i)
                block_times.append(time.perf_counter() - s)
                i += 1
            wall, cpu, thread = (
                time.perf_counter() - wall0,
                time.process_time() - cpu0,
                time.thread_time() - thread0,
            )
            if phase != "warmup":
                times[phase].extend(block_times)
                # CPU this process spent outside the stepping thread: the exporter (and GC, idle polls).
                blocks.append(
                    {
                        "phase": phase,
                        "mean": statistics.fmean(block_times),
                        "other_cpu": (cpu - thread) / wall,
                    }
                )
        out, _ = scraper.communicate(timeout=60)
        load_after = os.getloadavg()
        scraped = json.loads(out)
        micro = micro_costs(window_LE.copy(), gpu_load(window_LE, placement))

    off, on = times["off"], times["on"]
    # Each "on" block against the mean of the "off" blocks either side of it: drift cancels.
    paired = []
    for j, b in enumerate(blocks):
        if b["phase"] == "on":
            neighbours = [blocks[k]["mean"] for k in (j - 1, j + 1) if 0 <= k < len(blocks)]
            paired.append(100 * (b["mean"] / statistics.fmean(neighbours) - 1))
    other_cpu = {
        p: statistics.fmean(b["other_cpu"] for b in blocks if b["phase"] == p) for p in ("off", "on")
    }
    result: dict[str, Any] = {
        "shape": {
            "layers": L,
            "experts": E,
            "gpus": G,
            "slots": placement.num_physical,
            "tokens": args.tokens,
        },
        "rate_hz": args.rate,
        "scrape_seconds": args.duration,
        "blocks": args.blocks,
        "window_every": args.window_every,
        "min_render_interval_s": args.min_render_interval,
        "steps_off": len(off),
        "steps_on": len(on),
        "mean_off_ms": 1e3 * statistics.fmean(off),
        "mean_on_ms": 1e3 * statistics.fmean(on),
        "median_off_ms": 1e3 * statistics.median(off),
        "median_on_ms": 1e3 * statistics.median(on),
        "p99_off_ms": 1e3 * _percentile(off, 99),
        "p99_on_ms": 1e3 * _percentile(on, 99),
        "paired_block_change_pct": paired,
        "paired_change_median_pct": statistics.median(paired),
        "exporter_cpu_share_off": other_cpu["off"],
        "exporter_cpu_share_on": other_cpu["on"],
        "scrapes": scraped["scrapes"],
        "scrape_p50_ms": 1e3 * _percentile(scraped["latencies"], 50),
        "scrape_p99_ms": 1e3 * _percentile(scraped["latencies"], 99),
        "scrape_bytes": max(scraped["bytes"]) if scraped["bytes"] else 0,
        "loadavg_1m_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
        "cpus": os.cpu_count(),
        **{f"{k}_us": v * 1e6 for k, v in micro.items()},
    }
    result["mean_change_pct"] = 100 * (result["mean_on_ms"] / result["mean_off_ms"] - 1)
    result["median_change_pct"] = 100 * (result["median_on_ms"] / result["median_off_ms"] - 1)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of scraping (default 30)")
    parser.add_argument("--rate", type=float, default=20.0, help="scrapes per second (default 20)")
    parser.add_argument("--blocks", type=int, default=15, help="off/on block pairs (default 15)")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of steps before timing")
    parser.add_argument("--tokens", type=int, default=8192, help="T, tokens per pass (default 8192)")
    parser.add_argument("--num-gpus", type=int, default=32, help="G, EP ranks (default 32)")
    parser.add_argument("--num-redundant", type=int, default=32, help="redundant slots (default 32)")
    parser.add_argument("--window-every", type=int, default=10, help="steps between on_window calls")
    parser.add_argument(
        "--min-render-interval",
        type=float,
        default=1.0,
        help="PrometheusSink min_render_interval_s (default 1.0; 0 re-renders each new window)",
    )
    parser.add_argument("--rebalance-every", type=int, default=1000, help="steps between rebalances")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args(argv)
    if (
        args.duration <= 0
        or args.rate <= 0
        or args.blocks < 1
        or args.window_every < 1
        or args.rebalance_every < 1
    ):
        parser.error("--duration, --rate, --blocks, --window-every and --rebalance-every must be positive")
    result = run(args)
    rows = [
        ("steps", result["steps_off"], result["steps_on"], ""),
        ("mean step ms", result["mean_off_ms"], result["mean_on_ms"], result["mean_change_pct"]),
        ("median step ms", result["median_off_ms"], result["median_on_ms"], result["median_change_pct"]),
        (
            "p99 step ms",
            result["p99_off_ms"],
            result["p99_on_ms"],
            100 * (result["p99_on_ms"] / result["p99_off_ms"] - 1),
        ),
    ]
    print(f"{'':16} {'no scrape':>10} {f'{args.rate:g} Hz':>10} {'change %':>9}")
    for name, a, b, c in rows:
        change = f"{c:+9.2f}" if c != "" else ""
        print(f"{name:16} {a:10.4g} {b:10.4g} {change}")
    print(
        f"paired on/off block change: median {result['paired_change_median_pct']:+.2f}% over {len(result['paired_block_change_pct'])} blocks;"
        f" CPU outside the step thread: {100 * result['exporter_cpu_share_off']:.2f}% of a core without scrapes,"
        f" {100 * result['exporter_cpu_share_on']:.2f}% with"
    )
    print(
        f"scrapes {result['scrapes']} ({result['scrape_bytes']} B each), latency p50 {result['scrape_p50_ms']:.2f} ms"
        f" p99 {result['scrape_p99_ms']:.2f} ms; load avg {result['loadavg_1m_before_after']} on {result['cpus']} CPUs"
    )
    print(
        f"sink calls: on_forward_pass {result['on_forward_pass_us']:.2f} us, on_window {result['on_window_us']:.1f} us;"
        f" render: fresh window {result['on_window_plus_fresh_render_us']:.0f} us, cached {result['cached_render_us']:.0f} us"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
