"""Storage behind the recorder's modes: the stat window, per_pass host staging, per_token ids.

Shape legend: W window (passes), L layers, E logical experts, P physical slots, C count rows, K
top-k, T tokens (recorded).

Every store is bounded: the window holds W passes, per_pass keeps at most W finished records
plus a few in flight, per_token keeps at most a token budget. Per-pass counts are int32 (one
pass cannot reach 2**31 tokens per slot); sums over passes are int64.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from eplb.kernels.window_push import WindowPush


def _fused_push(device: torch.device) -> type[WindowPush] | None:
    """eplb.kernels.window_push's launcher on CUDA where Triton imports; None elsewhere (torch ops)."""
    if device.type != "cuda":
        return None
    try:
        from eplb.kernels.window_push import WindowPush
    except ImportError:
        return None
    return WindowPush


@dataclass(frozen=True)
class PassInfo:
    """Host-side facts about one counted pass."""

    pass_id: int
    """The recorder's counted-pass index (same on every rank)."""
    map_version: int
    """Which placement was live (its phy2log converts the pass's slot counts to experts)."""
    had_prefill: bool
    """Whether this rank's pass carried prefill tokens."""
    num_tokens: int
    """Tokens this rank processed in the pass."""


class StatWindow:
    """A circular window of per-pass slot counts on the device: int32 [W, L, P]."""

    def __init__(self, window: int, num_layers: int, num_physical: int, device: torch.device) -> None:
        self.counts_WLP = torch.zeros((window, num_layers, num_physical), dtype=torch.int32, device=device)
        self._rows = list(self.counts_WLP.unbind(0))  # views made once: a push is one device op
        self.push_kernel = _fused_push(self.counts_WLP.device)
        """The one-launch push (CUDA), or None: a torch sum and fill."""
        self._push: WindowPush | None = None  # made for the first count rows pushed
        self.info: list[PassInfo | None] = [None] * window
        self.next_row = 0
        self.filled = 0

    @property
    def window(self) -> int:
        return int(self.counts_WLP.shape[0])

    def push(self, pass_counts_LCP: torch.Tensor, info: PassInfo, *, zero: bool = False) -> None:
        """Sum one pass's count rows [L, C, P] into the next row, then zero them if ``zero`` (no host sync).

        On CUDA one launch does both (eplb.kernels.window_push: the recorder pays one launch per
        pass, not two torch ops); elsewhere a torch sum and fill.
        """
        if self.push_kernel is not None:
            push = self._push
            if push is None or push.rows_LCP is not pass_counts_LCP:
                push = self._push = self.push_kernel(pass_counts_LCP, self.counts_WLP)
            push(self.next_row, zero=zero)
        else:
            torch.sum(pass_counts_LCP, dim=1, dtype=torch.int32, out=self._rows[self.next_row])
            if zero:
                pass_counts_LCP.zero_()
        self.info[self.next_row] = info
        self.next_row = (self.next_row + 1) % self.window
        self.filled = min(self.filled + 1, self.window)

    def chronological_rows(self) -> list[int]:
        """Row indices of the filled part, oldest first."""
        start = (self.next_row - self.filled) % self.window
        return [(start + i) % self.window for i in range(self.filled)]

    def clear(self) -> None:
        self.counts_WLP.zero_()
        self.info = [None] * self.window
        self.next_row = 0
        self.filled = 0


class PerPassStaging:
    """per_pass mode: copy each pass's counts to pinned host memory without stalling the stream.

    A copy is enqueued ``non_blocking`` into one of a few pinned buffers and an event recorded
    after it; finished copies are collected on later passes (``event.query()``, never a wait),
    so the host only blocks when every staging buffer is still in flight, or at a dump.
    """

    def __init__(
        self, max_records: int, num_layers: int, num_physical: int, device: torch.device, num_staging: int = 4
    ) -> None:
        self.device = device
        pin = device.type == "cuda"
        shape = (num_layers, num_physical)
        self.staging = [torch.empty(shape, dtype=torch.int32, pin_memory=pin) for _ in range(num_staging)]
        self.free = list(range(num_staging))
        self.in_flight: deque[tuple[int, PassInfo, torch.cuda.Event | None]] = deque()
        self.records: deque[tuple[PassInfo, np.ndarray]] = deque(maxlen=max_records)

    def push(self, pass_counts_LCP: torch.Tensor, info: PassInfo) -> None:
        """Sum one pass's count rows [L, C, P] and copy the sum to a pinned buffer."""
        self.collect(wait=False)
        if not self.free:
            self._finish_oldest()
        slot = self.free.pop()
        self.staging[slot].copy_(torch.sum(pass_counts_LCP, dim=1, dtype=torch.int32), non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self.in_flight.append((slot, info, event))

    def collect(self, wait: bool) -> None:
        """Move finished copies into ``records``; with ``wait``, finish all of them."""
        while self.in_flight:
            _, _, event = self.in_flight[0]
            if event is not None and not wait and not event.query():
                return
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        slot, info, event = self.in_flight.popleft()
        if event is not None:
            event.synchronize()
        self.records.append((info, self.staging[slot].numpy().copy()))
        self.free.append(slot)

    def clear(self) -> None:
        self.collect(wait=True)
        self.records.clear()


class TokenBuffer:
    """per_token mode: logical top-k ids of each recorded token, int32 [budget, L, K] on the device."""

    def __init__(self, budget: int, num_layers: int, top_k: int, device: torch.device) -> None:
        self.ids_TLK = torch.full((budget, num_layers, top_k), -1, dtype=torch.int32, device=device)
        self.pass_of_token: list[int] = []
        self.used = 0
        self.dropped = 0
        self.pending_tokens = 0

    def write(self, layer: int, topk_ids_TK: torch.Tensor) -> None:
        """Store this pass's ids of one layer; tokens past the budget are dropped (and counted)."""
        room = self.ids_TLK.shape[0] - self.used
        T = int(topk_ids_TK.shape[0])
        keep = min(T, room)
        if keep > 0:
            self.ids_TLK[self.used : self.used + keep, layer].copy_(topk_ids_TK[:keep])
        self.pending_tokens = max(self.pending_tokens, T)

    def commit(self, pass_id: int, keep: bool) -> None:
        """End of pass: keep (or discard) the ids written since the last commit."""
        room = self.ids_TLK.shape[0] - self.used
        tokens = self.pending_tokens
        self.pending_tokens = 0
        if not keep or tokens == 0:
            if tokens:
                self.ids_TLK[self.used : self.used + min(tokens, room)].fill_(-1)
            return
        kept = min(tokens, room)
        self.dropped += tokens - kept
        self.pass_of_token.extend([pass_id] * kept)
        self.used += kept

    def clear(self) -> None:
        self.ids_TLK.fill_(-1)
        self.pass_of_token = []
        self.used = 0
        self.dropped = 0
        self.pending_tokens = 0
