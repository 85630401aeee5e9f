"""One group of a hot-swap on this rank: post it, land it in staging, wait, agree.

:class:`GroupRun` runs one compiled group (eplb.hotswap.program) on this rank's buffers
(eplb.hotswap.runtime) and settles it through its agreement (eplb.hotswap.agreement). Exceptions
while posting or landing are recorded and settled by the agreement, so every rank keeps taking
part in every collective; every wait has a deadline and watches the swap's control
(eplb.hotswap.control), which raises :class:`~eplb.hotswap.control.SwapFailure` for a lost or
late peer. Nothing here writes a slot: arrivals wait in staging until the swap commits.
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
from eplb.hotswap.control import SwapControl
from eplb.hotswap.program import Check, GroupProgram
from eplb.hotswap.runtime import SwapRuntime

_STREAMS: dict[int, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}


@dataclass
class GroupOutcome:
    """How one group ended on this rank (``failed`` is the same on every rank)."""

    failed: bool
    errors: list[str]
    mismatched: list[int]
    """Rows (transfers of the group) whose checksums differ."""


class GroupRun:
    """One group on this rank: its agreement vector, transfers and recorded errors.

    :meth:`start` posts it, :meth:`finish` settles it. On CUDA two side streams keep the link
    busy: a copy stream takes the local copies, and every piece's ``batch_isend_irecv`` is posted
    from it; a checksum stream checksums what this rank sends, then what it receives as soon as
    each piece has landed, while later pieces are on the wire. The agreement is queued behind all
    of it, so the host waits once, and every group after the first is posted before the host waits
    for the one before (``GroupProgram.overlaps_previous``). On CPU, or with a fault hook, the host
    waits for the transfers first and checksums what arrived itself.

    ``slot`` (0 or 1) picks the agreement's pinned buffers: two groups may be unsettled at once.
    """

    def __init__(
        self,
        rt: SwapRuntime,
        prog: GroupProgram,
        fault: Callable[..., None] | None,
        slot: int,
        control: SwapControl | None,
    ) -> None:
        self.rt, self.prog, self.fault, self.slot, self.control = rt, prog, fault, slot, control
        self.done: torch.cuda.Event | None = None
        self.cuda = rt.device.type == "cuda"
        self.streams = _streams(rt.device) if self.cuda else None
        self.defer = fault is not None or not self.cuda  # receivers checksum after the host wait
        self.errors: list[str] = []
        self.works: list[Any] = []
        with self._on(1):  # zeroed in the order of the checksums that add into it (side stream)
            self.vec = torch.zeros(prog.vector_length, dtype=torch.int64, device=rt.device)
        self.waiter = Waiter(self.works, self.cuda)
        self.deadline = time.monotonic() + rt.timeout_s
        self.spin = 0.0 if self.cuda else 1e-4  # a GPU event is polled hot; CPU cores go to Gloo
        # Checksums next to a transfer leave SMs to NCCL; after the last one they take the GPU.
        self.overlap, self.full = max(1, 2 * rt.sms // 3), 4 * rt.sms

    @classmethod
    def start(
        cls,
        rt: SwapRuntime,
        prog: GroupProgram,
        tag: int,
        fault: Callable[..., None] | None,
        *,
        slot: int = 0,
        control: SwapControl | None = None,
    ) -> GroupRun:
        """Post group ``prog`` on this rank (and on CUDA queue its agreement); :meth:`finish` it later."""
        with rt.timed("setup"):
            run = cls(rt, prog, fault, slot, control)
        with rt.timed("post"):
            run.post(tag)
            if not run.defer:
                run.done = queue_agreement(rt, run.vec, prog, slot=slot, failed=bool(run.errors))
        return run

    def finish(self) -> GroupOutcome:
        """Settle the group: every rank learns whether any rank failed (collective on CPU).

        Raises SwapFailure when the deadline passes, a peer is lost or the swap was given up.
        """
        rt, prog, what = self.rt, self.prog, f"chunk {self.prog.chunk}'s transfers"
        if self.defer:
            with rt.timed("wait"):
                if self.works:
                    assert self.control is not None, "only a group of several ranks transfers"
                    self.waiter.start()
                    self.control.wait(self.waiter.finished, deadline=self.deadline, what=what, spin=self.spin)
                    if self.waiter.errors:  # a connection to a peer broke
                        error = self.waiter.errors[0]
                        raise self.control.lost_peer(what, error) from error
            with rt.timed("verify"):
                self.land_deferred()
            with rt.timed("agree"):
                failed, mismatch = agree_now(
                    rt, self.vec, bool(self.errors), prog, self.control, self.deadline, self.spin
                )
        else:
            assert self.done is not None, "a group not deferred has its agreement queued at start"
            with rt.timed("agree"):  # queued behind the transfers: this is also the wait for them
                failed, mismatch = read_agreement(
                    rt,
                    self.vec,
                    prog,
                    slot=self.slot,
                    done=self.done,
                    control=self.control,
                    deadline=self.deadline,
                    spin=self.spin,
                )
        return GroupOutcome(failed, self.errors, mismatch)

    def settled(self) -> bool:
        """Nothing of this group is still in flight on this rank (no kernel waits for a peer)."""
        if self.done is not None:
            return bool(self.done.query())
        return all(w.is_completed() for w in self.works) if self.cuda else self.waiter.finished()

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

    def post(self, tag: int) -> None:
        """Every piece's transfers; source checksums, then arrival checksums, queued behind."""
        prog, rt = self.prog, self.rt
        if not prog.overlaps_previous:
            # Everything before (a commit's writes, the forward pass): later groups only read slots
            # and write staging rows of their own, so they need not wait for the group before.
            self._follow(0, None)
            self._follow(1, None)
        if self.fault is not None:
            with self.recording("prepare"):
                self.fault("prepare", prog.chunk, [])
        per_piece: list[list[Any]] = []
        for j, piece in enumerate(prog.pieces):
            got: list[Any] = []
            with self.recording("post"), self._on(0):
                ops = rt.p2p_ops(piece, tag | ((prog.chunk & 0x3FF) << 20) | ((j & 0x3FF) << 10))
                if ops:
                    got.extend(dist.batch_isend_irecv(ops))
            per_piece.append(got)
            self.works.extend(got)
            with self.recording("checksum"), self._on(1):
                self._checks(piece.src_checks, self.overlap)
        if not self.defer:
            with self.recording("receive"), self._on(1):
                for j, got in enumerate(per_piece):
                    self._land(j, got)
        with self.recording("local copy"):
            with self._on(0):
                for src, dst in prog.local.copies:
                    local_copy(rt.views(dst), rt.views(src))
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
        """After the host wait: the fault hook, then every piece's destination checksums."""
        if self.fault is not None:
            with self.recording("received"):
                spans = [span for p in self.prog.pieces for _, span in p.recvs]
                self.fault("received", self.prog.chunk, [v for s in spans for v in self.rt.views(s)])
        for j in range(len(self.prog.pieces)):
            with self.recording("receive"):
                self._land(j, [])

    def _land(self, j: int, works: list[Any]) -> None:
        """After piece j arrived (stream-ordered on CUDA): its destination checksums."""
        piece = self.prog.pieces[j]
        for w in works:
            w.wait()  # on CUDA: the current (checksum) stream waits for the transfer
        self._checks(piece.dst_checks, self.full if j == len(self.prog.pieces) - 1 else self.overlap)

    def _checks(self, checks: list[Check], programs: int) -> None:
        for check in checks:
            check.task(self.rt.buffer(check), self.vec, programs)


