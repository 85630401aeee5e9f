"""Surviving a lost rank: eplb's degraded plan against SGLang's ``elasticity_aware`` and no replanning.

Shape legend: F steps.

The deepseek-v3 preset (2000 passes, seed 0), EP32 on 4 nodes, SGLang's periodic schedule every
500 passes (window = interval), static dispatch. Each case replays the trace once
(eplb.simulate.failure) with ranks lost before pass 1000, for three runs that share the trace:
``scipy`` (eplb's default; at the loss, ``solve`` with ``alive_ranks``), SGLang 0.5.23's own
``elasticity_aware.rebalance_experts`` (``benchmarks.peers``, fetched from PyPI) at every rebalance
and at the loss, and ``none`` (scipy's plans until the loss, then no replanning: the old maps,
whose tokens for the lost ranks are lost). Reported per run: balancedness over the survivors from
the loss to the next rebalance (pass 1500) and to the end, prefill passes only too; bytes reloaded
(the lost experts, once each) and copied between survivors at the loss; the share of the window's
load on the experts lost with every replica (served only once reloaded); for ``none``, the tokens
its maps still send to the lost ranks; and balancedness before the loss (passes 500-999: what
failure-aware placement costs there).

Cases: one rank lost (ranks 0, 5, 10, 15, 20, 25, 30, one replay each, and their mean), with and
without eplb's failure-aware placement (``failure_domain=gpu``, one more replay per rank, eplb's run
alone: SGLang's and ``none``'s do not depend on it); one node lost (ranks 8-15): at 32 redundant
experts the 24 survivors hold 216 slots for 256 experts, which no plan can serve, so that case runs
at 96 redundant (11 slots per GPU, 264 left), with and without ``failure_domain=node``. The last
table checks, for each case, what failure-aware eplb must reach against SGLang: balancedness
after the loss at least SGLang's (to the next rebalance and to the end), fewer bytes reloaded and
fewer moved at the loss.

    python -m benchmarks.bench_rank_failure            # everything (about 6 minutes on 2 cores)
    python -m benchmarks.bench_rank_failure --ranks 5  # one single-rank case
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.harness import write_result
from benchmarks.peers import SGLANG_VERSION, load_sglang_elasticity_aware
from eplb.config import EplbConfig
from eplb.simulate import RunSpec, SimulationConfig
from eplb.simulate.failure import RankFailure, simulate_rank_failures
from eplb.traces import Trace
from eplb.workloads import WorkloadConfig, generate

STEPS, LOSS_STEP, INTERVAL = 2000, 1000, 500
RANKS = (0, 5, 10, 15, 20, 25, 30)
NODE = tuple(range(8, 16))
RESULT = Path(__file__).parent / "results" / "bench_rank_failure_cpu.json"


def config(redundant: int, solver_options: dict[str, Any] | None = None) -> SimulationConfig:
    flags = EplbConfig(
        enable_eplb=True,
        ep_size=32,
        nnodes=4,
        ep_num_redundant_experts=redundant,
        num_experts=256,
        eplb_rebalance_num_iterations=INTERVAL,
        ep_dispatch_algorithm="static",
    )
    return SimulationConfig(
        eplb=flags, bytes_per_expert=3 * 7168 * 2048, num_groups=8, solver_options=solver_options or {}
    )


def case(
    trace: Trace,
    sim: SimulationConfig,
    ranks: tuple[int, ...],
    sglang: Any,
    tag: str,
    runs: tuple[str, ...] = ("scipy", "none"),
) -> list[dict[str, Any]]:
    started = time.perf_counter()
    specs = [RunSpec(name, "static") for name in runs]
    result = simulate_rank_failures(trace, specs, sim, [RankFailure(LOSS_STEP, ranks)], sglang=sglang)
    print(result.table(), f"\n({tag}: {time.perf_counter() - started:.0f} s)\n", flush=True)
    return [{**row, "case": tag} for row in result.summaries()]


def aware_case(
    trace: Trace, redundant: int, domain: str, ranks: tuple[int, ...], tag: str, runs: tuple[str, ...]
) -> list[dict[str, Any]]:
    """eplb's runs with failure-aware placement over ``domain``, named ``scipy:static failure_domain=...``."""
    sim = config(redundant, {"failure_domain": domain})
    rows = case(trace, sim, ranks, None, f"{tag}, failure_domain={domain}", runs)
    return [{**r, "name": f"{r['name']} failure_domain={domain}"} for r in rows]


