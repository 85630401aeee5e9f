"""Checksums of selected expert slots of one slot buffer, in one launch with a bounded grid (Triton).

Shape legend: N rows (slots) of the buffer, R rows of one slot, Wd int32 words per row, n selected
slots, Tt tiles per slot (TILE_ROWS rows each).

Same numbers as eplb.hotswap_checksum.block_checksums (the plain-torch reference): per slot, the
sum of its int32 words and the sum of each row's word sum times (row + 1), both modulo 2**64.
Integer sums wrap and do not depend on order, so the kernel's tiling gives the reference's bits.

Three layers: the private ``@triton.jit`` kernel; the typed launcher
:func:`slot_checksum_partials` (checks, block sizes, grid); the public entry point
eplb.hotswap_checksum.SlotChecksum, which picks this backend or torch and adds the tiles up.

Grid: a persistent loop over (slot, tile) items with at most ``programs`` programs, so a checksum
that runs while NCCL moves the next piece leaves SMs free for NCCL's kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_ROWS = 16
"""Rows of one slot per work item."""


@triton.jit(do_not_specialize=["n_items", "tiles_per_slot", "rows_per_slot"])
def _slot_checksum_kernel(  # type: ignore[no-untyped-def]  # Triton types kernel arguments itself
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


def slot_checksum_partials(words_NRW: torch.Tensor, rows_n: torch.Tensor, programs: int) -> torch.Tensor:
    """int64 [n, Tt, 2]: per tile, (sum of words, sum of row sums times row + 1) of slots ``rows_n``.

    ``words_NRW`` is a contiguous int32 view [N, R, Wd] of the slot buffer; ``rows_n`` int64 slot
    indices on the same device. Summing over tiles gives the slot's checksum (mod 2**64).
    """
    if words_NRW.dtype != torch.int32 or words_NRW.dim() != 3 or not words_NRW.is_contiguous():
        raise ValueError(
            f"need a contiguous int32 [N, R, Wd] view, got {words_NRW.dtype} {tuple(words_NRW.shape)}"
        )
    if rows_n.dtype != torch.int64 or rows_n.device != words_NRW.device:
        raise ValueError("rows must be int64 on the buffer's device")
    _, R, Wd = words_NRW.shape
    n = int(rows_n.numel())
    tiles = triton.cdiv(R, TILE_ROWS)
    part = torch.empty(n, tiles, 2, dtype=torch.int64, device=words_NRW.device)
    if n == 0 or R == 0 or Wd == 0:
        return part.zero_()
    block_w = min(512, triton.next_power_of_2(Wd))
    grid = (max(1, min(programs, n * tiles)),)
    _slot_checksum_kernel[grid](
        words_NRW,
        rows_n,
        part,
        n * tiles,
        tiles,
        R * Wd,
        Wd,
        R,
        TILE_ROWS=TILE_ROWS,
        BLOCK_W=block_w,
        num_warps=8,
    )
    return part
