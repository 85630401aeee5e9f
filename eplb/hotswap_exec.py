"""One rank's side of a hot-swap chunk: post, wait, verify, agree, commit (used by eplb.hotswap).

Shape legend: S slots per GPU, W checksum words per expert; a slot's data is the list of views
``layout.slot_views`` returns.

Data moves over ``group`` (NCCL on GPUs) as raw bytes, in the chunk's transfer order, so NCCL
matches messages by order and Gloo by tag. Everything else goes over a CPU control group (Gloo;
the data group itself when it is Gloo): one all_reduce per chunk of [failure flags, and for every
cross-GPU transfer +sender checksum - receiver checksum]. All zero means the chunk arrived intact
everywhere. Keeping control off the data stream lets chunk k be agreed while chunk k+1 is still on
the wire, and the sender computes its checksums after posting, while the bytes travel.

Nothing here raises on a transfer failure: errors are recorded in the :class:`ChunkRun` and settled
by :meth:`SwapRuntime.agree`, so every rank keeps taking part in every collective.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from eplb.hotswap_checksum import MASK31, block_checksums
from eplb.hotswap_layout import SlotLayout
from eplb.hotswap_plan import SwapPlan
from eplb.placement import Placement

_CONTROL_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


@dataclass(frozen=True)
class Block:
    """Consecutive transfers of one chunk that move as one message per tensor (consecutive slots)."""

    index: int
    """Position in the chunk's block list (the same on every rank)."""
    transfers: tuple[int, ...]
    layer: int
    src_gpu: int
    dst_gpu: int
    src_slot: int
    dst_slot: int
    """First primary destination (global slot); block m holds dst_slot + m."""
    staged: bool

    @property
    def count(self) -> int:
        return len(self.transfers)


def chunk_blocks(plan: SwapPlan, k: int) -> list[Block]:
    """Group chunk k's transfers into maximal runs of consecutive source and destination slots.

    Only transfers with one destination join a run (fan-out transfers stay alone). Pure function of
    the plan, so sender and receiver cut the same messages.
    """
    chunk = plan.chunks[k]

    def staged(i: int) -> bool:
        t = plan.transfers[i]
        return any((t.layer, d) in chunk.staged for d in t.dst_slots)

    order = sorted(
        chunk.transfers,
        key=lambda i: (
            plan.transfers[i].layer,
            plan.transfers[i].src_gpu,
            plan.transfers[i].dst_gpu,
            plan.transfers[i].src_slot,
            i,
        ),
    )
    groups: list[list[int]] = []
    for i in order:
        t = plan.transfers[i]
        if groups:
            prev = plan.transfers[groups[-1][-1]]
            head = plan.transfers[groups[-1][0]]
            if (
                len(t.dst_slots) == 1
                and len(head.dst_slots) == 1
                and (t.layer, t.src_gpu, t.dst_gpu) == (prev.layer, prev.src_gpu, prev.dst_gpu)
                and t.src_slot == prev.src_slot + 1
                and t.dst_slots[0] == prev.dst_slots[0] + 1
                and staged(i) == staged(groups[-1][0])
            ):
                groups[-1].append(i)
                continue
        groups.append([i])
    blocks = []
    for index, group in enumerate(groups):
        t = plan.transfers[group[0]]
        blocks.append(
            Block(
                index,
                tuple(group),
                t.layer,
                t.src_gpu,
                t.dst_gpu,
                t.src_slot,
                t.dst_slots[0],
                staged(group[0]),
            )
        )
    return blocks


@dataclass
class ChunkRun:
    """State of one chunk on this rank."""

    index: int
    works: list[Any] = field(default_factory=list)
    primary: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """block index -> views [m, ...] the block lands in first (its first slots, or staging)."""
    sends: list[Block] = field(default_factory=list)
    recvs: list[Block] = field(default_factory=list)
    local: list[Block] = field(default_factory=list)
    checksums: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    """send / recv / src / dst -> int64 [m, W] per block of that list."""
    failed: bool = False
    finished: bool = False
    completed: bool = False
    errors: list[str] = field(default_factory=list)
    waiter: threading.Thread | None = None
    wait_error: Exception | None = None

    def fail(self, where: str, exc: BaseException) -> None:
        self.failed = True
        self.errors.append(f"chunk {self.index} {where}: {type(exc).__name__}: {exc}")


