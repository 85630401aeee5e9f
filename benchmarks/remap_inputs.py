"""Inputs and baselines shared by the remap benchmarks: router-like ids, EP32 tables, a one-GPU
stand-in for the ``lp`` exchange, a copy kernel, SGLang adapters.

Shape legend: T tokens, K top-k, E logical experts, P physical slots, G EP ranks, L layers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from eplb.placement.model import Placement
from eplb.remap.exchange import LpExchange
from eplb.remap.tables import DispatchTables


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, numel, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def triton_copy(src: torch.Tensor, dst: torch.Tensor) -> None:
    numel = src.numel()
    block = 1024
    _copy_kernel[(triton.cdiv(numel, block),)](src, dst, numel, BLOCK=block, num_warps=4)


def router_ids(T: int, K: int, E: int, device: torch.device, seed: int) -> torch.Tensor:
    """int32 [T, K]: K distinct experts per token, drawn from a Zipf-like skew (hot experts exist)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    probs = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 0.8
    probs = probs[torch.randperm(E, generator=gen)]
    ids = torch.multinomial(probs.float().expand(T, E), K, replacement=False, generator=gen)
    return ids.to(device=device, dtype=torch.int32).contiguous()


class SGLangDispatchInfo:
    """The two attributes SGLang's fused kernel reads from its ExpertLocationDispatchInfo."""

    def __init__(self, dispatch_map_E: torch.Tensor) -> None:
        self.ep_dispatch_algorithm = "static"
        self.partial_logical_to_rank_dispatch_physical_map = dispatch_map_E


def sglang_unfused(
    ids_TK: torch.Tensor, map_E: torch.Tensor, counts_P: torch.Tensor, nvalid_1: torch.Tensor
) -> torch.Tensor:
    """SGLang's unfused path: gather through the static map; scatter_add_ of the valid ones."""
    valid = ids_TK >= 0
    phys = torch.where(valid, map_E[ids_TK.clamp(min=0).long()], ids_TK)
    rows = torch.arange(ids_TK.shape[0], device=ids_TK.device)[:, None]
    counted = valid & (rows < nvalid_1)
    counts_P.scatter_add_(0, phys.masked_fill(~counted, 0).long().flatten(), counted.int().flatten())
    return phys


RANK, GPUS = 3, 32
"""The benchmarks' EP rank and EP size (EP32, as DeepSeek-V3 serving)."""


def make_tables(E: int, P: int, L: int, device: torch.device) -> DispatchTables:
    return DispatchTables.from_placement(
        Placement.trivial(L, E, num_gpus=GPUS, num_redundant=P - E), RANK, device
    )


def stub_exchange(tables: DispatchTables, others_E: torch.Tensor) -> LpExchange:
    """An exchange for one GPU: the other 31 ranks' counts fixed (``others_E`` each), this rank's copied in."""
    held_GE = others_E[None, :].repeat(GPUS, 1).contiguous()

    def gather(local_E: torch.Tensor, out_GE: torch.Tensor) -> None:
        out_GE.copy_(held_GE)  # rows other than RANK: fixed (set once per call, one device copy)
        out_GE[RANK].copy_(local_E)

    return LpExchange(tables, gather=gather)


__all__ = [
    "GPUS",
    "RANK",
    "SGLangDispatchInfo",
    "make_tables",
    "router_ids",
    "sglang_unfused",
    "stub_exchange",
    "triton_copy",
]
