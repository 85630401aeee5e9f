"""Layout adapters: between the plain expert-weight layout and the one an engine's kernels read.

Shape legend: S slots per GPU (this rank's), I intermediate size, H hidden size.

Plain layout: ``w13 [S, 2I, H]``, ``w2 [S, H, I]`` and optional per-slot scales, row-major.
Engines (aiter's MegaMoE) may pre-shuffle each slot into tiles their kernels load directly; a
:class:`SlotLayout` converts slot tensors both ways and names the contiguous views that hold one
slot, so hot-swap moves and checksums engine-layout bytes with no conversion on the way. Registry:
``plain``, ``block_shuffle`` (aiter's tile shuffle in plain torch, for CPU tests) and ``aiter``
(ROCm with amd-aiter only, shuffled by aiter itself).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Protocol

import torch


class SlotLayout(Protocol):
    """Converts slot tensors [S, ...] between the plain and an engine layout (same shape and dtype)."""

    name: str

    def to_engine(self, name: str, plain: torch.Tensor) -> torch.Tensor:
        """Engine layout of plain slot tensor ``name`` [S, ...]."""
        ...

    def to_plain(self, name: str, engine: torch.Tensor) -> torch.Tensor:
        """Plain layout of engine slot tensor ``name`` [S, ...]."""
        ...

    def slot_views(self, tensors: Mapping[str, torch.Tensor], slot: int) -> list[torch.Tensor]:
        """Contiguous views holding slot ``slot`` (local index) in the engine layout, in a fixed order."""
        ...

    def block_views(self, tensors: Mapping[str, torch.Tensor], start: int, count: int) -> list[torch.Tensor]:
        """Contiguous views [count, ...] holding slots ``start .. start+count-1``, in the same order."""
        ...


def slot_major_views(tensors: Mapping[str, torch.Tensor], slot: int) -> list[torch.Tensor]:
    """``[tensors[name][slot] for name in sorted order]``: the views of a slot-major layout."""
    return [tensors[name][slot] for name in sorted(tensors)]


def slot_major_blocks(tensors: Mapping[str, torch.Tensor], start: int, count: int) -> list[torch.Tensor]:
    """``[tensors[name][start:start+count] ...]``: consecutive slots of a slot-major layout."""
    return [tensors[name][start : start + count] for name in sorted(tensors)]


class PlainLayout:
    """The plain layout: nothing to convert."""

    name = "plain"

    def to_engine(self, name: str, plain: torch.Tensor) -> torch.Tensor:
        return plain

    def to_plain(self, name: str, engine: torch.Tensor) -> torch.Tensor:
        return engine

    def slot_views(self, tensors: Mapping[str, torch.Tensor], slot: int) -> list[torch.Tensor]:
        return slot_major_views(tensors, slot)

    def block_views(self, tensors: Mapping[str, torch.Tensor], start: int, count: int) -> list[torch.Tensor]:
        return slot_major_blocks(tensors, start, count)


def shuffle_weight_tiles(w: torch.Tensor, tile_n: int = 16, tile_k: int = 16) -> torch.Tensor:
    """Pre-shuffle [..., rows, cols] into (tile_n x 2*tile_k) tiles of 16-byte packs (aiter's weight order)."""
    pack = 16 // w.element_size()
    block_k = 2 * tile_k
    rows, cols = w.shape[-2], w.shape[-1]
    if rows % tile_n or cols % block_k or block_k % pack:
        raise ValueError(f"weight [{rows}, {cols}] does not tile into ({tile_n}, {block_k}) blocks")
    tiles = w.reshape(-1, rows // tile_n, tile_n, cols // block_k, block_k // pack, pack)
    return tiles.permute(0, 1, 3, 4, 2, 5).contiguous().view(w.shape)


def unshuffle_weight_tiles(w: torch.Tensor, tile_n: int = 16, tile_k: int = 16) -> torch.Tensor:
    """Inverse of :func:`shuffle_weight_tiles`."""
    pack = 16 // w.element_size()
    block_k = 2 * tile_k
    rows, cols = w.shape[-2], w.shape[-1]
    tiles = w.reshape(-1, rows // tile_n, cols // block_k, block_k // pack, tile_n, pack)
    return tiles.permute(0, 1, 4, 2, 3, 5).contiguous().view(w.shape)


def shuffle_scale_tiles(s: torch.Tensor) -> torch.Tensor:
    """Pre-shuffle e8m0 block scales [..., rows, weight cols / 32] in (32 x 8) tiles (aiter's scale order)."""
    rows, cols = s.shape[-2], s.shape[-1]
    if rows % 32 or cols % 8:
        raise ValueError(f"scales [{rows}, {cols}] must have rows divisible by 32 and columns by 8")
    tiles = s.reshape(-1, rows // 32, 2, 16, cols // 8, 2, 4)
    return tiles.permute(0, 1, 4, 6, 3, 5, 2).contiguous().view(s.shape)


def unshuffle_scale_tiles(s: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`shuffle_scale_tiles`."""
    rows, cols = s.shape[-2], s.shape[-1]
    tiles = s.reshape(-1, rows // 32, cols // 8, 4, 16, 2, 2)
    return tiles.permute(0, 1, 6, 4, 2, 5, 3).contiguous().view(s.shape)


def _is_scale(name: str) -> bool:
    return name.endswith("scale") or name.endswith("scale_inv")


class BlockShuffleLayout:
    """Weights in aiter's (16, 16) tile order and e8m0 scales in its (32, 8) order, per slot."""

    name = "block_shuffle"

    def to_engine(self, name: str, plain: torch.Tensor) -> torch.Tensor:
        return shuffle_scale_tiles(plain) if _is_scale(name) else shuffle_weight_tiles(plain)

    def to_plain(self, name: str, engine: torch.Tensor) -> torch.Tensor:
        return unshuffle_scale_tiles(engine) if _is_scale(name) else unshuffle_weight_tiles(engine)

    def slot_views(self, tensors: Mapping[str, torch.Tensor], slot: int) -> list[torch.Tensor]:
        # Each slot is shuffled on its own, so a slot is still one contiguous block per tensor.
        return slot_major_views(tensors, slot)

    def block_views(self, tensors: Mapping[str, torch.Tensor], start: int, count: int) -> list[torch.Tensor]:
        return slot_major_blocks(tensors, start, count)


class AiterMegaMoELayout(BlockShuffleLayout):
    """aiter's MegaMoE layout, shuffled by aiter itself (ROCm with amd-aiter only)."""

    name = "aiter"

    def __init__(self) -> None:
        shuffle = importlib.import_module("aiter.ops.shuffle")
        self._shuffle_weight: Callable[..., torch.Tensor] = shuffle.shuffle_weight
        try:
            fp4 = importlib.import_module("aiter.utility.fp4_utils")
            self._shuffle_scale: Callable[[torch.Tensor], torch.Tensor] = fp4.e8m0_shuffle
        except (ImportError, AttributeError):
            self._shuffle_scale = shuffle_scale_tiles

    def to_engine(self, name: str, plain: torch.Tensor) -> torch.Tensor:
        if _is_scale(name):
            flat = self._shuffle_scale(plain.reshape(-1, plain.shape[-1]))
            return flat.reshape(plain.shape)
        return self._shuffle_weight(plain, layout=(16, 16))


def _aiter_usable() -> bool:
    if getattr(torch.version, "hip", None) is None:
        return False
    try:
        importlib.import_module("aiter.ops.shuffle")
    except ImportError:
        return False
    return True


_LAYOUTS: dict[str, Callable[[], SlotLayout]] = {"plain": PlainLayout, "block_shuffle": BlockShuffleLayout}
if _aiter_usable():  # pragma: no cover - ROCm only
    _LAYOUTS["aiter"] = AiterMegaMoELayout


def available_layouts() -> list[str]:
    return sorted(_LAYOUTS)


def get_layout(name: str) -> SlotLayout:
    """The layout adapter called ``name``; a clear error for aiter off ROCm."""
    if name not in _LAYOUTS:
        hint = (
            " (aiter needs a ROCm build of torch and amd-aiter: pip install 'eplb[rocm]')"
            if name == "aiter"
            else ""
        )
        raise ValueError(f"unknown slot layout {name!r}; available: {available_layouts()}{hint}")
    return _LAYOUTS[name]()
