"""Hot-swap bandwidth against a raw NCCL send/recv of the same bytes, in the same run (bench_hotswap part 2).

Shape legend: S slots per GPU.

One layer of DeepSeek-V3-sized fp8 experts (w13 [S, 4096, 7168] + w2 [S, 7168, 2048], 44 MB each,
S = 72) on each of two ranks. "one-way N": N experts copied from GPU 0 into GPU 1's redundant
slots (one direction). "swap N+N": N experts of each GPU trade places (both directions at once;
every destination is also a source, so it is backed up first).

Per scenario and in the same process group, between synchronised starts (CUDA sync + barrier
before and after, as for the swap): the raw reference, one contiguous buffer per direction
carrying the same bytes in the same directions, in one ``batch_isend_irecv``; the same bytes cut
one op per expert tensor; and each hot-swap variant, timed as ``PreparedSwap.execute`` (the
prepare step, planning and the fingerprint check, is timed separately and reported), plus the
whole ``hot_swap`` call with default options. Medians of ``reps`` after one warm-up. After the
timings, one default swap per scenario is checked byte for byte against the sources.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from benchmarks.harness import wall_times
from eplb.hotswap.swap import HotSwapOptions, hot_swap, prepare_swap
from eplb.moe.spawn import RankContext
from eplb.placement.model import Placement

VARIANTS: dict[str, HotSwapOptions] = {
    "verify (default: pieces 1:2:1)": HotSwapOptions(),
    "verify, torch checksums": HotSwapOptions(checksum_backend="torch"),
    "verify, one piece": HotSwapOptions(piece_fractions=(1.0,)),
    "verify, pieces 1:3:3:1": HotSwapOptions(piece_fractions=(1.0, 3.0, 3.0, 1.0)),
    "verify, pieces 4:2:1": HotSwapOptions(piece_fractions=(4.0, 2.0, 1.0)),
    "verify, pieces 1:4:2:1": HotSwapOptions(piece_fractions=(1.0, 4.0, 2.0, 1.0)),
    "verify, 512 MB staging": HotSwapOptions(staging_budget_bytes=512 << 20),
    "no verify": HotSwapOptions(verify=False),
    "no verify, 512 MB staging": HotSwapOptions(verify=False, staging_budget_bytes=512 << 20),
}
WHOLE_CALL = "hot_swap call, default (prepare + execute)"


def sync(ctx: RankContext) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def expert_slots(ctx: RankContext, S: int, small: bool) -> dict[str, torch.Tensor]:
    H, inter = (256, 128) if small else (7168, 2048)
    dtype = torch.float8_e4m3fn if ctx.device.type == "cuda" else torch.uint8
    g = torch.Generator(device=ctx.device).manual_seed(ctx.rank)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=ctx.device, generator=g).view(dtype)

    return {"w13": rand(S, 2 * inter, H), "w2": rand(S, H, inter)}


def time_batches(ctx: RankContext, ops: list[dist.P2POp], reps: int) -> list[float]:
    """Seconds per ``batch_isend_irecv(ops)`` between synchronised starts (the first run is a warm-up)."""

    def run() -> None:
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return wall_times(run, reps, warmup=1, sync=lambda: sync(ctx))


def raw_transfer(ctx: RankContext, send_bytes: int, recv_bytes: int, reps: int) -> list[float]:
    """Seconds per raw send/recv of contiguous buffers (rank 0 <-> rank 1), same API as the swap."""
    peer = 1 - ctx.rank
    ops = []
    for op, nbytes in ((dist.isend, send_bytes), (dist.irecv, recv_bytes)):
        if nbytes:
            ops.append(dist.P2POp(op, torch.empty(nbytes, dtype=torch.uint8, device=ctx.device), peer))
    return time_batches(ctx, ops, reps)


def raw_per_tensor(
    ctx: RankContext, slots: dict[str, torch.Tensor], pairs: list[tuple[int, int]], trade: bool, reps: int
) -> list[float]:
    """The same bytes without the swap: each expert's tensors as separate ops in one batch."""
    names = sorted(slots)
    peer = 1 - ctx.rank
    sending, receiving = trade or ctx.rank == 0, trade or ctx.rank == 1
    landing = [[torch.empty_like(slots[n][0]) for n in names] for _ in pairs] if receiving else []
    ops = []
    if sending:
        ops += [
            dist.P2POp(dist.isend, slots[n][src].view(torch.uint8), peer) for src, _ in pairs for n in names
        ]
    for bufs in landing:
        ops += [dist.P2POp(dist.irecv, b.view(torch.uint8), peer) for b in bufs]
    return time_batches(ctx, ops, reps)


