"""One rank's side of a hot-swap group: back up, post the pieces, checksum, wait, agree (used by eplb.hotswap).

Shape legend: S slots per GPU, V views per slot; programs come from eplb.hotswap_program.

Data moves over ``group`` (NCCL on GPUs, Gloo on CPU) as raw bytes. On CUDA two side streams keep
the link busy: a copy stream takes the backups and local copies, and every piece's
``batch_isend_irecv`` is posted from it (so NCCL waits only for the backups the piece needs); a
checksum stream checksums what a rank sends as soon as it is backed up, and what it receives as
soon as each piece has landed, while the next piece is on the wire. The host only waits (with a
deadline, polling) for the last transfer, then runs the group's one agreement: an all-reduce over
``group`` of the agreement vector (two flags, then each transfer's source and destination
checksums, each written by one rank). On CPU the same steps run in order on the host.

Nothing here raises on a transfer failure: errors are recorded and settled by the agreement, so
every rank keeps taking part in every collective. A failed group is drained (its transfers are
let finish), then its backups are copied back.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from eplb.hotswap_layout import SlotLayout
from eplb.hotswap_program import Check, GroupProgram, Span, Stage
from eplb.placement import Placement

_CONTROL_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}
_STREAMS: dict[int, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}
_PINNED: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
_ALIGN = 512


@dataclass
class GroupOutcome:
    """How one group ended on this rank (``failed`` and ``fatal`` are the same on every rank)."""

    failed: bool
    fatal: bool
    errors: list[str]
    restore_error: str | None = None


@dataclass
class SwapRuntime:
    """This rank's slot buffers, process group and streams, for one hot-swap."""

    slots_L: Sequence[Mapping[str, torch.Tensor]]
    group: dist.ProcessGroup | None
    layout: SlotLayout
    rank: int
    world_size: int
    slots_per_gpu: int
    device: torch.device
    timeout_s: float
    verify: bool
    view_shapes: list[tuple[tuple[int, ...], torch.dtype]]
    peers: list[int]
    """Global rank of each rank of ``group``."""
    agree_device: torch.device
    sms: int
    phase_seconds: dict[str, float] = field(default_factory=dict)
    backup_flat: torch.Tensor | None = None
    _base: dict[int, list[torch.Tensor]] = field(default_factory=dict)

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
        for layer, tensors in enumerate(slots_L):
            for name, t in tensors.items():
                if t.shape[0] != S:
                    raise ValueError(f"layer {layer} tensor {name!r} has {t.shape[0]} slots, expected S={S}")
        views = layout.slot_views(slots_L[0], 0)
        device = views[0].device
        gloo = world == 1 or "gloo" in str(dist.get_backend(group))
        peers = [dist.get_global_rank(group, r) if group is not None else r for r in range(world)]
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        return cls(
            slots_L,
            group,
            layout,
            rank,
            world,
            S,
            device,
            timeout_s,
            verify,
            [(tuple(v.shape), v.dtype) for v in views],
            peers,
            torch.device("cpu") if gloo else device,
            sms,
        )

    @property
    def bytes_per_expert(self) -> int:
        return sum(_nbytes(shape, dtype) for shape, dtype in self.view_shapes)

    @contextlib.contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + time.perf_counter() - start

    # ---- collectives -----------------------------------------------------------------------
    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over ranks in place (through the group's device when ``t`` lives elsewhere)."""
        if self.world_size > 1:
            on = t if t.device == self.agree_device else t.to(self.agree_device)
            dist.all_reduce(on, op=dist.ReduceOp.SUM, group=self.group)
            if on is not t:
                t.copy_(on)
        return t

    def check_same_swap(self, fingerprint: int, backup_bytes: int) -> None:
        """Allocate the backup buffer; raise on every rank unless all ranks run the same swap and have it.

        Sums of the fingerprint's two 16-bit halves and of their squares: all ranks agree exactly
        when each half has zero variance over ranks.
        """
        failed = 0
        try:
            self.reserve_backups(backup_bytes)
        except Exception:  # out of memory here is reported on every rank below
            failed = 1
        hi, lo = (fingerprint >> 16) & 0xFFFF, fingerprint & 0xFFFF
        vec = torch.tensor([hi, lo, hi * hi, lo * lo, failed], dtype=torch.int64, device=self.agree_device)
        got = self.all_reduce_sum(vec).tolist()
        n = self.world_size
        if got[4]:
            raise RuntimeError(f"{got[4]} rank(s) could not allocate {backup_bytes} bytes of swap backups")
        if got[:4] != [n * hi, n * lo, n * hi * hi, n * lo * lo]:
            raise ValueError("ranks disagree on the placements or layers of this hot-swap")

    def agree_flags(self, failed: bool, fatal: bool) -> tuple[bool, bool]:
        """One agreement without checksums (a rollback with nothing to move)."""
        vec = torch.tensor([int(failed), int(fatal)], dtype=torch.int64, device=self.agree_device)
        got = self.all_reduce_sum(vec).tolist()
        return got[0] > 0, got[1] > 0

    # ---- buffers ---------------------------------------------------------------------------
    def reserve_backups(self, nbytes: int) -> None:
        """Make the backup buffer at least ``nbytes`` (groups run one at a time and share it)."""
        if nbytes and (self.backup_flat is None or self.backup_flat.numel() < nbytes):
            self.backup_flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def backup_bytes(self, prog: GroupProgram) -> int:
        return sum(
            _aligned(rows * _nbytes(shape, dtype))
            for rows in prog.backup_rows.values()
            for shape, dtype in self.view_shapes
        )

    def _backup_views(self, prog: GroupProgram) -> dict[int, list[torch.Tensor]]:
        self.reserve_backups(self.backup_bytes(prog))
        out: dict[int, list[torch.Tensor]] = {}
        offset = 0
        for layer, rows in sorted(prog.backup_rows.items()):
            views = []
            for shape, dtype in self.view_shapes:
                nbytes = rows * _nbytes(shape, dtype)
                assert self.backup_flat is not None
                views.append(self.backup_flat[offset : offset + nbytes].view(dtype).view(rows, *shape))
                offset += _aligned(nbytes)
            out[layer] = views
        return out

    def _base_views(self, layer: int) -> list[torch.Tensor]:
        if layer not in self._base:
            self._base[layer] = self.layout.block_views(self.slots_L[layer], 0, self.slots_per_gpu)
        return self._base[layer]

    def _views(self, span: Span, backups: dict[int, list[torch.Tensor]]) -> list[torch.Tensor]:
        bases = backups[span.layer] if span.backup else self._base_views(span.layer)
        return [b[span.start : span.start + span.count] for b in bases]

    def _buffer(self, check: Check, backups: dict[int, list[torch.Tensor]]) -> torch.Tensor:
        return (backups[check.layer] if check.backup else self._base_views(check.layer))[check.view]

    # ---- one group -------------------------------------------------------------------------
    def run_group(
        self, prog: GroupProgram, epoch: int, fault: Callable[..., None] | None, fatal: bool = False
    ) -> GroupOutcome:
        """Run group ``prog`` on this rank and agree on it; a failed group is drained and restored."""
        with self.timed("setup"):
            run = _GroupRun(self, prog, fault)
        with self.timed("post"):
            run.post(epoch)
        timed_out = False
        if run.defer:
            with self.timed("wait"):
                landed = run.waiter.wait()
                run.errors += [f"chunk {prog.chunk} wait: {e}" for e in run.waiter.errors]
            if landed:
                with self.timed("verify"):
                    run.land_deferred()
            with self.timed("agree"):
                failed, any_fatal, mismatch = self._agree(run.vec, bool(run.errors), fatal, prog)
        else:
            with self.timed("agree"):  # queued behind the transfers: this is also the wait for them
                failed, any_fatal, mismatch, timed_out = self._agree_queued(run, fatal)
        if timed_out and failed:
            run.errors.append(f"chunk {prog.chunk} wait: TimeoutError: not done after {self.timeout_s} s")
        if mismatch:
            run.errors.append(f"chunk {prog.chunk} verify: checksum mismatch in transfers {mismatch}")
        if not failed:
            return GroupOutcome(False, any_fatal, run.errors)
        with self.timed("restore"):
            run.waiter.drain()
            restore_error = None
            try:
                self._copy_all(prog.restore, run.backups)
            except Exception as exc:
                restore_error = f"chunk {prog.chunk} restore: {type(exc).__name__}: {exc}"
        return GroupOutcome(True, any_fatal, run.errors, restore_error)

    def _ops(self, piece: Stage, backups: dict[int, list[torch.Tensor]], tag: int) -> list[dist.P2POp]:
        ops = []
        for kind, items in ((dist.isend, piece.sends), (dist.irecv, piece.recvs)):
            count: dict[int, int] = {}
            for peer, span in items:
                for v in self._views(span, backups):
                    j = count.get(peer, 0)
                    count[peer] = j + 1
                    ops.append(dist.P2POp(kind, as_bytes(v), self.peers[peer], self.group, tag | (j & 0x3FF)))
        return ops

    def _copy_all(self, pairs: list[tuple[Span, Span]], backups: dict[int, list[torch.Tensor]]) -> None:
        """Copy each (source, destination) pair of spans (backups, restores)."""
        for src, dst in pairs:
            for d, s in zip(self._views(dst, backups), self._views(src, backups), strict=True):
                d.copy_(s)

    def _agree(
        self, vec: torch.Tensor, failed: bool, fatal: bool, prog: GroupProgram
    ) -> tuple[bool, bool, list[int]]:
        """(failed anywhere or changed in transit, fatal anywhere, mismatched transfer rows)."""
        if failed or fatal:
            vec[:2].copy_(torch.tensor([int(failed), int(fatal)], dtype=torch.int64))
        self.all_reduce_sum(vec)
        got = [*_summary(vec, prog).tolist(), 0]
        return got[0] > 0 or got[2] > 0, got[1] > 0, _mismatched(vec, prog) if got[2] else []

    def _agree_queued(self, run: _GroupRun, fatal: bool) -> tuple[bool, bool, list[int], bool]:
        """The agreement, queued on the GPU behind the transfers and checksums; then the host waits.

        The failure flag is read from pinned host memory when the stream reaches it, i.e. once
        every transfer of this rank has landed: a host whose deadline passes before then sets it,
        so a late transfer fails the group on every rank, as agreed. (failed, fatal, rows, timed out)
        """
        flag, result = _pinned(self.device)
        flag[0], flag[1] = int(bool(run.errors)), int(fatal)
        run.vec[:2].copy_(flag, non_blocking=True)
        self.all_reduce_sum(run.vec)
        summary = _summary(run.vec, run.prog)
        result[: summary.numel()].copy_(summary, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        deadline = time.monotonic() + self.timeout_s
        timed_out = False
        while not done.query():
            if not timed_out and time.monotonic() > deadline:
                flag[0] = 1  # too late for the copy if it already ran: the transfers had landed then
                timed_out = True
        got = result[: summary.numel()].tolist() + [0] * (3 - summary.numel())
        rows = _mismatched(run.vec, run.prog) if got[2] else []
        return got[0] > 0 or got[2] > 0, got[1] > 0, rows, timed_out


def _summary(vec: torch.Tensor, prog: GroupProgram) -> torch.Tensor:
    """int64 [2] or [3] on the vector's device: failures, fatal failures, (checksum halves differ)."""
    if not prog.checksum_width:
        return vec[:2]
    half = prog.num_transfers * prog.checksum_width
    differ = (vec[2 : 2 + half] != vec[2 + half :]).any().to(torch.int64)
    return torch.cat([vec[:2], differ.view(1)])


def _mismatched(vec: torch.Tensor, prog: GroupProgram) -> list[int]:
    """Rows (transfers of the group) whose source and destination checksums differ."""
    half = prog.num_transfers * prog.checksum_width
    differ = vec[2 : 2 + half] != vec[2 + half :]
    return [int(x) for x in differ.view(prog.num_transfers, -1).any(dim=1).nonzero().flatten().tolist()]


class _GroupRun:
    """One group on this rank: its agreement vector, backups, transfers and recorded errors."""

    def __init__(self, rt: SwapRuntime, prog: GroupProgram, fault: Callable[..., None] | None) -> None:
        self.rt, self.prog, self.fault = rt, prog, fault
        self.cuda = rt.device.type == "cuda"
        self.streams = _streams(rt.device) if self.cuda else None
        self.defer = fault is not None or not self.cuda  # receivers checksum after the host wait
        self.errors: list[str] = []
        self.works: list[Any] = []
        self.vec = torch.zeros(prog.vector_length, dtype=torch.int64, device=rt.device)
        self.backups = rt._backup_views(prog)
        self.waiter = _Waiter(self.works, rt.timeout_s, self.cuda)
        # Checksums next to a transfer leave SMs to NCCL; after the last one they take the GPU.
        self.overlap, self.full = max(1, 2 * rt.sms // 3), 4 * rt.sms

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
        self._follow(0, None)
        self._follow(1, None)
        if self.fault is not None:
            with self.recording("prepare"):
                self.fault("prepare", prog.chunk, [])
        per_piece: list[list[Any]] = []
        for j, piece in enumerate(prog.pieces):
            got: list[Any] = []
            with self.recording("post"), self._on(0):
                rt._copy_all(piece.backups, self.backups)
                tag = (epoch << 30) | ((prog.chunk & 0x3FF) << 20) | ((j & 0x3FF) << 10)
                ops = rt._ops(piece, self.backups, tag)
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
                rt._copy_all(prog.local.backups, self.backups)
                for src, dst in prog.local.copies:
                    local_copy(rt._views(dst, self.backups), rt._views(src, self.backups))
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
                    "received", self.prog.chunk, [v for s in spans for v in self.rt._views(s, self.backups)]
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
            local_copy(self.rt._views(dst, self.backups), self.rt._views(src, self.backups))
        self._checks(piece.dst_checks, self.full if j == len(self.prog.pieces) - 1 else self.overlap)

    def _checks(self, checks: list[Check], programs: int) -> None:
        for check in checks:
            check.task(self.rt._buffer(check, self.backups), self.vec, programs)


class _Waiter:
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


def control_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """A CPU (Gloo) group over the same ranks: ``group`` itself when it runs Gloo, else one made once.

    Creating a group is collective: every rank of ``group`` reaches here at the same point.
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


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of contiguous ``t`` (same storage): fp8 and other dtypes travel as raw bytes."""
    return t.reshape(-1).view(torch.uint8)


def _streams(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        _STREAMS[index] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
    return _STREAMS[index]


def _pinned(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Pinned int64 [2] flags and [3] result of this device's agreements (groups run one at a time)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PINNED:
        _PINNED[index] = (
            torch.zeros(2, dtype=torch.int64, pin_memory=True),
            torch.zeros(3, dtype=torch.int64, pin_memory=True),
        )
    return _PINNED[index]


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN
