"""Per-layer dispatch tables on the device, and the hash every remap backend shares.

Shape legend: L layers, E logical experts, P physical slots, R max replicas (P - E + 1, the most
replicas one expert can have), T tokens, K top-k, X replicated experts (the ``lp`` mode's rows), D
GPUs holding one replicated expert (its columns; capacities in eplb.remap.lp_rule).

:class:`DispatchTables` holds what the remap needs for every layer and mode, as device tensors
of fixed shape and address. After a hot-swap, :meth:`DispatchTables.update_` copies the new
placement into the same storage, so a CUDA graph captured before the swap stays valid.

Replica choice for the hashed modes (identical in every backend, so they agree bit for bit):

- ``i = row * K + k`` is the element's flat index; ``h = mix32(i ^ salt)`` with ``mix32`` the
  32-bit "lowbias32" integer mixer (xor-shift, multiply, all modulo 2**32);
- ``salt = mix32(base ^ seed)`` where ``base = mix32(layer * 0x9E3779B9 + (rank + 1) * 0x85EBCA6B)``
  (rank -1 for the rank-invariant weighted mode) and ``seed`` is the device scalar ``seed_1``
  (dynamic and fake only; weighted uses seed 0, so replays and ranks agree);
- dynamic: replica ``h % logcnt``; fake: slot ``h % P``; weighted: ``u = (h >> 8) * 2**-24`` and
  replica = how many of the first ``logcnt - 1`` cumulative weights are ``<= u``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

from eplb.placement.dispatch_map import static_dispatch_map
from eplb.placement.model import Placement
from eplb.remap.lp_rule import lp_tables

if TYPE_CHECKING:
    import torch

MASK32 = 0xFFFFFFFF
GOLDEN32 = 0x9E3779B9
RANK_MUL32 = 0x85EBCA6B
MIX_MUL1 = 0x7FEB352D
MIX_MUL2 = 0x846CA68B


def mix32_int(x: int) -> int:
    """lowbias32 on a Python int (host side: salts)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * MIX_MUL1) & MASK32
    x ^= x >> 15
    x = (x * MIX_MUL2) & MASK32
    x ^= x >> 16
    return x


def salt_base(layer: int, rank: int) -> int:
    """uint32 base of the salt for one layer and rank (rank -1: rank-invariant)."""
    return mix32_int(layer * GOLDEN32 + (rank + 1) * RANK_MUL32)


def as_int32_bits(x: int) -> int:
    """Reinterpret a uint32 value as the int32 with the same bits (for kernel arguments)."""
    x &= MASK32
    return x - (1 << 32) if x >= 1 << 31 else x


def hash_rank(mode: str, rank: int) -> int:
    """The rank that salts ``mode``'s hash: -1 (rank-invariant) in weighted mode, else ``rank``."""
    return -1 if mode == "weighted" else rank


@dataclass(frozen=True, eq=False)
class DispatchTables:
    """Device-side dispatch tables for every layer; update in place with :meth:`update_`."""

    static_LE: torch.Tensor
    """int32 [L, E]: this rank's static dispatch slot per logical expert (eplb.placement.dispatch_map)."""
    log2phy_LER: torch.Tensor
    """int32 [L, E, R]: slots of each expert, padded with -1; R = P - E + 1 (room for any placement)."""
    logcnt_LE: torch.Tensor
    """int32 [L, E]: replicas per expert (>= 1)."""
    cumweights_LER: torch.Tensor
    """float32 [L, E, R]: cumulative per-replica dispatch weights (weighted mode); 2.0 past the last."""
    seed_1: torch.Tensor
    """int32 [1]: salt of the dynamic and fake modes; bump with :meth:`advance_seed_` (graph-safe)."""
    num_physical: int
    """P, physical slots."""
    rank: int
    """The EP rank these tables serve."""
    derived: dict[str, Any] = field(default_factory=dict, init=False, repr=False)
    """Host-side facts backends derive once per tables (kernel arguments, pointers): valid because
    the tensors keep their shape and storage for the tables' lifetime (:meth:`update_` copies)."""
    num_gpus: int = 1
    """G, EP ranks (the ``lp`` mode's all-gather spans them)."""
    lp_expert_LX: torch.Tensor | None = None
    """int32 [L, X]: replicated experts per layer (eplb.remap.lp_rule.LpTables); None: no ``lp`` mode."""
    lp_slot_LXD: torch.Tensor | None = None
    """int32 [L, X, D]: each replicated expert's first replica on each GPU holding it."""
    lp_index_LE: torch.Tensor | None = None
    """int32 [L, E]: an expert's row in ``lp_expert_LX``, -1 with one replica."""
    lp_slot_LXG: torch.Tensor | None = None
    """int32 [L, X, G]: ``lp_slot_LXD`` by GPU (-1 where the GPU holds no replica), as the kernels read it."""
    lp_color_LX: torch.Tensor | None = None
    """int32 [L, X]: each replicated expert's re-fill colour (eplb.remap.lp_rule), -1 for none."""
    lp_colors_L: torch.Tensor | None = None
    """int32 [L]: colours per layer."""

    # Cached: the remap reads these on every call, and the tensors never change shape or device.
    @cached_property
    def num_layers(self) -> int:
        return int(self.static_LE.shape[0])

    @cached_property
    def num_logical(self) -> int:
        return int(self.static_LE.shape[1])

    @cached_property
    def max_replicas(self) -> int:
        return int(self.log2phy_LER.shape[2])

    @cached_property
    def device(self) -> torch.device:
        return self.static_LE.device

    @classmethod
    def from_placement(
        cls,
        placement: Placement,
        rank: int,
        device: torch.device | str = "cpu",
        weights_LER: Any = None,
    ) -> DispatchTables:
        """Build the tables of ``rank`` on ``device``.

        ``weights_LER``: optional per-replica dispatch weights [L, E, R'] (R' <= P - E + 1, rows
        in log2phy order; entries past an expert's replica count are ignored); default uniform.
        """
        import torch

        host = _host_tables(placement, rank, weights_LER)
        return cls(
            _to_torch(host["static"], device),
            _to_torch(host["log2phy"], device),
            _to_torch(host["logcnt"], device),
            _to_torch(host["cumweights"], device),
            torch.zeros(1, dtype=torch.int32, device=device),
            placement.num_physical,
            rank,
            num_gpus=placement.num_gpus,
            lp_expert_LX=_to_torch(host["lp_expert"], device),
            lp_slot_LXD=_to_torch(host["lp_slot"], device),
            lp_index_LE=_to_torch(host["lp_index"], device),
            lp_slot_LXG=_to_torch(host["lp_slot_by_gpu"], device),
            lp_color_LX=_to_torch(host["lp_color"], device),
            lp_colors_L=_to_torch(host["lp_colors"], device),
        )

    @property
    def slots_per_gpu(self) -> int:
        """S = P / G."""
        return self.num_physical // self.num_gpus

    def update_(self, placement: Placement, weights_LER: Any = None) -> None:
        """Copy a new placement (and weights) into the existing tensors, keeping their addresses."""
        if (placement.num_layers, placement.num_logical, placement.num_physical, placement.num_gpus) != (
            self.num_layers,
            self.num_logical,
            self.num_physical,
            self.num_gpus,
        ):
            raise ValueError(
                f"placement shape (L={placement.num_layers}, E={placement.num_logical}, "
                f"P={placement.num_physical}, G={placement.num_gpus}) differs from the tables' "
                f"(L={self.num_layers}, E={self.num_logical}, P={self.num_physical}, G={self.num_gpus})"
            )
        host = _host_tables(placement, self.rank, weights_LER)
        for name, dst in (
            ("static", self.static_LE),
            ("log2phy", self.log2phy_LER),
            ("logcnt", self.logcnt_LE),
            ("cumweights", self.cumweights_LER),
            ("lp_expert", self.lp_expert_LX),
            ("lp_slot", self.lp_slot_LXD),
            ("lp_index", self.lp_index_LE),
            ("lp_slot_by_gpu", self.lp_slot_LXG),
            ("lp_color", self.lp_color_LX),
            ("lp_colors", self.lp_colors_L),
        ):
            if dst is not None:
                dst.copy_(_to_torch(host[name], "cpu"))

    def advance_seed_(self) -> None:
        """Change the dynamic/fake salt for the next pass (a device op, capturable in a graph)."""
        self.seed_1.add_(1)