@dataclass
class SwapRuntime:
    """This rank's slot buffers and process groups, for one hot-swap call."""

    slots_L: Sequence[Mapping[str, torch.Tensor]]
    group: dist.ProcessGroup | None
    control: dist.ProcessGroup | None
    layout: SlotLayout
    rank: int
    world_size: int
    slots_per_gpu: int
    device: torch.device
    timeout_s: float
    verify: bool
    bytes_per_expert: int
    checksum_width: int
    phase_seconds: dict[str, float] = field(default_factory=dict)

    @classmethod
    def create(
        cls,
        slots_L: Sequence[Mapping[str, torch.Tensor]],
        placement: Placement,
        group: dist.ProcessGroup | None,
        layout: SlotLayout,
        timeout_s: float,
        verify: bool,
    ) -> SwapRuntime:
        distributed = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank(group) if distributed else 0
        world = dist.get_world_size(group) if distributed else 1
        if world != placement.num_gpus:
            raise ValueError(f"the placement spans {placement.num_gpus} GPUs but the group has {world} ranks")
        if len(slots_L) != placement.num_layers or not slots_L:
            raise ValueError(f"need slot buffers for {placement.num_layers} layers, got {len(slots_L)}")
        S = placement.slots_per_gpu
        views = layout.slot_views(slots_L[0], 0)
        for layer, tensors in enumerate(slots_L):
            for name, t in tensors.items():
                if t.shape[0] != S:
                    raise ValueError(f"layer {layer} tensor {name!r} has {t.shape[0]} slots, expected S={S}")
        return cls(
            slots_L,
            group,
            control_group(group) if world > 1 else None,
            layout,
            rank,
            world,
            S,
            views[0].device,
            timeout_s,
            verify,
            sum(v.numel() * v.element_size() for v in views),
            2 * len(views),
        )

    def views(self, layer: int, slot: int) -> list[torch.Tensor]:
        local = slot - self.rank * self.slots_per_gpu
        assert 0 <= local < self.slots_per_gpu, "slot belongs to another rank"
        return self.layout.slot_views(self.slots_L[layer], local)

    def block(self, layer: int, slot: int, count: int) -> list[torch.Tensor]:
        local = slot - self.rank * self.slots_per_gpu
        assert local >= 0 and local + count <= self.slots_per_gpu, "slots belong to another rank"
        return self.layout.block_views(self.slots_L[layer], local, count)

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + time.perf_counter() - start

    # ---- control ---------------------------------------------------------------------------
    def _all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            # The control group's own (long) timeout: a slow rank is waited for, a dead one ends the swap.
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.control)
        return t

    def check_same_plan_input(self, fingerprint: int) -> None:
        """Raise ValueError on every rank unless all ranks are about to run the same swap.

        Sums of the fingerprint's two 16-bit halves and of their squares: all ranks agree exactly
        when each half has zero variance over ranks.
        """
        hi, lo = (fingerprint >> 16) & 0xFFFF, fingerprint & 0xFFFF
        with self.timed("check"):
            got = self._all_reduce_sum(torch.tensor([hi, lo, hi * hi, lo * lo], dtype=torch.int64)).tolist()
        n = self.world_size
        if got != [n * hi, n * lo, n * hi * hi, n * lo * lo]:
            raise ValueError("ranks disagree on the placements or layers of this hot-swap")

    def agree(self, plan: SwapPlan | None, run: ChunkRun | None, commit_failed: bool) -> tuple[bool, bool]:
        """(chunk failed on some rank or arrived changed, a staged write of the previous chunk failed)."""
        with self.timed("agree"):
            position = (
                {}
                if run is None or plan is None
                else {i: j for j, i in enumerate(plan.chunks[run.index].transfers)}
            )
            width = self.checksum_width if self.verify else 0
            vec = torch.zeros(2 + len(position) * width, dtype=torch.int64)
            vec[0] = int(run is not None and run.failed)
            vec[1] = int(commit_failed)
            if run is not None and self.verify and not run.failed:
                try:
                    self._fill_checksums(run, position, width, vec)
                except Exception as exc:
                    run.fail("verify", exc)
                    vec[0] = 1
            self._all_reduce_sum(vec)
        mismatch = bool((vec[2:] != 0).any())
        if mismatch and run is not None:
            run.errors.append(f"chunk {run.index} verify: checksum mismatch")
        return bool(vec[0] > 0) or mismatch, bool(vec[1] > 0)

    def _fill_checksums(self, run: ChunkRun, position: dict[int, int], width: int, vec: torch.Tensor) -> None:
        cs = {k: [(c & MASK31).cpu() for c in v] for k, v in run.checksums.items()}
        if "src" in cs and not all(torch.equal(a, b) for a, b in zip(cs["src"], cs["dst"], strict=True)):
            run.fail("verify", RuntimeError("checksum mismatch in a local copy"))
            vec[0] = 1
        view = vec[2:].view(-1, width) if width else vec[2:].view(0, 0)
        for key, sign, blocks in (("send", 1, run.sends), ("recv", -1, run.recvs)):
            for block, c in zip(blocks, cs.get(key, []), strict=False):
                rows = torch.tensor([position[i] for i in block.transfers], dtype=torch.int64)
                view.index_add_(0, rows, sign * c)

    # ---- one chunk -------------------------------------------------------------------------
    def start_chunk(self, plan: SwapPlan, k: int, epoch: int, fault: Callable[..., None] | None) -> ChunkRun:
        """Staging, local copies, post the chunk's sends and receives, then sender checksums."""
        run = ChunkRun(k)
        with self.timed("start"):
            if fault is not None:
                try:
                    fault("prepare", k, [])
                except Exception as exc:  # injected: keep going so peers are not left waiting
                    run.fail("prepare", exc)
            for b in chunk_blocks(plan, k):
                if b.src_gpu == self.rank and b.dst_gpu == self.rank:
                    run.local.append(b)
                elif b.src_gpu == self.rank:
                    run.sends.append(b)
                elif b.dst_gpu == self.rank:
                    run.recvs.append(b)
            ops: list[dist.P2POp] = []
            try:
                for b in [*run.local, *run.recvs]:
                    first = self.block(b.layer, b.dst_slot, b.count)
                    run.primary[b.index] = [torch.empty_like(v) for v in first] if b.staged else first
                if run.local:
                    sources = [self.block(b.layer, b.src_slot, b.count) for b in run.local]
                    if self.verify:
                        run.checksums["src"] = [block_checksums(src) for src in sources]
                    for b, src in zip(run.local, sources, strict=True):
                        for dst, s in zip(run.primary[b.index], src, strict=True):
                            dst.copy_(s)
                peers = sorted({b.dst_gpu for b in run.sends} | {b.src_gpu for b in run.recvs})
                for peer in peers:
                    ops.extend(self._peer_ops(run, peer, epoch))
            except Exception as exc:
                run.fail("prepare", exc)
            try:
                if ops:
                    run.works = list(dist.batch_isend_irecv(ops))
            except Exception as exc:
                run.fail("post", exc)
            try:
                if self.verify and run.sends:  # computed while the bytes travel (both only read them)
                    run.checksums["send"] = [
                        block_checksums(self.block(b.layer, b.src_slot, b.count)) for b in run.sends
                    ]
            except Exception as exc:
                run.fail("prepare", exc)
        return run

    def _peer_ops(self, run: ChunkRun, peer: int, epoch: int) -> list[dist.P2POp]:
        base = (epoch << 29) | ((run.index & 0x3FFF) << 15)
        ops = []
        sends = [b for b in run.sends if b.dst_gpu == peer]
        for j, v in enumerate(v for b in sends for v in self.block(b.layer, b.src_slot, b.count)):
            ops.append(dist.P2POp(dist.isend, as_bytes(v), peer, self.group, base | (j & 0x7FFF)))
        recvs = [b for b in run.recvs if b.src_gpu == peer]
        for j, v in enumerate(v for b in recvs for v in run.primary[b.index]):
            ops.append(dist.P2POp(dist.irecv, as_bytes(v), peer, self.group, base | (j & 0x7FFF)))
        return ops

    def finish_chunk(self, run: ChunkRun, fault: Callable[..., None] | None) -> None:
        """Wait for the chunk, then checksum what arrived (compared at :meth:`agree`)."""
        if run.finished:
            return
        run.finished = True
        with self.timed("wait"):
            try:
                if not self._wait(run):
                    run.fail("wait", TimeoutError(f"transfers not done after {self.timeout_s} s"))
                    return
                run.completed = True
            except Exception as exc:
                run.fail("wait", exc)
                return
        with self.timed("verify"):
            try:
                if fault is not None:
                    fault("received", run.index, [v for b in run.recvs for v in run.primary[b.index]])
                if self.verify:
                    run.checksums["recv"] = [block_checksums(run.primary[b.index]) for b in run.recvs]
                    run.checksums["dst"] = [block_checksums(run.primary[b.index]) for b in run.local]
            except Exception as exc:
                run.fail("verify", exc)

    def write_direct(self, plan: SwapPlan, run: ChunkRun) -> None:
        """Copy each landed block to its destinations that are not staged (fan-out of one expert)."""
        if run.failed:
            return  # its destinations count as unknown anyway
        chunk = plan.chunks[run.index]
        with self.timed("commit"):
            try:
                for b in [*run.local, *run.recvs]:
                    bufs = run.primary[b.index]
                    if b.staged:  # direct destinations of a staged fan-out still take their copy now
                        t = plan.transfers[b.transfers[0]]
                        for d in t.dst_slots:
                            if (t.layer, d) not in chunk.staged:
                                _copy_all(self.block(t.layer, d, 1), bufs)
                    elif b.count == 1:
                        t = plan.transfers[b.transfers[0]]
                        for d in t.dst_slots[1:]:
                            _copy_all(self.block(t.layer, d, 1), bufs)
            except Exception as exc:
                run.fail("write", exc)

    def commit(self, plan: SwapPlan, run: ChunkRun) -> str | None:
        """Write staged destinations (after the chunk was agreed). The error, if a copy failed."""
        chunk = plan.chunks[run.index]
        with self.timed("commit"):
            try:
                for b in [*run.local, *run.recvs]:
                    if not b.staged:
                        continue
                    bufs = run.primary[b.index]
                    if b.count > 1:
                        _copy_all(self.block(b.layer, b.dst_slot, b.count), bufs)
                        continue
                    t = plan.transfers[b.transfers[0]]
                    for d in t.dst_slots:
                        if (t.layer, d) in chunk.staged:
                            _copy_all(self.block(t.layer, d, 1), bufs)
            except Exception as exc:
                return f"chunk {run.index} commit: {type(exc).__name__}: {exc}"
        return None

    def _wait(self, run: ChunkRun) -> bool:
        """Wait for the chunk's transfers up to the deadline; False on timeout (the ops stay posted).

        A timed-out wait inside Gloo or NCCL tears the connection down, so the deadline is kept
        here instead: CUDA works are polled, CPU works are waited for on a helper thread. A late
        peer then still completes its transfers, and the rollback can use the same group.
        """
        if not run.works:
            return True
        deadline = time.monotonic() + self.timeout_s
        if self.device.type == "cuda":
            while not all(w.is_completed() for w in run.works):
                if time.monotonic() > deadline:
                    return False
                time.sleep(20e-6)
            for w in run.works:
                w.wait()  # orders the current stream after the transfers
            return True
        run.waiter = threading.Thread(target=_wait_works, args=(run,), daemon=True)
        run.waiter.start()
        run.waiter.join(max(0.0, deadline - time.monotonic()))
        if run.waiter.is_alive():
            return False
        if run.wait_error is not None:
            raise run.wait_error
        return True

    def drain(self, run: ChunkRun) -> None:
        """Let a discarded or timed-out chunk finish (its peers posted it too); ignore its errors."""
        if run.completed:
            return
        if run.waiter is not None:
            run.waiter.join()
            return
        run.finished = True
        for work in run.works:
            try:
                work.wait()
            except Exception as exc:
                run.errors.append(f"chunk {run.index} drain: {type(exc).__name__}: {exc}")
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


def control_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """A CPU (Gloo) group over the same ranks: ``group`` itself when it runs Gloo, else one made once.

    Creating a group is collective: every rank of ``group`` reaches here in the same hot-swap call.
    """
    if "gloo" in str(dist.get_backend(group)):
        return group
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    key = (id(dist.group.WORLD), *ranks)  # a new default group (after re-init) gets new control groups
    if key not in _CONTROL_GROUPS:
        _CONTROL_GROUPS[key] = dist.new_group(
            ranks, backend="gloo", timeout=datetime.timedelta(minutes=10), use_local_synchronization=True
        )
    return _CONTROL_GROUPS[key]


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    for a, b in zip(dst, src, strict=True):
        a.copy_(b)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of contiguous ``t`` (same storage): fp8 and other dtypes travel as raw bytes."""
    return t.reshape(-1).view(torch.uint8)


def _wait_works(run: ChunkRun) -> None:
    try:
        for work in run.works:
            work.wait()
    except Exception as exc:
        run.wait_error = exc
