"""One group of a hot-swap on this rank: post, land, wait, agree, and undo it if it failed.

:class:`GroupRun` runs one compiled group (eplb.hotswap.program) on this rank's buffers
(eplb.hotswap.runtime) and settles it through its agreement (eplb.hotswap.agreement). Nothing
here raises on a transfer failure: errors are recorded and settled by the agreement, so every
rank keeps taking part in every collective; a dead peer is left to the process group's timeout.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from eplb.hotswap.agreement import agree_now, queue_agreement, read_agreement
from eplb.hotswap.program import Check, GroupProgram
from eplb.hotswap.runtime import SwapRuntime

_STREAMS: dict[int, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}


@dataclass
class GroupOutcome:
    """How one group ended on this rank (``failed`` and ``fatal`` are the same on every rank)."""

    failed: bool
    fatal: bool
    errors: list[str]


class GroupRun:
    """One group on this rank: its agreement vector, backups, transfers and recorded errors.

    :meth:`start` posts it, :meth:`finish` settles it and :meth:`restore` lets a failed group's
    transfers finish and copies its backups back. On CUDA two side streams keep the link busy: a
    copy stream takes the backups and local copies, and every piece's ``batch_isend_irecv`` is
    posted from it (so NCCL waits only for the backups the piece needs); a checksum stream
    checksums what this rank sends as soon as it is backed up, then what it receives as soon as
    each piece has landed, while later pieces are on the wire. The agreement is queued behind all
    of it, so the host waits once, and a group that overlaps the previous one
    (``GroupProgram.overlaps_previous``) is posted before the host waits for that one. On CPU, or
    with a fault hook, the host waits for the transfers (with a deadline) first and checksums what
    arrived itself.

    ``slot`` (0 or 1) picks the agreement's pinned buffers: two groups may be unsettled at once.
    """

    def __init__(
        self,
        rt: SwapRuntime,
        prog: GroupProgram,
        fault: Callable[..., None] | None,
        slot: int = 0,
        fatal: bool = False,
    ) -> None:
        self.rt, self.prog, self.fault, self.slot, self.fatal = rt, prog, fault, slot, fatal
        self.done: torch.cuda.Event | None = None
        self.cuda = rt.device.type == "cuda"
        self.streams = _streams(rt.device) if self.cuda else None
        self.defer = fault is not None or not self.cuda  # receivers checksum after the host wait
        self.errors: list[str] = []
        self.works: list[Any] = []
        with self._on(1):  # zeroed in the order of the checksums that add into it (side stream)
            self.vec = torch.zeros(prog.vector_length, dtype=torch.int64, device=rt.device)
        self.backups = rt.backup_views(prog)
        self.waiter = Waiter(self.works, rt.timeout_s, self.cuda)
        # Checksums next to a transfer leave SMs to NCCL; after the last one they take the GPU.
        self.overlap, self.full = max(1, 2 * rt.sms // 3), 4 * rt.sms

    @classmethod
    def start(
        cls,
        rt: SwapRuntime,
        prog: GroupProgram,
        epoch: int,
        fault: Callable[..., None] | None,
        *,
        slot: int = 0,
        fatal: bool = False,
    ) -> GroupRun:
        """Post group ``prog`` on this rank (and on CUDA queue its agreement); :meth:`finish` it later."""
        with rt.timed("setup"):
            run = cls(rt, prog, fault, slot, fatal)
        with rt.timed("post"):
            run.post(epoch)
            if not run.defer:
                run.done = queue_agreement(rt, run.vec, prog, slot=slot, failed=bool(run.errors), fatal=fatal)
        return run

    def finish(self) -> GroupOutcome:
        """Settle the group: every rank learns whether any rank failed (collective on CPU)."""
        rt, prog, timed_out = self.rt, self.prog, False
        if self.defer:
            with rt.timed("wait"):
                landed = self.waiter.wait()
                self.errors += [f"chunk {prog.chunk} wait: {e}" for e in self.waiter.errors]
            if landed:
                with rt.timed("verify"):
                    self.land_deferred()
            with rt.timed("agree"):
                failed, any_fatal, mismatch = agree_now(rt, self.vec, bool(self.errors), self.fatal, prog)
        else:
            assert self.done is not None, "a group not deferred has its agreement queued at start"
            with rt.timed("agree"):  # queued behind the transfers: this is also the wait for them
                failed, any_fatal, mismatch, timed_out = read_agreement(
                    rt, self.vec, prog, slot=self.slot, done=self.done
                )
        if timed_out and failed:
            self.errors.append(f"chunk {prog.chunk} wait: TimeoutError: not done after {rt.timeout_s} s")
        if mismatch:
            self.errors.append(f"chunk {prog.chunk} verify: checksum mismatch in transfers {mismatch}")
        return GroupOutcome(failed, any_fatal, self.errors)

    def restore(self) -> str | None:
        """Undo a started group that did not commit: let its transfers finish, copy its backups back."""
        with self.rt.timed("restore"):
            self.waiter.drain()
            try:
                self.rt.copy_all(self.prog.restore, self.backups)
            except Exception as exc:
                return f"chunk {self.prog.chunk} restore: {type(exc).__name__}: {exc}"
        return None

    @contextlib.contextmanager
    def recording(self, where: str) -> Iterator[None]:
        """Record an exception instead of raising it (the agreement settles it on every rank)."""
        try:
            yield
        except Exception as exc:
            self.errors.append(f"chunk {self.prog.chunk} {where}: {type(exc).__name__}: {exc}")

    def _on(self, which: int) -> contextlib.AbstractContextManager[Any]:
        return (
            torch.cuda.stream(self.streams[which]) if self.streams is not None else contextlib.nullcontext()
        )

    def _follow(self, waiter: int, leader: int | None) -> None:
        """Stream ``waiter`` (0 copy, 1 checksum) waits for ``leader`` (None: the current stream)."""
        if self.streams is not None:
            current = torch.cuda.current_stream(self.rt.device)
            self.streams[waiter].wait_stream(current if leader is None else self.streams[leader])

    def post(self, epoch: int) -> None:
        """Backups and every piece's transfers; source checksums, then arrival checksums, queued behind."""
        prog, rt = self.prog, self.rt
        if not prog.overlaps_previous:
            # Everything before, the previous group included. An overlapping group touches no slot
            # the previous one does, so it need not wait behind that group's agreement.
            self._follow(0, None)
            self._follow(1, None)
        if self.fault is not None:
            with self.recording("prepare"):
                self.fault("prepare", prog.chunk, [])
        per_piece: list[list[Any]] = []
        for j, piece in enumerate(prog.pieces):
            got: list[Any] = []
            with self.recording("post"), self._on(0):
                rt.copy_all(piece.backups, self.backups)
                tag = (epoch << 30) | ((prog.chunk & 0x3FF) << 20) | ((j & 0x3FF) << 10)
                ops = rt.p2p_ops(piece, self.backups, tag)
                if ops:
                    got.extend(dist.batch_isend_irecv(ops))
            per_piece.append(got)
            self.works.extend(got)
            with self.recording("checksum"), self._on(1):
                self._follow(1, 0)  # what this piece sends is backed up
                self._checks(piece.src_checks, self.overlap)
        if not self.defer:
            with self.recording("receive"), self._on(1):
                for j, got in enumerate(per_piece):
                    self._land(j, got)
        with self.recording("local copy"):
            with self._on(0):
                rt.copy_all(prog.local.backups, self.backups)
                for src, dst in prog.local.copies:
                    local_copy(rt.views(dst, self.backups), rt.views(src, self.backups))
            with self._on(1):
                self._follow(1, 0)
                self._checks(prog.local.src_checks, self.full)
                self._checks(prog.local.dst_checks, self.full)
        if self.streams is not None:
            current = torch.cuda.current_stream(rt.device)
            current.wait_stream(self.streams[0])
            current.wait_stream(self.streams[1])
            with self.recording("post"):
                for w in self.works:
                    w.wait()  # the current stream (the agreement) waits for the sends too

    def land_deferred(self) -> None:
        """After the host wait: the fault hook, then every piece's fan-out copies and checksums."""
        if self.fault is not None:
            with self.recording("received"):
                spans = [span for p in self.prog.pieces for _, span in p.recvs]
                self.fault(
                    "received", self.prog.chunk, [v for s in spans for v in self.rt.views(s, self.backups)]
                )
        for j in range(len(self.prog.pieces)):
            with self.recording("receive"):
                self._land(j, [])

    def _land(self, j: int, works: list[Any]) -> None:
        """After piece j arrived (stream-ordered on CUDA): fan-out copies, destination checksums."""
        piece = self.prog.pieces[j]
        for w in works:
            w.wait()  # on CUDA: the current (checksum) stream waits for the transfer
        for src, dst in piece.copies:
            local_copy(self.rt.views(dst, self.backups), self.rt.views(src, self.backups))
        self._checks(piece.dst_checks, self.full if j == len(self.prog.pieces) - 1 else self.overlap)

    def _checks(self, checks: list[Check], programs: int) -> None:
        for check in checks:
            check.task(self.rt.buffer(check, self.backups), self.vec, programs)


