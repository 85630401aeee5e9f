"""One remap call's arguments, validated once: what every remap backend takes, and the checks.

Shape legend: T tokens, K top-k, L layers, E logical experts, P physical slots, C count rows.

:func:`eplb.remap.api.remap_and_record` checks its arguments, allocates the output when none is
given, and builds one :class:`RemapCall`; each backend (torch, the Triton launcher and its direct
path, aiter) then reads the fields it needs instead of taking nine positional arguments in an
order each of them restated. The record lives here, beside the tables and away from the backend
registry, so ``eplb.kernels`` can import it without importing the registry back.

:class:`RemapArgs` is the record of a call's fixed arguments (everything but the tables, the layer,
the ids and the output): the public function builds it once from its keywords where its per-layer
cache misses, and its cache, its checks (:func:`check_remap_args`), the :class:`RemapCall` it
builds and eplb.remap.prepared's ``PreparedRemap`` (a ``RemapArgs`` with what was prepared from
it) all read that one record, so the argument list is written once.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from eplb.policy.dispatch import dispatch_mode, dispatch_mode_names

if TYPE_CHECKING:
    from eplb.remap.exchange import LpExchange
    from eplb.remap.tables import DispatchTables

MODES = tuple(name for name in dispatch_mode_names() if not dispatch_mode(name).per_pass)
"""The dispatch modes a call may name (eplb.policy.dispatch): one call runs one mode, so a mode
that picks among others pass by pass (``auto``) is resolved by the caller to the pass's mode."""


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
    map_padded_rows: bool = False
    """Map the rows at or past ``num_valid_tokens`` too (they are still not counted), as SGLang's
    fused kernel does; False: they pass through unchanged. Not in ``lp`` mode."""

    def counts_row_P(self) -> torch.Tensor | None:
        """``counts_P``'s first count row (all of it when [P]): where a backend that does not
        spread its counts over rows adds them (any row is correct, their sum is the count)."""
        counts = self.counts_P
        return counts[0] if counts is not None and counts.dim() == 2 else counts

    def count_rows(self) -> int:
        """Count rows of ``counts_P`` (1 when [P] or absent)."""
        counts = self.counts_P
        return counts.shape[0] if counts is not None and counts.dim() == 2 else 1


# Slotted and not frozen, as RemapCall (eplb.remap.prepared subclasses it, and the public
# function's cached path reads its fields as plain slots). Treat it as read-only.
@dataclass(slots=True, kw_only=True, eq=False)
class RemapArgs:
    """The fixed arguments of one layer's remap calls, as ``remap_and_record`` takes them (its
    keywords but ``out_TK``; semantics: eplb.remap.api). Two calls have the same fixed arguments
    when they pass the same tensor and exchange objects and equal mode and backend (:meth:`key`)."""

    mode: str = "static"
    """Dispatch mode, one of :data:`MODES` (checked by :func:`check_remap_args`)."""
    counts_P: torch.Tensor | None = None
    """int32 [P] or count rows [C, P], added to; None: not counted."""
    logical_counts_E: torch.Tensor | None = None
    """int32 [E], added to; None: not counted."""
    num_valid_tokens: torch.Tensor | None = None
    """int32 [1] on the device: rows at or past it are padding; None: every row is valid."""
    record: torch.Tensor | None = None
    """int32 [1] on the device: count only while nonzero; None: always count."""
    backend: str = "auto"
    """Backend name (eplb.remap.backends)."""
    lp: LpExchange | None = None
    """``lp`` mode: the rank's counts exchange as given (None: the tables' own)."""
    map_padded_rows: bool = False
    """Map the padded rows too (still not counted); not in ``lp`` mode."""

    def key(self) -> tuple[Any, ...]:
        """What two calls must share to be one call: the objects by identity (their ids: whoever
        keeps a key must keep the objects, so that no id is reused while it is kept), the mode and
        backend by equality. ``map_padded_rows`` by identity too, so that only a bool matches."""
        return (
            self.mode,
            self.backend,
            id(self.counts_P),
            id(self.logical_counts_E),
            id(self.num_valid_tokens),
            id(self.record),
            id(self.lp),
            id(self.map_padded_rows),
        )

    def remap_call(
        self,
        topk_ids_TK: torch.Tensor,
        tables: DispatchTables,
        layer: int,
        out_TK: torch.Tensor,
        lp: LpExchange | None,
    ) -> RemapCall:
        """The backend's record of one call with these fixed arguments (``lp``: the exchange the
        argument resolved to, eplb.remap.exchange.exchange_for).

        Built on every call of every layer that the Triton direct path does not launch: the slots
        are set here directly, since RemapCall's generated ``__init__`` parsing eleven keywords costs
        about 2.5 times as much. Every field is set (tests/test_remap_args.py compares the result
        with the constructor's, field by field)."""
        call = _new(RemapCall)
        call.topk_ids_TK = topk_ids_TK
        call.tables = tables
        call.layer = layer
        call.mode = self.mode
        call.out_TK = out_TK
        call.counts_P = self.counts_P
        call.logical_counts_E = self.logical_counts_E
        call.num_valid_tokens = self.num_valid_tokens
        call.record = self.record
        call.lp = lp
        call.map_padded_rows = self.map_padded_rows
        return call


