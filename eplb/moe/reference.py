"""Dense single-process reference of the MoE path: logical experts, no slots, no exchange.

Shape legend: T tokens, K top-k, H hidden size, I intermediate size, L layers, E logical experts.

A plain loop over logical experts (this is a test oracle, not a serving path). It shares nothing
with the expert-parallel code except the router and norm, so a bug in remap, exchange, grouped
GEMM or hot-swap shows up as a difference.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from eplb.moe.model import MoEModelConfig, rms_norm, route


def dense_moe(
    x_TH: torch.Tensor,
    topk_ids_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor,
    w13_E2IH: torch.Tensor,
    w2_EHI: torch.Tensor,
) -> torch.Tensor:
    """[T, H]: sum over k of weight * FFN of logical expert ids[t, k] (-1 or out-of-range ids: 0)."""
    T, K = topk_ids_TK.shape
    E = w13_E2IH.shape[0]
    intermediate = w13_E2IH.shape[1] // 2
    out_TKH = torch.zeros(T, K, x_TH.shape[1], dtype=torch.float32, device=x_TH.device)
    ids = topk_ids_TK.to(torch.int64)
    for e in range(E):
        t, k = torch.nonzero(ids == e, as_tuple=True)
        if t.numel():
            h = x_TH[t] @ w13_E2IH[e].T
            out_TKH[t, k] = ((F.silu(h[:, :intermediate]) * h[:, intermediate:]) @ w2_EHI[e].T).float()
    return (out_TKH * topk_weights_TK.float().unsqueeze(2)).sum(1).to(x_TH.dtype)


def reference_forward(
    cfg: MoEModelConfig,
    weights: Mapping[str, torch.Tensor],
    x_TH: torch.Tensor,
    router_bias_LE: torch.Tensor | None = None,
) -> torch.Tensor:
    """What :class:`eplb.moe.model.MoEModel` computes for the tokens ``x_TH`` of one rank."""
    dtype = cfg.torch_dtype
    for layer in range(cfg.num_layers):
        h = rms_norm(x_TH)
        bias = None if router_bias_LE is None else router_bias_LE[layer]
        ids, w = route(h, weights["router"][layer].to(x_TH.device), cfg.top_k, bias)
        w13 = weights["w13"][layer].to(device=x_TH.device, dtype=dtype)
        w2 = weights["w2"][layer].to(device=x_TH.device, dtype=dtype)
        x_TH = x_TH + dense_moe(h, ids, w, w13, w2)
    return x_TH
