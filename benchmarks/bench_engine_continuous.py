"""Continuous mode inside vLLM and SGLang, through each engine's own plugin loader, against the
engine's default algorithm at its default cadence, on one drifting trace.

Shape legend: F steps (forward passes), L layers, E logical experts, P physical slots, G GPUs, n
plans.

One trace from ``eplb.workloads`` (the deepseek-v3 preset: 58 layers x 256 experts, EP32 on 4
nodes, 32 redundant slots; drifting popularity with domain shifts). Each run is a subprocess with
vLLM 0.33.0 / SGLang 0.5.23 from PyPI importable (tests.helpers.engines) that loads eplb through
the engine's loader (``vllm.plugins.load_general_plugins``, ``sglang.srt.plugins.load_plugins``)
and calls the engine's own entry point on the engine's schedule:

- SGLang: ``eplb_algorithms.rebalance_experts`` every ``--eplb-rebalance-num-iterations`` passes on
  the window of its ``--expert-distribution-recorder-buffer-size`` passes, the live placement
  installed as SGLang's global ``ExpertLocationMetadata`` between rebalances. Default: ``auto``
  (SGLang's DeepSeek, hierarchical where it applies) at 1000 / 1000. eplb: ``--eplb-algorithm
  scipy`` with ``EPLB_REBALANCE_MODE=continuous`` at 50 / 50.
- vLLM: ``EPLB_POLICIES["default"].rebalance_experts`` on vLLM's ``EplbState`` schedule (the first
  rearrangement after a quarter of ``step_interval``, then every ``step_interval`` steps, on the
  window of the last ``window_size`` recorded steps summed). Default: vLLM's policy at 3000 /
  1000. eplb: ``EPLB_VLLM_POLICY=1 EPLB_REBALANCE_MODE=continuous`` at ``step_interval`` 50,
  ``window_size`` 50.

Each continuous run is made twice, in two processes (two "ranks" fed the same windows), and the
plans must be equal. Every plan is checked against the move budget (``EPLB_MAX_MOVED_EXPERTS``,
plus the documented first plan and shift burst: eplb.policy.decision.MoveAllowance), with copies
counted here from the maps (an arrival of an expert on a GPU that did not hold it). Scores: the
mean over the 50-pass blocks from ``--score-from`` on of the block's model balancedness (even
split over replicas) under the placement serving it; a plan made after pass t serves from t.

    python -m benchmarks.bench_engine_continuous                   # 3000 passes, both engines
    python -m benchmarks.bench_engine_continuous --steps 2000 --engines sglang --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 50
"""Passes per scored block: continuous mode's next window."""


@dataclass(frozen=True, kw_only=True)
class Case:
    """One trace and the engines' schedules."""

    preset: str = "deepseek-v3"
    steps: int = 3000
    seed: int = 1
    layers: int | None = None
    """Keep only the first this many layers (None: all; the tests use a few)."""
    score_from: int = 1000
    interval: int = 50
    """Continuous mode's cadence (SGLang's interval and buffer; vLLM's step_interval and window_size)."""
    max_moved_experts: int = 160
    """``EPLB_MAX_MOVED_EXPERTS``."""
    shift_burst: int = 8
    """``EPLB_SHIFT_BURST`` (eplb.config's default)."""
    sglang_default: tuple[int, int] = (1000, 1000)
    """SGLang's default (interval, buffer)."""
    vllm_default: tuple[int, int] = (3000, 1000)
    """vLLM's default (step_interval, window_size)."""


def trace_counts(case: Case) -> tuple[np.ndarray, Any]:
    """int64 [F, L, E] of the case's trace, and the model preset."""
    from eplb.workloads import PRESETS, WorkloadConfig, generate

    trace = generate(WorkloadConfig(preset=case.preset, num_steps=case.steps, seed=case.seed))
    counts_FLE = np.asarray(trace.counts_FLE, dtype=np.int64)
    if case.layers is not None:
        counts_FLE = counts_FLE[:, : case.layers]
    return counts_FLE, PRESETS[case.preset]


def sglang_schedule(steps: int, interval: int, buffer: int) -> list[tuple[int, int]]:
    """(end, start) of each window SGLang's EPLBManager plans from: every ``interval`` passes, the
    last ``buffer`` passes (its circular buffer, in time order when buffer equals the interval)."""
    return [(end, max(end - buffer, 0)) for end in range(interval, steps + 1, interval)]


