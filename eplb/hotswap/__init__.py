"""Hot-swap of expert weights in place: plan, compile per rank, transfer with checksums, agree, commit.

``hot_swap`` = ``prepare_swap`` + ``PreparedSwap.execute``; every tensor keeps its storage, so
captured CUDA graphs stay valid; every rank ends on the old or the new placement, whatever a peer
does, and ``committed_placement`` tells a restarted rank which one its group serves. Swaps run on
a process group of their own, never the one the model serves with: the caller's (``swap_group``),
or without one a swap group that ``hot_swap`` makes over the default group's ranks and drops after
a swap given up.
"""

from __future__ import annotations

from eplb.hotswap.check import HotSwapShapeError
from eplb.hotswap.control import committed_placement
from eplb.hotswap.layout import PlainLayout, SlotLayout, available_layouts, get_layout
from eplb.hotswap.runtime import swap_group
from eplb.hotswap.swap import (
    FaultHook,
    HotSwapError,
    HotSwapOptions,
    HotSwapResult,
    PreparedSwap,
    hot_swap,
    prepare_swap,
)

__all__ = [
    "FaultHook",
    "HotSwapError",
    "HotSwapOptions",
    "HotSwapResult",
    "HotSwapShapeError",
    "PlainLayout",
    "PreparedSwap",
    "SlotLayout",
    "available_layouts",
    "committed_placement",
    "get_layout",
    "hot_swap",
    "prepare_swap",
    "swap_group",
]
