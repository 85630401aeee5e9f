"""One rank's part of a hot-swap plan, compiled ahead of the transfer (used by eplb.hotswap.swap).

Shape legend: L layers, S slots per GPU, G GPUs, V views (tensors) per slot.

Each chunk of the plan becomes one :class:`GroupProgram` of this rank: messages cut into pieces,
local copies and checksum tasks, all as spans of slot or staging rows, and the copies the commit
makes from staging into the slots (:class:`SwapProgram`). Compiling is a pure function of the plan
and the slot shapes, so it runs off the serving path, and every rank cuts the same blocks and
pieces, so sends and receives match in order.
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
    """Its destinations are also read in this chunk (a trade or a cycle: ``Chunk.staged``)."""
    src_staged: bool
    """Its sources are overwritten in this chunk."""

    @property
    def count(self) -> int:
        return len(self.transfers)


def chunk_blocks(plan: SwapPlan, k: int) -> list[Block]:
    """Group chunk k's transfers into maximal runs of consecutive source and destination slots.

    Only transfers with one destination join a run (fan-out transfers stay alone), and a run does
    not mix staged and plain sources or destinations (``Chunk.staged``).
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
    """``count`` consecutive rows of layer ``layer``'s slot buffer (local slot index) or of staging."""

    layer: int
    start: int
    count: int
    staging: bool = False
    """Rows of this rank's staging buffer (shared by every layer) instead of the layer's slots."""


@dataclass(frozen=True)
class Check:
    """Checksum rows of one view of a slot buffer or of the staging buffer into the agreement vector."""

    layer: int
    view: int
    staging: bool
    task: SlotChecksum


@dataclass
class Stage:
    """One piece (cross-GPU) or the local stage of a group, on this rank."""

    sends: list[tuple[int, Span]] = field(default_factory=list)
    """(peer, source slot span), in the order the peer posts the matching receives."""
    recvs: list[tuple[int, Span]] = field(default_factory=list)
    """(peer, staging span)."""
    copies: list[tuple[Span, Span]] = field(default_factory=list)
    """(source slot span, staging span): local moves."""
    src_checks: list[Check] = field(default_factory=list)
    dst_checks: list[Check] = field(default_factory=list)


@dataclass
class GroupProgram:
    """What this rank does for one group (one chunk of the plan); every rank agrees on it once.

    - Nothing of a group writes a slot: every expert this rank receives or copies locally lands in
      its own rows of the *staging* buffer, and sends read the slots, which keep the old placement
      until the swap commits (:attr:`SwapProgram.commit` copies staging into the slots then). So a
      failed swap is undone by not committing it, any group may be posted before the previous one
      is agreed, and a transfer that lands late can only touch staging.
    - Cross-GPU moves go as *blocks* (consecutive source slots into consecutive staging rows, one
      message per view) cut into a few *pieces*, one ``batch_isend_irecv`` each, by
      ``piece_fractions`` of what arrives at each GPU: the receiver checksums piece k while piece
      k+1 is on the wire, so only the last (small) piece's checksum follows the transfer. Local
      copies come last.
    - Checksums land in an agreement vector int64 [2 + 4 V t] (eplb.hotswap.agreement): two
      counters, then for each transfer the source's checksum (written by the sending rank) and the
      destination's (by the receiving rank).
    """

    chunk: int
    num_transfers: int
    checksum_width: int
    pieces: list[Stage]
    local: Stage
    overlaps_previous: bool = False
    """It is posted before the previous group is agreed (every group but the first)."""
    staging_rows: int = 0
    """Rows of the staging buffer this group writes (after those of the groups before it)."""
    commit: list[tuple[Span, Span]] = field(default_factory=list)
    """(staging span, slot span): what the commit copies for this group's arrivals (fan-out included)."""

    @property
    def vector_length(self) -> int:
        return 2 + 2 * self.num_transfers * self.checksum_width


@dataclass
class SwapProgram:
    """This rank's whole swap: its groups, the staging rows they fill, and the commit's copies."""

    groups: list[GroupProgram]
    staging_rows: int
    commit: list[tuple[Span, Span]]


