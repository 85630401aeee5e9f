"""Which process group a hot-swap runs on: the caller's swap group, or one that eplb.hotswap owns.

A swap never runs on the group the model serves with: one given up with transfers still posted
leaves its group out of step, and the next collective on it may abort the process
(eplb.hotswap.runtime.swap_group). So ``hot_swap`` and ``prepare_swap`` refuse the default group
as ``group``, and without a ``group`` run on a swap group of their own over the default group's
ranks: made at the first swap's check (collective: every rank checks at the same point), one per
slot device type and group timeout, and kept while its swaps end with a decision every rank voted
on (committed or failed). A swap given up (``HotSwapError``, or a rank that left it, before its
check too) drops it on every rank alike; the next swap, which every rank starts at the same
point, makes a fresh one. A
group dropped is kept alive, never used or destroyed again (eplb.hotswap.runtime.keep_for_good).
With one process there is no group to make.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from eplb.hotswap.runtime import swap_group, swap_group_timeout_s

_OWNED: dict[tuple[str, float], tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}
"""(slot device type, group timeout): (the default group it spans, the swap group)."""


def refuse_serving(group: dist.ProcessGroup | None) -> None:
    """Raise ValueError when ``group`` is the default group (the one the model serves with)."""
    if group is not None and dist.is_available() and dist.is_initialized() and group is dist.group.WORLD:
        raise ValueError(
            "group: a hot-swap never runs on the default process group, which the model serves with "
            "(a swap given up would leave it out of step): pass group=None, and the swap runs on a "
            "swap group of its own over the same ranks, or a group made by eplb.hotswap.swap_group"
        )


def owned_group(device: torch.device, timeout_s: float) -> dist.ProcessGroup | None:
    """The swap group of a swap without a ``group``, of slots on ``device`` with ``timeout_s``:
    the one held, else a new one over the default group's ranks (collective: every rank calls this
    at the same point). None with one process (a swap has no peer)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    key = _key(device, timeout_s)
    world = dist.group.WORLD
    held = _OWNED.get(key)
    if held is None or held[0] is not world:  # none yet, or one over an earlier default group
        assert world is not None, "an initialized default group"
        held = _OWNED[key] = (world, swap_group(None, device, timeout_s=timeout_s))
    return held[1]


def drop(group: dist.ProcessGroup | None) -> None:
    """A swap gave ``group`` up: never hand it out again if it is one of ours (a caller's own group
    is the caller's to drop)."""
    for key, (_, held) in list(_OWNED.items()):
        if held is group:
            del _OWNED[key]


@contextlib.contextmanager
def unchecked(group: dist.ProcessGroup | None, device: torch.device, timeout_s: float) -> Iterator[None]:
    """Around a swap's work before its check: a rank that leaves there (any exception) takes no
    part in the check, where the others give the swap's group up; so without a ``group`` ours is
    dropped here too, and every rank's next swap makes a fresh one."""
    try:
        yield
    except BaseException:
        if group is None:
            _OWNED.pop(_key(device, timeout_s), None)
        raise


def _key(device: torch.device, timeout_s: float) -> tuple[str, float]:
    return device.type, swap_group_timeout_s(timeout_s)
