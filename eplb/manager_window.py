"""The manager's load window: per-pass logical counts on the device and a ring of the last W passes.

Shape legend: W window (passes), L layers, E logical experts.

A stand-in for the stat recorder of eplb.recorder (issue 3) behind the one method the manager
needs: the MoE layers add this pass's counts into ``pass_counts_LE`` (remap_and_record's
``logical_counts_E``, one row per layer); at the end of the pass the manager commits or
discards them. Logical counts do not depend on the placement, so the window stays valid across
rebalances. Per-pass counts are int32 (a pass never routes 2**31 tokens); the window sum is int64.
"""

from __future__ import annotations

import torch


class PassWindow:
    """A ring [W, L, E] of committed passes plus the current pass's counts [L, E], on ``device``."""

    def __init__(self, num_layers: int, num_logical: int, window: int, device: torch.device) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 pass, got {window}")
        self.pass_counts_LE = torch.zeros(num_layers, num_logical, dtype=torch.int32, device=device)
        self._ring_WLE = torch.zeros(window, num_layers, num_logical, dtype=torch.int32, device=device)
        self._next = 0
        self._filled = 0

    @property
    def capacity(self) -> int:
        return int(self._ring_WLE.shape[0])

    @property
    def num_passes(self) -> int:
        """Committed passes in the window (at most its capacity)."""
        return self._filled

    def end_pass(self, *, commit: bool) -> None:
        """Keep this pass's counts in the window (or drop them) and zero them for the next pass."""
        if commit:
            self._ring_WLE[self._next].copy_(self.pass_counts_LE)
            self._next = (self._next + 1) % self.capacity
            self._filled = min(self._filled + 1, self.capacity)
        self.pass_counts_LE.zero_()

    def window_WLE(self) -> torch.Tensor:
        """int32 [n, L, E]: the committed passes, oldest first (n = :attr:`num_passes`)."""
        if self._filled < self.capacity:
            return self._ring_WLE[: self._filled].clone()
        return torch.roll(self._ring_WLE, -self._next, dims=0)

    def reset(self) -> None:
        self._ring_WLE.zero_()
        self.pass_counts_LE.zero_()
        self._next = self._filled = 0
