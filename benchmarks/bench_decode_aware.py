"""Decode-aware dispatch: does routing an expert's few tokens to fewer replicas pay in decode?

Shape legend: L layers, E logical experts, P physical slots, G GPUs (EP ranks), S slots per GPU,
n passes.

In a weight-bound pass a GPU's MoE time is ``a + b * active`` (eplb.policy.cost_model: each
distinct active expert's weights are read once), so a replica that receives a single token costs
as much as one that receives a hundred. Static dispatch sends each rank's tokens to the rank's own
replica, so every replica of a loaded expert tends to be active; ``lp`` spreads tokens over all
replicas by design. Two decode-aware rules send all of an expert's tokens to one replica:

- ``primary``: one fixed replica per expert, the same on every rank (chosen once per placement so
  that the GPUs hold as few primaries as they can), served by the static kernel with another
  table: no exchange, static's kernel cost.
- ``greedy``: per pass, from the global counts (what ``lp`` exchanges), each loaded replicated
  expert, hottest first, goes to the replica whose GPU's time ``max(b * active, c * tokens)``
  grows least: ``lp``'s kernel cost.

Workloads: bench_forecast's ``mixed-decode`` (DeepSeek-V3, 10% prefill, fast drift) and the
deepseek-v3 and qwen3-235b-a22b presets, at EP32 on 4 nodes with 32 redundant slots; the placement
is scipy's static-dispatch plan on the first 1000 passes
(as SGLang serves it); the decode passes after pass 1000 give each layer's expert popularity, from
which each rank's top-k choices are drawn at three global decode batch sizes (tokens over all
ranks). Each pass is timed by the cost model per layer (the busiest GPU) plus each rule's dispatch
kernels per layer (``--eplb-dispatch-cost``'s table, decode rows: 58 layers in one CUDA graph).
Columns: mean MoE µs per pass (all layers) and the ratio to static; ``best`` takes per pass the
lower of static and ``primary`` (what ``auto`` could pick by the pass's size, no exchange).

    python -m benchmarks.bench_decode_aware --json benchmarks/results/bench_decode_aware_cpu.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.bench_forecast import WORKLOADS
from benchmarks.harness import write_result
from eplb.placement.dispatch_map import static_dispatch_maps
from eplb.placement.model import Placement
from eplb.policy.cost_model import CostModel, DispatchKernelCost, dispatch_kernel_cost
from eplb.remap.lp_rule import lp_quotas, lp_tables
from eplb.solver import SolveOptions, Topology, solve
from eplb.workloads import PRESETS, generate

G, NODES, REDUNDANT = 32, 4, 32
PLAN_PASSES = 1000
DECODE_WORKLOADS = ("mixed-decode", "deepseek-v3", "qwen3-235b-a22b")
"""The decode-heavy variant and the two presets (70% decode each)."""
RULES = ("static", "primary", "greedy", "lp")
KERNEL_OF = {"static": "static", "primary": "static", "greedy": "lp", "lp": "lp"}
"""Each rule's dispatch kernels: the static kernel with its table, or lp's count + exchange + map."""


def primary_slots(pl: Placement, load_LE: np.ndarray) -> np.ndarray:
    """int64 [L, E]: one replica per expert, the same on every rank: experts with one replica keep
    it; the others, hottest first, take the replica on the GPU holding the fewest primaries yet
    (ties: the lower planned load), so the busiest GPU's active count in a weight-bound pass is as
    small as the placement allows."""
    S = pl.slots_per_gpu
    out_LE = pl.log2phy_LER[:, :, 0].astype(np.int64)
    for layer in range(pl.num_layers):
        count_G = np.zeros(pl.num_gpus, dtype=np.int64)
        tokens_G = np.zeros(pl.num_gpus)
        cnt_E = pl.logcnt_LE[layer]
        for e in np.flatnonzero(cnt_E == 1):
            g = out_LE[layer, e] // S
            count_G[g] += 1
            tokens_G[g] += load_LE[layer, e]
        for e in sorted(np.flatnonzero(cnt_E > 1), key=lambda x: -load_LE[layer, x]):
            slots = pl.log2phy_LER[layer, e, : cnt_E[e]].astype(np.int64)
            gpus = slots // S
            best = min(range(len(slots)), key=lambda i: (count_G[gpus[i]], tokens_G[gpus[i]]))
            out_LE[layer, e] = slots[best]
            count_G[gpus[best]] += 1
            tokens_G[gpus[best]] += load_LE[layer, e]
    return out_LE


def rank_counts(rng: np.random.Generator, p_LE: np.ndarray, batch: int, top_k: int) -> np.ndarray:
    """int64 [L, E, G]: each rank's routed tokens per expert: ``batch`` tokens over the ranks, each
    choosing ``top_k`` experts (drawn with the layer's popularity ``p_LE``, with replacement)."""
    counts_LE = np.stack([rng.multinomial(batch * top_k, p) for p in p_LE])
    return rng.multinomial(counts_LE, np.full(G, 1.0 / G))


def gpu_terms(
    rule: str, counts_LEG: np.ndarray, pl: Placement, ctx: dict[str, Any]
) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [L, G], active experts [L, G]) of one pass under ``rule``."""
    L, E, S = pl.num_layers, pl.num_logical, pl.slots_per_gpu
    P = pl.num_physical
    counts_LE = counts_LEG.sum(axis=2)
    slot_tokens_LP: np.ndarray = np.zeros((L, P))
    if rule == "static":
        maps_GLE = ctx["maps_GLE"]
        flat = (np.arange(L)[None, :, None] * P + maps_GLE).ravel()
        weights = counts_LEG.transpose(2, 0, 1).ravel()
        slot_tokens_LP = np.bincount(flat, weights, minlength=L * P).reshape(L, P)
    elif rule == "primary":
        flat = (np.arange(L)[:, None] * P + ctx["primary_LE"]).ravel()
        slot_tokens_LP = np.bincount(flat, counts_LE.ravel(), minlength=L * P).reshape(L, P)
    elif rule == "greedy":
        slot_tokens_LP = _greedy(counts_LE, pl, ctx["cost"])
    elif rule == "lp":
        tables = ctx["lp_tables"]
        quota_LnXD, _ = lp_quotas(counts_LE[:, None, :], tables)
        slot_LXD = tables.slot_LXD
        valid = slot_LXD >= 0
        flat = (np.arange(L)[:, None, None] * P + np.where(valid, slot_LXD, 0))[valid]
        slot_tokens_LP = (
            np.bincount(flat, quota_LnXD[:, 0][valid], minlength=L * P).reshape(L, P).astype(float)
        )
        single_LE = tables.single_slot_LE
        has = single_LE >= 0
        flat = (np.arange(L)[:, None] * P + np.where(has, single_LE, 0))[has]
        slot_tokens_LP += np.bincount(flat, counts_LE[has], minlength=L * P).reshape(L, P)
    else:
        raise ValueError(f"unknown rule {rule!r}")
    tokens_LG = slot_tokens_LP.reshape(L, G, S).sum(axis=2)
    active_LG = (slot_tokens_LP > 0).reshape(L, G, S).sum(axis=2)
    assert np.allclose(tokens_LG.sum(axis=1), counts_LE.sum(axis=1)), rule  # every token lands once
    del E
    return tokens_LG, active_LG


def _greedy(counts_LE: np.ndarray, pl: Placement, cost: CostModel) -> np.ndarray:
    """float64 [L, P]: slot tokens when each loaded replicated expert, hottest first, goes whole
    to the replica whose GPU's ``max(b * active, c * tokens)`` grows least."""
    L, P, S = pl.num_layers, pl.num_physical, pl.slots_per_gpu
    b, c = cost.per_expert_us, cost.per_token_us
    out_LP = np.zeros((L, P))
    for layer in range(L):
        cnt_E = pl.logcnt_LE[layer]
        single = cnt_E == 1
        slots1 = pl.log2phy_LER[layer, single, 0].astype(np.int64)
        np.add.at(out_LP[layer], slots1, counts_LE[layer, single])
        tokens_G = out_LP[layer].reshape(G, S).sum(axis=1)
        active_G = (out_LP[layer] > 0).reshape(G, S).sum(axis=1).astype(float)
        multi = np.flatnonzero((cnt_E > 1) & (counts_LE[layer] > 0))
        for e in multi[np.argsort(-counts_LE[layer, multi], kind="stable")]:
            t = counts_LE[layer, e]
            slots = pl.log2phy_LER[layer, e, : cnt_E[e]].astype(np.int64)
            gpus = slots // S
            after = np.maximum(b * (active_G[gpus] + 1), c * (tokens_G[gpus] + t))
            i = int(np.argmin(after))
            out_LP[layer, slots[i]] += t
            tokens_G[gpus[i]] += t
            active_G[gpus[i]] += 1
    return out_LP


