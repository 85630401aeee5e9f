"""The ``torch`` remap backend: a plain reference with the Triton kernel's exact semantics, any device.

Shape legend: T tokens, K top-k, L layers, E logical experts, P physical slots, R max replicas (the
replica capacity).

Arguments arrive validated by :func:`eplb.remap.api.remap_and_record`, as one
:class:`eplb.remap.call.RemapCall`. Counting uses ``scatter_add_`` with a 0/1 weight (valid
element times the record flag), so nothing here reads a device value back to the host: no
synchronisation, and the whole function can be captured in a CUDA graph.
Hash arithmetic runs in int64 holding uint32 values (torch has no wrapping uint32 multiply).
"""

from __future__ import annotations

import torch

from eplb.remap.call import RemapCall
from eplb.remap.tables import MASK32, MIX_MUL1, MIX_MUL2, DispatchTables, salt_base


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32), split so no product leaves int64."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 tensors holding uint32 values (same bits as the kernel's uint32 math)."""
    x = x ^ (x >> 16)
    x = _mul32(x, MIX_MUL1)
    x = x ^ (x >> 15)
    x = _mul32(x, MIX_MUL2)
    return x ^ (x >> 16)


def element_hash(
    num_elements: int, tables: DispatchTables, layer: int, rank: int, seeded: bool
) -> torch.Tensor:
    """int64 [T*K] uint32 hashes of flat element indices (see eplb.remap.tables)."""
    device = tables.device
    base = torch.tensor(salt_base(layer, rank), dtype=torch.int64, device=device)
    seed = (
        (tables.seed_1.to(torch.int64) & MASK32)
        if seeded
        else torch.zeros(1, dtype=torch.int64, device=device)
    )
    salt = mix32(base ^ seed)
    flat = torch.arange(num_elements, dtype=torch.int64, device=device)
    return mix32(flat ^ salt)


def remap_record_torch(call: RemapCall) -> None:
    """Write int32 physical ids into ``call.out_TK`` and add this pass's counts (see eplb.remap.api)."""
    tables, layer, mode = call.tables, call.layer, call.mode
    T, K = call.topk_ids_TK.shape
    P = tables.num_physical
    device = call.topk_ids_TK.device
    ids, row_TK, valid, safe = valid_elements(call)
    if mode == "static":
        phys = tables.static_LE[layer].to(torch.int64)[safe]
    elif mode == "fake":
        phys = element_hash(T * K, tables, layer, tables.rank, seeded=True).reshape(T, K) % P
    else:
        cnt = tables.logcnt_LE[layer].to(torch.int64)[safe]
        if mode == "dynamic":
            replica = element_hash(T * K, tables, layer, tables.rank, seeded=True).reshape(T, K) % cnt
        elif mode == "dynamic_row":
            replica = row_TK % cnt
        else:  # weighted
            h = element_hash(T * K, tables, layer, -1, seeded=False).reshape(T, K)
            u = (h >> 8).to(torch.float32) * (1.0 / (1 << 24))
            cum = tables.cumweights_LER[layer][safe]  # [T, K, R]
            r = torch.arange(tables.max_replicas, device=device)
            below = (cum <= u[..., None]) & (r < (cnt - 1)[..., None])
            replica = below.sum(dim=-1)
        phys = tables.log2phy_LER[layer].to(torch.int64)[safe, replica]
    mapped = (ids >= 0) & (ids < tables.num_logical) if call.map_padded_rows else valid
    call.out_TK.copy_(torch.where(mapped, phys, ids).to(torch.int32))
    count_elements(call, valid & (phys >= 0) & (phys < P), phys, safe)


def valid_elements(call: RemapCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """int64 [T, K] ids, rows, valid (counted) mask, and ids with those not looked up set to 0 (the
    invalid ones; with ``map_padded_rows`` the padded rows' in-range ids are looked up too)."""
    T, K = call.topk_ids_TK.shape
    ids = call.topk_ids_TK.to(torch.int64)
    row_TK = torch.arange(T, dtype=torch.int64, device=ids.device)[:, None].expand(T, K)
    valid = (ids >= 0) & (ids < call.tables.num_logical)
    in_range = valid
    if call.num_valid_tokens is not None:
        valid = valid & (row_TK < call.num_valid_tokens.to(torch.int64).reshape(()))
    # With map_padded_rows the padded rows are mapped too (not counted): look them up as well.
    looked_up = in_range if call.map_padded_rows else valid
    return ids, row_TK, valid, torch.where(looked_up, ids, torch.zeros_like(ids))


def count_elements(call: RemapCall, counted: torch.Tensor, phys: torch.Tensor, safe: torch.Tensor) -> None:
    """Add 1 per ``counted`` element to ``call.counts_P[phys]`` and ``call.logical_counts_E[safe]``
    (times the record flag), where those buffers are given."""
    counts_P, logical_counts_E = call.counts_row_P(), call.logical_counts_E
    if counts_P is None and logical_counts_E is None:
        return
    weight = counted.to(torch.int32)
    if call.record is not None:
        weight = weight * (call.record.reshape(()) != 0).to(torch.int32)
    if counts_P is not None:
        counts_P.scatter_add_(0, torch.where(counted, phys, 0).reshape(-1), weight.reshape(-1))
    if logical_counts_E is not None:
        logical_counts_E.scatter_add_(0, safe.reshape(-1), weight.reshape(-1))


__all__ = ["count_elements", "element_hash", "mix32", "remap_record_torch", "valid_elements"]