def mean_rows(rows: list[dict[str, Any]], tag: str) -> list[dict[str, Any]]:
    """The mean of each run's numeric figures over ``rows`` (one per case)."""
    out = []
    for name in dict.fromkeys(r["name"] for r in rows):
        mine = [r for r in rows if r["name"] == name]
        keys = [k for k, v in mine[0].items() if isinstance(v, (int, float)) and k != "step"]
        out.append({"name": name, "case": tag, **{k: float(np.mean([r[k] for r in mine])) for k in keys}})
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| case | run | balancedness before the loss | to the next rebalance | to the end (prefill) "
        "| reloaded | moved at the loss | load orphaned | tokens lost |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['name']} | {r['balancedness_before']:.3f} | {r['balancedness_to_rebalance']:.3f} | "
            f"{r['balancedness_after']:.3f} ({r['balancedness_after_prefill']:.3f}) | "
            f"{r['bytes_reloaded'] / 1e9:.1f} GB | {r['bytes_moved_at_loss'] / 1e9:.1f} GB | "
            f"{100 * r['orphaned_load']:.1f}% | {100 * r['tokens_lost_fraction']:.1f}% |"
        )
    return "\n".join(lines)


def goal_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case: failure-aware eplb against SGLang, the issue's four conditions."""
    out = []
    for r in rows:
        if "refused" in r or "failure_domain" not in r["name"] or not r["name"].startswith("scipy"):
            continue
        base = r["case"].split(", failure_domain=")[0]
        peer = next(
            (p for p in rows if p["case"] == base and p["name"].startswith("sglang_elasticity_aware")), None
        )
        if peer is None:
            continue
        checks = {
            "balance_to_rebalance": r["balancedness_to_rebalance"] >= peer["balancedness_to_rebalance"],
            "balance_to_end": r["balancedness_after"] >= peer["balancedness_after"],
            "fewer_reloaded": r["bytes_reloaded"] < peer["bytes_reloaded"],
            "fewer_moved": r["bytes_moved_at_loss"] < peer["bytes_moved_at_loss"],
        }
        out.append({"case": base, "eplb": r, "sglang": peer, **checks, "met": all(checks.values())})
    return out


def goal_markdown(goals: list[dict[str, Any]]) -> str:
    lines = [
        "| case | to the next rebalance: eplb / SGLang | to the end | reloaded | moved at the loss | met |",
        "|---|---|---|---|---|---|",
    ]
    for g in goals:
        e, p = g["eplb"], g["sglang"]
        lines.append(
            f"| {g['case']} | {e['balancedness_to_rebalance']:.3f} / {p['balancedness_to_rebalance']:.3f} | "
            f"{e['balancedness_after']:.3f} / {p['balancedness_after']:.3f} | "
            f"{e['bytes_reloaded'] / 1e9:.1f} / {p['bytes_reloaded'] / 1e9:.1f} GB | "
            f"{e['bytes_moved_at_loss'] / 1e9:.1f} / {p['bytes_moved_at_loss'] / 1e9:.1f} GB | "
            f"{'yes' if g['met'] else 'no'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="*", default=list(RANKS), help="single ranks to lose")
    parser.add_argument("--no-node", action="store_true", help="skip the node-loss cases")
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    sglang = load_sglang_elasticity_aware()
    trace = generate(WorkloadConfig(preset="deepseek-v3", num_steps=STEPS, seed=0))
    rows: list[dict[str, Any]] = []
    singles: list[dict[str, Any]] = []
    for rank in args.ranks:
        singles += case(trace, config(32), (rank,), sglang, f"rank {rank}")
        singles += aware_case(trace, 32, "gpu", (rank,), f"rank {rank}", ("scipy",))
    rows += singles
    if singles:
        default = [r for r in singles if "failure_domain" not in r["case"]]
        aware = [r for r in singles if "failure_domain" in r["case"]]
        rows += mean_rows(default, f"one rank, mean of {len(args.ranks)}")
        rows += mean_rows(aware, f"one rank, mean of {len(args.ranks)}, failure_domain=gpu")
    if not args.no_node:
        try:
            case(trace, config(32), NODE, sglang, "node 1 at 32 redundant")
        except ValueError as exc:  # the survivors cannot hold every expert
            print(f"node 1 at 32 redundant: {exc}\n")
            rows.append({"case": "node 1 at 32 redundant", "refused": str(exc)})
        rows += case(trace, config(96), NODE, sglang, "node 1, 96 redundant")
        rows += aware_case(trace, 96, "node", NODE, "node 1, 96 redundant", ("scipy", "none"))
    shown = [
        r for r in rows if "refused" not in r and (not r["case"].startswith("rank") or len(args.ranks) == 1)
    ]
    goals = goal_rows(rows)
    print(markdown(shown))
    print()
    print(goal_markdown(goals))
    write_result(
        args.out,
        {
            "benchmark": "bench_rank_failure",
            "sglang": SGLANG_VERSION,
            "steps": STEPS,
            "loss_step": LOSS_STEP,
            "interval": INTERVAL,
            "rows": rows,
            "goal": [{k: v for k, v in g.items() if k not in ("eplb", "sglang")} for g in goals],
        },
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