def _to_torch(arr: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """int32 or float32 numpy -> a torch tensor of the same, explicitly named dtype on ``device``."""
    import torch

    dtype = {np.dtype(np.int32): torch.int32, np.dtype(np.float32): torch.float32}[arr.dtype]
    return torch.from_numpy(np.ascontiguousarray(arr)).to(device=device, dtype=dtype)


def _host_tables(placement: Placement, rank: int, weights_LER: Any) -> dict[str, np.ndarray]:
    """numpy versions of the tables (int32 maps, float32 cumulative weights)."""
    L, E, P = placement.num_layers, placement.num_logical, placement.num_physical
    R = P - E + 1
    r_have = placement.max_replicas
    log2phy = np.full((L, E, R), -1, dtype=np.int32)
    keep = min(R, r_have)
    if (placement.log2phy_LER[:, :, keep:] != -1).any():
        raise ValueError(f"log2phy holds more than {R} replicas for an expert")
    log2phy[:, :, :keep] = placement.log2phy_LER[:, :, :keep]
    logcnt = placement.logcnt_LE.astype(np.int32)
    lp = lp_tables(placement)
    return {
        "static": static_dispatch_map(placement, rank).astype(np.int32),
        "log2phy": log2phy,
        "logcnt": logcnt,
        "cumweights": cumulative_weights(weights_LER, logcnt, R),
        "lp_expert": lp.expert_LX,
        "lp_slot": lp.slot_LXD,
        "lp_index": lp.index_LE,
        "lp_slot_by_gpu": lp.slot_LXG,
        "lp_color": lp.color_LX,
        "lp_colors": lp.colors_L,
    }


def cumulative_weights(weights_LER: Any, logcnt_LE: np.ndarray, capacity: int) -> np.ndarray:
    """float32 [L, E, capacity]: running sums of normalised weights; 2.0 from each expert's last replica on.

    Uniform when ``weights_LER`` is None. Weights must be finite, non-negative, with a positive
    sum over each expert's replicas; ValueError otherwise.
    """
    L, E = logcnt_LE.shape
    used_LER = np.arange(capacity)[None, None, :] < logcnt_LE[:, :, None]
    if weights_LER is None:
        w = used_LER.astype(np.float64)
    else:
        if hasattr(weights_LER, "detach"):
            weights_LER = weights_LER.detach().cpu().numpy()
        raw = np.asarray(weights_LER, dtype=np.float64)
        if raw.ndim != 3 or raw.shape[:2] != (L, E) or raw.shape[2] > capacity:
            raise ValueError(f"weights must be [L={L}, E={E}, R<={capacity}], got shape {raw.shape}")
        w = np.zeros((L, E, capacity))
        w[:, :, : raw.shape[2]] = raw
        w = np.where(used_LER, w, 0.0)
        if not np.isfinite(w).all():
            raise ValueError("dispatch weights hold NaN or infinite values")
        if (w < 0).any():
            raise ValueError("dispatch weights must be non-negative")
        if (w.sum(axis=2) <= 0).any():
            layer, expert = np.argwhere(w.sum(axis=2) <= 0)[0]
            raise ValueError(f"dispatch weights of expert {expert} in layer {layer} sum to zero")
    cum = np.cumsum(w / w.sum(axis=2, keepdims=True), axis=2).astype(np.float32)
    # The last replica takes everything above the previous boundary: no rounding gap at 1.0.
    last_LER = np.arange(capacity)[None, None, :] >= (logcnt_LE[:, :, None] - 1)
    return np.where(last_LER, np.float32(2.0), cum).astype(np.float32)
