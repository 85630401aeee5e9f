"""The expert FFN over every local slot at once: one grouped GEMM per projection, no loop over slots.

Shape legend: M rows received (the token copies this rank's experts compute), H hidden size, I
intermediate size, S slots per GPU (this rank's).

Weights follow SGLang's MegaMoE contract: ``w13 [S, 2I, H]`` (gate rows, then up rows) and
``w2 [S, H, I]``; the FFN of a row routed to slot s is ``w2[s] @ (silu(w13[s, :I] @ x) * w13[s, I:] @ x)``.

Rows are sorted by slot and fed to ``torch._grouped_mm`` with the cumulative row counts as
offsets. Where that op is missing or refuses the dtype/shape (probed once per configuration), the
same rows are scattered into a padded [S, rows, H] block and multiplied with ``torch.bmm``. Neither
path reads a device value back to the host except the padded fallback (its row count), so the grouped
path can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.lru_cache(maxsize=64)
def grouped_mm_works(device_type: str, dtype: torch.dtype, hidden: int, intermediate: int) -> bool:
    """Whether ``torch._grouped_mm`` runs for these dims and dtype on this device type."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    device = torch.device(device_type)
    try:
        x = torch.zeros(4, hidden, dtype=dtype, device=device)
        w13 = torch.zeros(2, 2 * intermediate, hidden, dtype=dtype, device=device)
        w2 = torch.zeros(2, hidden, intermediate, dtype=dtype, device=device)
        offs = torch.tensor([1, 3], dtype=torch.int32, device=device)
        h = torch._grouped_mm(x, w13.transpose(1, 2), offs=offs)
        torch._grouped_mm(h[:, :intermediate].contiguous(), w2.transpose(1, 2), offs=offs)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def sort_by_slot(slot_M: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Order rows by slot; padding rows (slot -1) go last.

    Returns (order int64 [M], key int64 [M] sorted slot with S for padding, ends int32 [S]: the
    exclusive end row of each slot's segment in sorted order).
    """
    key = torch.where(
        slot_M >= 0, slot_M.to(torch.int64), torch.full_like(slot_M, num_slots, dtype=torch.int64)
    )
    sorted_key, order = torch.sort(key, stable=True)
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=slot_M.device)
    counts.index_add_(0, key, torch.ones_like(key))
    ends = torch.cumsum(counts[:num_slots], 0).to(torch.int32)
    return order, sorted_key, ends


def expert_ffn(
    x_MH: torch.Tensor,
    slot_M: torch.Tensor,
    w13_S2IH: torch.Tensor,
    w2_SHI: torch.Tensor,
    *,
    use_grouped_mm: bool | None = None,
) -> torch.Tensor:
    """[M, H] FFN outputs of rows ``x_MH`` routed to local slots ``slot_M`` (int32, -1 = padding -> 0)."""
    M, H = x_MH.shape
    S, two_i, _ = w13_S2IH.shape
    intermediate = two_i // 2
    if M == 0:
        return torch.zeros_like(x_MH)
    if use_grouped_mm is None:
        use_grouped_mm = grouped_mm_works(x_MH.device.type, x_MH.dtype, H, intermediate)
    order, sorted_key, ends = sort_by_slot(slot_M, S)
    x_sorted = x_MH.index_select(0, order)
    if use_grouped_mm:
        h = torch._grouped_mm(x_sorted, w13_S2IH.transpose(1, 2), offs=ends)
        a = F.silu(h[:, :intermediate]) * h[:, intermediate:]
        y_sorted = torch._grouped_mm(a, w2_SHI.transpose(1, 2), offs=ends)
    else:
        y_sorted = _padded_bmm_ffn(x_sorted, sorted_key, ends, w13_S2IH, w2_SHI)
    # Rows past the last segment are padding; _grouped_mm leaves them undefined.
    valid_sorted = (sorted_key < S).unsqueeze(1)
    y_sorted = torch.where(
        valid_sorted, y_sorted, torch.zeros((), dtype=y_sorted.dtype, device=y_sorted.device)
    )
    y = torch.empty_like(y_sorted)
    y.index_copy_(0, order, y_sorted)
    return y


def _padded_bmm_ffn(
    x_sorted_MH: torch.Tensor,
    sorted_key_M: torch.Tensor,
    ends_S: torch.Tensor,
    w13_S2IH: torch.Tensor,
    w2_SHI: torch.Tensor,
) -> torch.Tensor:
    """The grouped FFN as one padded batch: rows scattered into [S, rows, H], rows = the fullest slot's."""
    S = w13_S2IH.shape[0]
    intermediate = w13_S2IH.shape[1] // 2
    M, H = x_sorted_MH.shape
    ends = ends_S.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    capacity = int((ends - starts).max().item()) if S else 0
    valid = sorted_key_M < S
    slot = torch.where(valid, sorted_key_M, torch.zeros_like(sorted_key_M))
    pos = torch.arange(M, device=x_sorted_MH.device) - starts[slot]
    block = x_sorted_MH.new_zeros(S, max(capacity, 1), H)
    block[slot[valid], pos[valid]] = x_sorted_MH[valid]
    h = torch.bmm(block, w13_S2IH.transpose(1, 2))
    a = F.silu(h[..., :intermediate]) * h[..., intermediate:]
    y_block = torch.bmm(a, w2_SHI.transpose(1, 2))
    y = x_sorted_MH.new_zeros(M, H)
    y[valid] = y_block[slot[valid], pos[valid]]
    return y
