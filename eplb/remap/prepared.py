"""One MoE layer's remap with its fixed arguments checked once: the per-call path of a forward pass.

Shape legend: T tokens, K top-k, E logical experts, P physical slots.

Every argument of :func:`eplb.remap.api.remap_and_record` but the ids and the output stays the same
on every pass of one layer (the tables, the layer, the mode, the recorder's counts row and flag,
``num_valid_tokens``), and checking them all, and re-deriving their pointers, on every call costs
more than the launch. :func:`prepare_remap` checks them once; the :class:`PreparedRemap` it
returns checks only the ids (and the output, when given) per call and, on the Triton backend,
launches through a direct path whose fixed pointers and salt were resolved at preparation
(eplb.kernels.remap_record_direct.PreparedDirect). The public function builds and keeps these
too, for the argument objects it sees twice (:meth:`PreparedRemap.takes`). Semantics are the
public function's, bit for bit; the fixed tensors must keep their storage for the prepared call's
life (the recorder's and the tables' do).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import torch

from eplb.remap.backends import get_backend
from eplb.remap.call import RemapCall, check_ids, check_remap_args, check_tensor
from eplb.remap.tables import DispatchTables

if TYPE_CHECKING:
    from eplb.remap.exchange import LpExchange

# Backends with a prepared direct path: name -> "module:function(call) -> launcher | None".
_PREPARERS = {"triton": "eplb.kernels.remap_record:prepare_direct"}
_INT32 = torch.int32


class PreparedRemap:
    """Call with the router's int32 ids [T, K] (and ``out_TK``); returns the physical ids [T, K]."""

    __slots__ = (
        "_device",
        "_direct",
        "_fn",
        "_template",
        "backend",
        "counts_P",
        "layer",
        "logical_counts_E",
        "lp",
        "map_padded_rows",
        "mode",
        "num_valid_tokens",
        "record",
        "tables",
    )

    def __init__(
        self,
        tables: DispatchTables,
        layer: int,
        *,
        mode: str = "static",
        counts_P: torch.Tensor | None = None,
        logical_counts_E: torch.Tensor | None = None,
        num_valid_tokens: torch.Tensor | None = None,
        record: torch.Tensor | None = None,
        backend: str = "auto",
        lp: LpExchange | None = None,
        map_padded_rows: bool = False,
    ) -> None:
        probe = torch.empty((0, 1), dtype=_INT32, device=tables.device)
        check_remap_args(
            probe, tables, layer, mode, counts_P, logical_counts_E, num_valid_tokens, record, map_padded_rows
        )
        exchange = None
        if mode == "lp":
            from eplb.remap.exchange import exchange_for

            exchange = exchange_for(tables, lp)
        self.tables, self.layer, self.mode, self.backend = tables, layer, mode, backend
        # The fixed arguments as given (lp: the argument, not the exchange it resolves to), read
        # only to compare a later call's arguments by identity (eplb.remap.api's per-layer cache).
        self.counts_P, self.logical_counts_E = counts_P, logical_counts_E
        self.num_valid_tokens, self.record, self.lp = num_valid_tokens, record, lp
        self.map_padded_rows = map_padded_rows
        self._device = tables.device
        self._fn = get_backend(backend, self._device, mode)
        # The call's fixed fields; the ids and the output fill in per call.
        self._template = RemapCall(
            topk_ids_TK=probe,
            tables=tables,
            layer=layer,
            mode=mode,
            out_TK=probe,
            counts_P=counts_P,
            logical_counts_E=logical_counts_E,
            num_valid_tokens=num_valid_tokens,
            record=record,
            lp=exchange,
            map_padded_rows=map_padded_rows,
        )
        self._direct: Any = None
        name = "triton" if backend == "auto" and self._fn.__name__ == "remap_record_triton" else backend
        if mode != "lp" and name in _PREPARERS:
            module, func = _PREPARERS[name].split(":")
            self._direct = getattr(importlib.import_module(module), func)(self._template)

    def takes(
        self,
        mode: str,
        counts_P: torch.Tensor | None,
        logical_counts_E: torch.Tensor | None,
        num_valid_tokens: torch.Tensor | None,
        record: torch.Tensor | None,
        backend: str,
        lp: LpExchange | None,
        map_padded_rows: bool = False,
    ) -> bool:
        """Whether a public call with these fixed arguments is this one (the same objects, mode and
        backend), so that it may skip their checks (eplb.remap.api inlines this on its fast path)."""
        return (
            self.counts_P is counts_P
            and self.record is record
            and self.num_valid_tokens is num_valid_tokens
            and self.logical_counts_E is logical_counts_E
            and self.lp is lp
            and self.map_padded_rows is map_padded_rows
            and self.mode == mode
            and self.backend == backend
        )

    def __call__(self, topk_ids_TK: torch.Tensor, out_TK: torch.Tensor | None = None) -> torch.Tensor:
        check_ids(topk_ids_TK)  # the public function's checks on the ids and output, nothing else
        if topk_ids_TK.device != self._device:
            raise ValueError(f"dispatch tables live on {self._device} but topk_ids on {topk_ids_TK.device}")
        if out_TK is None:
            out_TK = torch.empty_like(topk_ids_TK)
        else:
            check_tensor("out_TK", out_TK, topk_ids_TK.shape, self._device)
        if topk_ids_TK.numel() == 0:
            if self._template.lp is not None:
                self._template.lp.idle()
            return out_TK
        direct = self._direct
        if direct is not None and direct.launch(topk_ids_TK, out_TK):
            return out_TK
        t = self._template
        self._fn(
            RemapCall(
                topk_ids_TK=topk_ids_TK,
                tables=t.tables,
                layer=t.layer,
                mode=t.mode,
                out_TK=out_TK,
                counts_P=t.counts_P,
                logical_counts_E=t.logical_counts_E,
                num_valid_tokens=t.num_valid_tokens,
                record=t.record,
                lp=t.lp,
                map_padded_rows=t.map_padded_rows,
            )
        )
        return out_TK


prepare_remap = PreparedRemap
"""``remap_and_record``'s fixed arguments for one layer, checked now (same errors, same meaning)."""


__all__ = ["PreparedRemap", "prepare_remap"]
