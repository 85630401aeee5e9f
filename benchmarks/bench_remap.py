"""Remap + record: this project's fused kernel against a same-bytes copy (the floor) and SGLang's paths.

Shape legend: T tokens, K top-k, E logical experts, P physical slots.

For every T: build router-like int32 ids [T, K] (K distinct experts per token from a skewed
distribution), check that every variant's physical ids and slot counts equal the torch reference,
then time each variant eagerly and under CUDA-graph replay. Two graph figures per variant: a graph
holding one call (replay overhead included, as in design.md §6) and a graph holding 20 calls
(the per-call cost inside a longer graph, as in a captured forward pass).

Variants: ``copy`` (min of ``Tensor.copy_`` and a Triton copy kernel: read and write T*K int32),
``eplb`` (static mode, slot counts; default launch config; ``eplb alloc`` allocates the output;
``eplb launcher`` is the same launch without the public function's argument checks, to split host
overhead, and ``eplb launcher jit`` the launch through ``kernel[grid]`` instead of the direct
launcher), ``eplb+logical`` (also logical counts), ``eplb rec=0`` (record flag off), ``eplb
dynamic`` / ``eplb weighted``,
``sglang-fused`` (SGLang 0.5.23's Triton kernel, loaded from the PyPI wheel by benchmarks/peers.py)
and ``sglang-unfused`` (gather through the dispatch map, then ``scatter_add_`` into the counts, as
SGLang's recorder does). ``--sweep`` also times a grid of launch configs of this kernel.

    python -m benchmarks.bench_remap --json out.json            # on a CUDA machine
    TRITON_INTERPRET=1 python -m benchmarks.bench_remap --check-only --tokens 64 512   # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import triton

from benchmarks.harness import capture_graph, event_us, graph_us, run_info, warm_up_gpu, write_result
from benchmarks.peers import load_sglang_fused_kernel
from benchmarks.remap_inputs import SGLangDispatchInfo, router_ids, sglang_unfused, triton_copy
from eplb.kernels.remap_record import LaunchConfig, default_config, remap_record_triton
from eplb.placement.model import Placement
from eplb.remap.api import remap_and_record
from eplb.remap.call import RemapCall
from eplb.remap.tables import DispatchTables

GRAPH_CALLS = 20


def time_interleaved(variants: dict[str, Callable[[], Any]], reps: int) -> dict[str, dict[str, float]]:
    """Median µs per call of every variant: eager, graph of 1 call, graph of GRAPH_CALLS calls.

    Variants take turns within each repetition, in a new random order each time, so drift in clocks
    or host load, and what ran just before (in a fixed order, the eager calls placed right after a
    ``kernel[grid]`` launch ran 4-17 µs slower than the same path elsewhere), hit all alike.
    """
    g1 = {name: capture_graph(fn, 1) for name, fn in variants.items()}
    gn = {name: capture_graph(fn, GRAPH_CALLS) for name, fn in variants.items()}
    for fn in variants.values():
        for _ in range(100):
            fn()
    samples: dict[str, dict[str, list[float]]] = {n: {"eager": [], "g1": [], "gn": []} for n in variants}
    order = list(variants)
    shuffle = random.Random(0).shuffle
    for _ in range(reps):
        shuffle(order)
        for name in order:
            fn = variants[name]
            samples[name]["eager"].append(event_us(fn))
            samples[name]["g1"].append(event_us(g1[name].replay))
            samples[name]["gn"].append(event_us(gn[name].replay) / GRAPH_CALLS)
    return {
        name: {
            "eager_us": statistics.median(s["eager"]),
            "eager_p10_us": float(np.percentile(s["eager"], 10)),
            "eager_p90_us": float(np.percentile(s["eager"], 90)),
            "graph1_us": statistics.median(s["g1"]),
            f"graph{GRAPH_CALLS}_us": statistics.median(s["gn"]),
            f"graph{GRAPH_CALLS}_p10_us": float(np.percentile(s["gn"], 10)),
            f"graph{GRAPH_CALLS}_p90_us": float(np.percentile(s["gn"], 90)),
        }
        for name, s in samples.items()
    }


def build_variants(
    T: int, K: int, E: int, P: int, device: torch.device, sglang: Any, seed: int
) -> tuple[dict[str, Callable[[], Any]], dict[str, Any]]:
    """Closures for every variant, and the buffers to check after one call of each."""
    placement = Placement.trivial(4, E, num_gpus=8, num_redundant=P - E)
    rng_weights = (
        torch.rand((4, E, placement.max_replicas), generator=torch.Generator().manual_seed(seed)) + 0.1
    )
    tables = DispatchTables.from_placement(placement, rank=3, device=device, weights_LER=rng_weights)
    layer = 2
    ids = router_ids(T, K, E, device, seed)
    nvalid = torch.tensor([T], dtype=torch.int32, device=device)
    rec_on = torch.ones(1, dtype=torch.int32, device=device)
    rec_off = torch.zeros(1, dtype=torch.int32, device=device)
    bufs: dict[str, Any] = {"ids": ids, "tables": tables, "layer": layer, "nvalid": nvalid}
    out: dict[str, torch.Tensor] = {}
    counts: dict[str, torch.Tensor] = {}

    def new(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        out[name] = torch.full_like(ids, -7)
        counts[name] = torch.zeros(P, dtype=torch.int32, device=device)
        return out[name], counts[name]

    variants: dict[str, Callable[[], Any]] = {}
    o_copy, _ = new("copy torch")
    variants["copy torch"] = lambda: o_copy.copy_(ids)
    o_tcopy, _ = new("copy triton")
    variants["copy triton"] = lambda: triton_copy(ids, o_tcopy)

    def eplb(name: str, mode: str, logical: bool, record: torch.Tensor, alloc: bool = False) -> None:
        o, c = new(name)
        lc = torch.zeros(E, dtype=torch.int32, device=device) if logical else None
        bufs[f"{name} logical"] = lc

        def run() -> None:
            out[name] = remap_and_record(
                ids,
                tables,
                layer,
                mode=mode,
                counts_P=c,
                logical_counts_E=lc,
                num_valid_tokens=nvalid,
                record=record,
                out_TK=None if alloc else o,
                backend="triton",
            )

        variants[name] = run

    eplb("eplb", "static", False, rec_on)
    eplb("eplb alloc", "static", False, rec_on, alloc=True)

    def launcher_call(name: str) -> RemapCall:
        """The launcher's argument, built once: its variants time the launcher alone, as before."""
        o, c = new(name)
        return RemapCall(
            topk_ids_TK=ids,
            tables=tables,
            layer=layer,
            mode="static",
            out_TK=o,
            counts_P=c,
            num_valid_tokens=nvalid,
            record=rec_on,
        )

    direct_call, jit_call = launcher_call("eplb launcher"), launcher_call("eplb launcher jit")
    bufs["launcher call"] = direct_call
    jit_config = default_config(ids.numel(), device)
    variants["eplb launcher"] = lambda: remap_record_triton(direct_call)
    variants["eplb launcher jit"] = lambda: remap_record_triton(jit_call, config=jit_config)
    eplb("eplb+logical", "static", True, rec_on)
    eplb("eplb rec=0", "static", False, rec_off)
    eplb("eplb dynamic", "dynamic", False, rec_on)
    eplb("eplb weighted", "weighted", False, rec_on)
    map_E = tables.static_LE[layer].contiguous()
    if sglang is not None:
        info = SGLangDispatchInfo(map_E)
        _, c_sf = new("sglang-fused")

        def sglang_fused() -> None:
            out["sglang-fused"] = sglang.eplb_map_and_record_fused(ids, info, c_sf, nvalid)

        variants["sglang-fused"] = sglang_fused
    _, c_su = new("sglang-unfused")

    def unfused() -> None:
        out["sglang-unfused"] = sglang_unfused(ids, map_E, c_su, nvalid)

    variants["sglang-unfused"] = unfused
    bufs["out"], bufs["counts"] = out, counts
    return variants, bufs


