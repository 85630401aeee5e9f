"""Does scraping the metrics slow the serving process? Step time with and without a 20 Hz scrape.

Shape legend: T tokens per pass, K top-k, L layers, E logical experts, P physical slots, G GPUs.

Two processes under test, each serving ``/metrics`` from the exporter's thread in-process:

- ``--mode demo``: ``eplb demo`` with the real manager (CPU ranks over Gloo; rank 0 in this
  process reports to the sink). A step is one forward pass of rank 0, timed between consecutive
  ``on_forward_pass`` calls (the model's MoE layers, the all-to-alls, the manager's hook, its
  background solves and chunked hot-swaps).
- ``--mode synthetic``: the sink driven at DeepSeek-V3 size (L=58, E=256, EP32 with 32 redundant
  slots). A step counts a pass's routed ids per layer on the host (``np.bincount`` of int32
  ``topk_ids [T, K]`` into E bins for each of L layers: numpy holding the GIL, the worst case for a
  scraping thread) and reports ``on_forward_pass``; every ``--window-every`` steps it hands over
  the window ([L, E] logical load, [L, G] GPU load under the placement), every
  ``--rebalance-every`` steps a rebalance. Micro-costs of each sink call and of a scrape's render
  are timed too.

A separate scraper process GETs ``/metrics`` over one kept-alive connection (as Prometheus does)
at ``--rate`` Hz during alternating "on" blocks: ``--blocks`` pairs of off/on blocks of
``--duration / --blocks`` seconds, so ``--duration`` seconds of scraping in all and drift in the
shared machine's load hits both phases alike. Reported: step time per phase, the change of the
mean and median, the median over "on" blocks of the change against the "off" blocks either side
(robust to drift), and (synthetic) the CPU this process spent outside the stepping thread. The
target is a change below 5%.

    python -m benchmarks.bench_metrics --mode demo --json bench_metrics_demo.json
    python -m benchmarks.bench_metrics --mode synthetic --json bench_metrics_synthetic.json

``--mode hostile`` asks instead whether scrapes are still answered under hostile clients: 16 and
then 20 clients trickling request heads and reconnecting at each cut-off (``--deadline``), with
a burst of 200 connections halfway, from 127.0.0.2... (the attackers apart) or all from
127.0.0.1, in a process of their own (tests/helpers/hostile_clients.py); a scrape every 0.1 s
from 127.0.0.1 for ``--duration`` seconds counts as answered when a whole 200 comes within 1 s.

    python -m benchmarks.bench_metrics --mode hostile --duration 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import generate_latest

from benchmarks.harness import wall_times, write_result
from eplb.metrics.exporter import MetricsExporter
from eplb.metrics.prometheus import PrometheusSink
from eplb.metrics.sink import PassKind
from eplb.placement.balance import gpu_load
from eplb.placement.model import Placement
from eplb.workloads import PRESETS
from tests.helpers.hostile_clients import Attack, scrape_under_attack

# Reads the "on" blocks' [start, end] wall times from stdin once the process under test is warm.
SCRAPER = r"""
import http.client, json, sys, time, urllib.parse
url, rate = sys.argv[1], float(sys.argv[2])
schedule = json.loads(sys.stdin.readline())
parts = urllib.parse.urlsplit(url)
conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=5)
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


class Blocks:
    """Alternating off/on blocks from ``start``; the scraper is told the "on" ones."""

    def __init__(self, start: float, duration: float, pairs: int) -> None:
        size = duration / pairs
        self.phases = [("off", "on")[j % 2] for j in range(2 * pairs)]
        self.bounds = [(start + j * size, start + (j + 1) * size) for j in range(2 * pairs)]
        self.end = self.bounds[-1][1]

    def on(self) -> list[tuple[float, float]]:
        return [b for b, p in zip(self.bounds, self.phases, strict=True) if p == "on"]

    def split(self, stamps: list[float], durations: list[float]) -> list[tuple[str, list[float]]]:
        """Step durations grouped by the block their end time falls in."""
        out: list[tuple[str, list[float]]] = [(p, []) for p in self.phases]
        j = 0
        for stamp, duration in zip(stamps, durations, strict=True):
            while j < len(self.bounds) and stamp >= self.bounds[j][1]:
                j += 1
            if j == len(self.bounds):
                break
            if stamp >= self.bounds[j][0]:
                out[j][1].append(duration)
        return out


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def summarize(blocks: list[tuple[str, list[float]]]) -> dict[str, Any]:
    """Step-time statistics per phase and the changes with scraping on."""
    steps = {p: [d for phase, ds in blocks if phase == p for d in ds] for p in ("off", "on")}
    means = [(p, statistics.fmean(ds)) for p, ds in blocks if ds]
    paired = []
    for j, (phase, mean) in enumerate(means):
        if phase == "on":
            neighbours = [means[k][1] for k in (j - 1, j + 1) if 0 <= k < len(means) and means[k][0] == "off"]
            paired.append(100 * (mean / statistics.fmean(neighbours) - 1))
    off, on = steps["off"], steps["on"]
    out: dict[str, Any] = {
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
    }
    out["mean_change_pct"] = 100 * (out["mean_on_ms"] / out["mean_off_ms"] - 1)
    out["median_change_pct"] = 100 * (out["median_on_ms"] / out["median_off_ms"] - 1)
    return out


