"""A group's agreement: one all-reduce that tells every rank whether the group landed intact.

Shape legend: n transfers of the group, W checksum words per transfer.

The agreement vector is int64 [2 + 2 n W]: a failure flag, a fatal flag, then every transfer's
source checksum (added by the sending rank) and destination checksum (by the receiving rank).
After a sum over the ranks each position has one writer, so a positive flag means some rank
failed and equal halves mean intact arrivals. On CPU, or with a fault hook, the host sums it
right away (:func:`agree_now`); on CUDA it is queued behind the group's transfers and checksums
(:func:`queue_agreement`) and the host waits once, with a deadline (:func:`read_agreement`).
"""

from __future__ import annotations

import time

import torch

from eplb.hotswap.program import GroupProgram
from eplb.hotswap.runtime import SwapRuntime

_PINNED: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def agree_now(
    rt: SwapRuntime, vec: torch.Tensor, failed: bool, fatal: bool, prog: GroupProgram
) -> tuple[bool, bool, list[int]]:
    """(failed anywhere or changed in transit, fatal anywhere, mismatched transfer rows)."""
    if failed or fatal:
        vec[:2].copy_(torch.tensor([int(failed), int(fatal)], dtype=torch.int64))
    rt.all_reduce_sum(vec)
    got = [*_summary(vec, prog).tolist(), 0]
    return got[0] > 0 or got[2] > 0, got[1] > 0, _mismatched(vec, prog) if got[2] else []


def queue_agreement(
    rt: SwapRuntime, vec: torch.Tensor, prog: GroupProgram, *, slot: int, failed: bool, fatal: bool
) -> torch.cuda.Event:
    """Queue the agreement on the GPU behind the group's transfers and checksums (no host wait).

    The failure flag is read from pinned host memory (``slot``: 0 or 1, as two groups may be
    unsettled at once) when the stream reaches it, i.e. once every transfer of this rank has
    landed: a host whose deadline passes before then sets it (:func:`read_agreement`), so a late
    transfer fails the group on every rank, as agreed. Returns the event that marks it done.
    """
    flag, result = _pinned(rt.device, slot)
    flag[0], flag[1] = int(failed), int(fatal)
    vec[:2].copy_(flag, non_blocking=True)
    rt.all_reduce_sum(vec)
    summary = _summary(vec, prog)
    result.zero_()
    result[: summary.numel()].copy_(summary, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return done


def read_agreement(
    rt: SwapRuntime, vec: torch.Tensor, prog: GroupProgram, *, slot: int, done: torch.cuda.Event
) -> tuple[bool, bool, list[int], bool]:
    """Wait (deadline: ``timeout_s`` from now) for a queued agreement. (failed, fatal, rows, timed out)"""
    flag, result = _pinned(rt.device, slot)
    deadline = time.monotonic() + rt.timeout_s
    timed_out = False
    while not done.query():
        if not timed_out and time.monotonic() > deadline:
            flag[0] = 1  # too late for the copy if it already ran: the transfers had landed then
            timed_out = True
    got = result.tolist()
    rows = _mismatched(vec, prog) if got[2] else []
    return got[0] > 0 or got[2] > 0, got[1] > 0, rows, timed_out


def _summary(vec: torch.Tensor, prog: GroupProgram) -> torch.Tensor:
    """int64 [2] or [3] on the vector's device: failures, fatal failures, (checksum halves differ)."""
    if not prog.checksum_width:
        return vec[:2]
    half = prog.num_transfers * prog.checksum_width
    differ = (vec[2 : 2 + half] != vec[2 + half :]).any().to(torch.int64)
    return torch.cat([vec[:2], differ.view(1)])


def _mismatched(vec: torch.Tensor, prog: GroupProgram) -> list[int]:
    """Rows (transfers of the group) whose source and destination checksums differ."""
    half = prog.num_transfers * prog.checksum_width
    differ = vec[2 : 2 + half] != vec[2 + half :]
    return [int(x) for x in differ.view(prog.num_transfers, -1).any(dim=1).nonzero().flatten().tolist()]


def _pinned(device: torch.device, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pinned int64 [2] flags and [3] result of this device's agreements in ``slot`` (0 or 1)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if (index, slot) not in _PINNED:
        _PINNED[(index, slot)] = (
            torch.zeros(2, dtype=torch.int64, pin_memory=True),
            torch.zeros(3, dtype=torch.int64, pin_memory=True),
        )
    return _PINNED[(index, slot)]