def vllm_schedule(steps: int, interval: int, window: int) -> list[tuple[int, int]]:
    """(end, start) of each window vLLM's EplbState plans from (eplb_state.py: the step counter starts
    at interval - interval // 4; a pass is recorded when at most ``window`` steps remain; at
    ``interval`` the last ``window`` recorded passes are summed and the counter restarts)."""
    out, step, recorded = [], interval - interval // 4, []
    for f in range(steps):
        if interval - step <= window:
            recorded.append(f)
        step += 1
        if step >= interval:
            step = 0
            kept = recorded[-window:]
            out.append((f + 1, kept[0] if kept else f + 1))
            assert not kept or kept == list(range(kept[0], f + 1)), "vLLM's window is contiguous here"
    return out


def log2phy_of(phy2log_LP: np.ndarray, num_logical: int) -> np.ndarray:
    """int64 [L, E, R]: each expert's slots in increasing order, padded with -1 (R: most replicas)."""
    L, P = phy2log_LP.shape
    counts_LE = np.stack([np.bincount(row, minlength=num_logical) for row in phy2log_LP])
    out = np.full((L, num_logical, int(counts_LE.max())), -1, dtype=np.int64)
    for layer in range(L):
        order = np.argsort(phy2log_LP[layer], kind="stable")
        experts = phy2log_LP[layer][order]
        starts = np.cumsum(counts_LE[layer]) - counts_LE[layer]
        out[layer, experts, np.arange(P) - starts[experts]] = order
    return out


# ---- inside the engine's process ----------------------------------------------------------------


def _sglang_run(case: Case, mode: str, counts_FLE: np.ndarray, preset: Any) -> tuple[list[int], list[Any]]:
    import sglang.srt.plugins as plugins
    import torch
    from sglang.srt.eplb import eplb_algorithms as algorithms
    from sglang.srt.eplb.expert_location import ExpertLocationMetadata, set_global_expert_location_metadata

    plugins.load_plugins()
    L, E = counts_FLE.shape[1:]
    G, N, P = preset.ep_size, preset.nnodes, preset.num_experts + preset.redundant
    choice = algorithms.compute_algorithm(
        raw_algorithm="scipy" if mode == "eplb" else "auto", num_groups=preset.num_groups, num_nodes=N
    )
    interval, buffer = (case.interval, case.interval) if mode == "eplb" else case.sglang_default

    def install(phy2log: Any, log2phy: Any) -> None:
        log2phy = torch.nn.functional.pad(log2phy, (0, P - log2phy.shape[-1]), value=-1)
        metadata = ExpertLocationMetadata(
            physical_to_logical_map=phy2log, physical_to_logical_map_cpu=phy2log,
            logical_to_all_physical_map=log2phy, logical_to_all_physical_map_cpu=log2phy,
            logical_to_all_physical_map_num_valid=(log2phy >= 0).sum(-1), ep_size=G,
            logical_to_rank_dispatch_physical_map=None,
        )  # fmt: skip
        set_global_expert_location_metadata(metadata, allow_overwrite=True)

    trivial = torch.arange(P, dtype=torch.int64).remainder(E).expand(L, P).contiguous()
    install(trivial, torch.from_numpy(log2phy_of(trivial.numpy(), E)))
    ends, maps = [], []
    for end, start in sglang_schedule(case.steps, interval, buffer):
        window = torch.from_numpy(counts_FLE[start:end])
        phy2log, log2phy, _ = algorithms.rebalance_experts(
            tokens_per_expert=window, num_physical_experts=P, num_local_physical_experts=P // G,
            num_groups=preset.num_groups, num_nodes=N, algorithm=choice,
        )  # fmt: skip
        install(phy2log, log2phy)  # SGLang's updater installs the plan before the next pass
        ends.append(end)
        maps.append(phy2log.numpy().astype(np.int16))
    return ends, maps


