"""``lp`` dispatch fused with remap + record: two Triton kernels around the counts all-gather.

Shape legend: T tokens, K top-k, E logical experts, P physical slots, G GPUs (EP ranks), S slots per
GPU, X replicated experts (eplb.remap.lp_rule states the rule), C count rows (one per program).

Program ``c`` of either kernel owns one contiguous chunk of the flat ``[T, K]`` ids, the same in
both, so "earlier programs" means "earlier ids":

1. ``_lp_count_kernel``: each program histograms its valid ids over the E experts, keeps that
   row (int32 [C, E] scratch) and adds it to the rank's ``local_E`` (zeroed just before). While
   recording it also adds the histogram to the logical counts and, for experts with one replica,
   through the static map to the slot counts (their slot is known without the exchange).
2. The exchange all-gathers ``local_E`` into int32 [G, E] (eplb.remap.lp.LpExchange).
3. ``_lp_assign_kernel``: every program derives the same per-replica quotas from the gathered
   counts (even split, then re-fill passes colour by colour, eplb.remap.lp_rule: a colour's
   experts share no GPU, so one round re-fills all of them over the GPU axis), per expert and
   GPU, and writes
   their running starts to a shared int32 [X, G] scratch (identical values from every program),
   then maps each id: one
   replica through the static map; a replicated expert by its global position (earlier ranks'
   tokens of it, earlier programs' from the scratch rows, then a running count within the
   chunk), found among the quota starts by binary search. Program 0 adds the rank's per-replica
   token counts to the slot counts once, from the quotas, so no per-id histogram is needed here.

Everything is int32 and no value is read back to the host. The launcher, its launch shapes and
direct launches are in eplb.kernels.remap_lp_launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from eplb.kernels.remap_record import _histogram

SUB = 128
"""Ids per step of the assign kernel's running count (a [SUB, X] one-hot and its prefix sum)."""
COUNT_BLOCK = 1024
"""Ids per step of the count kernel."""
MAX_PROGRAMS = 256
"""Most programs per launch (the assign kernel sums earlier programs' rows: [C, X] loads)."""
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
):
    pid = tl.program_id(0)
    limit = numel
    if HAS_NVALID:
        limit = tl.minimum(tl.maximum(tl.load(nvalid_ptr), 0), num_tokens) * K
    start = pid * chunk
    stop = tl.minimum(start + chunk, numel)
    acc = tl.zeros([EBINS], dtype=tl.int32)
    for step in range(0, chunk, BLOCK):
        offs = start + step + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < stop, other=-1)
        valid = (ids >= 0) & (ids < num_logical) & (offs < limit) & (offs < stop)
        acc += _histogram(tl.where(valid, ids, 0), valid, EBINS, HIST_MASK)
    bins = tl.arange(0, EBINS)
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


@triton.jit
def _water_fill_colour(owner_G, amount_G, levels_G, g_):  # type: ignore[no-untyped-def]
    # The rule's water-filling of one colour's experts at once, in GPU order: GPU g belongs to
    # expert owner_G[g] (-1: none), and each expert fills the GPUs it owns (pairwise form, as
    # eplb.remap.lp.water_fill_torch, within the GPUs of one owner).
    held_G = owner_G >= 0
    same = held_G[:, None] & (owner_G[:, None] == owner_G[None, :])
    inc = same & (levels_G[:, None] <= levels_G[None, :])
    n_inc = tl.sum(inc.to(tl.int32), axis=0)
    s_inc = tl.sum(tl.where(inc, levels_G[:, None], 0), axis=0)
    cand = (amount_G + s_inc) // tl.maximum(n_inc, 1)
    feasible = held_G & (cand >= levels_G)
    level = tl.min(tl.where(same & feasible[:, None], cand[:, None], 2147483647), axis=0)
    quota = tl.where(held_G, tl.maximum(level - levels_G, 0), 0)
    rest = amount_G - tl.sum(tl.where(same, quota[:, None], 0), axis=0)
    eligible = held_G & (levels_G <= level)
    first = tl.sum((same & eligible[:, None] & (g_[:, None] <= g_[None, :])).to(tl.int32), axis=0) <= rest
    return quota + (eligible & first).to(tl.int32)


