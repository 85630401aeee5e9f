"""Checksums of selected expert slots of one slot buffer, straight into an int64 vector (Triton).

Shape legend: p slots (the selected ones, of a buffer whose rows are slots, each a grid of rows x int32
words); TR x BW the tile one program loads per step.

Same numbers as eplb.hotswap.checksum.block_checksums (the plain-torch reference): per slot, the
sum of its int32 words and the sum of each row's word sum times (row + 1), both modulo 2**64.
Integer sums wrap and do not depend on order, so any split of the work gives the reference's bits.

Work: each selected slot is cut into ``splits`` *segments* of consecutive rows; a program walks
its segments (a persistent loop when there are more segments than programs). Within a segment it
loads [TR, BW] tiles (TR rows, BW words of each), row block after row block, and adds them into
two int64 register tiles, element by element: ``run`` (the sum of every block so far) and ``acc``
(the sum of ``run`` after each block). Nothing is reduced across threads inside the loop. At the
segment's end one reduction turns them into the segment's two sums (with J blocks, sum_j j*X_j
= J*run - acc gives every row its weight), and two int64 atomics add them into the vector.

Three layers: the private ``@triton.jit`` kernel; the typed launcher :func:`slot_checksum_into`
(checks, tile shape, segments, grid); the public entry point eplb.hotswap.checksum.SlotChecksum,
which picks this backend or torch. ``programs`` bounds the grid, so a checksum that runs while
NCCL moves the next piece leaves SMs to NCCL's kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_CONFIG: tuple[int, int] = (2048, 4)
"""(words per [TR, BW] tile, warps per program): the default; launchers may pass another."""
MIN_SEGMENT_BYTES = 64 << 10
"""A segment carries at least about this many bytes (one reduction and two atomics each)."""
SEGMENTS_PER_PROGRAM = 4
"""Segments per program when the slots are large enough: evens out the programs' work."""


@triton.jit(do_not_specialize=["n_segments", "splits", "rows_per_slot", "rows_per_split"])
def _slot_checksum_kernel(  # type: ignore[no-untyped-def]  # Triton types kernel arguments itself
    words_ptr,
    slots_ptr,
    pos_ptr,
    out_ptr,
    n_segments,
    splits,
    slot_words,
    row_words,
    rows_per_slot,
    rows_per_split,
    TR: tl.constexpr,
    BW: tl.constexpr,
    EVEN_ROWS: tl.constexpr,
    EVEN_COLS: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    t = tl.arange(0, TR)
    c = tl.arange(0, BW)
    for seg in range(pid, n_segments, nprog):
        k = seg // splits
        first = (seg - k * splits) * rows_per_split
        stop = tl.minimum(first + rows_per_split, rows_per_slot)
        slot = tl.load(slots_ptr + k)
        pos = tl.load(pos_ptr + k)
        base = words_ptr + slot * slot_words  # int64 slot index: a buffer may pass 2**31 words
        run = tl.zeros([TR, BW], dtype=tl.int64)
        acc = tl.zeros([TR, BW], dtype=tl.int64)
        for r0 in range(first, stop, TR):
            row = r0 + t
            offs = (row * row_words)[:, None] + c[None, :]  # int32 within a slot: fewer registers
            for c0 in range(0, row_words, BW):
                if EVEN_ROWS and EVEN_COLS:
                    x = tl.load(base + (offs + c0))
                else:
                    mask = (row < stop)[:, None] & ((c0 + c) < row_words)[None, :]
                    x = tl.load(base + (offs + c0), mask=mask, other=0)
                run += x.to(tl.int64)
            acc += run
        blocks = ((stop - first + TR - 1) // TR).to(tl.int64)
        run_t = tl.sum(run, axis=1)
        acc_t = tl.sum(acc, axis=1)
        weight_t = (first + t + 1).to(tl.int64)
        total = tl.sum(run_t, axis=0)
        weighted = tl.sum(weight_t * run_t + TR * (blocks * run_t - acc_t), axis=0)
        tl.atomic_add(out_ptr + pos, total, sem="relaxed")
        tl.atomic_add(out_ptr + pos + 1, weighted, sem="relaxed")


def tile_shape(rows: int, row_words: int, tile_words: int) -> tuple[int, int]:
    """(TR, BW), powers of two: BW words of a row per load (little masked waste), TR rows."""
    bw = min(512, triton.next_power_of_2(max(row_words, 1)))
    # Narrow the tile until the masked tail of each row wastes at most 1/8 of the lanes.
    while bw > 1 and triton.cdiv(row_words, bw) * bw * 8 > row_words * 9:
        bw //= 2
    tr = max(1, min(tile_words // bw, triton.next_power_of_2(max(rows, 1))))
    return tr, bw


def slot_checksum_into(
    buffer_words: torch.Tensor,
    slots_p: torch.Tensor,
    pos_p: torch.Tensor,
    out: torch.Tensor,
    programs: int,
    config: tuple[int, int] | None = None,
) -> None:
    """Add the checksum of slot ``slots_p[k]`` to ``out[pos_p[k]]`` and ``out[pos_p[k] + 1]``.

    ``buffer_words`` is a contiguous int32 view [slots, rows, words] of the slot buffer;
    ``slots_p`` and ``pos_p`` int64 [p] on its device; ``out`` int64 [length] there, zero at those
    positions for a plain checksum (the kernel adds). ``programs`` bounds the grid; ``config`` is
    (tile words, warps), default :data:`TILE_CONFIG`.
    """
    if buffer_words.dtype != torch.int32 or buffer_words.dim() != 3 or not buffer_words.is_contiguous():
        raise ValueError(
            "need a contiguous int32 [slots, rows, words] view, got "
            f"{buffer_words.dtype} {tuple(buffer_words.shape)}"
        )
    for name, t in (("slots", slots_p), ("positions", pos_p), ("out", out)):
        if t.dtype != torch.int64 or t.device != buffer_words.device or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous int64 on the buffer's device, got {t.dtype}")
    if slots_p.shape != pos_p.shape or slots_p.dim() != 1:
        raise ValueError("slots and positions must be 1-D and of the same length")
    _, rows, words = buffer_words.shape
    if rows * words >= 2**31:
        raise ValueError(f"a slot of {rows} x {words} words is too large (offsets within a slot are int32)")
    count = int(slots_p.numel())
    if count == 0 or rows == 0 or words == 0:
        return  # every checksum is zero
    tile_words, warps = config or TILE_CONFIG
    if programs < 1:
        raise ValueError(f"programs must be >= 1, got {programs}")
    tr, bw = tile_shape(rows, words, tile_words)
    # Segments: a few per program (programs that finish early take more: the grid stays busy
    # to the end), each at least a row block and about MIN_SEGMENT_BYTES.
    min_rows = max(tr, triton.cdiv(MIN_SEGMENT_BYTES, 4 * words))
    want = SEGMENTS_PER_PROGRAM * programs
    splits = max(1, min(triton.cdiv(want, count), triton.cdiv(rows, min_rows)))
    rows_per_split = triton.cdiv(triton.cdiv(rows, splits), tr) * tr
    splits = triton.cdiv(rows, rows_per_split)
    segments = count * splits
    grid = (min(programs, segments),)
    _slot_checksum_kernel[grid](
        buffer_words,
        slots_p,
        pos_p,
        out,
        segments,
        splits,
        rows * words,
        words,
        rows,
        rows_per_split,
        TR=tr,
        BW=bw,
        EVEN_ROWS=rows % tr == 0,
        EVEN_COLS=words % bw == 0,
        num_warps=warps,
    )