STATIC_CHECKED = ["eplb", "eplb alloc", "eplb launcher", "eplb launcher jit", "eplb+logical", "eplb rec=0"]
STATIC_CHECKED += ["sglang-fused", "sglang-unfused"]


def check(variants: dict[str, Callable[[], Any]], bufs: dict[str, Any]) -> list[str]:
    """Run each variant twice on zeroed counts; return a list of mismatches against the torch reference."""
    ids, tables, layer, nvalid = bufs["ids"], bufs["tables"], bufs["layer"], bufs["nvalid"]
    P, E = tables.num_physical, tables.num_logical
    problems = []
    for name, fn in variants.items():
        for _ in range(2):  # the first call of a specialisation goes through kernel[grid], the next direct
            bufs["counts"][name].zero_()
            if bufs.get(f"{name} logical") is not None:
                bufs[f"{name} logical"].zero_()
            fn()
    for mode, names in (
        ("static", STATIC_CHECKED),
        ("dynamic", ["eplb dynamic"]),
        ("weighted", ["eplb weighted"]),
    ):
        ref_c = torch.zeros(P, dtype=torch.int32, device=ids.device)
        ref_l = torch.zeros(E, dtype=torch.int32, device=ids.device)
        ref_o = remap_and_record(
            ids,
            tables,
            layer,
            mode=mode,
            counts_P=ref_c,
            logical_counts_E=ref_l,
            num_valid_tokens=nvalid,
            backend="torch",
        )
        for name in names:
            if name not in variants:
                continue
            if not torch.equal(bufs["out"][name].to(torch.int32), ref_o):
                problems.append(f"{name}: physical ids differ from the reference")
            want = torch.zeros_like(ref_c) if name == "eplb rec=0" else ref_c
            if not torch.equal(bufs["counts"][name], want):
                problems.append(f"{name}: slot counts differ from the reference")
            lc = bufs.get(f"{name} logical")
            if lc is not None and not torch.equal(lc, ref_l):
                problems.append(f"{name}: logical counts differ from the reference")
    for name in ("copy torch", "copy triton"):
        if not torch.equal(bufs["out"][name], ids):
            problems.append(f"{name}: copy is wrong")
    return problems