def start_scraper(url: str, rate: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", SCRAPER, url, str(rate)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def finish_scraper(scraper: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = scraper.communicate(timeout=120)
    scraped = json.loads(out)
    return {
        "scrapes": scraped["scrapes"],
        "scrape_p50_ms": 1e3 * _percentile(scraped["latencies"], 50),
        "scrape_p99_ms": 1e3 * _percentile(scraped["latencies"], 99),
        "scrape_bytes": max(scraped["bytes"]) if scraped["bytes"] else 0,
    }


def micro_costs(logical_LE: np.ndarray, gpu_LG: np.ndarray) -> dict[str, float]:
    """Median microseconds of each sink call and of a scrape's render (fresh window vs cached)."""
    sink = PrometheusSink(min_render_interval_s=0.0)  # every render after a new window is fresh

    def timed(fn: Callable[[], object], repeat: int) -> float:
        return 1e6 * statistics.median(wall_times(fn, repeat))

    def fresh() -> None:
        sink.on_window(logical_load_LE=logical_LE, gpu_load_LG=gpu_LG)
        sink.render()

    def fresh_generic() -> None:
        sink.on_window(logical_load_LE=logical_LE, gpu_load_LG=gpu_LG)
        generate_latest(sink.registry)

    return {
        "on_forward_pass_us": timed(lambda: sink.on_forward_pass(kind="decode", recorded=True), 2000),
        "on_window_us": timed(lambda: sink.on_window(logical_load_LE=logical_LE, gpu_load_LG=gpu_LG), 200),
        "on_window_plus_fresh_render_us": timed(fresh, 30),
        "cached_render_us": timed(sink.render, 200),
        # The same samples through prometheus_client's generic writer (the registry path).
        "on_window_plus_generate_latest_us": timed(fresh_generic, 30),
    }


def run_synthetic(args: argparse.Namespace) -> dict[str, Any]:
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
        scraper = start_scraper(exporter.url, args.rate)
        blocks = Blocks(time.time() + args.warmup + 1.0, args.duration, args.blocks)
        assert scraper.stdin is not None
        scraper.stdin.write(json.dumps(blocks.on()) + "\n")
        scraper.stdin.flush()
        stamps: list[float] = []
        durations: list[float] = []
        other_cpu: dict[str, list[float]] = {"off": [], "on": []}
        i = 0
        for (_start, end), phase in zip(
            [(0.0, blocks.bounds[0][0]), *blocks.bounds], ["warmup", *blocks.phases], strict=True
        ):
            wall0, cpu0, thread0 = time.perf_counter(), time.process_time(), time.thread_time()
            while time.time() < end:
                s = time.perf_counter()
                step(i)
                durations.append(time.perf_counter() - s)
                stamps.append(time.time())
                i += 1
            wall, cpu, thread = (
                time.perf_counter() - wall0,
                time.process_time() - cpu0,
                time.thread_time() - thread0,
            )
            if phase != "warmup":
                # CPU this process spent outside the stepping thread: the exporter (and idle polls).
                other_cpu[phase].append((cpu - thread) / wall)
        scraped = finish_scraper(scraper)
    return {
        "mode": "synthetic",
        "shape": {
            "layers": L,
            "experts": E,
            "gpus": G,
            "slots": placement.num_physical,
            "tokens": args.tokens,
        },
        "window_every": args.window_every,
        **summarize(blocks.split(stamps, durations)),
        **scraped,
        "exporter_cpu_share_off": statistics.fmean(other_cpu["off"]),
        "exporter_cpu_share_on": statistics.fmean(other_cpu["on"]),
        **micro_costs(window_LE.copy(), gpu_load(window_LE, placement)),
    }


class _TimingSink(PrometheusSink):
    """The exporter's sink, also stamping every forward pass rank 0 reports (the step boundaries)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stamps: list[float] = []

    def on_forward_pass(self, *, kind: PassKind, recorded: bool) -> None:
        self.stamps.append(time.time())
        super().on_forward_pass(kind=kind, recorded=recorded)


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    from eplb.cli import build_parser
    from eplb.commands import demo

    total = args.warmup + 2 * args.duration
    ns = build_parser().parse_args(["demo", *args.demo_args.split(), "--duration-s", str(total + 10)])
    config = demo.config_from_namespace(ns)
    sink = _TimingSink(min_render_interval_s=args.min_render_interval)
    result: dict[str, Any] = {}
    with MetricsExporter(sink) as exporter:
        scraper = start_scraper(exporter.url, args.rate)
        schedule: list[Blocks] = []

        def controller() -> None:
            # The demo's clock starts after its ranks are up: start the blocks once passes flow.
            while not sink.stamps:
                time.sleep(0.05)
            blocks = Blocks(time.time() + args.warmup, args.duration, args.blocks)
            schedule.append(blocks)
            assert scraper.stdin is not None
            scraper.stdin.write(json.dumps(blocks.on()) + "\n")
            scraper.stdin.flush()

        thread = threading.Thread(target=controller, daemon=True)
        thread.start()
        summary = demo.run_demo(config, sink=sink, out=lambda line: None, timeout_s=total + 600)
        thread.join(timeout=5)
        scraped = finish_scraper(scraper)
        (blocks,) = schedule
        if sink.stamps[-1] < blocks.end:
            raise RuntimeError("the demo stopped before the last block ended; raise its --steps")
        stamps = sink.stamps[1:]
        durations = np.diff(sink.stamps).tolist()
        result = {
            "mode": "demo",
            "demo_args": args.demo_args,
            "passes": summary["passes"],
            "rebalances_applied": summary["rebalances_applied"],
            **summarize(blocks.split(stamps, durations)),
            **scraped,
        }
    return result


def run_hostile(args: argparse.Namespace) -> dict[str, Any]:
    """Scrapes answered within 1 s under reconnecting tricklers and a burst (see the docstring)."""
    runs = []
    for apart in (True, False):
        for tricklers in (16, 20):
            sources = [f"127.0.0.{i}" for i in range(2, 22)] if apart else ["127.0.0.1"]
            attack = Attack(
                sources=sources, tricklers=tricklers, duration_s=args.duration, burst_at_s=args.duration / 2
            )
            with MetricsExporter(PrometheusSink(), request_deadline_s=args.deadline) as exporter:
                seen = scrape_under_attack(exporter.port, attack)
            answered = sum(s == 200 for s in seen.statuses)
            runs.append(
                {
                    "attackers": "127.0.0.2-21" if apart else "127.0.0.1",
                    "tricklers": tricklers,
                    "scrapes": len(seen.statuses),
                    "answered_within_1s": answered,
                    "answered_fraction": round(seen.answered, 4),
                    "scrape_p99_ms": round(1e3 * _percentile(seen.latencies_s, 99), 2),
                    "attack": seen.attack,
                }
            )
            print(
                f"attackers {runs[-1]['attackers']:>12}, {tricklers} tricklers: {answered} of"
                f" {len(seen.statuses)} scrapes answered within 1 s ({100 * seen.answered:.1f}%), p99"
                f" {runs[-1]['scrape_p99_ms']} ms; attack {seen.attack}"
            )
    return {"mode": "hostile", "deadline_s": args.deadline, "scrape_seconds": args.duration, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("demo", "synthetic", "hostile"), default="demo")
    parser.add_argument(
        "--deadline", type=float, default=1.0, help="hostile: the exporter's request_deadline_s (default 1)"
    )
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of scraping (default 30)")
    parser.add_argument("--rate", type=float, default=20.0, help="scrapes per second (default 20)")
    parser.add_argument("--blocks", type=int, default=15, help="off/on block pairs (default 15)")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of steps before timing")
    parser.add_argument(
        "--min-render-interval",
        type=float,
        default=1.0,
        help="PrometheusSink min_render_interval_s (default 1.0; 0 re-renders each new window)",
    )
    parser.add_argument(
        "--demo-args",
        default="--nproc 2 --preset mixtral-8x7b --steps 20000 --eplb-rebalance-num-iterations 100",
        help="demo mode: arguments for eplb demo (default: %(default)s)",
    )
    parser.add_argument(
        "--tokens", type=int, default=8192, help="synthetic: T, tokens per pass (default 8192)"
    )
    parser.add_argument("--num-gpus", type=int, default=32, help="synthetic: G, EP ranks (default 32)")
    parser.add_argument(
        "--num-redundant", type=int, default=32, help="synthetic: redundant slots (default 32)"
    )
    parser.add_argument(
        "--window-every", type=int, default=10, help="synthetic: steps between on_window calls"
    )
    parser.add_argument(
        "--rebalance-every", type=int, default=1000, help="synthetic: steps between rebalances"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    parser.add_argument(
        "--micro-only", action="store_true", help="synthetic: only the sink and render micro-costs"
    )
    args = parser.parse_args(argv)
    if (
        args.duration <= 0
        or args.rate <= 0
        or args.blocks < 1
        or args.window_every < 1
        or args.rebalance_every < 1
    ):
        parser.error("--duration, --rate, --blocks, --window-every and --rebalance-every must be positive")
    if not 0 < args.deadline < float("inf"):
        parser.error("--deadline must be a finite number > 0")
    load_before = os.getloadavg()[0]
    if args.mode == "hostile":
        hostile = run_hostile(args)
        hostile.update(
            loadavg_1m_before_after=[round(load_before, 2), round(os.getloadavg()[0], 2)], cpus=os.cpu_count()
        )
        if args.json is not None:
            write_result(args.json, hostile)
        return 0
    if args.micro_only:
        rng = np.random.default_rng(args.seed)
        window_LE = rng.integers(0, 10_000, size=(58, 256)).astype(np.float64)
        placement = Placement.trivial(58, 256, num_gpus=args.num_gpus, num_redundant=args.num_redundant)
        micro = micro_costs(window_LE, gpu_load(window_LE, placement))
        print(json.dumps({k: round(v, 2) for k, v in micro.items()}, indent=2))
        return 0
    result = run_demo(args) if args.mode == "demo" else run_synthetic(args)
    result.update(
        rate_hz=args.rate,
        scrape_seconds=args.duration,
        blocks=args.blocks,
        min_render_interval_s=args.min_render_interval,
        loadavg_1m_before_after=[round(load_before, 2), round(os.getloadavg()[0], 2)],
        cpus=os.cpu_count(),
    )
    print(f"{args.mode}: {'':8} {'no scrape':>10} {f'{args.rate:g} Hz':>10} {'change %':>9}")
    for name, key in (("mean step ms", "mean"), ("median step ms", "median"), ("p99 step ms", "p99")):
        a, b = result[f"{key}_off_ms"], result[f"{key}_on_ms"]
        print(f"{name:16} {a:10.4g} {b:10.4g} {100 * (b / a - 1):+9.2f}")
    print(
        f"steps {result['steps_off']} / {result['steps_on']}; paired on/off block change: median"
        f" {result['paired_change_median_pct']:+.2f}% over {len(result['paired_block_change_pct'])} blocks"
    )
    print(
        f"scrapes {result['scrapes']} ({result['scrape_bytes']} B each), latency p50 {result['scrape_p50_ms']:.2f} ms"
        f" p99 {result['scrape_p99_ms']:.2f} ms; load avg {result['loadavg_1m_before_after']} on {result['cpus']} CPUs"
    )
    if args.mode == "synthetic":
        print(
            f"CPU outside the step thread: {100 * result['exporter_cpu_share_off']:.2f}% of a core without scrapes,"
            f" {100 * result['exporter_cpu_share_on']:.2f}% with; sink calls: on_forward_pass"
            f" {result['on_forward_pass_us']:.2f} us, on_window {result['on_window_us']:.1f} us; render: fresh window"
            f" {result['on_window_plus_fresh_render_us']:.0f} us, cached {result['cached_render_us']:.0f} us;"
            f" prometheus_client's writer on a fresh window {result['on_window_plus_generate_latest_us']:.0f} us"
        )
    if args.json is not None:
        write_result(args.json, result, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
