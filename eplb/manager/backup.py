"""Copies of experts' weights outside the slots: a host copy on two ranks (``--eplb-host-backup``),
the caller's loader, and the point-to-point moves that bring either to the rank that needs it.

Shape legend: L layers, E logical experts, G GPUs (ranks), S slots per GPU.

With ``--eplb-host-backup`` expert ``(l, e)`` is kept in host memory (pinned on CUDA) by the ranks
:func:`keepers` names: ``k = (l * E + e) % G`` and ``(k + step) % G``, ``step`` one node's GPUs
when there are several nodes (so the copies are on different nodes), else 1. Losing any one rank
(with several nodes, any one node) leaves a copy of every expert. Memory per rank: about
``2 L E / G`` experts (DeepSeek-V3 in fp8 at EP32: 2 x 58 x 256 / 32 x 44 MB = 41 GB). The copy is
made once, when the manager starts: from the caller's loader where one is given (no transfer),
else from the slots (each copy sent by the rank holding the expert's first replica; collective
over the serving group). Served weights never change, so the copy stays valid through every
hot-swap.

:data:`ExpertLoader` is the caller's alternative: ``loader(layer, expert)`` returns one expert's
weights, a tensor per slot-buffer name shaped like one slot of it (``slot_tensors(layer)[name][0]``),
e.g. read from the checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from eplb.manager.liveness import Liveness
from eplb.placement.model import Placement

ExpertLoader = Callable[[int, int], Mapping[str, torch.Tensor]]
"""``loader(layer, expert)``: one logical expert's weights, one tensor per slot-buffer name, each
shaped like one slot of that buffer (the engine's layout)."""
SlotsOf = Callable[[int], Mapping[str, torch.Tensor]]
"""``slots_of(layer)``: this rank's slot buffers [S, ...] of a layer, by name (the engine's)."""
Move = tuple[int, int, tuple[int, int, int]]
"""(from rank index, to rank index, (layer, expert, slot on the sender or -1)) of one expert's weights."""


def keepers(layer: int, expert: int, num_experts: int, num_gpus: int, gpus_per_node: int) -> tuple[int, ...]:
    """The rank indices that keep ``(layer, expert)``'s host copy (one with a single rank)."""
    if num_gpus == 1:
        return (0,)
    first = (layer * num_experts + expert) % num_gpus
    step = gpus_per_node if gpus_per_node < num_gpus else 1
    return (first, (first + step) % num_gpus)


def checked_weights(
    got: Mapping[str, torch.Tensor], like: Mapping[str, torch.Tensor], what: str
) -> dict[str, torch.Tensor]:
    """``got`` (a loader's answer) if it holds one slot of every buffer in ``like``; ValueError naming what differs."""
    missing = sorted(set(like) - set(got))
    if missing:
        raise ValueError(
            f"{what}: the loader returned no {missing} (it must return every slot buffer's name)"
        )
    out = {}
    for name, buffer in like.items():
        t = got[name]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(buffer.shape[1:]):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{what}: {name!r} must be one slot {tuple(buffer.shape[1:])}, got {shape}")
        out[name] = t
    return out


class HostBackup:
    """This rank's host copies, and who keeps each expert's (global ranks of the world it was made over)."""

    def __init__(
        self,
        ranks: Sequence[int],
        num_experts: int,
        gpus_per_node: int,
        kept: dict[tuple[int, int], dict[str, torch.Tensor]],
    ) -> None:
        self.ranks, self.num_experts, self.gpus_per_node = list(ranks), num_experts, gpus_per_node
        self.kept = kept

    def keepers(self, layer: int, expert: int) -> tuple[int, ...]:
        """Global ranks keeping ``(layer, expert)``."""
        idx = keepers(layer, expert, self.num_experts, len(self.ranks), self.gpus_per_node)
        return tuple(self.ranks[i] for i in idx)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for views in self.kept.values() for t in views.values())

    @classmethod
    def fill(
        cls,
        slots_of: SlotsOf,
        placement: Placement,
        *,
        ranks: Sequence[int],
        me: int,
        group: dist.ProcessGroup | None,
        loader: ExpertLoader | None,
        liveness: Liveness | None,
    ) -> HostBackup:
        """Make this rank's copies (collective over ``group`` without a loader). ``ranks``: the
        group's global ranks; ``me``: this rank's index there."""
        L, E, S, G = placement.num_layers, placement.num_logical, placement.slots_per_gpu, placement.num_gpus
        per_node = placement.gpus_per_node
        mine = [(layer, e) for layer in range(L) for e in range(E) if me in keepers(layer, e, E, G, per_node)]
        pin = slots_of(0)[next(iter(slots_of(0)))].device.type == "cuda"
        kept: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        if loader is not None:
            for layer, e in mine:
                got = checked_weights(
                    loader(layer, e), slots_of(layer), f"host copy of layer {layer} expert {e}"
                )
                kept[(layer, e)] = {n: _host(t, pin) for n, t in got.items()}
            return cls(ranks, E, per_node, kept)
        moves: list[Move] = []
        for layer in range(L):
            for e in range(E):
                slot = int(placement.log2phy_LER[layer, e, 0])
                for k in keepers(layer, e, E, G, per_node):
                    moves.append((slot // S, k, (layer, e, slot % S)))
        for src, dst, (layer, e, slot) in moves:
            if src == dst == me:  # this rank holds the expert it keeps
                kept[(layer, e)] = {n: _host(t[slot], pin) for n, t in slots_of(layer).items()}
        arrived = move_experts(
            moves,
            me=me,
            ranks=ranks,
            group=group,
            read=lambda key: {n: t[key[2]] for n, t in slots_of(key[0]).items()},
            like=lambda key: slots_of(key[0]),
            liveness=liveness,
            what="filling the host copies",
        )
        for (layer, e, _), views in arrived.items():
            kept[(layer, e)] = {n: _host(t, pin) for n, t in views.items()}
        assert set(kept) == set(mine), "every copy this rank keeps arrived"
        return cls(ranks, E, per_node, kept)


def transport_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """Where a group's point-to-point buffers live: the CPU for Gloo, ``device`` otherwise."""
    return torch.device("cpu") if "gloo" in str(dist.get_backend(group)) else device


def move_experts(
    moves: Sequence[Move],
    *,
    me: int,
    ranks: Sequence[int],
    group: dist.ProcessGroup | None,
    read: Callable[[tuple[int, int, int]], Mapping[str, torch.Tensor]],
    like: Callable[[tuple[int, int, int]], Mapping[str, torch.Tensor]],
    liveness: Liveness | None,
    what: str,
) -> dict[tuple[int, int, int], dict[str, torch.Tensor]]:
    """Send and receive this rank's part of ``moves`` (every rank passes the same list; moves
    within a rank are skipped): ``read(key)`` gives the sender's tensors, ``like(key)`` the slot
    buffers whose one-slot shape and dtype the receiver allocates. Returns what arrived here,
    by key. Bounded by ``liveness`` (RankLost when a peer is gone)."""
    ops: list[dist.P2POp] = []
    arrived: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {}
    keep: list[torch.Tensor] = []  # send buffers stay alive until their transfer is done
    transport: torch.device | None = None
    for i, (src, dst, key) in enumerate(moves):
        if src == dst or me not in (src, dst):
            continue
        if transport is None:
            transport = transport_device(group, next(iter(like(key).values())).device)
        if me == src:
            tensors = read(key)
            for j, name in enumerate(sorted(tensors)):
                t = tensors[name].to(transport).contiguous()
                keep.append(t)
                ops.append(dist.P2POp(dist.isend, t, ranks[dst], group, _tag(i, j)))
        else:
            buffers = like(key)
            bufs = {n: torch.empty(b.shape[1:], dtype=b.dtype, device=transport) for n, b in buffers.items()}
            arrived[key] = bufs
            for j, name in enumerate(sorted(bufs)):
                ops.append(dist.P2POp(dist.irecv, bufs[name], ranks[src], group, _tag(i, j)))
    works = dist.batch_isend_irecv(ops) if ops else []
    for work in works:
        if liveness is not None:
            liveness.wait(work, what)
        else:
            work.wait()
    return arrived


def _tag(move: int, view: int) -> int:
    return (move * 16 + view) % (1 << 30)


def _host(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """A host copy of ``t`` (pinned when the slots are on CUDA, for fast copies back)."""
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
    out.copy_(t)
    return out
