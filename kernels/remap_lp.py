"""``lp`` dispatch fused with remap + record: three Triton kernels around the counts all-gather.

Shape legend: T tokens, K top-k, E logical experts, P physical slots, G GPUs (EP ranks), S slots per
GPU, X replicated experts (eplb.remap.lp_rule states the rule), C count rows (one per program).

Program ``c`` of the count and the map kernel owns one contiguous chunk of the flat ``[T, K]`` ids,
the same in both, so "earlier programs" means "earlier ids":

1. ``_lp_count_kernel``: each program histograms its valid ids over the E experts (in
   shared-memory bins where the kernel compiles to PTX, eplb.kernels.shared_bins), keeps that row
   (int32 [C, E] scratch) and adds it to the rank's ``local_E`` (zero on entry: the quota kernel
   of the call before zeroed it). While recording it also adds the histogram to the logical
   counts and, for experts with one replica, through the static map to the slot counts (their
   slot is known without the exchange).
2. The exchange all-gathers ``local_E`` into int32 [G, E] (eplb.remap.lp.LpExchange).
3. ``_lp_quota_kernel``, one program: the per-replica quotas from the gathered counts (even
   split, the proportional start's rounds over every replicated expert at once, then re-fill
   passes colour by colour, eplb.remap.lp_rule), in row form: every replicated
   expert is a row of an [X, G] tile and water-fills along the GPU axis (sorted levels and prefix
   sums), the rows of one colour at once (they share no GPU). It writes the quotas' running starts
   (int32 [X, G] scratch) and, when recording, the rank's per-replica token counts to the slot
   counts, so no per-id histogram is needed. It also scans the count rows over the programs
   (each program's earlier programs' tokens of every replicated expert, int32 [C, X] scratch) and
   zeroes ``local_E``, which the exchange has read.
4. ``_lp_map_kernel``: one replica through the static map; a replicated expert by its global
   position (earlier ranks' tokens of it, earlier programs' from the scan, then the order
   within the chunk). A program's tokens of an expert hold consecutive positions, almost always
   inside one replica's quota, so it maps them through a table of its own; an expert whose range
   straddles a quota boundary takes a running count and a binary search over the starts.

Everything is int32 and no value is read back to the host. The launcher, its launch shapes and
direct launches are in eplb.kernels.remap_lp_launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from eplb.kernels import shared_bins
from eplb.kernels.remap_record import _histogram

SUB = 128
"""Granularity of a program's chunk (ids)."""
COUNT_BLOCK = 1024
"""Ids per step of the count and the map kernel."""
MAX_PROGRAMS = 256
"""Most programs per launch (the map kernel sums earlier programs' rows: [C, X] loads)."""
INT32_MAX = 2**31 - 1


