"""How close ``lp`` dispatch's rule comes to the exact min-max split (SciPy HiGHS), per batch.

Shape legend: L layers, E logical experts, P physical slots, G GPUs, S slots per GPU, X replicated
experts, D GPUs holding one replicated expert.

For a fixed placement and one batch's global counts, the split of each replicated expert's tokens
over its GPUs that minimises the busiest GPU is a linear program; its optimum (rounded up to an
integer) is the floor any integer split can reach. This benchmark measures the rule of
eplb.remap.lp_rule (even split, then re-fill passes colour by colour) at 1, 2, 3, 4 and 6 passes,
with the proportional start (``LP_SCALE_ROUNDS``) at 4 and 8 rounds before 1, 2 and 4 passes,
and the rule before colours (heaviest expert first, two passes; restated here), as the busiest
GPU's excess over that floor:

- ``solved``: scipy's plans (``dispatch="lp"`` and ``"static"``) for the deepseek-v3 and
  qwen3-235b-a22b presets at EP32 from the synthetic workload's first 200 passes, scored on the
  prefill passes after them (every third layer);
- ``random``: random placements (tests' generator) with heavy-tailed (Pareto) counts, some ranks'
  experts idle (zero counts on every expert of a quarter of the GPUs).

    python -m benchmarks.bench_lp_optimum --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import linprog

import eplb.remap.lp_rule as rule
from eplb.placement.model import Placement
from eplb.solver import solve
from eplb.solver.types import SolveOptions, Topology
from eplb.workloads import PRESETS, WorkloadConfig, generate


def optimum(counts_E: np.ndarray, tables: rule.LpTables, layer: int) -> float:
    """The LP optimum of the busiest GPU (fractional split) of one layer and batch."""
    S, G = tables.slots_per_gpu, tables.num_gpus
    base_G = np.zeros(G)
    single = tables.single_slot_LE[layer]
    np.add.at(base_G, single[single >= 0] // S, counts_E[single >= 0])
    pairs = [
        (x, int(slot) // S)
        for x, expert in enumerate(tables.expert_LX[layer])
        if expert >= 0
        for slot in tables.slot_LXD[layer, x]
        if slot >= 0
    ]
    rows = int((tables.expert_LX[layer] >= 0).sum())
    n = len(pairs) + 1
    a_eq, b_eq = np.zeros((rows, n)), counts_E[tables.expert_LX[layer, :rows]].astype(float)
    a_ub, b_ub = np.zeros((G, n)), -base_G
    for j, (x, g) in enumerate(pairs):
        a_eq[x, j] = a_ub[g, j] = 1
    a_ub[:, -1] = -1
    cost = np.zeros(n)
    cost[-1] = 1
    res = linprog(cost, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq if rows else None, b_eq=b_eq if rows else None)
    assert res.status == 0, res.message
    return float(res.x[-1])


def heaviest_first_peak(counts_E: np.ndarray, tables: rule.LpTables, layer: int, passes: int = 2) -> int:
    """The busiest GPU under the rule before colours: replicated experts re-fill one at a time,
    heaviest first (ties: lower row), ``passes`` times."""
    S, G = tables.slots_per_gpu, tables.num_gpus
    loads = np.zeros(G + 1, dtype=np.int64)
    single = tables.single_slot_LE[layer]
    np.add.at(loads, single[single >= 0] // S, counts_E[single >= 0])
    expert_X, slot_XD = tables.expert_LX[layer], tables.slot_LXD[layer]
    valid_XD = slot_XD >= 0
    gpu_XD = np.where(valid_XD, slot_XD // S, G)
    amount_X = np.where(expert_X >= 0, counts_E[np.maximum(expert_X, 0)], 0)
    width_X = np.maximum(valid_XD.sum(axis=1), 1)
    D = slot_XD.shape[1]
    quota_XD = np.where(
        valid_XD, (amount_X // width_X)[:, None] + (np.arange(D) < (amount_X % width_X)[:, None]), 0
    )
    np.add.at(loads, gpu_XD.ravel(), quota_XD.ravel())
    order = sorted(np.flatnonzero(expert_X >= 0), key=lambda x: (-amount_X[x], x))
    for _ in range(passes):
        for x in order:
            loads[gpu_XD[x]] -= quota_XD[x]
            quota_XD[x] = rule.water_fill(amount_X[x : x + 1], loads[gpu_XD[x]][None], valid_XD[x][None])[0]
            loads[gpu_XD[x]] += quota_XD[x]
    return int(loads[:G].max())


def colour_peaks(
    counts_LnE: np.ndarray, placement: Placement, passes: int, scale_rounds: int = 0
) -> np.ndarray:
    """int64 [L, n]: the busiest GPU under eplb.remap.lp_rule with ``scale_rounds`` rounds of the
    proportional start and ``passes`` re-fill passes."""
    saved = rule.LP_PASSES, rule.LP_SCALE_ROUNDS
    rule.LP_PASSES, rule.LP_SCALE_ROUNDS = passes, scale_rounds
    try:
        _, loads_LnG = rule.lp_quotas(counts_LnE, rule.lp_tables(placement))
    finally:
        rule.LP_PASSES, rule.LP_SCALE_ROUNDS = saved
    return loads_LnG.max(axis=2)


def score(name: str, placement: Placement, counts_nLE: np.ndarray, layers: range) -> dict[str, Any]:
    """Excess of the busiest GPU over the integer floor, per rule: mean, p90, max over (batch, layer)."""
    tables = rule.lp_tables(placement)
    counts_LnE = np.ascontiguousarray(np.transpose(counts_nLE, (1, 0, 2))).astype(np.int64)
    floor = np.array(
        [
            [np.ceil(optimum(counts_LnE[layer, b], tables, layer) - 1e-6) for b in range(counts_LnE.shape[1])]
            for layer in layers
        ]
    )
    peaks = {
        f"colours, {p} passes": colour_peaks(counts_LnE, placement, p)[list(layers)] for p in (1, 2, 3, 4, 6)
    }
    for rounds, passes in ((4, 1), (4, 2), (4, 4), (8, 1), (8, 2)):
        peaks[f"start {rounds} rounds, {passes} passes"] = colour_peaks(
            counts_LnE, placement, passes, rounds
        )[list(layers)]
    peaks["heaviest first, 2 passes"] = np.array(
        [
            [heaviest_first_peak(counts_LnE[layer, b], tables, layer) for b in range(counts_LnE.shape[1])]
            for layer in layers
        ]
    )
    row: dict[str, Any] = {"case": name, "samples": int(floor.size)}
    for rule_name, peak in peaks.items():
        excess = peak / np.maximum(floor, 1) - 1
        row[rule_name] = {
            "mean": float(excess.mean()),
            "p90": float(np.quantile(excess, 0.9)),
            "max": float(excess.max()),
        }
    return row


def solved_cases(seed: int) -> list[tuple[str, Placement, np.ndarray]]:
    cases = []
    for preset in ("deepseek-v3", "qwen3-235b-a22b"):
        model = PRESETS[preset]
        trace = generate(WorkloadConfig(preset=preset, num_steps=400, seed=seed))
        topology = Topology(
            num_gpus=model.ep_size,
            num_nodes=model.nnodes,
            num_physical=model.num_experts + model.redundant,
            num_groups=model.num_groups,
        )
        prefill = np.flatnonzero(trace.is_prefill_F[200:]) + 200
        for dispatch in ("lp", "static"):
            plan = solve(trace.counts_FLE[:200], topology, options=SolveOptions(dispatch=dispatch))
            cases.append((f"{preset}, {dispatch} plan", plan.placement, trace.counts_FLE[prefill[:24]]))
    return cases


def random_cases(seed: int) -> list[tuple[str, Placement, np.ndarray]]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.helpers.placements import random_phy2log

    rng = np.random.default_rng(seed)
    cases = []
    for E, P, G in ((64, 96, 16), (256, 288, 32)):
        placement = Placement.from_phy2log(random_phy2log(rng, 4, E, P), num_gpus=G)
        counts = np.rint(1000 * (rng.pareto(1.2, size=(24, 4, E)) + 0.05)).astype(np.int64)
        idle_G = rng.permutation(G)[: G // 4]
        S = P // G
        for layer in range(4):
            on_idle = np.isin(placement.phy2log_LP[layer].reshape(G, S)[idle_G], np.arange(E))
            idle_experts = np.unique(placement.phy2log_LP[layer].reshape(G, S)[idle_G][on_idle])
            counts[:12, layer, idle_experts] = 0  # half the batches: a quarter of the GPUs' experts idle
        cases.append((f"random E={E} P={P} G={G}, Pareto counts", placement, counts))
    return cases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = []
    for name, placement, counts in solved_cases(args.seed):
        rows.append(score(name, placement, counts, range(0, placement.num_layers, 3)))
    for name, placement, counts in random_cases(args.seed):
        rows.append(score(name, placement, counts, range(placement.num_layers)))
    for row in rows:
        print(f"{row['case']} ({row['samples']} batch-layers)")
        for key, stats in row.items():
            if isinstance(stats, dict):
                print(
                    f"  {key:28s} mean {stats['mean']:+.4f}  p90 {stats['p90']:+.4f}  max {stats['max']:+.4f}"
                )
    if args.json is not None:
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(rows, indent=1))
        tmp.replace(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
