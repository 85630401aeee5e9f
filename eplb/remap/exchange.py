"""The ``lp`` dispatch mode's counts exchange: one all-gather of int32 [G, E] per layer call.

Shape legend: E logical experts, G GPUs (EP ranks), L layers, X replicated experts.

Every rank counts its valid tokens per expert (int32 [E]), :class:`LpExchange` all-gathers those
counts into int32 [G, E] over the EP group, and every rank then derives the same per-replica
quotas and its own tokens' positions from the gathered counts (eplb.remap.lp_rule). A rank with no
tokens takes part with zeros, so no rank waits for one that had nothing to send.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from eplb.remap.tables import DispatchTables

GatherFn = Callable[[torch.Tensor, torch.Tensor], None]
"""``gather(local_E, out_GE)``: fill row g of ``out_GE`` with rank g's ``local_E``."""


class LpExchange:
    """One rank's buffers and collective for ``lp`` dispatch (build once per tables; reuse every call).

    ``group``: the EP process group (None: the default group when torch.distributed is
    initialised). ``gather`` replaces the collective (tests, or an engine's own all-gather).
    Without torch.distributed and without ``gather``, the tables must have one GPU.
    """

    def __init__(self, tables: DispatchTables, *, group: Any = None, gather: GatherFn | None = None) -> None:
        if tables.lp_expert_LX is None:
            raise ValueError(
                "these dispatch tables carry no lp tables (build them with DispatchTables.from_placement)"
            )
        E, G, device = tables.num_logical, tables.num_gpus, tables.device
        self.tables = tables
        self.local_E = torch.zeros(E, dtype=torch.int32, device=device)
        """int32 [E]: this rank's valid tokens per expert in the current call; zero between calls
        (the Triton count kernel adds into it, and the quota kernel zeroes it after the exchange)."""
        self.gathered_GE = torch.zeros((G, E), dtype=torch.int32, device=device)
        """int32 [G, E]: every rank's ``local_E``, by rank."""
        self.scratch: dict[str, torch.Tensor] = {}
        """Kernel scratch buffers by name (eplb.kernels.remap_lp), allocated on first use."""
        self._gather = gather if gather is not None else _collective(group, G, tables.rank)

    def exchange(self) -> None:
        """All-gather ``local_E`` into ``gathered_GE`` (every rank, every call)."""
        self._gather(self.local_E, self.gathered_GE)

    def idle(self) -> None:
        """This rank has no tokens this call: take part in the exchange with zeros."""
        self.local_E.zero_()
        self.exchange()


def _collective(group: Any, num_gpus: int, rank: int) -> GatherFn:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if num_gpus != 1:
            raise ValueError(
                f"lp dispatch over {num_gpus} ranks needs torch.distributed (the EP group) or a gather function"
            )

        def copy(local_E: torch.Tensor, out_GE: torch.Tensor) -> None:
            out_GE.copy_(local_E[None])

        return copy
    world, me = dist.get_world_size(group), dist.get_rank(group)
    if (world, me) != (num_gpus, rank):
        raise ValueError(
            f"the lp group has {world} ranks (this one {me}) but the tables are rank {rank} of {num_gpus}"
        )

    def gather(local_E: torch.Tensor, out_GE: torch.Tensor) -> None:
        dist.all_gather_into_tensor(out_GE.view(-1), local_E, group=group)

    return gather


def exchange_for(tables: DispatchTables, lp: LpExchange | None) -> LpExchange:
    """``lp``, or the tables' default exchange (the default process group), made once and kept."""
    if lp is not None:
        if lp.tables is not tables:
            raise ValueError("the LpExchange was built for other dispatch tables")
        return lp
    kept: LpExchange | None = tables.derived.get("lp_exchange")
    if kept is None:
        kept = tables.derived["lp_exchange"] = LpExchange(tables)
    return kept


__all__ = ["GatherFn", "LpExchange", "exchange_for"]
