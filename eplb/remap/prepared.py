"""One MoE layer's remap with its fixed arguments checked once: the per-call path of a forward pass.

Shape legend: T tokens, K top-k, E logical experts, P physical slots.

Every argument of :func:`eplb.remap.api.remap_and_record` but the ids and the output stays the same
on every pass of one layer (the tables, the layer, the mode, the recorder's counts row and flag,
``num_valid_tokens``), and checking them all, and re-deriving their pointers, on every call costs
more than the launch. :func:`prepare_remap` checks them once; the :class:`PreparedRemap` it
returns checks only the ids (and the output, when given) per call and, on the Triton backend,
launches through a direct path whose fixed pointers and salt were resolved at preparation
(eplb.kernels.remap_record_direct.PreparedDirect). The public function builds and keeps these
too, for the argument objects it sees twice (compared by :meth:`RemapArgs.key`). Semantics are the
public function's, bit for bit; the fixed tensors must keep their storage for the prepared call's
life (the recorder's and the tables' do). A prepared remap is its fixed arguments
(eplb.remap.call.RemapArgs) with what was resolved from them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from eplb.remap.backends import get_backend
from eplb.remap.call import ARG_NAMES, RemapArgs, RemapCall, check_ids, check_remap_args, check_tensor
from eplb.remap.tables import DispatchTables

if TYPE_CHECKING:
    from eplb.remap.exchange import LpExchange

# Backends with a prepared direct path: name -> "module:function(call) -> launcher | None".
_PREPARERS = {"triton": "eplb.kernels.remap_record:prepare_direct"}
_INT32 = torch.int32


@dataclass(slots=True, eq=False)
class PreparedRemap(RemapArgs):
    """Call with the router's int32 ids [T, K] (and ``out_TK``); returns the physical ids [T, K].

    Built as ``PreparedRemap(tables, layer, mode=..., counts_P=..., ...)``, the keywords being
    :class:`~eplb.remap.call.RemapArgs`' fields: its fixed arguments as given (``lp``: the
    argument, not the exchange it resolves to), which eplb.remap.api's per-layer cache compares a
    later call's arguments with. Checked when built (the public function's errors)."""

    tables: DispatchTables
    """The rank's dispatch tables."""
    layer: int
    """The MoE layer."""
    earlier: PreparedRemap | None = field(default=None, init=False)
    """The layer's next earlier preparation in eplb.remap.api's per-layer cache (None: the last,
    or not kept there)."""
    _device: torch.device = field(init=False)
    _fn: Any = field(init=False)
    _exchange: LpExchange | None = field(init=False)
    _template: RemapCall = field(init=False)
    _direct: Any = field(init=False)

    @classmethod
    def of(cls, tables: DispatchTables, layer: int, args: RemapArgs) -> PreparedRemap:
        """The prepared call of ``args`` (checked now, as the constructor checks its keywords)."""
        return cls(tables, layer, **{name: getattr(args, name) for name in ARG_NAMES})

    def __post_init__(self) -> None:
        tables, layer = self.tables, self.layer
        probe = torch.empty((0, 1), dtype=_INT32, device=tables.device)
        check_remap_args(probe, tables, layer, self)
        exchange = None
        if self.mode == "lp":
            from eplb.remap.exchange import exchange_for

            exchange = exchange_for(tables, self.lp)
        self._exchange = exchange
        self._device = tables.device
        self._fn = get_backend(self.backend, self._device, self.mode)
        # The call's fixed fields; the ids and the output fill in per call.
        self._template = self.remap_call(probe, tables, layer, probe, exchange)
        self._direct = None
        backend = self.backend
        name = "triton" if backend == "auto" and self._fn.__name__ == "remap_record_triton" else backend
        if self.mode != "lp" and name in _PREPARERS:
            module, func = _PREPARERS[name].split(":")
            self._direct = getattr(importlib.import_module(module), func)(self._template)

    def __call__(self, topk_ids_TK: torch.Tensor, out_TK: torch.Tensor | None = None) -> torch.Tensor:
        check_ids(topk_ids_TK)  # the public function's checks on the ids and output, nothing else
        if topk_ids_TK.device != self._device:
            raise ValueError(f"dispatch tables live on {self._device} but topk_ids on {topk_ids_TK.device}")
        if out_TK is None:
            out_TK = torch.empty_like(topk_ids_TK)
        else:
            check_tensor("out_TK", out_TK, topk_ids_TK.shape, self._device)
        if topk_ids_TK.numel() == 0:
            if self._exchange is not None:
                self._exchange.idle()
            return out_TK
        direct = self._direct
        if direct is not None and direct.launch(topk_ids_TK, out_TK):
            return out_TK
        self._fn(self.remap_call(topk_ids_TK, self.tables, self.layer, out_TK, self._exchange))
        return out_TK


prepare_remap = PreparedRemap
"""``remap_and_record``'s fixed arguments for one layer, checked now (same errors, same meaning)."""


__all__ = ["PreparedRemap", "prepare_remap"]
