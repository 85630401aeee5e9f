"""A group's agreement: one all-reduce that tells every rank whether the group landed intact.

Shape legend: V views per slot.

The agreement vector is int64 [2 + 4 V t] for the group's t transfers: the number of ranks that
failed, the number of ranks that took part, then every transfer's source checksum (2V words, added
by the sending rank) and destination checksum (by the receiving rank). After a sum over the ranks each checksum position has one
writer, so a positive first word means some rank failed and equal halves mean intact arrivals.
On CPU, or with a fault hook, the host sums it right away (:func:`agree_now`); on CUDA it is
queued behind the group's transfers and checksums (:func:`queue_agreement`) and the host waits
once (:func:`read_agreement`). Both waits have a deadline and watch the swap's control
(eplb.hotswap.control): a peer that dies or stalls fails the wait instead of blocking it.
"""

from __future__ import annotations

import torch

from eplb.hotswap.control import SwapControl, SwapFailure
from eplb.hotswap.program import GroupProgram
from eplb.hotswap.runtime import SwapRuntime

_PINNED: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def agree_now(
    rt: SwapRuntime,
    vec: torch.Tensor,
    failed: bool,
    prog: GroupProgram,
    control: SwapControl | None,
    deadline: float,
    spin: float,
) -> tuple[bool, list[int]]:
    """(failed anywhere or changed in transit, mismatched transfer rows)."""
    vec[:2].copy_(torch.tensor([int(failed), 1], dtype=torch.int64))
    summed, work = rt.all_reduce_async(vec)
    if work is not None:
        what = f"chunk {prog.chunk}'s agreement"
        if control is not None:
            control.wait(work.is_completed, deadline=deadline, what=what, spin=spin)
        try:
            work.wait()
        except Exception as exc:  # the collective itself failed: a connection to a peer broke
            raise (control.lost_peer(what, exc) if control is not None else exc) from exc
        if summed is not vec:
            vec.copy_(summed)
    got = [*_summary(vec, prog).tolist(), 0]
    _check_took_part(got[1], rt.world_size, prog)
    return got[0] > 0 or got[2] > 0, _mismatched(vec, prog) if got[2] else []


def queue_agreement(
    rt: SwapRuntime, vec: torch.Tensor, prog: GroupProgram, *, slot: int, failed: bool
) -> torch.cuda.Event:
    """Queue the agreement on the GPU behind the group's transfers and checksums (no host wait).

    ``failed`` (errors while posting) travels through pinned host memory (``slot``: 0 or 1, as two
    groups may be unsettled at once). Returns the event that marks it done.
    """
    flag, result = _pinned(rt.device, slot)
    flag[0], flag[1] = int(failed), 1
    vec[:2].copy_(flag, non_blocking=True)
    rt.all_reduce_sum(vec)
    summary = _summary(vec, prog)
    result.zero_()
    result[: summary.numel()].copy_(summary, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return done


def read_agreement(
    rt: SwapRuntime,
    vec: torch.Tensor,
    prog: GroupProgram,
    *,
    slot: int,
    done: torch.cuda.Event,
    control: SwapControl | None,
    deadline: float,
    spin: float,
) -> tuple[bool, list[int]]:
    """Wait (until ``deadline``) for a queued agreement: (failed or changed in transit, rows)."""
    _, result = _pinned(rt.device, slot)
    if control is not None:
        what = f"chunk {prog.chunk}'s transfers and agreement"
        control.wait(done.query, deadline=deadline, what=what, spin=spin)
    else:
        done.synchronize()
    got = result.tolist()
    _check_took_part(got[1], rt.world_size, prog)
    rows = _mismatched(vec, prog) if got[2] else []
    return got[0] > 0 or got[2] > 0, rows


def _check_took_part(count: int, world: int, prog: GroupProgram) -> None:
    if count != world:  # a collective matched one of another swap: the group is out of step
        raise SwapFailure(
            "peer lost", None, f"peer lost: {count} of {world} ranks agreed on chunk {prog.chunk}"
        )


def _summary(vec: torch.Tensor, prog: GroupProgram) -> torch.Tensor:
    """int64 [2] or [3] on the vector's device: failures, ranks, (checksum halves differ)."""
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