@triton.jit(do_not_specialize=["numel", "num_tokens", "num_logical", "num_physical", "layer", "chunk"])
def _lp_count_kernel(  # type: ignore[no-untyped-def]  # Triton types kernel arguments itself
    ids_ptr,
    static_ptr,
    index_ptr,
    local_ptr,
    hist_ptr,
    counts_ptr,
    lcounts_ptr,
    nvalid_ptr,
    record_ptr,
    numel,
    num_tokens,
    num_logical,
    num_physical,
    layer,
    chunk,
    K: tl.constexpr,
    BLOCK: tl.constexpr,
    EBINS: tl.constexpr,
    COUNT_PHYS: tl.constexpr,
    COUNT_LOGICAL: tl.constexpr,
    HAS_NVALID: tl.constexpr,
    HAS_RECORD: tl.constexpr,
    HIST_MASK: tl.constexpr,
    SMEM: tl.constexpr,
    SMEM_DECL: tl.constexpr,
):
    pid = tl.program_id(0)
    limit = numel
    if HAS_NVALID:
        limit = tl.minimum(tl.maximum(tl.load(nvalid_ptr), 0), num_tokens) * K
    start = pid * chunk
    stop = tl.minimum(start + chunk, numel)
    bins = tl.arange(0, EBINS)
    if SMEM:
        # Shared-memory bins (eplb.kernels.shared_bins): one increment per id where
        # tl.histogram's lowering costs 50-100 instructions per id at 256 bins.
        shared_bins.declare(SMEM_DECL)
        shared_bins.zero(bins)
        tl.debug_barrier()
    acc = tl.zeros([EBINS], dtype=tl.int32)
    for step in range(0, chunk, BLOCK):
        offs = start + step + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < stop, other=-1)
        valid = (ids >= 0) & (ids < num_logical) & (offs < limit) & (offs < stop)
        if SMEM:
            shared_bins.increment(tl.where(valid, ids, 0), valid)
        else:
            acc += _histogram(tl.where(valid, ids, 0), valid, EBINS, HIST_MASK)
    if SMEM:
        tl.debug_barrier()  # every warp's increments land before any warp reads the bins
        acc = shared_bins.read(bins)
    in_e = bins < num_logical
    tl.store(hist_ptr + pid * EBINS + bins, acc)
    nonzero = in_e & (acc > 0)
    tl.atomic_add(local_ptr + bins, acc, mask=nonzero, sem="relaxed")
    do_count = COUNT_PHYS or COUNT_LOGICAL
    if HAS_RECORD:
        do_count = do_count & (tl.load(record_ptr) != 0)
    if do_count:
        if COUNT_LOGICAL:
            tl.atomic_add(lcounts_ptr + bins, acc, mask=nonzero, sem="relaxed")
        if COUNT_PHYS:
            row = layer * num_logical + bins
            single = tl.load(index_ptr + row, mask=in_e, other=0) < 0
            slot = tl.load(static_ptr + row, mask=in_e, other=-1)
            ok = nonzero & single & (slot >= 0) & (slot < num_physical)
            tl.atomic_add(counts_ptr + slot, acc, mask=ok, sem="relaxed")