class Waiter:
    """Waits for a group's transfers up to a deadline; a timed-out group keeps its transfers posted.

    A timed-out wait inside Gloo or NCCL tears the connection down, so the deadline is kept here:
    CUDA works are polled (they complete in order), CPU works are waited for on a helper thread.
    A late peer then still completes its transfers, and the rollback can use the same group.
    """

    def __init__(self, works: list[Any], timeout_s: float, cuda: bool) -> None:
        self.works, self.timeout_s, self.cuda = works, timeout_s, cuda
        self.errors: list[str] = []
        self.thread: threading.Thread | None = None
        self.completed = False

    def wait(self) -> bool:
        if not self.works:
            self.completed = True
            return True
        deadline = time.monotonic() + self.timeout_s
        try:
            if self.cuda:
                i = 0
                while i < len(self.works):
                    if self.works[i].is_completed():
                        i += 1
                    elif time.monotonic() > deadline:
                        self.errors.append(f"TimeoutError: transfers not done after {self.timeout_s} s")
                        return False
                for w in self.works:
                    w.wait()  # orders the current stream after the transfers
            else:
                self.thread = threading.Thread(target=self._wait_all, daemon=True)
                self.thread.start()
                self.thread.join(max(0.0, deadline - time.monotonic()))
                if self.thread.is_alive():
                    self.errors.append(f"TimeoutError: transfers not done after {self.timeout_s} s")
                    return False
                if self.errors:
                    return False
        except Exception as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")
            return False
        self.completed = True
        return True

    def _wait_all(self) -> None:
        try:
            for w in self.works:
                w.wait()
        except Exception as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}")

    def drain(self) -> None:
        """Let a failed group's transfers finish (its peers posted them too); ignore their errors."""
        if self.completed:
            return
        if self.thread is not None:
            self.thread.join()
            return
        for w in self.works:
            with contextlib.suppress(Exception):
                w.wait()
        if self.cuda:
            torch.cuda.synchronize()


def local_copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """A local move of one or more slots (every view); tests patch it to inject a bad copy."""
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)


def _streams(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        _STREAMS[index] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
    return _STREAMS[index]