def _vllm_run(case: Case, mode: str, counts_FLE: np.ndarray, preset: Any) -> tuple[list[int], list[Any]]:
    import torch
    import vllm.plugins
    from vllm.distributed.eplb.policy import EPLB_POLICIES

    vllm.plugins.load_general_plugins()
    policy = EPLB_POLICIES["default"]
    L, E = counts_FLE.shape[1:]
    G, N, P = preset.ep_size, preset.nnodes, preset.num_experts + preset.redundant
    interval, window = (case.interval, case.interval) if mode == "eplb" else case.vllm_default
    live = torch.arange(P, dtype=torch.int64).remainder(E).expand(L, P).contiguous()
    ends, maps = [], []
    for end, start in vllm_schedule(case.steps, interval, window):
        load_LE = torch.from_numpy(counts_FLE[start:end].sum(axis=0))
        live = policy.rebalance_experts(load_LE, P, preset.num_groups, N, G, live)
        ends.append(end)
        maps.append(live.numpy().astype(np.int16))
    return ends, maps


def worker(engine: str, mode: str, case: Case, out: Path) -> None:
    """Run one engine's schedule (``mode``: eplb or default) and save every plan's map."""
    counts_FLE, preset = trace_counts(case)
    started = time.perf_counter()
    run = {"sglang": _sglang_run, "vllm": _vllm_run}[engine]
    ends, maps = run(case, mode, counts_FLE, preset)
    np.savez(
        out, ends=np.asarray(ends, dtype=np.int64), maps=np.stack(maps), seconds=time.perf_counter() - started
    )


# ---- orchestration and scores ----------------------------------------------------------------


