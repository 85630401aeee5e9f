"""A small MoE model on one EP rank: L routed-expert layers in slot buffers, plus its dense reference.

Shape legend: T tokens (on this rank), K top-k, H hidden size, I intermediate size, L layers, E
logical experts, P physical slots, S slots per GPU (this rank's), R max replicas.

Each layer: ``x = x + moe(rmsnorm(x))`` with a linear router (softmax, top-k, renormalised
weights, int32 ids) plus an optional per-layer logit bias (how the demo imposes a workload's
skew). Weights are random and seeded, identical on every rank; each rank keeps only its slots.
The model is also the engine the EPLB manager drives: ``slot_tensors`` and ``set_placement``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from eplb.hotswap.layout import PlainLayout, SlotLayout
from eplb.moe.exchange import ExactExchange, PaddedExchange
from eplb.moe.layer import ExpertParallelMoE
from eplb.placement.model import Placement
from eplb.recorder.recorder import ExpertDistributionRecorder
from eplb.remap.prepared import PreparedRemap
from eplb.remap.tables import DispatchTables

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class MoEModelConfig:
    """Shape and seed of the model."""

    num_layers: int = 4
    """L, MoE layers."""
    num_experts: int = 16
    """E, routed (logical) experts per layer."""
    top_k: int = 4
    """Experts per token."""
    hidden: int = 64
    """H, model width."""
    intermediate: int = 32
    """I, expert FFN width."""
    dtype: str = "float32"
    """float32 | bfloat16 | float16: weights and activations."""
    seed: int = 0
    """Seed of the random weights (identical on every rank)."""

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_experts, self.top_k, self.hidden, self.intermediate) < 1:
            raise ValueError("every model dimension must be >= 1")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) exceeds the number of experts ({self.num_experts})")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def logical_weights(cfg: MoEModelConfig) -> dict[str, torch.Tensor]:
    """float32 CPU weights: w13 [L, E, 2I, H], w2 [L, E, H, I], router [L, E, H] (seeded)."""
    g = torch.Generator().manual_seed(cfg.seed)
    L, E, H, inter = cfg.num_layers, cfg.num_experts, cfg.hidden, cfg.intermediate
    return {
        "w13": torch.randn(L, E, 2 * inter, H, generator=g) / H**0.5,
        "w2": torch.randn(L, E, H, inter, generator=g) / inter**0.5,
        "router": torch.randn(L, E, H, generator=g) / H**0.5,
    }


def slot_buffers(
    experts: Mapping[str, torch.Tensor],
    placement: Placement,
    rank: int,
    device: torch.device,
    dtype: torch.dtype,
    layout: SlotLayout | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Per layer, this rank's slot tensors [S, ...] in ``layout``, filled from logical [L, E, ...] weights."""
    layout = layout or PlainLayout()
    S = placement.slots_per_gpu
    mine_LS = torch.from_numpy(placement.phy2log_LP[:, rank * S : (rank + 1) * S].astype(np.int64))
    return [
        {
            name: layout.to_engine(name, experts[name][layer].index_select(0, mine_LS[layer]))
            .to(device=device, dtype=dtype)
            .contiguous()
            for name in ("w13", "w2")
        }
        for layer in range(placement.num_layers)
    ]


def route(
    x_TH: torch.Tensor, router_EH: torch.Tensor, top_k: int, bias_E: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int32 [T, K], weights float32 [T, K]): softmax top-k with weights renormalised to sum 1."""
    logits = x_TH.float() @ router_EH.float().T
    if bias_E is not None:
        logits = logits + bias_E.float()
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return ids.to(torch.int32), weights / weights.sum(dim=-1, keepdim=True)


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


class MoEModel:
    """The model's layers on one rank. ``recorder`` (eplb.recorder.recorder), when set, records every layer."""

    def __init__(
        self,
        cfg: MoEModelConfig,
        placement: Placement,
        *,
        rank: int,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        mode: str = "static",
        capacity: int | None = None,
        weights: Mapping[str, torch.Tensor] | None = None,
        remap_backend: str = "auto",
    ) -> None:
        if placement.num_layers != cfg.num_layers or placement.num_logical != cfg.num_experts:
            raise ValueError("placement shape does not match the model (layers, experts)")
        self.cfg = cfg
        self.placement = placement
        self.rank = rank
        self.device = device
        w = weights if weights is not None else logical_weights(cfg)
        self.router_LEH = w["router"].to(device=device, dtype=torch.float32)
        self.slots_L = slot_buffers(w, placement, rank, device, cfg.torch_dtype)
        self.tables = DispatchTables.from_placement(placement, rank, device)
        G, S = placement.num_gpus, placement.slots_per_gpu
        exchange: ExactExchange | PaddedExchange = (
            ExactExchange(G, S, group) if capacity is None else PaddedExchange(G, S, capacity, group)
        )
        self.layers = [
            ExpertParallelMoE(
                layer=layer,
                slots=self.slots_L[layer],
                tables=self.tables,
                exchange=exchange,
                mode=mode,
                remap_backend=remap_backend,
            )
            for layer in range(cfg.num_layers)
        ]
        self.recorder: ExpertDistributionRecorder | None = None
        """Records every layer when set: each layer runs the recorder's prepared call
        (``ExpertDistributionRecorder.prepare``, rebuilt when the recorder, the tables or
        ``num_valid_tokens`` change)."""
        self._prepared: tuple[tuple[object, ...], list[PreparedRemap]] | None = None

    def forward(
        self,
        x_TH: torch.Tensor,
        router_bias_LE: torch.Tensor | None = None,
        num_valid_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        remaps = self._remaps(num_valid_tokens)
        for layer, moe in enumerate(self.layers):
            h = rms_norm(x_TH)
            bias = None if router_bias_LE is None else router_bias_LE[layer]
            ids, weights = route(h, self.router_LEH[layer], self.cfg.top_k, bias)
            remap = None if remaps is None else remaps[layer]
            x_TH = x_TH + moe(h, ids, weights, num_valid_tokens=num_valid_tokens, remap=remap)
        return x_TH

    def _remaps(self, num_valid_tokens: torch.Tensor | None) -> list[PreparedRemap] | None:
        """The recorder's prepared call per layer (None without a recorder), kept while the
        recorder, the layers' tables and ``num_valid_tokens`` are the same objects."""
        if self.recorder is None:
            return None
        # Every layer serves one set of tables (serve_on swaps them all); ExpertParallelMoE
        # asserts per call that its remap was prepared on its own.
        tables = self.layers[0].tables
        key = (self.recorder, tables, num_valid_tokens)
        kept = self._prepared
        if kept is None or any(a is not b for a, b in zip(kept[0], key, strict=True)):
            first = self.layers[0]
            remaps = self.recorder.prepare(
                tables, mode=first.mode, backend=first.remap_backend, num_valid_tokens=num_valid_tokens
            )
            self._prepared = kept = (key, remaps)
        return kept[1]

    __call__ = forward

    # ---- the engine interface the EPLB manager drives ----------------------------------------
    def slot_tensors(self, layer: int) -> Mapping[str, torch.Tensor]:
        return self.slots_L[layer]

    def set_placement(self, placement: Placement, dispatch_weights_LER: np.ndarray | None = None) -> None:
        """Copy the new maps into the dispatch tables in place (after the weights have moved)."""
        self.tables.update_(placement, dispatch_weights_LER)
        self.placement = placement
