"""``lp`` dispatch on 58 distinct layers of a solved placement: its cost beside static and the copy.

Shape legend: T tokens, K top-k, E logical experts, P physical slots, G EP ranks, L layers.

The placement is scipy's plan (``dispatch="lp"``) for the deepseek-v3 preset at EP32 (256 experts,
288 slots, 4 nodes) from the synthetic workload's first 200 passes, so the ``lp`` tables hold what
a served plan holds (3-5 re-fill colours per layer, experts on up to 13 GPUs), unlike the trivial
placement of ``bench_remap``. For every T, router-like ids [T, 8] (eplb's rank 3; the other 31
ranks' counts fixed, exchanged by a device copy, so no network is in these figures):

1. correctness: on every layer, the Triton kernels' ids and slot counts equal the torch
   reference's (``layers_mismatched`` must read 0);
2. one CUDA graph of L = 58 calls, call i on layer i, replayed ``--reps`` times: median µs per
   call, for the copy of the same bytes, static remap+record (one count row and 16), the exchange
   alone, and ``lp`` with each ``--scale-rounds`` (rounds of the proportional start,
   eplb.remap.lp_rule.LP_SCALE_ROUNDS; every setting's outputs checked against the torch reference
   at the same setting), each ``--passes`` (re-fill passes, eplb.remap.lp_rule.LP_PASSES), each
   ``--quota-warps`` (warps of the quota kernel's one program) and each ``--lp-programs``
   (programs of the count and the map kernel, eplb.kernels.remap_lp_launch.LP_PROGRAMS) and
   each ``--lp-max-chunk`` (ids per program at most, LP_MAX_CHUNK);
3. eagerly, one call between events (host launch cost included), static and ``lp`` at the
   defaults;
4. with ``--parts``, ``lp``'s parts in the same graph of 58 calls, the other launches (and the
   exchange) left out: the count kernel alone, the map kernel alone, both, the quota kernel
   alone at 0 and each ``--passes``, and everything but the quota kernel. The parts' outputs
   are wrong by construction (a kernel reads what a skipped one would have written); only
   their time is measured.

    python -m benchmarks.bench_lp_layers --json out.json          # on a CUDA machine
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import capture_graph, event_us
from benchmarks.remap_inputs import RANK, router_ids, stub_exchange, triton_copy
from eplb.remap.api import remap_and_record
from eplb.remap.lp_rule import LP_PASSES, LP_SCALE_ROUNDS
from eplb.remap.tables import DispatchTables
from eplb.solver import solve
from eplb.solver.types import SolveOptions, Topology
from eplb.workloads import WorkloadConfig, generate

K, E, P, G, NODES = 8, 256, 288, 32, 4


def solved_tables(device: torch.device) -> DispatchTables:
    """Rank 3's tables of scipy's ``lp`` plan for the deepseek-v3 preset (first 200 passes)."""
    trace = generate(WorkloadConfig(preset="deepseek-v3", num_steps=200, seed=1))
    topology = Topology(num_gpus=G, num_nodes=NODES, num_physical=P, num_groups=8)
    plan = solve(trace.counts_FLE, topology, options=SolveOptions(dispatch="lp"))
    return DispatchTables.from_placement(plan.placement, RANK, device)


@contextlib.contextmanager
def rule_setting(scale_rounds: int, passes: int) -> Iterator[None]:
    """The rule's rounds for the kernels' launcher and the torch reference alike, for a while."""
    import eplb.kernels.remap_lp_launch as launch
    import eplb.remap.lp as reference

    names = ("LP_SCALE_ROUNDS", "LP_PASSES")
    modules: tuple[Any, ...] = (launch, reference)
    saved = [tuple(getattr(m, name) for name in names) for m in modules]
    for m in modules:
        m.LP_SCALE_ROUNDS, m.LP_PASSES = scale_rounds, passes
    try:
        yield
    finally:
        for m, values in zip(modules, saved, strict=True):
            m.LP_SCALE_ROUNDS, m.LP_PASSES = values


def graph_us(fn: Callable[[int], object], layers: int, reps: int) -> float:
    """Median µs per call of one graph holding ``fn(0) ... fn(layers - 1)``."""
    step = iter(range(10**9))
    graph = capture_graph(lambda: fn(next(step) % layers), layers)
    for _ in range(5):
        graph.replay()
    return statistics.median(event_us(graph.replay) / layers for _ in range(reps))


class _Skippable:
    """A launcher of eplb.kernels.remap_lp_launch that launches only while ``on``."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.on = inner, True

    def launch(self, *args: Any, **kwargs: Any) -> None:
        if self.on:
            self.inner.launch(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)  # num_warps and the rest, as the launcher reads them


