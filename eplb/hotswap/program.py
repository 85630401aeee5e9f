"""One rank's part of a hot-swap plan, compiled ahead of the transfer (used by eplb.hotswap.swap).

Shape legend: L layers, S slots per GPU, G GPUs, V views (tensors) per slot, W = 2 * V checksum
words per expert, n transfers of a group.

Each chunk of the plan becomes one :class:`GroupProgram` of this rank: backups, messages cut into
pieces, local copies and checksum tasks, all as slot spans. Compiling is a pure function of the
plan and the slot shapes, so it runs off the serving path, and every rank cuts the same blocks
and pieces, so sends and receives match in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from eplb.hotswap.checksum import SlotChecksum, bind_all
from eplb.hotswap.plan import SwapPlan


@dataclass(frozen=True)
class Block:
    """Consecutive transfers of one chunk that move as one message per view (consecutive slots)."""

    transfers: tuple[int, ...]
    layer: int
    src_gpu: int
    dst_gpu: int
    src_slot: int
    dst_slot: int
    """First primary destination (global slot); block m writes dst_slot + m."""
    staged: bool
    """Its destinations are also read in this group: they are backed up before being written."""
    src_staged: bool
    """Its sources are overwritten in this group: they are read from their backups."""

    @property
    def count(self) -> int:
        return len(self.transfers)


def chunk_blocks(plan: SwapPlan, k: int) -> list[Block]:
    """Group chunk k's transfers into maximal runs of consecutive source and destination slots.

    Only transfers with one destination join a run (fan-out transfers stay alone), and a run does
    not mix backed-up and plain sources or destinations.
    """
    chunk = plan.chunks[k]

    def flags(i: int) -> tuple[bool, bool]:
        t = plan.transfers[i]
        return any((t.layer, d) in chunk.staged for d in t.dst_slots), (t.layer, t.src_slot) in chunk.staged

    order = sorted(chunk.transfers, key=lambda i: (*_key(plan, i), i))
    groups: list[list[int]] = []
    for i in order:
        t = plan.transfers[i]
        if groups:
            prev, head = plan.transfers[groups[-1][-1]], plan.transfers[groups[-1][0]]
            if (
                len(t.dst_slots) == 1
                and len(head.dst_slots) == 1
                and _key(plan, i)[:3] == _key(plan, groups[-1][-1])[:3]
                and t.src_slot == prev.src_slot + 1
                and t.dst_slots[0] == prev.dst_slots[0] + 1
                and flags(i) == flags(groups[-1][0])
            ):
                groups[-1].append(i)
                continue
        groups.append([i])
    out = []
    for group in groups:
        t = plan.transfers[group[0]]
        staged, src_staged = flags(group[0])
        out.append(
            Block(tuple(group), t.layer, t.src_gpu, t.dst_gpu, t.src_slot, t.dst_slots[0], staged, src_staged)
        )
    return out


def _key(plan: SwapPlan, i: int) -> tuple[int, int, int, int]:
    t = plan.transfers[i]
    return t.layer, t.src_gpu, t.dst_gpu, t.src_slot


@dataclass(frozen=True)
class Span:
    """``count`` consecutive rows of layer ``layer``'s slot buffer (local slot index) or backup buffer."""

    layer: int
    start: int
    count: int
    backup: bool = False


@dataclass(frozen=True)
class Check:
    """Checksum rows of one view of a slot or backup buffer into the agreement vector."""

    layer: int
    view: int
    backup: bool
    task: SlotChecksum


@dataclass
class Stage:
    """One piece (cross-GPU) or the local stage of a group, on this rank."""

    backups: list[tuple[Span, Span]] = field(default_factory=list)
    """(slot span, backup span): copied before anything of this stage is posted."""
    sends: list[tuple[int, Span]] = field(default_factory=list)
    """(peer, source span), in the order the peer posts the matching receives."""
    recvs: list[tuple[int, Span]] = field(default_factory=list)
    copies: list[tuple[Span, Span]] = field(default_factory=list)
    """(source, destination): after arrival (fan-out of a received expert) or local moves."""
    src_checks: list[Check] = field(default_factory=list)
    dst_checks: list[Check] = field(default_factory=list)