@triton.jit(
    do_not_specialize=[
        "num_logical",
        "num_physical",
        "num_gpus",
        "slots_per_gpu",
        "rank",
        "layer",
        "programs",
    ]
)
def _lp_quota_kernel(  # type: ignore[no-untyped-def]
    static_ptr,
    index_ptr,
    expert_ptr,
    slot_ptr,
    colors_ptr,
    color_ptr,
    gathered_ptr,
    local_ptr,
    hist_ptr,
    before_ptr,
    start_ptr,
    counts_ptr,
    record_ptr,
    num_logical,
    num_physical,
    num_gpus,
    slots_per_gpu,
    rank,
    layer,
    programs,
    X: tl.constexpr,
    EBINS: tl.constexpr,
    GBINS: tl.constexpr,
    NBINS: tl.constexpr,
    CBINS: tl.constexpr,
    SCALE_ROUNDS: tl.constexpr,
    PASSES: tl.constexpr,
    COUNT_PHYS: tl.constexpr,
    HAS_RECORD: tl.constexpr,
):
    # One program per layer: the re-fills are a chain of dependent rounds, so they run once, not
    # once per program of the map kernel.
    e_ = tl.arange(0, EBINS)
    g_ = tl.arange(0, GBINS)
    n_ = tl.arange(0, NBINS)
    c_ = tl.arange(0, CBINS)
    in_e = e_ < num_logical
    in_g = g_ < num_gpus
    # The count kernel's programs' tokens of each replicated expert before each program (a scan
    # over programs, done once here instead of a [C, X] sum in every program of the map kernel).
    expert_X = tl.load(expert_ptr + layer * X + n_, mask=n_ < X, other=-1)
    has_X = expert_X >= 0
    safe_X = tl.where(has_X, expert_X, 0)
    in_c = c_ < programs
    rows_CX = tl.load(
        hist_ptr + c_[:, None] * EBINS + safe_X[None, :], mask=in_c[:, None] & has_X[None, :], other=0
    )
    tl.store(
        before_ptr + c_[:, None] * NBINS + n_[None, :],
        tl.cumsum(rows_CX, axis=0) - rows_CX,
        mask=in_c[:, None],
    )
    # The exchange has read this rank's counts: zero them for the next call's count kernel.
    tl.store(local_ptr + e_, tl.zeros([EBINS], dtype=tl.int32), mask=in_e)
    counts_E = tl.sum(
        tl.load(
            gathered_ptr + g_[:, None] * num_logical + e_[None, :],
            mask=in_g[:, None] & in_e[None, :],
            other=0,
        ),
        axis=0,
    )
    row_E = layer * num_logical + e_
    single_E = in_e & (tl.load(index_ptr + row_E, mask=in_e, other=0) < 0)
    gpu_E = tl.load(static_ptr + row_E, mask=in_e, other=0) // slots_per_gpu
    on_gpu_EG = single_E[:, None] & (gpu_E[:, None] == g_[None, :])
    loads_G = tl.sum(tl.where(on_gpu_EG, counts_E[:, None], 0), axis=0)
    tile_GX = tl.load(
        gathered_ptr + g_[:, None] * num_logical + safe_X[None, :],
        mask=in_g[:, None] & has_X[None, :],
        other=0,
    )
    amount_X = tl.sum(tile_GX, axis=0)
    slot_XG = tl.load(
        slot_ptr + (layer * X + n_[:, None]) * num_gpus + g_[None, :],
        mask=has_X[:, None] & in_g[None, :],
        other=-1,
    )
    held_XG = slot_XG >= 0
    width_X = tl.maximum(tl.sum(held_XG.to(tl.int32), axis=1), 1)
    even_X = amount_X // width_X
    nth_XG = tl.cumsum(held_XG.to(tl.int32), axis=1) - 1
    quota_XG = tl.where(held_XG, even_X[:, None] + (nth_XG < (amount_X - even_X * width_X)[:, None]), 0)
    k_G = g_ + 1
    if SCALE_ROUNDS > 0:
        # The proportional start: the water level of every replicated token over the base loads
        # of the GPUs holding any, then rounds that scale every row at once (int64 products).
        used_G = tl.sum(held_XG.to(tl.int32), axis=0) > 0
        num_used = tl.sum(used_G.to(tl.int32), axis=0)
        usable_G = k_G <= num_used
        sorted_G = tl.sort(tl.where(used_G, loads_G, 2147483647), dim=0)
        prefix_G = tl.cumsum(tl.where(usable_G, sorted_G, 0).to(tl.int64), axis=0)
        cand_G = (tl.sum(amount_X.to(tl.int64), axis=0) + prefix_G) // k_G
        level = tl.min(tl.where(usable_G & (cand_G >= sorted_G), cand_G, 9223372036854775807), axis=0)
        level = tl.where(num_used > 0, level, 0)
        room_G = tl.maximum(level - loads_G, 0) + 1
        amount_X1 = amount_X.to(tl.int64)[:, None]
        for _ in tl.static_range(SCALE_ROUNDS):
            demand_G = tl.maximum(tl.sum(quota_XG, axis=0), 1).to(tl.int64)
            scaled_XG = tl.where(held_XG, quota_XG.to(tl.int64) * room_G[None, :] // demand_G[None, :], 0)
            cum_XG = tl.cumsum(scaled_XG, axis=1)
            total_X1 = tl.sum(scaled_XG, axis=1)[:, None]
            div_X1 = tl.maximum(total_X1, 1)
            rescaled_XG = (cum_XG * amount_X1 // div_X1 - (cum_XG - scaled_XG) * amount_X1 // div_X1).to(
                tl.int32
            )
            quota_XG = tl.where(total_X1 > 0, rescaled_XG, quota_XG)
    loads_G += tl.sum(quota_XG, axis=0)
    # Re-fill passes in row form: every replicated expert is a row of the [X, G] tile and
    # water-fills along the GPU axis (its levels sorted, their prefix sums), so each reduction runs
    # along one axis and no vector changes layout inside the chain; the rows of colour c are
    # active in its round (they share no GPU). Measured faster than a compact [X, F] form.
    num_colors = tl.load(colors_ptr + layer)
    color_X = tl.load(color_ptr + layer * X + n_, mask=n_ < X, other=-1)
    usable_XG = k_G[None, :] <= width_X[:, None]
    for _ in tl.static_range(PASSES):
        for c in range(num_colors):
            active_X = color_X == c
            lev_XG = tl.where(held_XG, loads_G[None, :] - quota_XG, 2147483647)
            sorted_XG = tl.sort(lev_XG, dim=1)
            prefix_XG = tl.cumsum(tl.where(usable_XG, sorted_XG, 0), axis=1)
            cand_XG = (amount_X[:, None] + prefix_XG) // k_G[None, :]
            feasible_XG = usable_XG & (cand_XG >= sorted_XG)
            level_X = tl.min(tl.where(feasible_XG, cand_XG, 2147483647), axis=1)
            new_XG = tl.where(held_XG, tl.maximum(level_X[:, None] - lev_XG, 0), 0)
            rest_X = amount_X - tl.sum(new_XG, axis=1)
            eligible_XG = held_XG & (lev_XG <= level_X[:, None])
            first_XG = tl.cumsum(eligible_XG.to(tl.int32), axis=1) <= rest_X[:, None]
            new_XG += (eligible_XG & first_XG).to(tl.int32)
            new_XG = tl.where(active_X[:, None], new_XG, quota_XG)
            loads_G += tl.sum(new_XG - quota_XG, axis=0)
            quota_XG = new_XG
    starts_XG = tl.cumsum(quota_XG, axis=1) - quota_XG
    tl.store(start_ptr + n_[:, None] * GBINS + g_[None, :], tl.where(in_g[None, :], starts_XG, 2147483647))
    if COUNT_PHYS:
        # This rank's positions [offset, offset + mine) against each replica's quota range.
        offset_X = tl.sum(tl.where(g_[:, None] < rank, tile_GX, 0), axis=0)
        mine_X = tl.sum(tl.where(g_[:, None] == rank, tile_GX, 0), axis=0)
        lo = tl.maximum(starts_XG, offset_X[:, None])
        hi = tl.minimum(starts_XG + quota_XG, (offset_X + mine_X)[:, None])
        got_XG = tl.maximum(hi - lo, 0)
        ok = held_XG & (got_XG > 0) & (slot_XG < num_physical)
        if HAS_RECORD:
            ok = ok & (tl.load(record_ptr + 0 * slot_XG) != 0)  # the flag, broadcast to the tile
        tl.atomic_add(counts_ptr + slot_XG, got_XG, mask=ok, sem="relaxed")


@triton.jit(do_not_specialize=["numel", "num_tokens", "num_logical", "num_gpus", "rank", "layer", "chunk"])
def _lp_map_kernel(  # type: ignore[no-untyped-def]
    ids_ptr,
    out_ptr,
    static_ptr,
    index_ptr,
    expert_ptr,
    slot_ptr,
    gathered_ptr,
    hist_ptr,
    before_ptr,
    start_ptr,
    direct_ptr,
    nvalid_ptr,
    numel,
    num_tokens,
    num_logical,
    num_gpus,
    rank,
    layer,
    chunk,
    K: tl.constexpr,
    X: tl.constexpr,
    BLOCK: tl.constexpr,
    EBINS: tl.constexpr,
    GBINS: tl.constexpr,
    LOG2_GBINS: tl.constexpr,
    NBINS: tl.constexpr,
    HAS_NVALID: tl.constexpr,
    GATHER_MAP: tl.constexpr,
):
    # A program's tokens of a replicated expert hold consecutive global positions [p0, p1]. Almost
    # always one replica's quota holds them all (a rank holds about 1/G of an expert's positions,
    # and the expert's D replicas put D - 1 boundaries among them), so the program maps such
    # experts through a table of its own, as a static map does; only an expert whose range
    # straddles a boundary ("split") pays the running count, one expert at a time.
    pid = tl.program_id(0)
    g_ = tl.arange(0, GBINS)
    n_ = tl.arange(0, NBINS)
    if GATHER_MAP:
        # The layer's rows, loaded first so their latency hides behind the prologue.
        e_ = tl.arange(0, EBINS)
        in_e = e_ < num_logical
        index_E = tl.load(index_ptr + layer * num_logical + e_, mask=in_e, other=-1)
        static_E = tl.load(static_ptr + layer * num_logical + e_, mask=in_e, other=0)
    expert_X = tl.load(expert_ptr + layer * X + n_, mask=n_ < X, other=-1)
    has_X = expert_X >= 0
    safe_X = tl.where(has_X, expert_X, 0)
    offset_X = tl.sum(
        tl.load(
            gathered_ptr + g_[:, None] * num_logical + safe_X[None, :],
            mask=(g_[:, None] < rank) & has_X[None, :],
            other=0,
        ),
        axis=0,
    )
    before_X = tl.load(before_ptr + pid * NBINS + n_)
    here_X = tl.load(hist_ptr + pid * EBINS + safe_X, mask=has_X, other=0)
    first_X = offset_X + before_X
    starts_XG = tl.load(start_ptr + n_[:, None] * GBINS + g_[None, :])
    # Replica of the first and of the last position: the last GPU starting at or before it.
    entry0_X = tl.sum((starts_XG <= first_X[:, None]).to(tl.int32), axis=1) - 1
    entry1_X = tl.sum((starts_XG <= (first_X + here_X - 1)[:, None]).to(tl.int32), axis=1) - 1
    used_X = has_X & (here_X > 0)
    one_X = used_X & (entry0_X == entry1_X)
    split_X = used_X & (entry0_X != entry1_X)
    direct_X = tl.load(slot_ptr + (layer * X + n_) * num_gpus + tl.maximum(entry0_X, 0), mask=one_X, other=-1)
    row_ptr = direct_ptr + pid * (2 * NBINS)
    if GATHER_MAP:
        # This program's whole map in registers (-1: a split expert, mapped below): an id looks
        # its replica up with tl.gather, no dependent global load per id.
        map_E = tl.where(index_E >= 0, tl.gather(direct_X, tl.maximum(index_E, 0), 0), static_E)
    else:
        tl.store(row_ptr + n_, direct_X)
    tl.store(row_ptr + NBINS + tl.cumsum(split_X.to(tl.int32), axis=0) - 1, n_, mask=split_X)
    num_split = tl.sum(split_X.to(tl.int32), axis=0)
    tl.debug_barrier()  # the table this program stored is read back below
    limit = numel
    if HAS_NVALID:
        limit = tl.minimum(tl.maximum(tl.load(nvalid_ptr), 0), num_tokens) * K
    start = pid * chunk
    stop = tl.minimum(start + chunk, numel)
    for step in range(0, chunk, BLOCK):
        offs = start + step + tl.arange(0, BLOCK)
        in_chunk = offs < stop
        ids = tl.load(ids_ptr + offs, mask=in_chunk, other=-1)
        valid = (ids >= 0) & (ids < num_logical) & (offs < limit) & in_chunk
        if GATHER_MAP:
            phys = tl.gather(map_E, tl.where(valid, ids, 0), 0)
            keep = in_chunk & ~(valid & (phys < 0))  # a split expert's ids are mapped below
        else:
            row = layer * num_logical + tl.where(valid, ids, 0)
            n = tl.load(index_ptr + row, mask=valid, other=-1)
            replicated = valid & (n >= 0)
            direct = tl.load(row_ptr + n, mask=replicated, other=-1)
            single = tl.load(static_ptr + row, mask=valid & ~replicated, other=0)
            phys = tl.where(replicated, direct, single)
            keep = in_chunk & ~(replicated & (direct < 0))  # a split expert's ids are mapped below
        tl.store(out_ptr + offs, tl.where(valid, phys, ids), mask=keep)
    for j in range(num_split):
        x = tl.load(row_ptr + NBINS + j)
        expert = tl.sum(tl.where(n_ == x, expert_X, 0), axis=0)
        running = tl.sum(tl.where(n_ == x, first_X, 0), axis=0)
        for step in range(0, chunk, BLOCK):
            offs = start + step + tl.arange(0, BLOCK)
            in_chunk = offs < stop
            ids = tl.load(ids_ptr + offs, mask=in_chunk, other=-1)
            hit = (ids == expert) & (offs < limit) & in_chunk
            seen = tl.cumsum(hit.to(tl.int32), axis=0)
            position = running + seen - 1
            running += tl.sum(hit.to(tl.int32), axis=0)
            entry = tl.zeros([BLOCK], dtype=tl.int32)
            for s in tl.static_range(LOG2_GBINS):
                probe = entry + (GBINS >> (s + 1))
                bound = tl.load(start_ptr + x * GBINS + probe, mask=hit, other=2147483647)
                entry = tl.where(bound <= position, probe, entry)
            spread = tl.load(slot_ptr + (layer * X + x) * num_gpus + entry, mask=hit, other=0)
            tl.store(out_ptr + offs, spread, mask=hit)


__all__ = ["COUNT_BLOCK", "MAX_PROGRAMS", "SUB"]
