"""Remap + record per MoE layer: static and ``lp`` dispatch against the copy floor and SGLang, in one run.

Shape legend: T tokens, K top-k, E logical experts, P physical slots, G EP ranks, L layers.

For every T: router-like int32 ids [T, K] (Zipf-skewed), E = 256, P = 288 on G = 32 ranks, this
rank 3. Every variant's ids and slot counts are checked equal to the torch reference, then timed
eagerly (CUDA events around one call, host launch cost included) and inside one CUDA graph of
``--graph-calls`` calls (58: one per layer of a captured DeepSeek-V3 forward), time / calls.

Variants: ``copy`` (the floor: the faster of ``Tensor.copy_`` and a Triton copy kernel of the same
T*K int32), ``static`` (``remap_and_record``, slot counts, device ``num_valid_tokens`` and record
flag), ``static rows`` (the same into 16 count rows [16, P], as eplb.recorder passes on CUDA),
``static prepared`` (rows, through ``eplb.remap.prepared``: the recorder's path), ``static rec=0`` (flag off:
no histogram), ``static ballot`` (counting with ``tl.histogram`` in registers instead of
shared-memory bins: the kernel before eplb.kernels.shared_bins), ``lp`` (``mode="lp"``: count kernel, counts exchange, assign kernel; on one GPU the
exchange is a device copy of this rank's row into counts of 32 ranks held fixed, so the
all-gather's network latency is not in these figures), ``sglang-fused`` (SGLang 0.5.23's Triton
kernel, benchmarks/peers.py) and ``sglang-unfused`` (gather + ``scatter_add_``).

Recorder: host CPU per pass of ``--graph-calls`` layers at T = 4096 (thread clock, GPU work queued)
of every documented recorder path, each minus plain prepared remap in the same run
(benchmarks.bench_remap_host.recorder_pass_us, the one measurement both benchmarks print).

``--sweep`` adds static launch configs inside the graph (block x warps x programs per SM, with
and without ``gather_map``: the lookup from the map row in registers; shared-memory bins or
``tl.histogram``), and ``lp`` with 1, 2, 4 warps per program of its assign kernel (at T = 64,
4096, 65536).
Prints compact tables; writes JSON to ``--json`` or, when ``$OUT`` is set, ``$OUT/bench_remap.json``.

    python -m benchmarks.bench_remap --sweep                                  # on a CUDA machine
    TRITON_INTERPRET=1 python -m benchmarks.bench_remap --check-only --tokens 64 300   # CPU
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.bench_remap_host import recorder_pass_us
from benchmarks.harness import capture_graph, event_us, run_info, warm_up_gpu, write_result
from benchmarks.peers import load_sglang_fused_kernel
from benchmarks.remap_inputs import (
    GPUS,
    SGLangDispatchInfo,
    make_tables,
    router_ids,
    sglang_unfused,
    stub_exchange,
    triton_copy,
)
from eplb.integrations import sglang_remap
from eplb.kernels.remap_record import default_config, remap_record_triton
from eplb.recorder.recorder import CUDA_COUNT_ROWS
from eplb.remap.api import count_rows_sum, remap_and_record
from eplb.remap.call import RemapCall
from eplb.remap.prepared import prepare_remap

LAYER = 2


def build_variants(
    T: int, K: int, E: int, P: int, device: torch.device, sglang: Any, seed: int
) -> tuple[dict[str, Callable[[], Any]], dict[str, Any]]:
    """Closures for every variant, and what :func:`check` needs."""
    tables = make_tables(E, P, 4, device)
    ids = router_ids(T, K, E, device, seed)
    nvalid = torch.tensor([T], dtype=torch.int32, device=device)
    rec_on = torch.ones(1, dtype=torch.int32, device=device)
    rec_off = torch.zeros(1, dtype=torch.int32, device=device)
    others_E = torch.bincount(ids.reshape(-1).long(), minlength=E).to(torch.int32)
    lp = stub_exchange(tables, others_E)
    out: dict[str, torch.Tensor] = {}
    counts: dict[str, torch.Tensor] = {}

    def new(name: str, rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        out[name] = torch.full_like(ids, -7)
        counts[name] = torch.zeros((rows, P) if rows else (P,), dtype=torch.int32, device=device)
        return out[name], counts[name]

    variants: dict[str, Callable[[], Any]] = {}
    o_copy, _ = new("copy torch")
    variants["copy torch"] = lambda: o_copy.copy_(ids)
    o_tcopy, _ = new("copy triton")
    variants["copy triton"] = lambda: triton_copy(ids, o_tcopy)

    def public(name: str, mode: str, record: torch.Tensor, rows: int = 0) -> None:
        o, c = new(name, rows)
        kw: dict[str, Any] = {"counts_P": c, "num_valid_tokens": nvalid, "record": record, "out_TK": o}
        if mode == "lp":
            kw["lp"] = lp
        variants[name] = lambda: remap_and_record(ids, tables, LAYER, mode=mode, backend="triton", **kw)

    public("static", "static", rec_on)
    public("static rows", "static", rec_on, CUDA_COUNT_ROWS)
    o_p, c_p = new("static prepared", CUDA_COUNT_ROWS)
    prepared = prepare_remap(
        tables, LAYER, counts_P=c_p, num_valid_tokens=nvalid, record=rec_on, backend="triton"
    )
    variants["static prepared"] = lambda: prepared(ids, o_p)
    public("static rec=0", "static", rec_off)
    o_b, c_b = new("static ballot")
    ballot_call = RemapCall(
        topk_ids_TK=ids,
        tables=tables,
        layer=LAYER,
        mode="static",
        out_TK=o_b,
        counts_P=c_b,
        num_valid_tokens=nvalid,
        record=rec_on,
    )
    ballot_cfg = replace(default_config(ids.numel(), device), shared_bins=False)
    variants["static ballot"] = lambda: remap_record_triton(ballot_call, config=ballot_cfg)
    public("lp", "lp", rec_on)
    map_E = tables.static_LE[LAYER].contiguous()
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
    path_variants, fold, fold_check = sglang_path_variants(ids, map_E, nvalid, P, out, counts)
    variants.update(path_variants)
    bufs = {"ids": ids, "tables": tables, "nvalid": nvalid, "lp": lp, "out": out, "counts": counts}
    return variants, {**bufs, "timed_only": {"sglang fold": fold}, "post_checks": [fold_check]}


SGLANG_PATH = ("sglang-eplb", "sglang-eplb rows", "sglang-eplb rows nvalid")
"""eplb's SGLang adapter (eplb.integrations.sglang_remap.eplb_map_and_record_fused) on SGLang's
``load_buffer``: a [P] buffer of the caller's own (the single-row form, what the adapter ran before
count rows), a row of a recorder-like buffer [L, P] given count rows (what SGLang's gatherer gets),
and the same with a device ``num_token_non_padded`` (one launch that counts the valid rows and maps
every row, as SGLang does: ``map_padded_rows``; before 2026-12-02 the adapter launched twice). ``sglang fold``: one fold of the count rows of
``--graph-calls`` layers into the buffer, once per pass where SGLang reads it."""


def sglang_path_variants(
    ids: torch.Tensor,
    map_E: torch.Tensor,
    nvalid: torch.Tensor,
    P: int,
    out: dict[str, torch.Tensor],
    counts: dict[str, torch.Tensor],
    layers: int = 58,
) -> tuple[dict[str, Callable[[], Any]], Callable[[], None], Callable[[torch.Tensor], list[str]]]:
    """The SGLANG_PATH variants (their counts in ``counts``), the fold, and the fold's check."""
    sglang_remap._BACKEND[0] = "triton"  # what auto picks on a GPU; also the interpreter's on the CPU
    info = SGLangDispatchInfo(map_E)
    single_P = torch.zeros(P, dtype=torch.int32, device=ids.device)
    data_LP = {
        name: torch.zeros((layers, P), dtype=torch.int32, device=ids.device) for name in SGLANG_PATH[1:]
    }
    for data in data_LP.values():
        sglang_remap.attach_rows(data)  # as SGLang's gatherer reset does at a recorded pass's start
    counts["sglang-eplb"] = single_P
    for name, data in data_LP.items():
        counts[name] = sglang_remap._counts_for(data[LAYER])  # its count rows [C, P]
        assert counts[name].dim() == 2, "the recorder-like buffer got no count rows"
    buffers = {"sglang-eplb": single_P, **{name: data[LAYER] for name, data in data_LP.items()}}
    valid = {"sglang-eplb": None, "sglang-eplb rows": None, "sglang-eplb rows nvalid": nvalid}

    def call(name: str) -> Callable[[], Any]:
        def run() -> None:
            mapped = sglang_remap.eplb_map_and_record_fused(ids, info, buffers[name], valid[name])
            assert mapped is not None, "a dispatch info was given"
            out[name] = mapped

        return run

    folded = data_LP["sglang-eplb rows"]

    def fold() -> None:
        sglang_remap.fold_rows(folded)

    def fold_check(ref_P: torch.Tensor) -> list[str]:
        folded.zero_(), counts["sglang-eplb rows"].zero_()
        call("sglang-eplb rows")()
        fold()
        ok = torch.equal(folded[LAYER], ref_P) and int(counts["sglang-eplb rows"].abs().sum()) == 0
        return [] if ok else ["sglang fold: SGLang's buffer after the fold differs from the reference"]

    return {name: call(name) for name in SGLANG_PATH}, fold, fold_check


def check(variants: dict[str, Callable[[], Any]], bufs: dict[str, Any]) -> list[str]:
    """Run each variant twice on zeroed counts (the second static call takes the direct launch);
    return the mismatches against the torch reference."""
    ids, tables, nvalid = bufs["ids"], bufs["tables"], bufs["nvalid"]
    problems = []
    for name, fn in list(variants.items()):
        try:
            for _ in range(2):
                bufs["counts"][name].zero_()
                fn()
        except Exception as exc:  # one broken variant must not cost the others their figures
            problems.append(f"{name}: raised {type(exc).__name__}: {exc}")
            del variants[name]
    for mode, names in (
        (
            "static",
            [
                "static",
                "static rows",
                "static prepared",
                "static rec=0",
                "static ballot",
                "sglang-fused",
                "sglang-unfused",
                *SGLANG_PATH,
            ],
        ),
        ("lp", ["lp"]),
    ):
        ref_c = torch.zeros(tables.num_physical, dtype=torch.int32, device=ids.device)
        kw = {"lp": bufs["lp"]} if mode == "lp" else {}
        ref_o = remap_and_record(
            ids, tables, LAYER, mode=mode, counts_P=ref_c, num_valid_tokens=nvalid, backend="torch", **kw
        )
        for name in names:
            if name not in variants:
                continue
            if not torch.equal(bufs["out"][name].to(torch.int32), ref_o):
                problems.append(f"{name}: physical ids differ from the reference")
            want = torch.zeros_like(ref_c) if name == "static rec=0" else ref_c
            if not torch.equal(count_rows_sum(bufs["counts"][name]), want.to(torch.int64)):
                problems.append(f"{name}: slot counts differ from the reference")
        if mode == "static":
            for post_check in bufs.get("post_checks", []):
                problems += post_check(ref_c)
    for name in ("copy torch", "copy triton"):
        if not torch.equal(bufs["out"][name], ids):
            problems.append(f"{name}: copy is wrong")
    return problems


def time_variants(
    variants: dict[str, Callable[[], Any]], reps: int, graph_calls: int
) -> dict[str, dict[str, float]]:
    """Median (p10, p90) µs per call, eager and inside a graph of ``graph_calls`` calls.

    Variants take turns within each repetition, in a new random order each time, so drift and
    what ran just before hit all alike.
    """
    graphs = {name: capture_graph(fn, graph_calls) for name, fn in variants.items()}
    for fn in variants.values():
        for _ in range(20):
            fn()
    samples: dict[str, dict[str, list[float]]] = {n: {"eager": [], "graph": []} for n in variants}
    order = list(variants)
    shuffle = random.Random(0).shuffle
    for _ in range(reps):
        shuffle(order)
        for name in order:
            samples[name]["eager"].append(event_us(variants[name]))
            samples[name]["graph"].append(event_us(graphs[name].replay) / graph_calls)
    return {
        name: {
            f"{kind}_{stat}_us": float(fn(s[kind]))
            for kind in ("eager", "graph")
            for stat, fn in (
                ("median", statistics.median),
                ("p10", lambda x: np.percentile(x, 10)),
                ("p90", lambda x: np.percentile(x, 90)),
            )
        }
        for name, s in samples.items()
    }


SWEEP = [
    (b, w, p, g, s, r)
    for b in (512, 1024, 2048, 4096)
    for w in (4, 8)
    for p in (1, 2)
    for g in (False, True)
    for s, r in ((True, 16), (True, 1), (False, 1))
]


def sweep(bufs: dict[str, Any], reps: int, graph_calls: int) -> list[dict[str, Any]]:
    """Static launch configs inside the graph (through kernel[grid]: the config is explicit); the
    first call of each is checked against the torch reference."""
    from eplb.kernels.remap_record import LaunchConfig

    ids, tables = bufs["ids"], bufs["tables"]
    P = tables.num_physical
    calls = {
        r: RemapCall(
            topk_ids_TK=ids,
            tables=tables,
            layer=LAYER,
            mode="static",
            out_TK=torch.empty_like(ids),
            counts_P=torch.zeros((r, P) if r > 1 else (P,), dtype=torch.int32, device=ids.device),
            num_valid_tokens=bufs["nvalid"],
        )
        for r in (1, CUDA_COUNT_ROWS)
    }
    # the reference is computed here: the variants' own buffers have accumulated the timing runs' counts
    ref_out = torch.empty_like(ids)
    ref_counts = torch.zeros(P, dtype=torch.int32, device=ids.device)
    remap_and_record(
        ids,
        tables,
        LAYER,
        mode="static",
        backend="torch",
        counts_P=ref_counts,
        num_valid_tokens=bufs["nvalid"],
        out_TK=ref_out,
    )
    rows = []
    for block, warps, per_sm, gather, shared, count_rows in SWEEP:
        if block > 4 * max(128, 1 << (ids.numel() - 1).bit_length()):
            continue
        cfg = LaunchConfig(
            block=block, num_warps=warps, programs_per_sm=per_sm, gather_map=gather, shared_bins=shared
        )

        call = calls[count_rows]

        def run(cfg: LaunchConfig = cfg, call: RemapCall = call) -> None:
            remap_record_triton(call, config=cfg)

        assert call.counts_P is not None
        call.counts_P.zero_()
        run()
        if not torch.equal(call.out_TK, ref_out) or not torch.equal(
            count_rows_sum(call.counts_P), ref_counts.to(torch.int64)
        ):
            raise AssertionError(f"launch config {cfg} differs from the reference")
        graph = capture_graph(run, graph_calls)
        us = statistics.median(event_us(graph.replay) / graph_calls for _ in range(reps))
        rows.append(
            {
                "block": block,
                "warps": warps,
                "per_sm": per_sm,
                "gather_map": gather,
                "shared_bins": shared,
                "count_rows": count_rows,
                "graph_us": us,
            }
        )
    return rows


def lp_warps_sweep(
    variants: dict[str, Callable[[], Any]], reps: int, graph_calls: int
) -> list[dict[str, Any]]:
    """``lp`` inside the graph with 2, 4 and 8 warps in the quota kernel's one program (its re-fills
    are a chain of dependent rounds over [X, G] tiles)."""
    from eplb.kernels.remap_lp_launch import QUOTA

    rows = []
    default = QUOTA.num_warps
    try:
        for warps in (2, 4, 8):
            QUOTA.num_warps = warps
            graph = capture_graph(variants["lp"], graph_calls)  # the capture keeps this launch
            us = statistics.median(event_us(graph.replay) / graph_calls for _ in range(reps))
            rows.append({"quota_warps": warps, "graph_us": us})
    finally:
        QUOTA.num_warps = default
    return rows


def print_tables(results: list[dict[str, Any]], recorder: dict[str, Any] | None, graph_calls: int) -> None:
    names = [
        "copy",
        "static",
        "static rows",
        "static prepared",
        "static rec=0",
        "static ballot",
        "lp",
        "sglang-fused",
        "sglang-unfused",
    ]
    for kind, label in (("graph", f"inside a graph of {graph_calls} calls"), ("eager", "eager")):
        print(f"\nµs per call, {label} (median)")
        print("T".rjust(6) + "".join(n.rjust(16) for n in names) + "  static/copy  lp/copy  sglang/static")
        for row in results:
            t = row["timings"]
            key = f"{kind}_median_us"
            copy = min(t["copy torch"][key], t["copy triton"][key])
            cell = {n: t[n][key] if n in t else float("nan") for n in names[1:]}
            cells = [copy, *cell.values()]
            print(
                str(row["T"]).rjust(6)
                + "".join(f"{v:16.2f}" for v in cells)
                + f"{cell['static'] / copy:13.2f}{cell['lp'] / copy:9.2f}"
                + f"{cell['sglang-fused'] / cell['static']:15.2f}"
            )
    if graph_calls:
        print(
            f"\ntargets (graph of {graph_calls}): static <= 1.5x copy at T >= 4096, <= copy + 1 µs at T = 64"
        )
        for row in results:
            t = row["timings"]
            copy = min(t["copy torch"]["graph_median_us"], t["copy triton"]["graph_median_us"])
            s = t["static"]["graph_median_us"] if "static" in t else float("nan")
            ok = s <= copy + 1.0 if row["T"] <= 64 else (s <= 1.5 * copy if row["T"] >= 4096 else True)
            print(f"  T={row['T']}: static {s:.2f} vs copy {copy:.2f} -> {'met' if ok else 'NOT met'}")
    for row in results:
        if "sweep" in row:
            best = sorted(row["sweep"], key=lambda r: r["graph_us"])[:3]
            plain = min((r for r in row["sweep"] if not r["gather_map"]), key=lambda r: r["graph_us"])
            print(f"sweep T={row['T']}: best {best}; best without gather_map {plain}")
        if "lp_warps" in row:
            print(
                f"lp T={row['T']}: "
                + ", ".join(f"{r['quota_warps']} quota warps {r['graph_us']:.2f}" for r in row["lp_warps"])
            )
    print_sglang_path(results, graph_calls)
    if recorder is not None:
        print(
            f"\nhost µs per pass of {recorder['layers']} layers at T = {recorder['T']} "
            f"(thread CPU, median of {recorder['passes']}; benchmarks.bench_remap_host.recorder_pass_us)"
        )
        for name, us in recorder["pass_us"].items():
            above = recorder["above_prepared_plain_us"][name]
            print(f"  {name:40s}{us:10.1f}  ({above:+.1f} above plain prepared; target <= 20)")


def print_sglang_path(results: list[dict[str, Any]], graph_calls: int) -> None:
    """The SGLang adapter's forms against the copy of the same run (SGLANG_PATH); ``rows + fold``
    adds one fold per pass of ``graph_calls`` layers, spread over them."""
    if not results or "sglang-eplb" not in results[0]["timings"]:
        return
    names = [*SGLANG_PATH, "sglang fold"]
    print(f"\nSGLang adapter, µs per call inside a graph of {graph_calls} calls (median); x = / copy")
    print(
        "T".rjust(6)
        + "copy".rjust(9)
        + "".join(n.rjust(25) for n in names)
        + "  single x  rows+fold x  nvalid x"
    )
    for row in results:
        t = row["timings"]
        copy = min(t["copy torch"]["graph_median_us"], t["copy triton"]["graph_median_us"])
        us = {n: t[n]["graph_median_us"] for n in names}
        fold = us["sglang fold"] / max(graph_calls, 1)
        rows = us["sglang-eplb rows"] + fold
        print(
            str(row["T"]).rjust(6) + f"{copy:9.2f}" + "".join(f"{us[n]:25.2f}" for n in names)
            + f"{us['sglang-eplb'] / copy:10.2f}{rows / copy:12.2f}{(us['sglang-eplb rows nvalid'] + fold) / copy:10.2f}"
            + ("" if row["T"] < 4096 else "  (target rows+fold <= 1.5x: " + ("met)" if rows <= 1.5 * copy else "NOT met)"))
        )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 512, 4096, 16384, 65536])
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--physical", type=int, default=288)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--graph-calls", type=int, default=58)
    ap.add_argument("--recorder-passes", type=int, default=300, help="passes of each recorder row (median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sweep", action="store_true", help="also time static launch configs in the graph")
    ap.add_argument(
        "--check-only", action="store_true", help="correctness only (works under TRITON_INTERPRET=1)"
    )
    ap.add_argument("--no-sglang", action="store_true", help="skip SGLang's fused kernel")
    ap.add_argument("--json", type=Path, default=None, help="default: $OUT/bench_remap.json when $OUT is set")
    args = ap.parse_args(argv)
    started = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sglang = None if args.no_sglang or device.type != "cuda" else load_sglang_fused_kernel()
    info = run_info()
    K, E, P = args.top_k, args.experts, args.physical
    meta = {"K": K, "E": E, "P": P, "G": GPUS, "graph_calls": args.graph_calls, "reps": args.reps}
    print(meta, info.get("gpu"), "torch", info["torch"], "triton", info["triton"])
    timed = device.type == "cuda" and not args.check_only
    if timed:
        warm_up_gpu()
    results: list[dict[str, Any]] = []
    failed = False
    for T in args.tokens:
        variants, bufs = build_variants(T, K, E, P, device, sglang, args.seed + T)
        problems = check(variants, bufs)
        print(
            f"T={T}: outputs {'checked equal' if not problems else 'DIFFER: ' + '; '.join(problems)}",
            flush=True,
        )
        failed |= bool(problems)
        if not timed:
            continue
        variants.update(bufs["timed_only"])  # not checked by check(): its own check ran there
        row: dict[str, Any] = {"T": T, "timings": time_variants(variants, args.reps, args.graph_calls)}
        if args.sweep:
            row["sweep"] = sweep(bufs, max(30, args.reps // 4), args.graph_calls)
            if "lp" in variants and T in (64, 4096, 65536):  # each T compiles its own lp kernels
                row["lp_warps"] = lp_warps_sweep(variants, max(30, args.reps // 4), args.graph_calls)
        results.append(row)
    recorder = None
    if timed:
        recorder = recorder_pass_us(4096, args.graph_calls, args.recorder_passes, device)
        print_tables(results, recorder, args.graph_calls)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    path = args.json or (Path(os.environ["OUT"]) / "bench_remap.json" if os.environ.get("OUT") else None)
    if path is not None:
        write_result(path, {"meta": meta, "results": results, "recorder": recorder}, info=info)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