@triton.jit(
    do_not_specialize=[
        "numel",
        "num_tokens",
        "num_logical",
        "num_physical",
        "num_gpus",
        "slots_per_gpu",
        "rank",
        "layer",
        "chunk",
    ]
)
def _lp_assign_kernel(  # type: ignore[no-untyped-def]
    ids_ptr,
    out_ptr,
    static_ptr,
    index_ptr,
    expert_ptr,
    slot_ptr,
    colors_ptr,
    cover_ptr,
    gathered_ptr,
    hist_ptr,
    start_ptr,
    counts_ptr,
    nvalid_ptr,
    record_ptr,
    numel,
    num_tokens,
    num_logical,
    num_physical,
    num_gpus,
    slots_per_gpu,
    rank,
    layer,
    chunk,
    K: tl.constexpr,
    X: tl.constexpr,
    SUB: tl.constexpr,
    EBINS: tl.constexpr,
    GBINS: tl.constexpr,
    LOG2_GBINS: tl.constexpr,
    NBINS: tl.constexpr,
    CBINS: tl.constexpr,
    PASSES: tl.constexpr,
    COUNT_PHYS: tl.constexpr,
    HAS_NVALID: tl.constexpr,
    HAS_RECORD: tl.constexpr,
):
    pid = tl.program_id(0)
    e_ = tl.arange(0, EBINS)
    g_ = tl.arange(0, GBINS)
    n_ = tl.arange(0, NBINS)
    c_ = tl.arange(0, CBINS)
    in_e = e_ < num_logical
    in_g = g_ < num_gpus
    # ---- the batch's global counts and every GPU's base load (experts with one replica) ----------
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
    # ---- replicated experts: global count, this rank's offset and count, earlier programs' -------
    expert_X = tl.load(expert_ptr + layer * X + n_, mask=n_ < X, other=-1)
    has_X = expert_X >= 0
    safe_X = tl.where(has_X, expert_X, 0)
    tile_GX = tl.load(
        gathered_ptr + g_[:, None] * num_logical + safe_X[None, :],
        mask=in_g[:, None] & has_X[None, :],
        other=0,
    )
    amount_X = tl.sum(tile_GX, axis=0)
    offset_X = tl.sum(tl.where(g_[:, None] < rank, tile_GX, 0), axis=0)
    mine_X = tl.sum(tl.where(g_[:, None] == rank, tile_GX, 0), axis=0)
    before_X = tl.sum(
        tl.load(
            hist_ptr + c_[:, None] * EBINS + safe_X[None, :],
            mask=(c_[:, None] < pid) & has_X[None, :],
            other=0,
        ),
        axis=0,
    )
    # Quotas live per (expert, GPU): a GPU that does not hold the expert has none. The GPUs in
    # ascending order are the rule's order of an expert's GPUs, so [X, G] tiles need no gather.
    slot_XG = tl.load(
        slot_ptr + (layer * X + n_[:, None]) * num_gpus + g_[None, :],
        mask=has_X[:, None] & in_g[None, :],
        other=-1,
    )
    held_XG = slot_XG >= 0
    # ---- quotas: even split, then re-fill passes, heaviest first ---------------------------------
    width_X = tl.maximum(tl.sum(held_XG.to(tl.int32), axis=1), 1)
    even_X = amount_X // width_X
    nth_XG = tl.cumsum(held_XG.to(tl.int32), axis=1) - 1  # the GPU's place among the expert's
    quota_XG = tl.where(held_XG, even_X[:, None] + (nth_XG < (amount_X - even_X * width_X)[:, None]), 0)
    loads_G += tl.sum(quota_XG, axis=0)
    # Re-fill passes, colour by colour: one colour's experts share no GPU, so the colour re-fills
    # at once over the GPUs, each GPU's owner (cover row) water-filling the GPUs it holds.
    num_colors = tl.load(colors_ptr + layer)
    for _ in tl.static_range(PASSES):
        for c in range(num_colors):
            owner_G = tl.load(cover_ptr + (layer * X + c) * num_gpus + g_, mask=in_g, other=-1)
            mine_XG = n_[:, None] == owner_G[None, :]
            amount_G = tl.sum(tl.where(mine_XG, amount_X[:, None], 0), axis=0)
            levels_G = loads_G - tl.sum(tl.where(mine_XG, quota_XG, 0), axis=0)
            new_G = _water_fill_colour(owner_G, amount_G, levels_G, g_)
            loads_G = tl.where(owner_G >= 0, levels_G + new_G, loads_G)
            quota_XG = tl.where(mine_XG, new_G[None, :], quota_XG)
    # Running starts over the GPUs: non-decreasing, so "the last GPU starting at or before a
    # position" is the one whose quota holds it (a GPU with no quota never is: the next starts
    # where it does). Past the last GPU: unreachable.
    starts_XG = tl.cumsum(quota_XG, axis=1) - quota_XG
    tl.store(start_ptr + n_[:, None] * GBINS + g_[None, :], tl.where(in_g[None, :], starts_XG, 2147483647))
    if COUNT_PHYS:
        do_count = pid == 0
        if HAS_RECORD:
            do_count = do_count & (tl.load(record_ptr) != 0)
        if do_count:
            # This rank's positions [offset, offset + mine) against each replica's quota range.
            lo = tl.maximum(starts_XG, offset_X[:, None])
            hi = tl.minimum(starts_XG + quota_XG, (offset_X + mine_X)[:, None])
            mine_XG = tl.maximum(hi - lo, 0)
            ok = held_XG & (mine_XG > 0) & (slot_XG < num_physical)
            tl.atomic_add(counts_ptr + slot_XG, mine_XG, mask=ok, sem="relaxed")
    tl.debug_barrier()  # the starts this program stored are read back below
    # ---- map this program's chunk ------------------------------------------------------------------
    limit = numel
    if HAS_NVALID:
        limit = tl.minimum(tl.maximum(tl.load(nvalid_ptr), 0), num_tokens) * K
    running_X = offset_X + before_X
    start = pid * chunk
    stop = tl.minimum(start + chunk, numel)
    for step in range(0, chunk, SUB):
        offs = start + step + tl.arange(0, SUB)
        in_chunk = offs < stop
        ids = tl.load(ids_ptr + offs, mask=in_chunk, other=-1)
        valid = (ids >= 0) & (ids < num_logical) & (offs < limit) & in_chunk
        safe = tl.where(valid, ids, 0)
        row = layer * num_logical + safe
        n = tl.load(index_ptr + row, mask=valid, other=-1)
        replicated = valid & (n >= 0)
        hot = replicated[:, None] & (n[:, None] == n_[None, :])
        seen = tl.cumsum(hot.to(tl.int32), axis=0)
        position = tl.sum(tl.where(hot, seen - 1 + running_X[None, :], 0), axis=1)
        running_X += tl.sum(hot.to(tl.int32), axis=0)
        n_safe = tl.where(replicated, n, 0)
        # Binary search over the starts (counting them from one load of the row instead measured
        # 13% slower at T = 65536 on the H200: docs/benchmarks.md).
        entry = tl.zeros([SUB], dtype=tl.int32)
        for s in tl.static_range(LOG2_GBINS):
            probe = entry + (GBINS >> (s + 1))
            bound = tl.load(start_ptr + n_safe * GBINS + probe, mask=replicated, other=2147483647)
            entry = tl.where(bound <= position, probe, entry)
        spread = tl.load(slot_ptr + (layer * X + n_safe) * num_gpus + entry, mask=replicated, other=0)
        single = tl.load(static_ptr + row, mask=valid & ~replicated, other=0)
        phys = tl.where(replicated, spread, single)
        tl.store(out_ptr + offs, tl.where(valid, phys, ids), mask=in_chunk)


__all__ = ["COUNT_BLOCK", "MAX_PROGRAMS", "SUB"]
