"""One rank's side of a hot-swap chunk: post, wait, verify, agree, commit (used by eplb.hotswap).

Shape legend: S slots per GPU; a slot's data is the list of views ``layout.slot_views`` returns.

Messages between two ranks follow the chunk's transfer order (each transfer's views, then one
checksum tensor), so NCCL matches them by order and Gloo by tag. Nothing here raises on a
transfer failure: errors are recorded in the :class:`ChunkRun` and settled by :meth:`SwapRuntime.agree`,
so every rank keeps taking part in every collective and no rank waits forever.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from eplb.hotswap_checksum import expert_checksum
from eplb.hotswap_layout import SlotLayout
from eplb.hotswap_plan import SwapPlan, Transfer
from eplb.placement import Placement


@dataclass
class ChunkRun:
    """State of one chunk on this rank."""

    index: int
    works: list[Any] = field(default_factory=list)
    primary: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """transfer -> buffers the expert lands in first (its first slot, or staging)."""
    recvs_from: dict[int, list[int]] = field(default_factory=dict)
    local: list[int] = field(default_factory=list)
    src_checksum: dict[int, torch.Tensor] = field(default_factory=dict)
    checksum_in: dict[int, torch.Tensor] = field(default_factory=dict)
    mismatch_1: torch.Tensor | None = None
    failed: bool = False
    finished: bool = False
    errors: list[str] = field(default_factory=list)
    completed: bool = False
    waiter: threading.Thread | None = None
    wait_error: Exception | None = None

    def fail(self, where: str, exc: BaseException) -> None:
        self.failed = True
        self.errors.append(f"chunk {self.index} {where}: {type(exc).__name__}: {exc}")


@dataclass
class SwapRuntime:
    """This rank's slot buffers and process group, for one hot-swap call."""

    slots_L: Sequence[Mapping[str, torch.Tensor]]
    group: dist.ProcessGroup | None
    layout: SlotLayout
    rank: int
    world_size: int
    slots_per_gpu: int
    device: torch.device
    timeout_s: float
    verify: bool
    bytes_per_expert: int

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
            layout,
            rank,
            world,
            S,
            views[0].device,
            timeout_s,
            verify,
            sum(v.numel() * v.element_size() for v in views),
        )

    def views(self, layer: int, slot: int) -> list[torch.Tensor]:
        local = slot - self.rank * self.slots_per_gpu
        assert 0 <= local < self.slots_per_gpu, "slot belongs to another rank"
        return self.layout.slot_views(self.slots_L[layer], local)

    # ---- collectives -----------------------------------------------------------------------
    def _all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            # The group's own (long) timeout: a slow rank is waited for, a dead one ends the swap.
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t

    def check_same_plan_input(self, fingerprint: int) -> None:
        """Raise ValueError on every rank unless all ranks are about to run the same swap."""
        t = torch.tensor([fingerprint, -fingerprint], dtype=torch.int64, device=self.device)
        lo_hi = self._all_reduce_max(t).tolist()
        if lo_hi[0] != -lo_hi[1]:
            raise ValueError("ranks disagree on the placements or layers of this hot-swap")

    def agree(self, failed: bool, mismatch_1: torch.Tensor | None, commit_failed: bool) -> tuple[bool, bool]:
        """(some rank failed this chunk, some rank failed a staged write of the previous one)."""
        status = torch.tensor([int(failed), int(commit_failed)], dtype=torch.int32, device=self.device)
        if mismatch_1 is not None:
            status[0] = torch.maximum(status[0], mismatch_1.to(torch.int32).reshape(()))
        flags = self._all_reduce_max(status).tolist()
        return bool(flags[0]), bool(flags[1])

    # ---- one chunk -------------------------------------------------------------------------
    def start_chunk(self, plan: SwapPlan, k: int, epoch: int, fault: Callable[..., None] | None) -> ChunkRun:
        """Local copies, sender checksums, staging, then post the chunk's sends and receives."""
        run = ChunkRun(k)
        chunk = plan.chunks[k]
        if fault is not None:
            try:
                fault("prepare", k, [])
            except Exception as exc:  # injected: keep going so peers are not left waiting
                run.fail("prepare", exc)
        sends_to: dict[int, list[int]] = {}
        for i in chunk.transfers:
            t = plan.transfers[i]
            if t.src_gpu == self.rank and t.dst_gpu == self.rank:
                run.local.append(i)
            elif t.src_gpu == self.rank:
                sends_to.setdefault(t.dst_gpu, []).append(i)
            elif t.dst_gpu == self.rank:
                run.recvs_from.setdefault(t.src_gpu, []).append(i)
        ops: list[dist.P2POp] = []
        try:
            for i in [*run.local, *(i for lst in run.recvs_from.values() for i in lst)]:
                t = plan.transfers[i]
                first = self.views(t.layer, t.dst_slots[0])
                staged = any((t.layer, d) in chunk.staged for d in t.dst_slots)
                run.primary[i] = [torch.empty_like(v) for v in first] if staged else first
            for i in run.local:
                t = plan.transfers[i]
                src = self.views(t.layer, t.src_slot)
                if self.verify:
                    run.src_checksum[i] = expert_checksum(src)
                for dst, s in zip(run.primary[i], src, strict=True):
                    dst.copy_(s)
            for peer in sorted(set(sends_to) | set(run.recvs_from)):
                ops.extend(self._peer_ops(plan, run, peer, sends_to.get(peer, []), epoch))
        except Exception as exc:
            run.fail("prepare", exc)
        try:
            if ops:
                run.works = list(dist.batch_isend_irecv(ops))
        except Exception as exc:
            run.fail("post", exc)
        return run

    def _peer_ops(
        self, plan: SwapPlan, run: ChunkRun, peer: int, sends: list[int], epoch: int
    ) -> list[dist.P2POp]:
        base = (epoch << 29) | ((run.index & 0x3FFF) << 15)
        ops = []
        for j, v in enumerate(
            v for i in sends for v in self.views(plan.transfers[i].layer, plan.transfers[i].src_slot)
        ):
            ops.append(dist.P2POp(dist.isend, as_bytes(v), peer, self.group, base | (j & 0x7FFF)))
        if self.verify and sends:
            out = torch.stack([expert_checksum(self._src_views(plan.transfers[i])) for i in sends])
            ops.append(dist.P2POp(dist.isend, out, peer, self.group, base | 0x7FFF))
        recvs = run.recvs_from.get(peer, [])
        for j, v in enumerate(v for i in recvs for v in run.primary[i]):
            ops.append(dist.P2POp(dist.irecv, as_bytes(v), peer, self.group, base | (j & 0x7FFF)))
        if self.verify and recvs:
            width = 2 * len(run.primary[recvs[0]])
            run.checksum_in[peer] = torch.empty(len(recvs), width, dtype=torch.int64, device=self.device)
            ops.append(dist.P2POp(dist.irecv, run.checksum_in[peer], peer, self.group, base | 0x7FFF))
        return ops

    def _src_views(self, t: Transfer) -> list[torch.Tensor]:
        return self.views(t.layer, t.src_slot)

    def finish_chunk(self, run: ChunkRun, fault: Callable[..., None] | None) -> None:
        """Wait for the chunk, verify what arrived, and write the direct destinations."""
        if run.finished:
            return
        run.finished = True
        try:
            if not self._wait(run):
                run.fail("wait", TimeoutError(f"transfers not done after {self.timeout_s} s"))
                return
            run.completed = True
        except Exception as exc:
            run.fail("wait", exc)
            return
        try:
            received = [run.primary[i] for lst in run.recvs_from.values() for i in lst]
            if fault is not None:
                fault("received", run.index, [v for bufs in received for v in bufs])
            if self.verify:
                mismatch = torch.zeros((), dtype=torch.bool, device=self.device)
                for peer, lst in run.recvs_from.items():
                    got = torch.stack([expert_checksum(run.primary[i]) for i in lst])
                    mismatch |= (got != run.checksum_in[peer]).any()
                for i in run.local:
                    mismatch |= (expert_checksum(run.primary[i]) != run.src_checksum[i]).any()
                run.mismatch_1 = mismatch
        except Exception as exc:
            run.fail("verify", exc)

    def write_direct(self, plan: SwapPlan, run: ChunkRun) -> None:
        """Copy each landed expert to its other destinations that are not staged."""
        if run.failed:
            return  # its destinations count as unknown anyway
        chunk = plan.chunks[run.index]
        try:
            for i, bufs in run.primary.items():
                t = plan.transfers[i]
                for d in t.dst_slots:
                    if (t.layer, d) in chunk.staged:
                        continue
                    dst = self.views(t.layer, d)
                    if dst[0].data_ptr() != bufs[0].data_ptr():
                        for a, b in zip(dst, bufs, strict=True):
                            a.copy_(b)
        except Exception as exc:
            run.fail("write", exc)

    def commit(self, plan: SwapPlan, run: ChunkRun) -> str | None:
        """Write staged destinations (after the chunk was agreed). The error, if a copy failed."""
        chunk = plan.chunks[run.index]
        try:
            for i, bufs in run.primary.items():
                t = plan.transfers[i]
                for d in t.dst_slots:
                    if (t.layer, d) in chunk.staged:
                        for a, b in zip(self.views(t.layer, d), bufs, strict=True):
                            a.copy_(b)
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


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of contiguous ``t`` (same storage): fp8 and other dtypes travel as raw bytes."""
    return t.reshape(-1).view(torch.uint8)


def _wait_works(run: ChunkRun) -> None:
    try:
        for work in run.works:
            work.wait()
    except Exception as exc:
        run.wait_error = exc
