"""Hot-swap of expert weights in place: plan, compile per rank, transfer with checksums, agree, commit.

``hot_swap`` = ``prepare_swap`` + ``PreparedSwap.execute``; every tensor keeps its storage, so
captured CUDA graphs stay valid; any failure rolls every rank back to the old placement.
"""

from __future__ import annotations

from eplb.hotswap.layout import PlainLayout, SlotLayout, available_layouts, get_layout
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
    "PlainLayout",
    "PreparedSwap",
    "SlotLayout",
    "available_layouts",
    "get_layout",
    "hot_swap",
    "prepare_swap",
]