def run(
    workload: str, batches: list[int], passes: int, steps: int, cost_name: str, seed: int
) -> list[dict[str, Any]]:
    """One workload at every batch size: each rule's mean µs per decode pass and busiest active count."""
    started = time.perf_counter()
    config = WORKLOADS[workload]
    top_k = PRESETS[config.preset].top_k
    trace = generate(config.with_(num_steps=steps, seed=0))
    L, E = trace.num_layers, trace.num_experts
    topology = Topology(num_gpus=G, num_nodes=NODES, num_physical=E + REDUNDANT)
    plan_load_LE = trace.counts_FLE[:PLAN_PASSES].sum(axis=0, dtype=np.float64)
    pl = solve(plan_load_LE, topology, None, SolveOptions(algorithm="scipy", dispatch="static")).placement
    cost = CostModel()
    kernels: DispatchKernelCost = dispatch_kernel_cost(cost_name)
    ctx = {
        "maps_GLE": static_dispatch_maps(pl).astype(np.int64),
        "primary_LE": primary_slots(pl, plan_load_LE),
        "lp_tables": lp_tables(pl),
        "cost": cost,
    }
    decode_F = np.flatnonzero(~trace.is_prefill_F[PLAN_PASSES:]) + PLAN_PASSES
    chosen = decode_F[np.linspace(0, decode_F.size - 1, passes).astype(int)]
    rng = np.random.default_rng(seed)
    rows: list[dict[str, Any]] = []
    for batch in batches:
        us = {rule: np.zeros(passes) for rule in RULES}
        active_max = {rule: 0.0 for rule in RULES}
        for i, step in enumerate(chosen):
            counts_LE = trace.counts_FLE[step].astype(np.float64) + 1e-3  # no expert never chosen
            counts_LEG = rank_counts(rng, counts_LE / counts_LE.sum(axis=1, keepdims=True), batch, top_k)
            for rule in RULES:
                tokens_LG, active_LG = gpu_terms(rule, counts_LEG, pl, ctx)
                kernel = kernels.layer_us(KERNEL_OF[rule], np.array([batch / G]), np.array([False]))[0]
                us[rule][i] = cost.layer_times_us(tokens_LG, active_LG).sum() + L * kernel
                active_max[rule] += float(active_LG.max(axis=1).mean()) / passes
        best = np.minimum(us["static"], us["primary"])
        row: dict[str, Any] = {
            "workload": workload,
            "batch_tokens": batch,
            "tokens_per_rank": batch / G,
            "pass_us": {rule: float(us[rule].mean()) for rule in RULES} | {"best": float(best.mean())},
            "busiest_active": active_max,
        }
        row["ratio_to_static"] = {k: v / row["pass_us"]["static"] for k, v in row["pass_us"].items()}
        rows.append(row)
        print(_line(row), flush=True)
    print(f"{workload}: {time.perf_counter() - started:.0f} s", flush=True)
    return rows


