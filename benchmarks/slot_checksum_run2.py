"""The slot checksum kernel as it was in hot-swap run 2 (baseline for benchmarks/bench_checksum.py only).

Shape legend: N slots of the buffer, R rows of one slot, Wd int32 words per row, n selected slots,
Tt tiles per slot. It loads [16, 512] tiles and reduces each across the warps before the next
load; per tile it stores two int64 partials that torch then adds up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_ROWS = 16


@triton.jit(do_not_specialize=["n_items", "tiles_per_slot", "rows_per_slot"])
def _run2_kernel(  # type: ignore[no-untyped-def]
    words_ptr,
    rows_ptr,
    part_ptr,
    n_items,
    tiles_per_slot,
    slot_words,
    row_words,
    rows_per_slot,
    TILE_ROWS: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    r = tl.arange(0, TILE_ROWS)
    c = tl.arange(0, BLOCK_W)
    for item in range(pid, n_items, nprog):
        k = item // tiles_per_slot
        tile = item - k * tiles_per_slot
        slot = tl.load(rows_ptr + k).to(tl.int64)
        row = tile * TILE_ROWS + r
        row_ok = row < rows_per_slot
        base = words_ptr + slot * slot_words + row.to(tl.int64)[:, None] * row_words
        acc = tl.zeros([TILE_ROWS], dtype=tl.int64)
        for c0 in range(0, row_words, BLOCK_W):
            col = c0 + c
            mask = row_ok[:, None] & (col < row_words)[None, :]
            x = tl.load(base + col[None, :], mask=mask, other=0)
            acc += tl.sum(x.to(tl.int64), axis=1)
        weighted = acc * (row + 1).to(tl.int64)
        tl.store(part_ptr + 2 * item, tl.sum(acc, axis=0))
        tl.store(part_ptr + 2 * item + 1, tl.sum(weighted, axis=0))


def run2_checksums(buffer_words: torch.Tensor, rows_n: torch.Tensor, programs: int) -> torch.Tensor:
    """int64 [n, 2]: the checksums of slots ``rows_n`` (the run-2 launch, tiles added by torch)."""
    _, R, Wd = buffer_words.shape
    n = int(rows_n.numel())
    tiles = triton.cdiv(R, TILE_ROWS)
    part = torch.empty(n, tiles, 2, dtype=torch.int64, device=buffer_words.device)
    grid = (max(1, min(programs, n * tiles)),)
    _run2_kernel[grid](
        buffer_words,
        rows_n,
        part,
        n * tiles,
        tiles,
        R * Wd,
        Wd,
        R,
        TILE_ROWS=TILE_ROWS,
        BLOCK_W=min(512, triton.next_power_of_2(Wd)),
        num_warps=8,
    )
    return part.sum(dim=1)
