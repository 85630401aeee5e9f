"""Token exchange between EP ranks: send each (token, k) copy to the rank owning its physical slot.

Shape legend: T tokens (on this rank), K top-k, H hidden size, G GPUs (ranks), S slots per GPU (this
rank's), M rows received (G times the capacity when padded).

Two forms with one interface (``dispatch`` -> rows for the local experts, ``combine`` -> [T, H]):

- :class:`ExactExchange`: copies sorted by destination and sent with exact split sizes
  (``all_to_all_single`` with splits; the sizes cross to the host once per call). Traffic and
  expert work follow the routed load, as in a real engine's prefill.
- :class:`PaddedExchange`: every rank sends a fixed [G, capacity] block to every peer (unused rows carry
  slot -1), so shapes never change and no value is read on the host: the decode step can be
  captured in a CUDA graph. Copies past the capacity are dropped (counted in ``dropped_1``); a
  capacity of T*K (the default) never drops.

With one rank both degrade to local work (no collective).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Routed:
    """Rows this rank's experts must compute, and what ``combine`` needs to bring them home."""

    x_MH: torch.Tensor
    """Received hidden rows [M, H]."""
    slot_M: torch.Tensor
    """int32 [M]: local slot of each row, -1 for padding."""
    state: tuple[torch.Tensor, ...]
    """Exchange-specific bookkeeping."""


