"""How the ranks of a manager agree: small all-reduces on the CPU control group, broadcasts from rank 0.

Per-pass flags and durations travel on a CPU (Gloo) group over the same ranks, so NCCL ranks do
not sync the device for them; a plan (phy2log, weights) is broadcast, and a window summed, over
the data group. With a :class:`~eplb.manager.liveness.Liveness` every collective is waited for
with a look at the other ranks' heartbeats, so a lost rank raises
:class:`~eplb.manager.liveness.RankLost` on every survivor instead of leaving one waiting for
the group's timeout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from eplb.hotswap.runtime import control_group
from eplb.manager.liveness import Liveness


@dataclass(frozen=True)
class RankAgreement:
    """The collectives every rank calls at the same point (no-ops with one rank)."""

    group: dist.ProcessGroup | None
    """The data group (NCCL on GPUs)."""
    control: dist.ProcessGroup | None
    """A CPU group over the same ranks (None with one rank)."""
    world_size: int
    device: torch.device
    liveness: Liveness | None = None
    """Watches the other ranks while a collective waits (None: plain blocking collectives)."""

    @classmethod
    def create(
        cls,
        group: dist.ProcessGroup | None,
        world_size: int,
        device: torch.device,
        liveness: Liveness | None = None,
    ) -> RankAgreement:
        """Collective when ``world_size > 1`` (it may create the control group)."""
        return cls(group, control_group(group) if world_size > 1 else None, world_size, device, liveness)

    def any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on some rank."""
        return self.max(float(flag)) > 0.0

    def max(self, value: float) -> float:
        """The maximum of ``value`` over the ranks, the same float on every rank."""
        return self.max_of(value)[0]

    def any_of(self, *flags: bool) -> list[bool]:
        """For each flag, True on every rank if it is true on some rank (one all-reduce)."""
        return [v > 0.0 for v in self.max_of(*(float(f) for f in flags))]

    def max_of(self, *values: float) -> list[float]:
        """The maximum of each value over the ranks, the same floats on every rank (one all-reduce)."""
        t = torch.tensor(values, dtype=torch.float64)
        if self.world_size > 1:
            self._wait(
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.control, async_op=True), "an agreement"
            )
        return [float(v) for v in t.tolist()]

    def same(self, *values: int) -> list[bool]:
        """For each integer (below 2**53 in size), whether every rank holds the same (one all-reduce)."""
        got = self.max_of(*(float(sign * v) for v in values for sign in (1, -1)))
        return [got[2 * i] == -got[2 * i + 1] for i in range(len(values))]

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``t`` (a CPU tensor) on every rank, over the data group."""
        if self.world_size == 1:
            return t
        on_device = t.to(self.device)
        src = dist.get_global_rank(self.group, 0) if self.group else 0
        self._wait(dist.broadcast(on_device, src=src, group=self.group, async_op=True), "rank 0's broadcast")
        return on_device.cpu()

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a CPU tensor) summed over the ranks, over the data group."""
        if self.world_size == 1:
            return t
        on_device = t.to(self.device)
        self._wait(dist.all_reduce(on_device, group=self.group, async_op=True), "a sum over the ranks")
        return on_device.cpu()

    def _wait(self, work: dist.Work | None, what: str) -> None:
        if self.liveness is not None:
            self.liveness.wait(work, what)
        elif work is not None:
            work.wait()