@dataclass
class GroupProgram:
    """What this rank does for one group (one chunk of the plan); every rank agrees on it once.

    - Slots that the group both reads and overwrites (``Chunk.staged``: the two sides of a trade,
      a cycle) are copied to a *backup* buffer first. Reads of such a slot come from its backup, so
      receives and local copies write every destination in place, in any order, and a failed group
      is undone by copying the backups back; every other overwritten slot's old expert still sits
      in a slot the group does not touch (eplb.hotswap.plan's invariant).
    - Cross-GPU moves go as *blocks* (consecutive source and destination slots, one message per
      view) cut into a few *pieces*, one ``batch_isend_irecv`` each, by ``piece_fractions`` of what
      arrives at each GPU: the receiver checksums piece k while piece k+1 is on the wire, so only
      the last (small) piece's checksum follows the transfer; a small first piece starts the link
      early when its sources must be backed up first. Local copies come last.
    - Checksums land in an agreement vector int64 [2 + 2 n W] (eplb.hotswap.agreement): two flags,
      then for each transfer the source's checksum (written by the sending rank) and the
      destination's (by the receiving rank).
    """

    chunk: int
    num_transfers: int
    checksum_width: int
    backup_rows: dict[int, int]
    """layer -> rows of its backup buffer (this rank's backed-up slots of that layer)."""
    restore: list[tuple[Span, Span]]
    """(backup span, slot span): what a failed group copies back."""
    pieces: list[Stage]
    local: Stage
    overlaps_previous: bool = False
    """It may be posted before the previous group is agreed (see :func:`may_overlap`)."""

    @property
    def vector_length(self) -> int:
        return 2 + 2 * self.num_transfers * self.checksum_width


def compile_group(
    plan: SwapPlan,
    k: int,
    *,
    rank: int,
    piece_fractions: Sequence[float],
    view_shapes: Sequence[tuple[tuple[int, ...], torch.dtype]],
    device: torch.device,
    verify: bool,
    checksum_backend: str = "auto",
) -> GroupProgram:
    """This rank's program for chunk k. ``view_shapes``: (shape, dtype) of each view of one slot."""
    S, G = plan.slots_per_gpu, plan.num_gpus
    chunk = plan.chunks[k]
    lo = rank * S
    row_of = {i: j for j, i in enumerate(chunk.transfers)}
    mine = sorted((layer, s) for layer, s in chunk.staged if lo <= s < lo + S)
    backup_row: dict[tuple[int, int], int] = {}
    backup_rows: dict[int, int] = {}
    for layer, s in mine:
        backup_row[(layer, s)] = backup_rows.get(layer, 0)
        backup_rows[layer] = backup_rows.get(layer, 0) + 1

    def src_span(layer: int, slot: int, count: int) -> Span:
        if (layer, slot) in chunk.staged:
            return Span(layer, backup_row[(layer, slot)], count, backup=True)
        return Span(layer, slot - lo, count)

    blocks = chunk_blocks(plan, k)
    cross = [b for b in blocks if b.src_gpu != b.dst_gpu]
    pieces_global = _cut_pieces(cross, piece_fractions, G)
    stages: list[Stage] = []
    touched: set[tuple[int, int]] = set()
    W = 2 * len(view_shapes)
    n = len(chunk.transfers)
    checks = _CheckBuilder(view_shapes, device, checksum_backend if verify else None, W, n)
    for blocks_of_piece in [*pieces_global, [b for b in blocks if b.src_gpu == b.dst_gpu == rank]]:
        stage = Stage()
        slots: list[tuple[int, int]] = []
        for b in blocks_of_piece:
            ts = [plan.transfers[i] for i in b.transfers]
            if b.src_gpu == rank:
                slots += [(b.layer, b.src_slot + m) for m in range(b.count)]
                src = src_span(b.layer, b.src_slot, b.count)
                if b.dst_gpu != rank:
                    stage.sends.append((b.dst_gpu, src))
                checks.add(src, [row_of[i] for i in b.transfers], side=0)
            if b.dst_gpu != rank:
                continue
            dst = Span(b.layer, b.dst_slot - lo, b.count)
            slots += [(b.layer, d) for t in ts for d in t.dst_slots]
            if b.src_gpu == rank:
                stage.copies.append((src, dst))
            else:
                stage.recvs.append((b.src_gpu, dst))
            checks.add(dst, [row_of[i] for i in b.transfers], side=1)
            for d in ts[0].dst_slots[1:] if b.count == 1 else ():
                stage.copies.append((src if b.src_gpu == rank else dst, Span(b.layer, d - lo, 1)))
        fresh = sorted({x for x in slots if x in backup_row and x not in touched})
        touched.update(fresh)
        stage.backups = [
            (Span(layer, s - lo, m), Span(layer, backup_row[(layer, s)], m, backup=True))
            for layer, s, m in _slot_runs(fresh)
        ]
        checks.emit(stage)
        stages.append(stage)
    checks.bind()
    restore = [(b, s) for s, b in (x for st in stages for x in st.backups)]
    return GroupProgram(
        k, n, W if verify else 0, backup_rows, restore, stages[:-1], stages[-1], may_overlap(plan, k)
    )