ARG_NAMES = tuple(f.name for f in fields(RemapArgs))
"""The fixed arguments' names, in order: the keywords of ``remap_and_record`` but ``out_TK``."""
_new = object.__new__


# Every check below runs on every call of every MoE layer, mostly eagerly (prefill): attribute
# reads and comparisons only, nothing that allocates, synchronises or formats a string unless
# it is about to raise.
_INT32 = torch.int32


def check_remap_args(
    topk_ids_TK: torch.Tensor, tables: DispatchTables, layer: int, args: RemapArgs
) -> torch.device:
    """Validate every argument of eplb.remap.api.remap_and_record but the output (the ids, the
    tables, the layer and the fixed ``args``); TypeError for dtypes, ValueError otherwise.

    Returns the ids' device. The backend name is checked where it is resolved (eplb.remap.backends).
    """
    mode, map_padded_rows = args.mode, args.map_padded_rows
    counts_P, logical_counts_E = args.counts_P, args.logical_counts_E
    check_ids(topk_ids_TK)
    if mode not in MODES:
        if mode in dispatch_mode_names():
            picks = " or ".join(dispatch_mode(mode).per_pass)
            raise ValueError(f"dispatch mode {mode!r} picks {picks} per pass: call with the pass's mode")
        raise ValueError(f"unknown dispatch mode {mode!r}; choose from {MODES}")
    if map_padded_rows is not False and map_padded_rows is not True:
        raise TypeError(f"map_padded_rows must be a bool, got {type(map_padded_rows).__name__}")
    if map_padded_rows and mode == "lp":
        raise ValueError("map_padded_rows is not supported in lp mode (its split counts the rows it maps)")
    if not 0 <= layer < tables.num_layers:
        raise ValueError(f"layer {layer} outside [0, {tables.num_layers})")
    device = topk_ids_TK.device
    if tables.device != device:
        raise ValueError(f"dispatch tables live on {tables.device} but topk_ids on {device}")
    if counts_P is not None:
        rows = (counts_P.shape[0],) if isinstance(counts_P, torch.Tensor) and counts_P.dim() == 2 else ()
        if rows and not 1 <= rows[0] <= MAX_COUNT_ROWS:
            raise ValueError(f"counts_P has {rows[0]} count rows; at most {MAX_COUNT_ROWS} (and at least 1)")
        check_tensor("counts_P", counts_P, (*rows, tables.num_physical), device)
    if logical_counts_E is not None:
        check_tensor("logical_counts_E", logical_counts_E, (tables.num_logical,), device)
    if args.num_valid_tokens is not None:
        check_tensor("num_valid_tokens", args.num_valid_tokens, None, device)
    if args.record is not None:
        check_tensor("record", args.record, None, device)
    return device


def check_ids(topk_ids_TK: torch.Tensor) -> None:
    """The router's ids: a contiguous int32 tensor [T, K] (TypeError naming a wrong dtype)."""
    if not isinstance(topk_ids_TK, torch.Tensor):
        raise TypeError(f"topk_ids must be a torch.Tensor, got {type(topk_ids_TK).__name__}")
    if topk_ids_TK.dtype != _INT32:
        raise TypeError(
            f"topk_ids must be int32, got {topk_ids_TK.dtype}: convert at the router "
            "(an int64 id would silently turn every map lookup into int64)"
        )
    if topk_ids_TK.dim() != 2:
        raise ValueError(f"topk_ids must be [T, K], got shape {tuple(topk_ids_TK.shape)}")
    if not topk_ids_TK.is_contiguous():
        raise ValueError("topk_ids must be contiguous")


MAX_COUNT_ROWS = 64
"""Count rows a ``counts_P`` of shape [C, P] may have at most."""


def count_rows_sum(counts: torch.Tensor) -> torch.Tensor:
    """The counts of a ``counts_P`` of count rows [C, P] (int64 [P]); a [P] buffer as int64."""
    return counts.to(torch.int64).sum(0) if counts.dim() == 2 else counts.to(torch.int64)


def check_tensor(name: str, t: torch.Tensor, shape: tuple[int, ...] | None, device: torch.device) -> None:
    """An int32 contiguous tensor on ``device`` of ``shape`` (None: one element)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != _INT32:
        raise TypeError(f"{name} must be {_INT32}, got {t.dtype}")
    if shape is None:
        if t.numel() != 1:
            raise ValueError(f"{name} must hold one element, got shape {tuple(t.shape)}")
    elif t.shape != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but topk_ids on {device}")
    if shape is not None and not t.is_contiguous():  # one element is always contiguous
        raise ValueError(f"{name} must be contiguous")


__all__ = [
    "ARG_NAMES",
    "MAX_COUNT_ROWS",
    "MODES",
    "RemapArgs",
    "RemapCall",
    "check_ids",
    "check_remap_args",
    "check_tensor",
    "count_rows_sum",
]