def copy_destinations(
    phys_TK: torch.Tensor, valid_TK: torch.Tensor, slots_per_rank: int, world_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dest rank int64 [T*K] with ``world_size`` for invalid copies, local slot int32 [T*K] or -1)."""
    phys = phys_TK.reshape(-1).to(torch.int64)
    valid = valid_TK.reshape(-1)
    safe = torch.where(valid, phys, torch.zeros_like(phys))
    dest = torch.where(valid, safe // slots_per_rank, torch.full_like(phys, world_size))
    local = torch.where(valid, safe % slots_per_rank, torch.full_like(phys, -1)).to(torch.int32)
    return dest, local


class ExactExchange:
    """Variable-size all-to-all: only real copies travel (one host sync per dispatch for the sizes)."""

    def __init__(self, world_size: int, slots_per_rank: int, group: dist.ProcessGroup | None = None) -> None:
        self.world_size = world_size
        self.slots_per_rank = slots_per_rank
        self.group = group

    def on_group(self, group: dist.ProcessGroup, world_size: int) -> ExactExchange:
        """This exchange over another group (the survivors' after a rank was lost)."""
        return ExactExchange(world_size, self.slots_per_rank, group)

    def dispatch(self, hidden_TH: torch.Tensor, phys_TK: torch.Tensor, valid_TK: torch.Tensor) -> Routed:
        K = phys_TK.shape[1]
        G = self.world_size
        dest, local = copy_destinations(phys_TK, valid_TK, self.slots_per_rank, G)
        _, order = torch.sort(dest, stable=True)
        send_counts = torch.zeros(G + 1, dtype=torch.int64, device=dest.device)
        send_counts.index_add_(0, dest, torch.ones_like(dest))
        send_counts = send_counts[:G].contiguous()
        n_send = int(send_counts.sum().item())
        order = order[:n_send]
        send_x = hidden_TH.index_select(0, order // K)
        send_slot = local.index_select(0, order)
        if G == 1:
            return Routed(send_x, send_slot, (order, send_counts, send_counts))
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        in_splits = send_counts.tolist()
        out_splits = recv_counts.tolist()
        recv_x = hidden_TH.new_empty(sum(out_splits), hidden_TH.shape[1])
        recv_slot = send_slot.new_empty(sum(out_splits))
        dist.all_to_all_single(recv_x, send_x, out_splits, in_splits, group=self.group)
        dist.all_to_all_single(recv_slot, send_slot, out_splits, in_splits, group=self.group)
        return Routed(recv_x, recv_slot, (order, send_counts, recv_counts))

    def combine(self, y_MH: torch.Tensor, routed: Routed, weights_TK: torch.Tensor) -> torch.Tensor:
        order, send_counts, recv_counts = routed.state
        T, K = weights_TK.shape
        if self.world_size == 1:
            back = y_MH
        else:
            back = y_MH.new_empty(order.numel(), y_MH.shape[1])
            dist.all_to_all_single(back, y_MH, send_counts.tolist(), recv_counts.tolist(), group=self.group)
        per_copy = y_MH.new_zeros(T * K, y_MH.shape[1], dtype=torch.float32)
        per_copy.index_copy_(0, order, back.float())
        return weighted_sum(per_copy, weights_TK).to(y_MH.dtype)


class PaddedExchange:
    """Fixed-shape all-to-all of [G, capacity] blocks: no host sync, CUDA-graph capturable."""

    def __init__(
        self,
        world_size: int,
        slots_per_rank: int,
        capacity: int,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.world_size = world_size
        self.slots_per_rank = slots_per_rank
        self.capacity = capacity
        self.group = group
        self.dropped_1: torch.Tensor | None = None

    def on_group(self, group: dist.ProcessGroup, world_size: int) -> PaddedExchange:
        """This exchange over another group (the survivors' after a rank was lost), same capacity."""
        return PaddedExchange(world_size, self.slots_per_rank, self.capacity, group)

    def dispatch(self, hidden_TH: torch.Tensor, phys_TK: torch.Tensor, valid_TK: torch.Tensor) -> Routed:
        T, K = phys_TK.shape
        G, cap = self.world_size, self.capacity
        device = hidden_TH.device
        dest, local = copy_destinations(phys_TK, valid_TK, self.slots_per_rank, G)
        # Position of each copy among the copies to the same destination (one-hot running count).
        one_hot = one_hot_rows(dest, G + 1)
        pos = torch.gather(torch.cumsum(one_hot, 0), 1, dest.unsqueeze(1)).squeeze(1) - 1
        keep = (dest < G) & (pos < cap)
        trash = G * cap  # row that swallows dropped and invalid copies
        row = torch.where(keep, dest * cap + pos, torch.full_like(dest, trash))
        if self.dropped_1 is None or self.dropped_1.device != device:
            self.dropped_1 = torch.zeros(1, dtype=torch.int64, device=device)
        self.dropped_1.add_(((dest < G) & ~keep).sum())
        send_x = hidden_TH.new_empty(G * cap + 1, hidden_TH.shape[1])
        send_slot = torch.full((G * cap + 1,), -1, dtype=torch.int32, device=device)
        token = torch.arange(T * K, device=device) // K
        send_x.index_copy_(0, row, hidden_TH.index_select(0, token))
        send_slot.index_copy_(0, row, torch.where(keep, local, torch.full_like(local, -1)))
        send_x, send_slot = send_x[:trash], send_slot[:trash]
        if G == 1:
            return Routed(send_x, send_slot, (row, keep))
        recv_x = torch.empty_like(send_x)
        recv_slot = torch.empty_like(send_slot)
        dist.all_to_all_single(recv_x, send_x, group=self.group)
        dist.all_to_all_single(recv_slot, send_slot, group=self.group)
        return Routed(recv_x, recv_slot, (row, keep))

    def combine(self, y_MH: torch.Tensor, routed: Routed, weights_TK: torch.Tensor) -> torch.Tensor:
        row, keep = routed.state
        if self.world_size == 1:
            back = y_MH
        else:
            back = torch.empty_like(y_MH)
            dist.all_to_all_single(back, y_MH, group=self.group)
        safe_row = torch.where(keep, row, torch.zeros_like(row))
        per_copy = back.index_select(0, safe_row).float() * keep.unsqueeze(1)
        return weighted_sum(per_copy, weights_TK).to(y_MH.dtype)


def one_hot_rows(index: torch.Tensor, num_classes: int) -> torch.Tensor:
    """int64 [x, num_classes] one-hot rows (torch's one_hot syncs on CUDA to check the range)."""
    out = torch.zeros(index.numel(), num_classes, dtype=torch.int64, device=index.device)
    out.scatter_(1, index.unsqueeze(1), 1)
    return out


def weighted_sum(per_copy_xH: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """float32 [T, H]: sum over k of weight[t, k] * copy output[t*K + k] (the combine)."""
    T, K = weights_TK.shape
    return (per_copy_xH.view(T, K, per_copy_xH.shape[1]) * weights_TK.float().unsqueeze(2)).sum(1)