def may_overlap(plan: SwapPlan, k: int) -> bool:
    """Chunk k may be posted while chunk k - 1 is still unagreed.

    It writes no slot that chunk k - 1 reads (``may_overlap_previous``; nor does chunk k - 1 write
    one that chunk k reads, by the plan's order), and it backs nothing up, so a failure of either
    is undone by chunk k - 1's backups alone and the old experts still sit in known slots.
    The same on every rank: a function of the plan.
    """
    return k > 0 and plan.chunks[k].may_overlap_previous and not plan.chunks[k].staged


def _cut_pieces(cross: list[Block], fractions: Sequence[float], G: int) -> list[list[Block]]:
    """Cut blocks so that piece k carries ``fractions[k]`` of the slots arriving at each GPU.

    Blocks are taken in order; a block that crosses a piece boundary of its receiving GPU is
    split there, so a trade's pieces carry both directions. Empty pieces are dropped.
    """
    total = np.zeros(G, dtype=np.int64)
    for b in cross:
        total[b.dst_gpu] += b.count
    bounds = np.cumsum(np.asarray(fractions, dtype=np.float64))
    bounds = bounds / bounds[-1]
    seen = np.zeros(G, dtype=np.int64)
    pieces: list[list[Block]] = [[] for _ in fractions]
    for b in cross:
        g, start = b.dst_gpu, 0
        while start < b.count:
            # Piece of the next slot, and how many slots of this block stay in it.
            k = int(np.searchsorted(bounds * total[g], seen[g], side="right"))
            k = min(k, len(fractions) - 1)
            room = int(np.ceil(bounds[k] * total[g])) - int(seen[g])
            m = max(1, min(b.count - start, room))
            pieces[k].append(_sub_block(b, start, m))
            seen[g] += m
            start += m
    return [p for p in pieces if p]


def _sub_block(b: Block, start: int, count: int) -> Block:
    return Block(
        b.transfers[start : start + count],
        b.layer,
        b.src_gpu,
        b.dst_gpu,
        b.src_slot + start,
        b.dst_slot + start,
        b.staged,
        b.src_staged,
    )


def _slot_runs(slots: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(layer, first slot, count) for runs of consecutive slots of one layer (input sorted)."""
    runs: list[tuple[int, int, int]] = []
    for layer, s in slots:
        if runs and runs[-1][0] == layer and runs[-1][1] + runs[-1][2] == s:
            runs[-1] = (layer, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((layer, s, 1))
    return runs


class _CheckBuilder:
    """Collects a stage's checksum rows; one task per (side, layer, view, buffer) when emitted."""

    def __init__(
        self,
        view_shapes: Sequence[tuple[tuple[int, ...], torch.dtype]],
        device: torch.device,
        backend: str | None,
        width: int,
        n: int,
    ) -> None:
        self.view_shapes, self.device, self.backend, self.width, self.n = (
            view_shapes,
            device,
            backend,
            width,
            n,
        )
        self.pending: dict[tuple[int, int, int, bool], tuple[list[int], list[int]]] = {}
        self.tasks: list[SlotChecksum] = []

    def add(self, span: Span, rows: list[int], side: int) -> None:
        """Checksum ``span``'s rows as the ``side`` (0 source, 1 destination) of transfer ``rows``."""
        if self.backend is None:
            return
        for v in range(len(self.view_shapes)):
            buf_rows, pos = self.pending.setdefault((side, span.layer, v, span.backup), ([], []))
            buf_rows.extend(range(span.start, span.start + span.count))
            pos.extend(2 + side * self.n * self.width + r * self.width + 2 * v for r in rows)

    def emit(self, stage: Stage) -> None:
        for (side, layer, v, backup), (rows, pos) in sorted(self.pending.items()):
            shape, dtype = self.view_shapes[v]
            task = SlotChecksum(shape, dtype, rows, pos, self.device, self.backend or "auto", bind=False)
            (stage.dst_checks if side else stage.src_checks).append(Check(layer, v, backup, task))
            self.tasks.append(task)
        self.pending = {}

    def bind(self) -> None:
        """Move every task's index tensors to the device in one copy."""
        bind_all(self.tasks, self.device)
