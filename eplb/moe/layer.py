"""One expert-parallel MoE layer whose routed experts live in fixed physical-slot buffers.

Shape legend: T tokens (on this rank), K top-k, H hidden size, I intermediate size, E logical
experts, P physical slots, G GPUs (ranks), S slots per GPU (P / G, this rank's), M rows received.

Forward: router ids (int32 [T, K]) -> remap (logical -> physical, counts recorded on the device:
the recorder's prepared call for this layer, eplb.recorder, or eplb.remap.api.remap_and_record)
-> exchange (all-to-all to the ranks owning the slots) -> expert FFN over all local slots as one
grouped GEMM (eplb.moe.experts) -> exchange back -> combine with the top-k weights. The slot buffers and dispatch tables are written in place by a hot-swap, so a captured
CUDA graph keeps working after a swap.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from eplb.moe.exchange import ExactExchange, PaddedExchange
from eplb.moe.experts import expert_ffn, grouped_mm_works
from eplb.remap.api import remap_and_record
from eplb.remap.prepared import PreparedRemap
from eplb.remap.tables import DispatchTables

Exchange = ExactExchange | PaddedExchange


class ExpertParallelMoE:
    """Routed experts of one layer on one rank: ``slots = {"w13": [S, 2I, H], "w2": [S, H, I]}``."""

    def __init__(
        self,
        *,
        layer: int,
        slots: Mapping[str, torch.Tensor],
        tables: DispatchTables,
        exchange: Exchange,
        mode: str = "static",
        remap_backend: str = "auto",
    ) -> None:
        w13, w2 = slots["w13"], slots["w2"]
        if w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != w2.shape[0]:
            raise ValueError(
                f"need w13 [S, 2I, H] and w2 [S, H, I], got {tuple(w13.shape)} and {tuple(w2.shape)}"
            )
        S, two_i, H = w13.shape
        if two_i % 2 or tuple(w2.shape[1:]) != (H, two_i // 2):
            raise ValueError(f"w2 must be [S, H={H}, I={two_i // 2}], got {tuple(w2.shape)}")
        if exchange.slots_per_rank != S:
            raise ValueError(f"exchange expects {exchange.slots_per_rank} slots per rank, buffers hold {S}")
        self.layer = layer
        self.slots = slots
        self.tables = tables
        self.exchange = exchange
        self.mode = mode
        self.remap_backend = remap_backend
        self.use_grouped_mm = grouped_mm_works(w13.device.type, w13.dtype, H, two_i // 2)

    @property
    def num_logical(self) -> int:
        return self.tables.num_logical

    def serve_on(self, exchange: Exchange, tables: DispatchTables) -> None:
        """Serve from the next call on through ``exchange`` and ``tables``: after a rank was lost,
        the survivors' group and this rank's tables of their placement (eplb.manager.recovery).
        The slot buffers stay (their rows are this rank's slots in the survivors' placement)."""
        S = self.slots["w13"].shape[0]
        if exchange.slots_per_rank != S or tables.slots_per_gpu != S:
            raise ValueError(
                f"the new exchange and tables must keep {S} slots per rank, got "
                f"{exchange.slots_per_rank} and {tables.slots_per_gpu}"
            )
        self.exchange, self.tables = exchange, tables

    def forward(
        self,
        hidden_TH: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        topk_weights_TK: torch.Tensor,
        *,
        counts_P: torch.Tensor | None = None,
        logical_counts_E: torch.Tensor | None = None,
        num_valid_tokens: torch.Tensor | None = None,
        record: torch.Tensor | None = None,
        remap: PreparedRemap | None = None,
    ) -> torch.Tensor:
        """[T, H] routed-expert output. Ids of -1, out of range, or in rows at/after
        ``num_valid_tokens`` (int32 [1] on the device) contribute nothing and are not counted.

        ``remap``: a call prepared for this layer's tables, mode and ``num_valid_tokens`` (a
        recorder's, ``ExpertDistributionRecorder.prepare``), used instead of the public function
        and ``counts_P`` / ``logical_counts_E`` / ``record``."""
        if remap is not None:
            assert remap.tables is self.tables and remap.layer == self.layer, (
                "remap prepared for another layer"
            )
            phys_TK = remap(topk_ids_TK)
        else:
            phys_TK = remap_and_record(
                topk_ids_TK,
                self.tables,
                self.layer,
                mode=self.mode,
                counts_P=counts_P,
                logical_counts_E=logical_counts_E,
                num_valid_tokens=num_valid_tokens,
                record=record,
                backend=self.remap_backend,
            )
        valid_TK = (topk_ids_TK >= 0) & (topk_ids_TK < self.num_logical)
        if num_valid_tokens is not None:
            rows = torch.arange(topk_ids_TK.shape[0], device=topk_ids_TK.device).unsqueeze(1)
            valid_TK &= rows < num_valid_tokens.to(torch.int64).reshape(())
        routed = self.exchange.dispatch(hidden_TH, phys_TK, valid_TK)
        y_MH = expert_ffn(
            routed.x_MH,
            routed.slot_M,
            self.slots["w13"],
            self.slots["w2"],
            use_grouped_mm=self.use_grouped_mm,
        )
        return self.exchange.combine(y_MH, routed, topk_weights_TK)

    __call__ = forward