PARTS = {
    "count kernel alone": (True, False, False, False),
    "map kernel alone": (False, False, False, True),
    "count + map kernels": (True, False, False, True),
    "all but the quota kernel": (True, True, False, True),
}
"""Part name: (count kernel, exchange, quota kernel, map kernel) launched."""


def time_parts(
    call: Callable[[int], None], lp: Any, layers: int, args: argparse.Namespace
) -> dict[str, float]:
    """µs per call of ``lp``'s parts (the benchmark's step 4), at the launcher's quota warps."""
    import eplb.kernels.remap_lp_launch as launch

    saved = launch.COUNT, launch.QUOTA, launch.MAP, launch.LP_PASSES, lp._gather
    count, quota, mapping = (_Skippable(k) for k in saved[:3])
    launch.COUNT, launch.QUOTA, launch.MAP = count, quota, mapping
    out: dict[str, float] = {}
    try:
        variants = [(name, flags, saved[3]) for name, flags in PARTS.items()]
        variants += [
            (f"quota kernel alone passes={n}", (False, False, True, False), n) for n in [0, *args.passes]
        ]
        for name, (c, x, q, m), passes in variants:
            count.on, quota.on, mapping.on = c, q, m
            launch.LP_PASSES = passes
            lp._gather = saved[4] if x else (lambda local_E, out_GE: None)
            call(0)  # compile outside the capture
            out[name] = graph_us(call, layers, args.reps)
    finally:
        launch.COUNT, launch.QUOTA, launch.MAP, launch.LP_PASSES, lp._gather = saved
        lp.local_E.zero_()  # left counting by the parts without the quota kernel, which zeroes it
    return out


