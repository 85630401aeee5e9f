"""Checksums of expert weights in transit: exact integer sums over the raw bytes, on the device.

Each tensor's bytes are read as int32 words (int16 or uint8 when its row size demands), grouped in
rows (its first dimension). The checksum is two int64 numbers: the sum of all words and the sum of
each row's sum times (row index + 1). Integer sums wrap modulo 2**64 and do not depend on
summation order, so sender and receiver agree bit for bit; any changed word changes the first
number, a swapped pair of rows the second. One pass over the data, no host synchronisation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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


def expert_checksum(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """int64 [2 * len(tensors)]: (sum, row-weighted sum) of each tensor's words, in order."""
    if not tensors:
        raise ValueError("expert_checksum needs at least one tensor")
    parts = []
    for t in tensors:
        words = _words(t)
        row_sums = words.sum(dim=1, dtype=torch.int64)
        weight = torch.arange(1, words.shape[0] + 1, dtype=torch.int64, device=t.device)
        parts.append(row_sums.sum().reshape(1))
        parts.append((row_sums * weight).sum().reshape(1))
    return torch.cat(parts)