def scenarios(S: int, small: bool) -> dict[str, tuple[np.ndarray, np.ndarray, int, list[tuple[int, int]]]]:
    """name -> (old phy2log [1, 2S], new phy2log, experts each way, (source, destination) local slots)."""
    out = {}
    for moved in (8,) if small else (32, 64):
        # GPU 0 holds experts 0..S-1; GPU 1 holds S..S+extra-1 and redundant copies of them,
        # whose slots then take `moved` of GPU 0's experts.
        extra = S - moved
        base = np.concatenate([np.arange(S), S + np.arange(S) % extra])[None].astype(np.int32)
        one_way = base.copy()
        one_way[0, S + extra : S + extra + moved] = np.arange(moved)
        out[f"one-way {moved}"] = (base, one_way, moved, [(s, extra + s) for s in range(moved)])
    for half in (4,) if small else (16, 32):
        # 2S experts; the first `half` slots of each GPU trade places.
        old = np.arange(2 * S, dtype=np.int32)[None]
        new = old.copy()
        new[0, :half], new[0, S : S + half] = old[0, S : S + half], old[0, :half]
        out[f"swap {half}+{half}"] = (old, new, half, [(s, s) for s in range(half)])
    return out


def bandwidth(ctx: RankContext, reps: int, small: bool) -> list[dict[str, Any]]:
    S = 10 if small else 72
    slots = expert_slots(ctx, S, small)
    per_expert = sum(t[0].numel() * t.element_size() for t in slots.values())
    rows = []
    for name, (p_old, p_new, n, pairs) in scenarios(S, small).items():
        trade = name.startswith("swap")
        old = Placement.from_phy2log(p_old, 2)
        new = Placement.from_phy2log(p_new, 2, max_replicas=old.max_replicas)
        send, recv = (n, n) if trade else ((n, 0) if ctx.rank == 0 else (0, n))
        row: dict[str, Any] = {"scenario": name, "experts_each_way": n, "bytes_one_way": n * per_expert}
        row["raw_s"] = statistics.median(raw_transfer(ctx, send * per_expert, recv * per_expert, reps))
        row["raw, one op per tensor_s"] = statistics.median(raw_per_tensor(ctx, slots, pairs, trade, reps))
        for label, options in [*VARIANTS.items(), (WHOLE_CALL, HotSwapOptions())]:
            try:
                row.update(time_variant(ctx, slots, old, new, trade, label, options, reps))
            except Exception as exc:  # a variant that breaks is reported, the others still run
                row[f"{label}_error"] = f"{type(exc).__name__}: {exc}"
        row["landed_exactly"] = landed_exactly(ctx, slots, old, new, pairs, trade)
        rows.append(row)
    rows.append({"checksum_tb_s": checksum_speed(ctx, slots, reps)})
    return rows