def _line(row: dict[str, Any]) -> str:
    r = row["ratio_to_static"]
    return (
        f"{row['workload']:<16} batch {row['batch_tokens']:>6} ({row['tokens_per_rank']:.0f}/rank)  static {row['pass_us']['static']:.0f} µs"
        f"  primary {r['primary']:.3f}  greedy {r['greedy']:.3f}  lp {r['lp']:.3f}  best {r['best']:.3f}"
    )


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of every workload and batch size."""
    lines = [
        "| workload | decode batch (tokens, all ranks) | static µs per pass | primary | greedy | lp | best of static, primary "
        "| busiest GPU's active experts static / primary / greedy / lp |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        r, a = row["ratio_to_static"], row["busiest_active"]
        lines.append(
            f"| {row['workload']} | {row['batch_tokens']} ({row['tokens_per_rank']:.0f} per rank) | {row['pass_us']['static']:.0f} | "
            f"{r['primary']:.3f} | {r['greedy']:.3f} | {r['lp']:.3f} | {r['best']:.3f} | "
            f"{a['static']:.2f} / {a['primary']:.2f} / {a['greedy']:.2f} / {a['lp']:.2f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(DECODE_WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 2048, 8192])
    parser.add_argument("--passes", type=int, default=100)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--eplb-dispatch-cost", dest="cost", default="h200")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rows = [
        r for w in args.workloads for r in run(w, args.batches, args.passes, args.steps, args.cost, args.seed)
    ]
    print(table(rows))
    if args.json is not None:
        write_result(
            args.json, {"command": " ".join(sys.argv), "cost": args.cost, "passes": args.passes, "rows": rows}
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