@dataclass(frozen=True, kw_only=True)
class ProgramSpec:
    """What this rank's program is compiled for: the same for every chunk of a swap."""

    rank: int
    """The rank (GPU) whose part of the plan is compiled."""
    piece_fractions: Sequence[float]
    """How a chunk's arrivals at each GPU are cut into pieces (``HotSwapOptions.piece_fractions``)."""
    view_shapes: Sequence[tuple[tuple[int, ...], torch.dtype]]
    """(shape, dtype) of each view of one slot."""
    device: torch.device
    """Where the checksum tasks' index tensors live (the slot buffers' device)."""
    verify: bool
    """Checksum every moved expert; False: no checksum tasks."""
    checksum_backend: str = "auto"
    """auto | torch | triton (``HotSwapOptions.checksum_backend``)."""


def compile_swap(plan: SwapPlan, spec: ProgramSpec) -> SwapProgram:
    """This rank's program for every chunk of ``plan``; staging rows follow the chunks' order."""
    groups: list[GroupProgram] = []
    rows = 0
    for k in range(len(plan.chunks)):
        prog = compile_group(plan, k, spec, first_row=rows)
        rows += prog.staging_rows
        groups.append(prog)
    return SwapProgram(groups, rows, [pair for g in groups for pair in g.commit])


def compile_group(plan: SwapPlan, k: int, spec: ProgramSpec, *, first_row: int = 0) -> GroupProgram:
    """This rank's program for chunk k, staging from row ``first_row`` on."""
    rank, view_shapes, verify = spec.rank, spec.view_shapes, spec.verify
    S, G = plan.slots_per_gpu, plan.num_gpus
    chunk = plan.chunks[k]
    lo = rank * S
    row_of = {i: j for j, i in enumerate(chunk.transfers)}
    blocks = chunk_blocks(plan, k)
    # One staging row per transfer arriving at this rank, consecutive within a block (one message).
    staging_row: dict[int, int] = {}
    commit: list[tuple[Span, Span]] = []
    next_row = first_row
    for b in blocks:
        if b.dst_gpu != rank:
            continue
        for m, i in enumerate(b.transfers):
            staging_row[i] = next_row + m
        commit.append(
            (Span(b.layer, next_row, b.count, staging=True), Span(b.layer, b.dst_slot - lo, b.count))
        )
        if b.count == 1:  # a fan-out transfer: its other destinations copy the same staging row
            t = plan.transfers[b.transfers[0]]
            commit += [
                (Span(b.layer, next_row, 1, staging=True), Span(b.layer, d - lo, 1)) for d in t.dst_slots[1:]
            ]
        next_row += b.count
    cross = [b for b in blocks if b.src_gpu != b.dst_gpu]
    pieces_global = _cut_pieces(cross, spec.piece_fractions, G)
    stages: list[Stage] = []
    words = 2 * len(view_shapes)  # checksum words per transfer
    n = len(chunk.transfers)
    checks = _CheckBuilder(view_shapes, spec.device, spec.checksum_backend if verify else None, words, n)
    for blocks_of_piece in [*pieces_global, [b for b in blocks if b.src_gpu == b.dst_gpu == rank]]:
        stage = Stage()
        for b in blocks_of_piece:
            rows = [row_of[i] for i in b.transfers]
            src = Span(b.layer, b.src_slot - lo, b.count)
            if b.src_gpu == rank:
                if b.dst_gpu != rank:
                    stage.sends.append((b.dst_gpu, src))
                checks.add(src, rows, side=0)
            if b.dst_gpu != rank:
                continue
            dst = Span(b.layer, staging_row[b.transfers[0]], b.count, staging=True)
            if b.src_gpu == rank:
                stage.copies.append((src, dst))
            else:
                stage.recvs.append((b.src_gpu, dst))
            checks.add(dst, rows, side=1)
        checks.emit(stage)
        stages.append(stage)
    checks.bind()
    return GroupProgram(
        k, n, words if verify else 0, stages[:-1], stages[-1], k > 0, next_row - first_row, commit
    )


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
            buf_rows, pos = self.pending.setdefault((side, span.layer, v, span.staging), ([], []))
            buf_rows.extend(range(span.start, span.start + span.count))
            pos.extend(2 + side * self.n * self.width + r * self.width + 2 * v for r in rows)

    def emit(self, stage: Stage) -> None:
        for (side, layer, v, staging), (rows, pos) in sorted(self.pending.items()):
            shape, dtype = self.view_shapes[v]
            task = SlotChecksum(shape, dtype, rows, pos, self.device, self.backend or "auto", bind=False)
            (stage.dst_checks if side else stage.src_checks).append(Check(layer, v, staging, task))
            self.tasks.append(task)
        self.pending = {}

    def bind(self) -> None:
        """Move every task's index tensors to the device in one copy."""
        bind_all(self.tasks, self.device)