class Waiter:
    """Tells the host when a group's transfers are done, without blocking inside Gloo or NCCL.

    A wait inside Gloo or NCCL has no deadline, so the host polls instead: CUDA works through
    ``is_completed`` (they complete in order), CPU works through a helper thread that waits for
    them. A group that is given up keeps its transfers posted: an arrival from a late peer then
    lands in staging, never in a slot.
    """

    def __init__(self, works: list[Any], cuda: bool) -> None:
        self.works, self.cuda = works, cuda
        self.errors: list[BaseException] = []
        self.thread: threading.Thread | None = None
        self._next = 0

    def start(self) -> None:
        if not self.cuda and self.thread is None:
            self.thread = threading.Thread(target=self._wait_all, daemon=True, name="eplb-swap-wait")
            self.thread.start()

    def finished(self) -> bool:
        if not self.cuda:
            return self.thread is None or not self.thread.is_alive()
        try:
            while self._next < len(self.works) and self.works[self._next].is_completed():
                self._next += 1
            if self._next < len(self.works):
                return False
            for w in self.works:
                w.wait()  # orders the current stream after the transfers
        except Exception as exc:
            self.errors.append(exc)
        return True

    def _wait_all(self) -> None:
        try:
            for w in self.works:
                w.wait()
        except Exception as exc:
            self.errors.append(exc)


def local_copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """A local move of one or more slots (every view); tests patch it to inject a bad copy."""
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)


def _streams(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        _STREAMS[index] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
    return _STREAMS[index]