def run_worker(site: Path, engine: str, mode: str, case: Case, out: Path) -> dict[str, np.ndarray]:
    """One worker subprocess with the engines importable; its saved plans."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EPLB_", "VLLM_", "SGLANG_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)])
    if mode == "eplb":
        env.update(
            EPLB_REBALANCE_MODE="continuous",
            EPLB_MAX_MOVED_EXPERTS=str(case.max_moved_experts),
            EPLB_SHIFT_BURST=str(case.shift_burst),
        )
        if engine == "vllm":
            env["EPLB_VLLM_POLICY"] = "1"
    cmd = [sys.executable, "-m", "benchmarks.bench_engine_continuous", "--worker", engine, mode,
           json.dumps(asdict(case)), str(out)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(
            f"{engine} {mode} worker failed ({done.returncode}):\n{done.stdout}\n{done.stderr[-5000:]}"
        )
    with np.load(out) as saved:
        return {k: saved[k] for k in saved.files}


def arrivals(old_LP: np.ndarray, new_LP: np.ndarray, num_gpus: int) -> int:
    """Expert copies across GPUs from ``old`` to ``new`` (plain numpy): the (layer, GPU, expert)
    triples where the GPU holds the expert in ``new`` but not in ``old``."""
    L, P = old_LP.shape
    E = int(max(old_LP.max(), new_LP.max())) + 1
    held = []
    for phy2log in (old_LP, new_LP):
        on_LGE = np.zeros((L, num_gpus, E), dtype=bool)
        gpu_P = np.arange(P) // (P // num_gpus)
        for layer in range(L):
            on_LGE[layer, gpu_P, phy2log[layer]] = True
        held.append(on_LGE)
    return int((held[1] & ~held[0]).sum())


def block_scores(
    counts_FLE: np.ndarray, ends: np.ndarray, maps: np.ndarray, case: Case, num_gpus: int
) -> float:
    """Mean model balancedness (even split) of each BLOCK-pass block from ``score_from`` on, under
    the placement serving it (the trivial one before the first plan)."""
    L, E = counts_FLE.shape[1:]
    P = maps.shape[2]
    trivial = np.tile(np.arange(P) % E, (L, 1))
    scores = []
    for start in range(case.score_from, case.steps - BLOCK + 1, BLOCK):
        served = np.flatnonzero(ends <= start)
        phy2log = trivial if served.size == 0 else maps[served[-1]].astype(np.int64)
        load_LE = counts_FLE[start : start + BLOCK].sum(axis=0).astype(np.float64)
        replicas_LE = np.stack([np.bincount(row, minlength=E) for row in phy2log])
        share_LP = np.take_along_axis(load_LE / replicas_LE, phy2log, axis=1)
        gpu_LG = share_LP.reshape(L, num_gpus, -1).sum(axis=2)
        scores.append(float(np.mean(gpu_LG.mean(axis=1) / gpu_LG.max(axis=1))))
    return float(np.mean(scores))


def budget_check(
    maps: np.ndarray, case: Case, num_gpus: int, num_physical: int, num_logical: int
) -> dict[str, Any]:
    """Copies of each plan from the one before (the first from the trivial placement), and whether
    every plan after the first stays within the allowance: each at most ``burst`` budgets, and any
    run of k of them at most k budgets plus ``burst - 1`` (MoveAllowance's debt)."""
    L = maps.shape[1]
    trivial = np.tile(np.arange(num_physical) % num_logical, (L, 1))
    previous = [trivial, *maps[:-1].astype(np.int64)]
    copies = [arrivals(p, m.astype(np.int64), num_gpus) for p, m in zip(previous, maps, strict=True)]
    rate, burst = case.max_moved_experts, case.shift_burst
    later = np.asarray(copies[1:], dtype=np.int64)
    sums = np.concatenate([[0], np.cumsum(later)])
    worst_run = max(
        (
            int(sums[j] - sums[i]) - (j - i) * rate
            for i in range(len(later))
            for j in range(i + 1, len(later) + 1)
        ),
        default=0,
    )
    return {
        "copies": copies,
        "first_plan_copies": copies[0] if copies else 0,
        "max_plan_copies": int(later.max()) if later.size else 0,
        "worst_run_excess": worst_run,
        "within_budget": bool((later <= rate * burst).all() and worst_run <= (burst - 1) * rate),
    }


def run(
    case: Case, engines: tuple[str, ...] = ("sglang", "vllm"), site: Path | None = None
) -> dict[str, Any]:
    """Every run of ``case``; the scores and checks per engine."""
    if site is None:
        from tests.helpers.engines import ensure_engines

        site = ensure_engines()
    counts_FLE, preset = trace_counts(case)
    G, P, E = preset.ep_size, preset.num_experts + preset.redundant, preset.num_experts
    out: dict[str, Any] = {"case": asdict(case), "engines": {}}
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max_workers=2) as pool:
        jobs = {
            (engine, mode, rank): pool.submit(
                run_worker, site, engine, mode, case, Path(tmp) / f"{engine}-{mode}-{rank}.npz"
            )
            for engine in engines
            for mode, rank in (("eplb", 0), ("eplb", 1), ("default", 0))
        }
        for engine in engines:
            ours, twin, theirs = (
                jobs[(engine, m, r)].result() for m, r in (("eplb", 0), ("eplb", 1), ("default", 0))
            )
            out["engines"][engine] = {
                "same_plans_on_both_ranks": bool(
                    np.array_equal(ours["ends"], twin["ends"]) and np.array_equal(ours["maps"], twin["maps"])
                ),
                "eplb_plans": len(ours["ends"]),
                "default_plans": len(theirs["ends"]),
                "eplb_next_window": block_scores(counts_FLE, ours["ends"], ours["maps"], case, G),
                "default_next_window": block_scores(counts_FLE, theirs["ends"], theirs["maps"], case, G),
                "eplb_seconds": float(ours["seconds"]),
                "budget": budget_check(ours["maps"], case, G, P, E),
                "default_copies": budget_check(theirs["maps"], case, G, P, E)["copies"],
            }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--worker", nargs=4, metavar=("ENGINE", "MODE", "CASE", "OUT"), help=argparse.SUPPRESS
    )
    parser.add_argument("--steps", type=int, default=Case.steps)
    parser.add_argument("--seed", type=int, default=Case.seed)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--engines", nargs="+", default=["sglang", "vllm"], choices=["sglang", "vllm"])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.worker:
        engine, mode, case_json, out = args.worker
        fields = json.loads(case_json)
        fields = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
        worker(engine, mode, Case(**fields), Path(out))
        return 0
    case = Case(steps=args.steps, seed=args.seed, layers=args.layers)
    result = run(case, tuple(args.engines))
    for engine, got in result["engines"].items():
        budget = got["budget"]
        print(
            f"{engine}: next-window balancedness eplb continuous {got['eplb_next_window']:.4f} "
            f"({got['eplb_plans']} plans) vs default {got['default_next_window']:.4f} ({got['default_plans']} plans); "
            f"same plans on both ranks: {got['same_plans_on_both_ranks']}; within budget: {budget['within_budget']} "
            f"(first plan {budget['first_plan_copies']} copies, largest later {budget['max_plan_copies']}, "
            f"copies in all {sum(budget['copies'])} vs default {sum(got['default_copies'])}); "
            f"eplb run {got['eplb_seconds']:.0f} s"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
