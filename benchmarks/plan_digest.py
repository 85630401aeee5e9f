"""A digest of every plan eplb makes on a fixed set of cases: the check that a refactor changed no plan.

Shape legend: W window (passes), L layers, E logical experts, P physical slots.

Cases (seeded synthetic load, deepseek-v3 shape unless named): the simulator at periodic
intervals 1000 and 200 (window = interval) and continuous mode, with static, dynamic and ``lp``
dispatch, scipy and DeepSeek's policy, at EP32 and EP64; a lost-rank replay; ``eplb solve``'s
planner; both engine adapters' entry points (vLLM's policy class and SGLang's
``rebalance_experts`` contract) over a drifting window sequence, periodic and continuous. Each
case hashes what decides a plan and what it is (every event's step, applied flag, reason,
prediction, moves, and the final placement; every adapter call's returned maps), never wall
time. Run it before and after a change::

    python -m benchmarks.plan_digest --out before.json
    python -m benchmarks.plan_digest --check before.json   # exit 1 naming each case that differs
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import numpy as np


def _h(*parts: Any) -> str:
    digest = hashlib.md5()
    for part in parts:
        if isinstance(part, np.ndarray):
            digest.update(str(part.dtype).encode() + str(part.shape).encode())
            digest.update(np.ascontiguousarray(part).tobytes())
        else:
            digest.update(repr(part).encode())
    return digest.hexdigest()


def _events_digest(result: Any) -> str:
    parts: list[Any] = []
    for run in result.runs:
        parts.append(run.spec.name)
        for e in run.events:
            parts.append(
                (
                    e.step,
                    e.window_steps,
                    e.applied,
                    e.reason,
                    e.predicted_balancedness,
                    e.changed_slots,
                    e.experts_moved_across_gpus,
                    e.experts_moved_across_nodes,
                    e.bytes_moved,
                    e.switch_step,
                    e.transfer_seconds,
                    e.stall_seconds,
                    e.realized_balancedness,
                )
            )
        parts.append(run.final_placement.phy2log_LP)
        parts.append(run.balancedness_F.astype(np.float64))
    return _h(*parts)


def _trace(preset: str, steps: int, seed: int = 0) -> Any:
    from eplb.workloads import WorkloadConfig, generate

    return generate(WorkloadConfig(preset=preset, num_steps=steps, seed=seed))


def _sim_config(trace: Any, **flags: Any) -> Any:
    from eplb.config import EplbConfig
    from eplb.simulate.config import SimulationConfig

    eplb = EplbConfig(enable_eplb=True, num_experts=trace.num_experts, **flags)
    return SimulationConfig.for_trace(trace, eplb=eplb, seed=0)


def _simulate(trace: Any, runs: list[str], dispatch: str, **flags: Any) -> str:
    from eplb.simulate.engine import simulate
    from eplb.simulate.planners import parse_runs

    config = _sim_config(trace, ep_dispatch_algorithm=dispatch, **flags)
    return _events_digest(simulate(trace, parse_runs(runs, dispatch), config))


def sim_cases(quick: bool) -> Iterator[tuple[str, Callable[[], str]]]:
    ep32 = {"ep_size": 32, "nnodes": 4, "ep_num_redundant_experts": 32}
    ep64 = {"ep_size": 64, "nnodes": 8, "ep_num_redundant_experts": 64}
    long = _trace("deepseek-v3", 1300 if quick else 2300)
    short = _trace("deepseek-v3", 700 if quick else 1000)
    for dispatch in ("static", "dynamic", "lp"):
        yield (
            f"sim periodic@1000 EP32 {dispatch}",
            partial(
                _simulate, long, ["scipy", "deepseek"], dispatch, eplb_rebalance_num_iterations=1000, **ep32
            ),
        )
        yield (
            f"sim periodic@200 EP32 {dispatch}",
            partial(
                _simulate, short, ["scipy", "deepseek"], dispatch, eplb_rebalance_num_iterations=200, **ep32
            ),
        )
        yield (
            f"sim continuous EP32 {dispatch}",
            partial(_simulate, short, ["scipy"], dispatch, eplb_rebalance_mode="continuous", **ep32),
        )
    yield (
        "sim continuous EP64 static",
        lambda: _simulate(short, ["scipy"], "static", eplb_rebalance_mode="continuous", **ep64),
    )
    yield (
        "sim periodic@200 EP64 static",
        lambda: _simulate(short, ["scipy", "deepseek"], "static", eplb_rebalance_num_iterations=200, **ep64),
    )
    yield (
        "sim continuous EP32 static, budget 40, threshold 0.9, transfer 50 GB/s",
        lambda: _simulate(
            short,
            ["scipy"],
            "static",
            eplb_rebalance_mode="continuous",
            eplb_max_moved_experts=40,
            eplb_min_rebalancing_utilization_threshold=0.9,
            eplb_transfer_gbps=50.0,
            **ep32,
        ),
    )
    yield (
        "sim periodic@100 tiny dynamic, prefill only",
        lambda: _simulate(
            _trace("tiny", 800),
            ["scipy", "deepseek", "deepseek_hierarchical"],
            "dynamic",
            eplb_rebalance_num_iterations=100,
            eplb_record_prefill_only=True,
            ep_size=4,
            nnodes=1,
            ep_num_redundant_experts=4,
        ),
    )


def _failure(mode: str) -> str:
    from eplb.simulate.failure import parse_rank_failures, simulate_rank_failures
    from eplb.simulate.planners import parse_runs

    trace = _trace("deepseek-v3", 900)
    flags: dict[str, Any] = {"ep_size": 32, "nnodes": 4, "ep_num_redundant_experts": 32}
    if mode == "continuous":
        flags["eplb_rebalance_mode"] = "continuous"
    else:
        flags["eplb_rebalance_num_iterations"] = 200
    config = _sim_config(trace, ep_dispatch_algorithm="static", **flags)
    failures = parse_rank_failures(["420:5", "650:16-17"], trace.num_steps, 32)
    result = simulate_rank_failures(trace, parse_runs(["scipy", "none"], "static"), config, failures)
    parts: list[Any] = []
    for run in result.runs:
        parts.append(run.name)
        for loss in run.losses:
            parts.append(
                (
                    loss.step,
                    loss.reason,
                    loss.reloads,
                    loss.survivor_copies,
                    loss.changed_slots,
                    loss.bytes_moved,
                )
            )
        for e in run.result.events:
            parts.append((e.step, e.applied, e.reason, e.predicted_balancedness, e.experts_moved_across_gpus))
        final = run.result.final_placement
        parts.append(None if final is None else final.phy2log_LP)
        parts.append(run.result.balancedness_F.astype(np.float64))
    return _h(*parts)


def failure_cases() -> Iterator[tuple[str, Callable[[], str]]]:
    yield "lost ranks periodic@200 EP32 static", lambda: _failure("periodic")
    yield "lost ranks continuous EP32 static", lambda: _failure("continuous")


def _solve_command() -> str:
    """``eplb solve``'s plan, through its own planner code path (the subcommand's function)."""
    import contextlib
    import io
    import tempfile
    from pathlib import Path

    from eplb.cli import main

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan"
        trace_path = Path(tmp) / "trace.safetensors"
        _trace("deepseek-v3", 400).save(trace_path)
        with contextlib.redirect_stdout(io.StringIO()):
            code = main(
                [
                    "solve",
                    "--trace",
                    str(trace_path),
                    "--out",
                    str(out),
                    "--disable-tqdm",
                    "--ep-dispatch-algorithm",
                    "static",
                ]
            )
        assert code == 0, f"eplb solve exited {code}"
        files = sorted(p for p in out.rglob("*") if p.is_file() and p.suffix in (".json", ".safetensors"))
        parts: list[Any] = []
        for path in files:
            if path.suffix == ".json":
                data = json.loads(path.read_text())
                parts.append((path.name, _strip_times(data)))
            else:
                from safetensors.numpy import load_file

                parts.append((path.name, sorted((k, _h(v)) for k, v in load_file(str(path)).items())))
        return _h(*parts)


def _strip_times(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _strip_times(v) for k, v in sorted(data.items()) if "seconds" not in k and "time" not in k}
    if isinstance(data, list):
        return [_strip_times(v) for v in data]
    return data


@contextmanager
def _env(**values: str) -> Iterator[None]:
    import os

    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _windows(L: int = 6, E: int = 64, windows: int = 12, passes: int = 50) -> list[np.ndarray]:
    """A drifting load: each window [passes, L, E] of counts whose hot experts move."""
    rng = np.random.default_rng(7)
    logits_LE = rng.normal(0.0, 1.0, (L, E))
    out = []
    for _ in range(windows):
        logits_LE = 0.9 * logits_LE + 0.45 * rng.normal(0.0, 1.0, (L, E))
        p_LE = np.exp(logits_LE) / np.exp(logits_LE).sum(axis=1, keepdims=True)
        out.append(rng.multinomial(4096, p_LE.reshape(-1) / L, size=passes).reshape(passes, L, E))
    return out


def _vllm(mode: str) -> str:
    import torch

    from eplb.integrations.engine_env import read_engine_env
    from eplb.integrations.vllm import EplbVllmPolicy

    with _env(EPLB_REBALANCE_MODE=mode):
        EplbVllmPolicy.configure(algorithm="auto", settings=read_engine_env())
    parts: list[Any] = []
    old: torch.Tensor | None = None
    for window_WLE in _windows():
        phy2log = EplbVllmPolicy.rebalance_experts(
            torch.from_numpy(window_WLE.sum(axis=0)), 80, 1, 2, 8, old_global_expert_indices=old
        )
        plan = EplbVllmPolicy.last_plan
        assert plan is not None
        parts.append((phy2log.numpy(), plan.applied, plan.reason, plan.copies, plan.predicted))
        old = phy2log
    # a scale-down: rank 7 leaves
    phy2log = EplbVllmPolicy.rebalance_experts(
        torch.from_numpy(_windows()[0].sum(axis=0)), 70, 1, 1, 7, old_global_expert_indices=old
    )
    parts.append(phy2log.numpy())
    EplbVllmPolicy.reset()
    return _h(*parts)


def _sglang(mode: str) -> str:
    import torch

    from eplb.integrations import sglang

    sglang.reset()
    with _env(EPLB_REBALANCE_MODE=mode):
        sglang.settings()
    algorithm = sglang.EplbSolverAlgorithm("auto")
    parts: list[Any] = []
    live: Any = None
    for window_WLE in _windows():
        maps = sglang.rebalance_with_eplb(
            torch.from_numpy(window_WLE), 80, 10, 1, 2, algorithm, current_phy2log=live, active_ranks=[1] * 8
        )
        parts.append(tuple(m.numpy() for m in maps))
        live = maps[0]
    maps = sglang.rebalance_with_eplb(
        torch.from_numpy(_windows()[0]),
        80,
        10,
        1,
        2,
        algorithm,
        current_phy2log=live,
        active_ranks=[1, 1, 1, 0, 1, 1, 1, 1],
    )
    parts.append(tuple(m.numpy() for m in maps))
    sglang.reset()
    return _h(*parts)


def engine_cases() -> Iterator[tuple[str, Callable[[], str]]]:
    yield "eplb solve", _solve_command
    for mode in ("periodic", "continuous"):
        yield f"vLLM policy {mode}", partial(_vllm, mode)
        yield f"SGLang rebalance_experts {mode}", partial(_sglang, mode)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the digests (JSON) here")
    parser.add_argument("--check", help="compare with a digest file written by --out; exit 1 on a difference")
    parser.add_argument("--quick", action="store_true", help="shorter traces (a different digest set)")
    parser.add_argument("--only", default="", help="run only the cases whose name contains this")
    args = parser.parse_args(argv)
    digests: dict[str, str] = {}
    cases = [*sim_cases(args.quick), *failure_cases(), *engine_cases()]
    for name, case in cases:
        if args.only not in name:
            continue
        started = time.perf_counter()
        digests[name] = case()
        print(f"{digests[name]}  {name}  ({time.perf_counter() - started:.1f} s)", file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"quick": args.quick, "digests": digests}, f, indent=1)
    if args.check:
        with open(args.check) as f:
            want = json.load(f)
        assert want["quick"] == args.quick, "compare digests of the same --quick setting"
        differ = [n for n in digests if want["digests"].get(n) != digests[n]]
        for name in differ:
            print(f"DIFFERS: {name}", file=sys.stderr)
        print(f"{len(digests) - len(differ)} of {len(digests)} cases identical", file=sys.stderr)
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