SWEEP = [
    LaunchConfig(block=b, num_warps=w, programs_per_sm=p)
    for b in (512, 1024, 2048, 4096, 8192)
    for w in (4, 8, 16)
    for p in (1, 2, 4, 8)
    if b // (32 * w) >= 2
]


def sweep(bufs: dict[str, Any], reps: int) -> list[dict[str, Any]]:
    ids, tables = bufs["ids"], bufs["tables"]
    # The launcher variants' call on buffers of its own, counting without a record flag.
    call = replace(
        bufs["launcher call"],
        out_TK=torch.empty_like(ids),
        counts_P=torch.zeros(tables.num_physical, dtype=torch.int32, device=ids.device),
        record=None,
    )
    rows = []
    for cfg in SWEEP:
        if cfg.block > 4 * triton.next_power_of_2(ids.numel()):
            continue

        def run(cfg: LaunchConfig = cfg) -> None:
            remap_record_triton(call, config=cfg)

        rows.append(
            {
                "block": cfg.block,
                "warps": cfg.num_warps,
                "per_sm": cfg.programs_per_sm,
                "graph20_us": graph_us(run, GRAPH_CALLS, reps),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 512, 4096, 16384, 65536])
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--physical", type=int, default=288)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sweep", action="store_true", help="also time a grid of launch configs")
    ap.add_argument(
        "--check-only", action="store_true", help="correctness only (works under TRITON_INTERPRET=1)"
    )
    ap.add_argument("--no-sglang", action="store_true", help="skip SGLang's fused kernel")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sglang = None if args.no_sglang else load_sglang_fused_kernel()
    if device.type == "cpu" and sglang is not None:
        sglang = None  # SGLang's wrapper returns None off CUDA
    info = run_info()
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (TRITON_INTERPRET=1)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
        "K": args.top_k,
        "E": args.experts,
        "P": args.physical,
        "graph_calls": GRAPH_CALLS,
        "interpret": os.environ.get("TRITON_INTERPRET", "0"),
    }
    print(json.dumps(meta))
    results: list[dict[str, Any]] = []
    failed = False
    if device.type == "cuda" and not args.check_only:
        warm_up_gpu()
    for T in args.tokens:
        variants, bufs = build_variants(
            T, args.top_k, args.experts, args.physical, device, sglang, args.seed + T
        )
        problems = check(variants, bufs)
        cfg = default_config(T * args.top_k, device)
        print(
            f"T={T}: outputs {'checked equal' if not problems else 'DIFFER: ' + '; '.join(problems)} (default config {cfg})"
        )
        failed |= bool(problems)
        if args.check_only or device.type != "cuda":
            continue
        row: dict[str, Any] = {"T": T, "timings": time_interleaved(variants, args.reps)}
        if args.sweep:
            row["sweep"] = sweep(bufs, max(50, args.reps // 3))
        results.append(row)
    if results:
        print_table(results)
    if args.json:
        write_result(args.json, {"meta": meta, "results": results}, info=info)
    return 1 if failed else 0


def print_table(results: list[dict[str, Any]]) -> None:
    g = f"graph{GRAPH_CALLS}_us"
    for key in ("graph1_us", g, "eager_us"):
        print(f"\n{key} (median µs per call)")
        names = list(results[0]["timings"])
        print("T".rjust(6) + "".join(n.rjust(18) for n in names) + "  eplb/floor  sglang/eplb")
        for row in results:
            t = row["timings"]
            floor = min(t["copy torch"][key], t["copy triton"][key])
            ratio_sg = t["sglang-fused"][key] / t["eplb"][key] if "sglang-fused" in t else float("nan")
            print(
                str(row["T"]).rjust(6)
                + "".join(f"{t[n][key]:18.2f}" for n in names)
                + f"{t['eplb'][key] / floor:12.2f}{ratio_sg:13.2f}"
            )
    for row in results:
        if "sweep" in row:
            best = sorted(row["sweep"], key=lambda r: r["graph20_us"])[:3]
            print(f"sweep T={row['T']}: best {best}")


if __name__ == "__main__":
    raise SystemExit(main())