def checksum_speed(ctx: RankContext, slots: dict[str, torch.Tensor], reps: int) -> dict[str, float]:
    """TB/s of checksumming 32 slots of each tensor, per backend and grid (the swap's receiver side)."""
    from eplb.hotswap.checksum import SlotChecksum

    if ctx.device.type != "cuda":
        return {}
    n = min(32, slots["w13"].shape[0])
    nbytes = sum(t[:n].numel() * t.element_size() for t in slots.values())
    sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count
    out = {}
    for label, backend, programs in (
        ("triton, 2/3 of the SMs (next to a transfer)", "triton", 2 * sms // 3),
        ("triton, 4 x SMs (after the last piece)", "triton", 4 * sms),
        ("torch", "torch", 0),
    ):
        tasks = [
            (t, SlotChecksum(t.shape[1:], t.dtype, range(n), range(2, 2 + 2 * n, 2), ctx.device, backend))
            for t in slots.values()
        ]
        vec = torch.zeros(2 + 2 * n, dtype=torch.int64, device=ctx.device)

        def run(
            tasks: list[tuple[torch.Tensor, SlotChecksum]] = tasks,
            vec: torch.Tensor = vec,
            programs: int = programs,
        ) -> None:
            for t, task in tasks:
                task(t, vec, programs)

        # zeroed before each run, untimed: the Triton kernel adds into the vector
        times = wall_times(run, reps, warmup=1, sync=torch.cuda.synchronize, setup=vec.zero_)
        out[label] = nbytes / statistics.median(times) / 1e12
    return out


def time_variant(
    ctx: RankContext,
    slots: dict[str, torch.Tensor],
    old: Placement,
    new: Placement,
    trade: bool,
    label: str,
    options: HotSwapOptions,
    reps: int,
) -> dict[str, Any]:
    times, prepare = [], []
    for rep in range(reps + 1):
        # one-way moves only from old to new (new -> old is local copies): reset untimed.
        a, b = (old, new) if rep % 2 == 0 or not trade else (new, old)
        sync(ctx)
        start = time.perf_counter()
        if label == WHOLE_CALL:
            res = hot_swap([slots], a, b, options=options)
        else:
            prepared = prepare_swap([slots], a, b, options=options)
            sync(ctx)
            prepare.append(time.perf_counter() - start)
            start = time.perf_counter()
            res = prepared.execute()
        sync(ctx)
        times.append(time.perf_counter() - start)
        assert res.ok, res.error
        if not trade:
            hot_swap([slots], b, a, options=options)
    if trade and reps % 2 == 0:  # leave the slots as they started
        hot_swap([slots], new, old, options=options)
    out = {
        f"{label}_s": statistics.median(times[1:]),
        f"{label}_phases": {k: round(v * 1e3, 3) for k, v in res.phase_seconds.items()},
        f"{label}_chunks": res.chunks,
    }
    if prepare:
        out[f"{label}_prepare_s"] = statistics.median(prepare[1:])
    return out


def landed_exactly(
    ctx: RankContext,
    slots: dict[str, torch.Tensor],
    old: Placement,
    new: Placement,
    pairs: list[tuple[int, int]],
    trade: bool,
) -> bool:
    """One default swap, then the sources (copied before it) sent raw and compared byte for byte."""
    peer = 1 - ctx.rank
    names = sorted(slots)
    src = [s for s, _ in pairs]
    dst = [d for _, d in pairs]
    sending, receiving = trade or ctx.rank == 0, trade or ctx.rank == 1
    before = [slots[n][src].clone() for n in names] if sending else []
    sync(ctx)
    res = hot_swap([slots], old, new)
    expected = [torch.empty_like(slots[n][dst]) for n in names] if receiving else []
    ops = [dist.P2POp(dist.isend, t.view(torch.uint8), peer) for t in before]
    ops += [dist.P2POp(dist.irecv, t.view(torch.uint8), peer) for t in expected]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    sync(ctx)
    ok = res.ok and all(
        torch.equal(slots[n][dst].view(torch.uint8), e.view(torch.uint8))
        for n, e in zip(names, expected, strict=False)
    )
    back = hot_swap([slots], new, old)
    flag = torch.tensor([int(ok and back.ok)], device=ctx.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def print_bandwidth(results: list[dict[str, Any]], gb_unit: float = 1e9) -> None:
    """Markdown table: the slower rank's median per row; ratios against raw NCCL of the same run."""
    r0 = [row for row in results[0]["bandwidth"] if "scenario" in row]
    speeds = [row["checksum_tb_s"] for r in results for row in r["bandwidth"] if "checksum_tb_s" in row]
    print(f"\nchecksum TB/s (rank 0, rank 1): {speeds}")
    print("\n| scenario | GB each way | variant | ms | GB/s | vs raw NCCL | prepare ms |")
    print("|---|---|---|---|---|---|---|")
    for i, row in enumerate(r0):
        per_rank = [r["bandwidth"][i] for r in results]
        gb = row["bytes_one_way"] / gb_unit
        raw = max(r["raw_s"] for r in per_rank)
        print(
            f"| {row['scenario']} | {gb:.2f} | raw NCCL send/recv | {raw * 1e3:.2f} | {gb / raw:.0f} | 1.00 | |"
        )
        for key in row:
            if key.endswith("_error"):
                print(f"| {row['scenario']} | {gb:.2f} | {key[:-6]} | error: {row[key]} | | | |")
            if not key.endswith("_s") or key == "raw_s" or key.endswith("_prepare_s"):
                continue
            t = max(r[key] for r in per_rank)
            prep_key = key[:-2] + "_prepare_s"
            prep = f"{max(r[prep_key] for r in per_rank) * 1e3:.2f}" if prep_key in row else ""
            print(
                f"| {row['scenario']} | {gb:.2f} | {key[:-2]} | {t * 1e3:.2f} | {gb / t:.0f} | {raw / t:.2f} | {prep} |"
            )
        print(f"| {row['scenario']} | landed exactly: {row['landed_exactly']} | | | | | |")
    print("\nhost time per phase of the last rep, ms (rank 0 / rank 1):")
    for i, row in enumerate(r0):
        for key in row:
            if key.endswith("_phases"):
                chunks = row[key.replace("_phases", "_chunks")]
                phases = [r["bandwidth"][i][key] for r in results]
                print(f"  {row['scenario']} / {key[:-7]} ({chunks} chunks): {phases}")
