"""One remap call's arguments, validated once: what every remap backend takes.

Shape legend: T tokens, K top-k, L layers, E logical experts, P physical slots.

:func:`eplb.remap.api.remap_and_record` checks its arguments, allocates the output when none is
given, and builds one :class:`RemapCall`; each backend (torch, the Triton launcher and its direct
path, aiter) then reads the fields it needs instead of taking nine positional arguments in an
order each of them restated. The record lives here, beside the tables and away from the backend
registry, so ``eplb.kernels`` can import it without importing the registry back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from eplb.remap.exchange import LpExchange
    from eplb.remap.tables import DispatchTables


# Slotted and not frozen: built on every call of every MoE layer, and a frozen dataclass's __init__
# sets each field through object.__setattr__ (about twice the cost). Treat it as read-only.
# eq=False: tensors have no boolean equality; two calls are the same call only if they are one object.
@dataclass(slots=True, kw_only=True, eq=False)
class RemapCall:
    """The arguments of one remap+record call (semantics: eplb.remap.api).

    Built by ``remap_and_record`` after its checks; a backend may assume every tensor is int32,
    contiguous where it has more than one element, and on ``topk_ids_TK``'s device, with shapes
    as documented per field, and ``T * K > 0``.
    """

    topk_ids_TK: torch.Tensor
    """int32 [T, K]: the router's logical expert ids (-1 and out-of-range ids pass through)."""
    tables: DispatchTables
    """The rank's dispatch tables, on the ids' device."""
    layer: int
    """MoE layer, in ``[0, tables.num_layers)``."""
    mode: str
    """Dispatch mode, one of eplb.remap.api.MODES."""
    out_TK: torch.Tensor
    """int32 [T, K]: receives the physical slot ids."""
    counts_P: torch.Tensor | None = None
    """int32 [P], or count rows [C, P] whose sum is the count: per-slot counts, added to in
    place; None: not counted."""
    logical_counts_E: torch.Tensor | None = None
    """int32 [E]: per-expert counts, added to in place; None: not counted."""
    num_valid_tokens: torch.Tensor | None = None
    """int32 [1] on the device: rows at or past it are padding; None: every row is valid."""
    record: torch.Tensor | None = None
    """int32 [1] on the device: count only while nonzero; None: always count."""
    lp: LpExchange | None = None
    """``lp`` mode: the rank's counts exchange (eplb.remap.lp); None in every other mode."""

    def counts_row_P(self) -> torch.Tensor | None:
        """``counts_P``'s first count row (all of it when [P]): where a backend that does not
        spread its counts over rows adds them (any row is correct, their sum is the count)."""
        counts = self.counts_P
        return counts[0] if counts is not None and counts.dim() == 2 else counts

    def count_rows(self) -> int:
        """Count rows of ``counts_P`` (1 when [P] or absent)."""
        counts = self.counts_P
        return counts.shape[0] if counts is not None and counts.dim() == 2 else 1


__all__ = ["RemapCall"]