def run_tokens(T: int, tables: DispatchTables, args: argparse.Namespace) -> dict[str, Any]:
    import eplb.kernels.remap_lp_launch as launch

    device, L = tables.device, tables.num_layers
    ids = router_ids(T, K, E, device, args.seed)
    lp = stub_exchange(tables, torch.bincount(ids.reshape(-1).long(), minlength=E).to(torch.int32))
    nvalid = torch.tensor([T], dtype=torch.int32, device=device)
    record = torch.ones(1, dtype=torch.int32, device=device)
    out = torch.empty_like(ids)

    def call(layer: int, mode: str, counts: torch.Tensor, backend: str = "triton", out_TK: Any = out) -> None:
        remap_and_record(
            ids, tables, layer, mode=mode, backend=backend, lp=lp if mode == "lp" else None,
            out_TK=out_TK, counts_P=counts, num_valid_tokens=nvalid, record=record,
        )  # fmt: skip

    def mismatched() -> int:
        """Layers whose Triton ids or slot counts differ from the torch reference's."""
        bad = 0
        for layer in range(L):
            got = [
                (torch.empty_like(ids), torch.zeros(P, dtype=torch.int32, device=device)) for _ in range(2)
            ]
            for (o, c), backend in zip(got, ("torch", "triton"), strict=True):
                call(layer, "lp", c, backend, o)
            bad += int(not (torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])))
        return bad

    row: dict[str, Any] = {"T": T, "layers_mismatched": mismatched()}
    counts = torch.zeros(P, dtype=torch.int32, device=device)
    rows = torch.zeros((16, P), dtype=torch.int32, device=device)
    copy_out = torch.empty_like(ids)
    row["copy"] = graph_us(lambda i: triton_copy(ids, copy_out), L, args.reps)
    row["static"] = graph_us(lambda i: call(i, "static", counts), L, args.reps)
    row["static rows"] = graph_us(lambda i: call(i, "static", rows), L, args.reps)
    row["exchange"] = graph_us(lambda i: lp.exchange(), L, args.reps)
    saved = launch.LP_PASSES, launch.QUOTA.num_warps, launch.LP_PROGRAMS, launch.LP_MAX_CHUNK
    default_setting = f"scale={launch.LP_SCALE_ROUNDS} passes={launch.LP_PASSES}"
    try:
        for programs in args.lp_programs:
            for max_chunk in args.lp_max_chunk or [saved[3]]:
                launch.LP_PROGRAMS, launch.LP_MAX_CHUNK = programs, max_chunk
                suffix = "" if programs == saved[2] else f" programs={programs}"
                suffix += "" if max_chunk == saved[3] else f" max_chunk={max_chunk}"
                if max_chunk != saved[3]:
                    row[f"layers_mismatched{suffix}"] = mismatched()
                for scale_rounds in args.scale_rounds:
                    for passes in args.passes:
                        with rule_setting(scale_rounds, passes):
                            setting = f"scale={scale_rounds} passes={passes}"
                            if not suffix and setting != default_setting:
                                row[f"layers_mismatched {setting}"] = mismatched()
                            for warps in args.quota_warps:
                                launch.QUOTA.num_warps = warps
                                row[f"lp {setting} quota_warps={warps}{suffix}"] = graph_us(
                                    lambda i: call(i, "lp", counts), L, args.reps
                                )
    finally:
        launch.QUOTA.num_warps, launch.LP_PROGRAMS, launch.LP_MAX_CHUNK = saved[1:]
    if args.parts:
        default_chunk = launch.LP_MAX_CHUNK
        try:
            for max_chunk in args.lp_max_chunk or [default_chunk]:
                launch.LP_MAX_CHUNK = max_chunk
                suffix = "" if max_chunk == default_chunk else f" max_chunk={max_chunk}"
                parts = time_parts(lambda i: call(i, "lp", counts), lp, L, args)
                row.update({name + suffix: us for name, us in parts.items()})
        finally:
            launch.LP_MAX_CHUNK = default_chunk
    for mode in ("static", "lp"):

        def eager(mode: str = mode) -> None:
            call(RANK, mode, counts)

        eager()
        row[f"eager {mode}"] = statistics.median(event_us(eager) for _ in range(args.reps))
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 4096, 16384, 65536])
    ap.add_argument("--passes", type=int, nargs="+", default=[LP_PASSES])
    ap.add_argument("--scale-rounds", type=int, nargs="+", default=[LP_SCALE_ROUNDS])
    ap.add_argument("--quota-warps", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument(
        "--lp-programs",
        type=int,
        nargs="+",
        default=[32],
        help="programs the lp count and map kernels aim at (eplb.kernels.remap_lp_launch.LP_PROGRAMS)",
    )
    ap.add_argument(
        "--lp-max-chunk",
        type=int,
        nargs="+",
        default=None,
        help="ids per program at most (eplb.kernels.remap_lp_launch.LP_MAX_CHUNK; default: the launcher's)",
    )
    ap.add_argument("--parts", action="store_true", help="also time lp's parts (the docstring's step 4)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--json", type=Path, default=None, help="default: $OUT/bench_lp_layers.json when $OUT is set"
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_lp_layers: error: needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    tables = solved_tables(device)
    meta = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "layers": tables.num_layers,
        "colors_per_layer": tables.lp_colors_L.tolist() if tables.lp_colors_L is not None else None,
    }
    print(json.dumps(meta), flush=True)
    rows = []
    for T in args.tokens:
        rows.append(run_tokens(T, tables, args))
        print(
            json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in rows[-1].items()}),
            flush=True,
        )
    path = args.json or (Path(os.environ["OUT"]) / "bench_lp_layers.json" if "OUT" in os.environ else None)
    if path is not None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        tmp.replace(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
