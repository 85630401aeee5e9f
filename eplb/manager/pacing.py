"""Pacing of a swap sent beside the passes (continuous mode, ``--eplb-transfer-gbps``).

Shape legend: L layers, G GPUs (ranks), E logical experts.

A swap beside serving must not take the link (or memory bandwidth) from the passes in bursts, so
its chunks are spread over the passes that follow the plan. Each pass earns a credit of
``cap x the pass's duration`` bytes; a chunk goes, between two passes, once the credit covers its
cost (the most bytes one GPU receives in it), and the credit pays for it. A chunk's transfers
are NCCL point-to-point and plain tensor copies issued between passes, finished (and agreed)
before the next pass starts, so nothing runs on SMs beside a pass.

Every rank must take the same chunks on the same pass, so pacing uses only agreed inputs: the
costs come from the broadcast plan, and the pass's duration is the maximum over ranks (one
all-reduce on the CPU control group; an EP pass lasts as long as its slowest rank). No rank
decides anything on its own clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from eplb.placement.diff import diff_placements
from eplb.placement.model import Placement


@dataclass
class Pacer:
    """A byte credit: earned at ``bytes_per_second`` over the passes' agreed durations, spent by chunks."""

    bytes_per_second: float
    credit: float = 0.0

    def earn(self, seconds: float) -> None:
        assert seconds >= 0.0, "a pass's duration is not negative"
        self.credit += self.bytes_per_second * seconds

    def take(self, cost: int) -> bool:
        """Spend ``cost`` bytes if the credit covers them (True: the chunk may go now)."""
        if cost > self.credit:
            return False
        self.credit -= cost
        return True


def chunk_costs(
    original: Placement, target: Placement, chunks: list[list[int]], bytes_per_expert: int
) -> list[int]:
    """Per chunk of layers: the most bytes one GPU receives from other GPUs (local copies are free).

    Each layer changes in exactly one chunk, so the chunk's arrivals are the arrivals of
    ``original -> target`` restricted to its layers.
    """
    arrivals_LG = diff_placements(original, target).arrivals_LGE.sum(axis=2)
    return [int(arrivals_LG[chunk].sum(axis=0).max(initial=0)) * bytes_per_expert for chunk in chunks]


def per_chunk_layers(configured: int | None, paced: bool, num_changed: int) -> int:
    """Layers per chunk: as configured, else one when paced (fine steps), else all changed layers."""
    if configured is not None:
        return configured
    return 1 if paced else max(num_changed, 1)
