"""Checksums of expert weights in transit: exact integer sums over the raw bytes, on the device.

Shape legend: p slots (a run of consecutive ones), V views per slot (the tensors of one expert).

Sender and receiver must agree bit for bit with no host synchronisation, so the checksum is a pair
of wrapping integer sums (order-independent) rather than a hash: :func:`block_checksums` defines
it; :class:`SlotChecksum` computes it for chosen slots straight into hot-swap's agreement vector
(eplb.kernels.slot_checksum, Triton, on CUDA; torch elsewhere).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence

import torch

TRITON_FAILURES: list[str] = []
"""Why the Triton checksum failed in this process (``auto`` then uses torch); empty when it never did."""


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
    """int64 [p, 2V]: the checksum of each of p consecutive slots held by V block views [p, ...].

    Each tensor's bytes are read as int32 words (int16 or uint8 when its row size demands), grouped
    in rows (its first dimension). Its checksum is two int64 numbers: the sum of all words and the
    sum of each row's sum times (row index + 1). Integer sums wrap modulo 2**64 and do not depend
    on summation order, so sender and receiver agree bit for bit; any changed word changes the
    first number, a swapped pair of rows the second. One pass over the data.
    """
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


def checksum_backends() -> list[str]:
    return ["auto", "torch", "triton"]


class SlotChecksum:
    """Checksums of slots ``rows`` of a slot buffer [slots, ...] into ``out[pos[k]]``, ``out[pos[k] + 1]``.

    One launch of eplb.kernels.slot_checksum (a bounded grid, adding straight into ``out``) where
    the words are int32 on CUDA, else :func:`block_checksums` per run of consecutive slots.

    Built once (index tensors on ``device``); called with the buffer, which may be bound later
    (hot-swap's staging buffer exists only while a swap runs). ``out`` is int64 [length] and must hold
    zeros at those positions before the call.
    """

    def __init__(
        self,
        slot_shape: Sequence[int],
        dtype: torch.dtype,
        rows: Sequence[int],
        pos: Sequence[int],
        device: torch.device,
        backend: str = "auto",
        *,
        bind: bool = True,
    ) -> None:
        if backend not in checksum_backends():
            raise ValueError(f"checksum backend must be one of {checksum_backends()}, got {backend!r}")
        if len(rows) != len(pos):
            raise ValueError("rows and pos must have the same length")
        one = _words(torch.empty(tuple(slot_shape), dtype=dtype, device="meta"))
        fast = device.type == "cuda" and one.dtype == torch.int32 and _triton_available()
        if backend == "triton" and not fast:
            raise ValueError("the triton checksum needs CUDA, Triton and rows of whole int32 words")
        self.triton = fast and backend != "torch"
        self.backend = backend
        self.rows = list(rows)
        self.word_shape = (int(one.shape[0]), int(one.shape[1]))
        self.word_dtype = one.dtype
        self.pos = list(pos)
        self.pos2_list = [p + j for p in pos for j in (0, 1)]
        self.pos2 = torch.empty(0, dtype=torch.int64)
        self.rows_t: torch.Tensor | None = None
        self.pos_t: torch.Tensor | None = None
        self.runs = _runs(self.rows)
        if bind:
            bind_all([self], device)

    def __call__(self, buffer: torch.Tensor, out: torch.Tensor, programs: int = 0) -> None:
        """Write the checksums of ``buffer[rows]`` into ``out``; ``programs`` bounds the Triton grid."""
        if not self.rows:
            return
        if self.triton and not (self.backend == "auto" and TRITON_FAILURES):
            try:
                self._triton(buffer, out, programs)
                return
            except Exception as exc:
                if self.backend != "auto":
                    raise
                # auto: a kernel that does not build here (a Triton version) falls back to torch, once
                TRITON_FAILURES.append(f"{type(exc).__name__}: {exc}")
                warnings.warn(
                    f"Triton slot checksum failed, using torch: {exc}", RuntimeWarning, stacklevel=2
                )
        sums = torch.cat([block_checksums([buffer[a:b]]) for a, b in self.runs])
        out.index_copy_(0, self.pos2, sums.reshape(-1))

    def _triton(self, buffer: torch.Tensor, out: torch.Tensor, programs: int) -> None:
        from eplb.kernels.slot_checksum import slot_checksum_into

        words = buffer.reshape(-1).view(torch.uint8).view(self.word_dtype)
        words = words.view(buffer.shape[0], *self.word_shape)
        assert self.rows_t is not None and self.pos_t is not None
        slot_checksum_into(words, self.rows_t, self.pos_t, out, programs or 1 << 30)


def bind_all(tasks: Sequence[SlotChecksum], device: torch.device) -> None:
    """Give every task its index tensors on ``device``, from one host-to-device copy."""
    parts: list[int] = []
    for t in tasks:
        parts += t.pos2_list + (t.rows + t.pos if t.triton else [])
    if not tasks:
        return
    packed = torch.tensor(parts, dtype=torch.int64).to(device)
    at = 0
    for t in tasks:
        t.pos2 = packed[at : at + len(t.pos2_list)]  # the torch path's (also auto's fallback)
        at += len(t.pos2_list)
        if t.triton:
            n = len(t.rows)
            t.rows_t, t.pos_t = packed[at : at + n], packed[at + n : at + 2 * n]
            at += 2 * n


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """Maximal runs [a, b) of consecutive values, in order (rows keep their order in the output)."""
    runs: list[tuple[int, int]] = []
    for r in rows:
        if runs and runs[-1][1] == r:
            runs[-1] = (runs[-1][0], r + 1)
        else:
            runs.append((r, r + 1))
    return runs


@functools.cache
def _triton_available() -> bool:
    try:
        import eplb.kernels.slot_checksum  # noqa: F401
    except ImportError:
        return False
    return True
