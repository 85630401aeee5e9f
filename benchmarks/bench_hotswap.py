"""Hot-swap on two ranks: correctness (CUDA-graph replay after a swap), bandwidth vs raw NCCL, layer time.

Shape legend: S slots per GPU, E logical experts, P physical slots, H hidden, I expert width, T tokens.

Three parts, one process per GPU (NCCL) or per CPU rank (Gloo, ``--device cpu``, small sizes):

1. ``check``: a 2-layer MoE model with the fixed-shape exchange; on CUDA its decode step is
   captured in a CUDA graph. Hot-swap to a random placement, replay the same graph (no recapture):
   the output must equal the dense reference and the eager output; slot storage must not move.
   A swap with an injected checksum mismatch must roll back exactly.
2. ``bandwidth`` (benchmarks/bench_hotswap_bandwidth.py): DeepSeek-V3-sized fp8 experts moved one
   way and traded both ways; each hot-swap variant (checksum backend, piece size, staging budget,
   verify off) against a raw NCCL send/recv of the same bytes in the same directions, same run.
3. ``layer``: one MoE layer at DeepSeek-V3 dims (bf16, E=32 + 4 redundant, top-8) under a router
   skewed onto GPU 0's experts, timed before and after one rebalance (eplb.solver + hot-swap).

    python -m benchmarks.bench_hotswap --json out.json                  # 2 GPUs
    python -m benchmarks.bench_hotswap --device cpu --small             # Gloo, CPU

``--checksum-tile TILE,WARPS`` sets the slot checksum kernel's tile for this run (default: the
kernel's ``TILE_CONFIG``; ``python -m benchmarks.bench_checksum --best FILE`` writes the fastest).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from benchmarks.bench_hotswap_bandwidth import bandwidth, print_bandwidth, sync
from benchmarks.harness import wall_times, write_result
from eplb.hotswap.swap import HotSwapOptions, hot_swap
from eplb.moe.spawn import RankContext, run_ranks
from eplb.placement.model import Placement


# ---- 1. correctness ---------------------------------------------------------------------------
def check(ctx: RankContext, small: bool) -> dict[str, Any]:
    from eplb.moe.model import MoEModel, MoEModelConfig, logical_weights
    from eplb.moe.reference import reference_forward

    cuda = ctx.device.type == "cuda"
    cfg = MoEModelConfig(
        num_layers=2,
        num_experts=8,
        top_k=2,
        hidden=64 if small else 256,
        intermediate=32 if small else 128,
        dtype="bfloat16" if cuda else "float32",
    )
    G, T = ctx.world_size, 16
    w = logical_weights(cfg)
    old = Placement.trivial(cfg.num_layers, cfg.num_experts, G, num_redundant=2 * G)
    rng = np.random.default_rng(7)
    new_p2l = np.stack([rng.permutation(old.phy2log_LP[layer]) for layer in range(cfg.num_layers)])
    new = Placement.from_phy2log(new_p2l, G, max_replicas=old.max_replicas)
    model = MoEModel(cfg, old, rank=ctx.rank, device=ctx.device, weights=w, capacity=T * cfg.top_k)
    g = torch.Generator().manual_seed(ctx.rank)
    x_static = torch.randn(T, cfg.hidden, generator=g).to(ctx.device, cfg.torch_dtype)
    ref = reference_forward(
        cfg, {k: v.to(ctx.device) for k, v in w.items()}, x_static.float().to(cfg.torch_dtype)
    )
    if cuda:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                model(x_static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y_static = model(x_static)
        step = graph.replay
    else:
        y_static = torch.empty(T, cfg.hidden, dtype=cfg.torch_dtype)

        def step() -> None:
            y_static.copy_(model(x_static))

    step()
    sync(ctx)
    before = y_static.clone()
    ptrs = [t.data_ptr() for d in model.slots_L for t in d.values()] + [model.tables.static_LE.data_ptr()]
    res = hot_swap(model.slots_L, old, new, update_maps=lambda: model.set_placement(new))
    step()
    sync(ctx)
    after = y_static.clone()
    eager = model(x_static)
    tol = 2e-2 if cuda else 1e-5
    out: dict[str, Any] = {
        "swap_ok": res.ok,
        "experts_moved": res.experts_moved,
        "graph_vs_reference_before": float((before.float() - ref.float()).abs().max()),
        "graph_vs_reference_after": float((after.float() - ref.float()).abs().max()),
        "graph_after_vs_eager_after": float((after.float() - eager.float()).abs().max()),
        "ptrs_same": ptrs
        == [t.data_ptr() for d in model.slots_L for t in d.values()] + [model.tables.static_LE.data_ptr()],
    }
    snapshot = [{k: v.clone() for k, v in d.items()} for d in model.slots_L]

    def corrupt(stage: str, k: int, bufs: list[torch.Tensor]) -> None:
        if stage == "received" and ctx.rank == 1 and bufs:
            bufs[0].view(torch.uint8).view(-1)[0] ^= 1

    bad = hot_swap(
        model.slots_L, new, old, fault=corrupt, options=HotSwapOptions(staging_budget_bytes=1 << 16)
    )
    out["rollback_ok"] = (not bad.ok) and all(
        torch.equal(a[k], b[k]) for a, b in zip(model.slots_L, snapshot, strict=True) for k in a
    )
    out["rollback_queued_ok"] = corrupted_local_copy_rolls_back(ctx, model.slots_L, new, old, snapshot)
    out["triton_checksum_equal"] = checksums_agree(ctx.device) if cuda else None
    out["passed"] = bool(
        res.ok
        and out["triton_checksum_equal"] is not False
        and out["ptrs_same"]
        and out["rollback_ok"]
        and out["rollback_queued_ok"]
        and out["graph_vs_reference_after"] < tol
        and out["graph_vs_reference_before"] < tol
        and out["graph_after_vs_eager_after"] <= (0.0 if not cuda else tol)
    )
    return out


def corrupted_local_copy_rolls_back(
    ctx: RankContext,
    slots_L: list[dict[str, torch.Tensor]],
    live: Placement,
    other: Placement,
    snapshot: list[dict[str, torch.Tensor]],
) -> bool:
    """A byte flipped after a local copy, with no fault hook (on CUDA: the agreement queued on the GPU,
    checksums on the side stream): every rank rolls back to ``live`` exactly."""
    from eplb.hotswap import group as hotswap_group

    original = hotswap_group.local_copy
    hit: list[bool] = []

    def corrupting_copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        original(dst, src)
        if ctx.rank == 1 and not hit:
            dst[0].view(torch.uint8).view(-1)[0] ^= 1
            hit.append(True)

    hotswap_group.local_copy = corrupting_copy
    try:
        res = hot_swap(slots_L, live, other)
    finally:
        hotswap_group.local_copy = original
    flag = torch.tensor([int(bool(hit))], device=ctx.device)
    dist.all_reduce(flag)
    exact = all(torch.equal(a[k], b[k]) for a, b in zip(slots_L, snapshot, strict=True) for k in a)
    # Rank 1 always has a local copy in this scenario; if it had none, the swap must have worked.
    return bool(flag.item()) and not res.ok and "checksum mismatch" in (res.error or "") and exact


def checksums_agree(device: torch.device) -> bool:
    """The Triton checksum and the plain-torch one give the same numbers on fp8 slots (non-consecutive rows)."""
    from eplb.hotswap.checksum import SlotChecksum

    g = torch.Generator(device=device).manual_seed(3)
    buf = torch.randint(0, 256, (6, 272, 7168), dtype=torch.uint8, device=device, generator=g)
    buf = buf.view(torch.float8_e4m3fn)
    rows, pos = [5, 0, 3, 4], [2, 6, 10, 14]
    out = {}
    for backend in ("torch", "triton"):
        vec = torch.zeros(18, dtype=torch.int64, device=device)
        SlotChecksum(buf.shape[1:], buf.dtype, rows, pos, device, backend)(buf, vec, 7)
        out[backend] = vec
    return bool(torch.equal(out["torch"], out["triton"]) and out["torch"].count_nonzero() == 8)


# ---- 3. layer time before / after one rebalance -----------------------------------------------
def layer_time(ctx: RankContext, reps: int, small: bool) -> dict[str, Any]:
    from eplb.moe.exchange import ExactExchange
    from eplb.moe.layer import ExpertParallelMoE
    from eplb.placement.balance import model_balancedness
    from eplb.remap.tables import DispatchTables
    from eplb.solver import SolveOptions, Topology, solve

    cuda = ctx.device.type == "cuda"
    E, redundant, K = 32, 4, 8
    H, inter = (64, 32) if small else (7168, 2048)
    dtype = torch.bfloat16 if cuda else torch.float32
    G = ctx.world_size
    placement = Placement.trivial(1, E, G, num_redundant=redundant)
    S = placement.slots_per_gpu
    g = torch.Generator(device=ctx.device).manual_seed(0)  # same logical weights on every rank
    w13_E = torch.randn(E, 2 * inter, H, device=ctx.device, dtype=dtype, generator=g) / H**0.5
    w2_E = torch.randn(E, H, inter, device=ctx.device, dtype=dtype, generator=g) / inter**0.5
    mine = torch.from_numpy(placement.phy2log_LP[0, ctx.rank * S : (ctx.rank + 1) * S].astype(np.int64)).to(
        ctx.device
    )
    slots = {"w13": w13_E[mine].contiguous(), "w2": w2_E[mine].contiguous()}
    del w13_E, w2_E
    tables = DispatchTables.from_placement(placement, ctx.rank, ctx.device)
    layer = ExpertParallelMoE(layer=0, slots=slots, tables=tables, exchange=ExactExchange(G, S))
    bias = torch.zeros(E, device=ctx.device)
    bias[4:S] = 2.5  # experts only GPU 0 holds take most of the tokens
    result: dict[str, Any] = {}
    for tokens in (64, 4096) if not small else (16, 256):
        gen = torch.Generator(device=ctx.device).manual_seed(10 + ctx.rank)
        x = torch.randn(tokens, H, device=ctx.device, dtype=dtype, generator=gen)
        logits = torch.randn(tokens, E, device=ctx.device, generator=gen) + bias
        weights, ids = torch.topk(torch.softmax(logits, -1), K, dim=-1)
        ids = ids.to(torch.int32)
        result[f"T{tokens}"] = {"ids": ids, "x": x, "weights": weights}

    def timed(batch: dict[str, torch.Tensor]) -> float:
        def run() -> None:
            layer(batch["x"], batch["ids"], batch["weights"])

        return statistics.median(wall_times(run, reps, warmup=2, sync=lambda: sync(ctx)))

    counts = torch.zeros(E, dtype=torch.int32, device=ctx.device)
    big = result[f"T{4096 if not small else 256}"]
    layer(big["x"], big["ids"], big["weights"], logical_counts_E=counts)
    dist.all_reduce(counts)
    load_LE = counts.cpu().numpy()[None].astype(np.float64)
    out: dict[str, Any] = {"balancedness_before": float(model_balancedness(load_LE, placement))}
    for key, batch in result.items():
        out[f"{key}_before_ms"] = timed(batch) * 1e3
    plan = solve(
        load_LE,
        Topology(num_gpus=G, num_physical=placement.num_physical),
        placement,
        SolveOptions(algorithm="deepseek"),
    )
    swap = hot_swap([slots], placement, plan.placement, update_maps=lambda: tables.update_(plan.placement))
    assert swap.ok, swap.error
    out["balancedness_after"] = float(model_balancedness(load_LE, plan.placement))
    out["rebalance_experts_moved"] = swap.experts_moved
    out["rebalance_seconds"] = swap.seconds
    for key, batch in result.items():
        out[f"{key}_after_ms"] = timed(batch) * 1e3
    return out


def rank_main(
    ctx: RankContext, parts: list[str], reps: int, small: bool, tile: tuple[int, int] | None
) -> dict[str, Any]:
    from eplb.hotswap.checksum import TRITON_FAILURES

    if tile is not None:
        from eplb.kernels import slot_checksum

        slot_checksum.TILE_CONFIG = tile
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu",
        "checksum_tile": list(tile) if tile is not None else None,
    }
    runs: dict[str, Callable[[], Any]] = {
        "check": lambda: check(ctx, small),
        "bandwidth": lambda: bandwidth(ctx, reps, small),
        "layer": lambda: layer_time(ctx, reps, small),
    }
    for part, run in runs.items():
        if part in parts:
            out[part] = run()
            # Printed as it ends, so a run cut short still shows what finished.
            print(f"rank {ctx.rank} {part}: {json.dumps(out[part])}", flush=True)
    out["triton_checksum_failures"] = list(TRITON_FAILURES)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--parts", nargs="+", default=["check", "bandwidth", "layer"])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--small", action="store_true", help="small shapes (for CPU runs)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--checksum-tile", default=None, help="TILE,WARPS of the slot checksum kernel")
    args = parser.parse_args()
    tile = tuple(int(x) for x in args.checksum_tile.split(",")) if args.checksum_tile else None
    if tile is not None and len(tile) != 2:
        parser.error(f"--checksum-tile takes TILE,WARPS, got {args.checksum_tile!r}")
    backend = "nccl" if args.device == "cuda" else "gloo"
    results = run_ranks(
        rank_main, 2, args=(args.parts, args.reps, args.small, tile), backend=backend, timeout_s=200
    )
    print_tables(results)
    if args.json:
        write_result(args.json, {"torch": torch.__version__, "ranks": results}, indent=2)
    ok = all(r.get("check", {}).get("passed", True) for r in results)
    return 0 if ok else 1


def print_tables(results: list[dict[str, Any]]) -> None:
    r0 = results[0]
    print(f"device: {r0['device']}, torch {torch.__version__}")
    print(f"Triton checksum failures: {[r.get('triton_checksum_failures') for r in results]}")
    if "check" in r0:
        for rank, r in enumerate(results):
            print(f"check rank {rank}: {r['check']}")
    if "bandwidth" in r0:
        print_bandwidth(results)
    if "layer" in r0:
        print("\nlayer time (max over ranks of the median), before -> after one rebalance:")
        for key in r0["layer"]:
            print(
                f"  {key}: "
                + ", ".join(
                    f"{r['layer'][key]:.4g}" if isinstance(r["layer"][key], float) else str(r["layer"][key])
                    for r in results
                )
            )


if __name__ == "__main__":
    sys.exit(main())
