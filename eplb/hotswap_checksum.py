"""Checksums of expert weights in transit: exact integer sums over the raw bytes, on the device.

Shape legend: n experts, V tensors per expert (views of one slot), W = 2 * V checksum words.

Each tensor's bytes are read as int32 words (int16 or uint8 when its row size demands), grouped in
rows (its first dimension). Its checksum is two int64 numbers: the sum of all words and the sum of
each row's sum times (row index + 1). Integer sums wrap modulo 2**64 and do not depend on
summation order, so sender and receiver agree bit for bit; any changed word changes the first
number, a swapped pair of rows the second. One pass over the data, no host synchronisation, and
a few kernels per block of consecutive slots (what hot-swap sends as one message).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

MASK31 = 0x7FFFFFFF
"""Checksums are compared as 31-bit values, so +sender and -receiver sum without overflow."""


def _words(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of contiguous ``t`` as a 2-D integer view [rows, words per row]."""
    if not t.is_contiguous():
        raise ValueError("checksummed tensors must be contiguous (slot views of slot-major buffers are)")
    rows = int(t.shape[0]) if t.dim() >= 2 and t.shape[0] > 0 else 1
    flat = t.reshape(-1).view(torch.uint8)
    row_bytes = flat.numel() // rows
    for dtype, size in ((torch.int32, 4), (torch.int16, 2)):
        if row_bytes % size == 0:
            return flat.view(dtype).view(rows, row_bytes // size)
    return flat.view(rows, row_bytes)


def block_checksums(blocks: Sequence[torch.Tensor]) -> torch.Tensor:
    """int64 [m, 2V]: the checksum of each of m consecutive slots held by V block views [m, ...]."""
    if not blocks:
        raise ValueError("block_checksums needs at least one tensor")
    m = int(blocks[0].shape[0])
    device = blocks[0].device
    parts = []
    for block in blocks:
        if not block.is_contiguous():
            raise ValueError("checksummed tensors must be contiguous (slot views of slot-major buffers are)")
        if m == 0:
            parts += [torch.zeros(0, dtype=torch.int64, device=device)] * 2
            continue
        one = _words(block[0])
        rows = one.shape[0]
        words = block.reshape(-1).view(torch.uint8).view(one.dtype).view(m, rows, one.shape[1])
        rows_mR = words.sum(dim=2, dtype=torch.int64)
        weight_R = torch.arange(1, rows + 1, dtype=torch.int64, device=device)
        parts.append(rows_mR.sum(dim=1))
        parts.append((rows_mR * weight_R).sum(dim=1))
    return torch.stack(parts, dim=1)


def expert_checksum(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """int64 [2V]: the checksum of one expert's tensors (one slot's views)."""
    if not tensors:
        raise ValueError("expert_checksum needs at least one tensor")
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("checksummed tensors must be contiguous (slot views of slot-major buffers are)")
    return block_checksums([t.unsqueeze(0) for t in tensors])[0]
