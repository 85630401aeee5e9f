"""This rank's side of a hot-swap: its slot and backup buffers, their views, its collectives.

Shape legend: S slots per GPU, V views per slot; spans and checks come from eplb.hotswap.program.

Compiled programs name slots by :class:`~eplb.hotswap.program.Span` (rows of a layer's slot
buffer or of the backup buffer); :class:`SwapRuntime` turns them into tensor views, point-to-point
ops and copies, and holds the one backup buffer every group of a swap shares. Data and each
group's agreement go over ``group`` (NCCL on GPUs, Gloo on CPU) as raw bytes; the fingerprint
check runs on a CPU (Gloo) group over the same ranks (:func:`control_group`), so it never waits
for the device. Running a group on top of this is eplb.hotswap.group's concern.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from eplb.hotswap.layout import SlotLayout
from eplb.hotswap.program import Check, GroupProgram, Span, Stage
from eplb.placement.model import Placement

_CONTROL_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}
_ALIGN = 512


@dataclass
class SwapRuntime:
    """This rank's slot buffers, backup buffer and process group, for one hot-swap."""

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
        when each half has zero variance over ranks. On the CPU control group: no device sync.
        """
        failed = 0
        try:
            self.reserve_backups(backup_bytes)
        except Exception:  # out of memory here is reported on every rank below
            failed = 1
        hi, lo = (fingerprint >> 16) & 0xFFFF, fingerprint & 0xFFFF
        vec = torch.tensor([hi, lo, hi * hi, lo * lo, failed], dtype=torch.int64)
        if self.world_size > 1:
            dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=control_group(self.group))
        got = vec.tolist()
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

    def backup_views(self, prog: GroupProgram) -> dict[int, list[torch.Tensor]]:
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

    def base_views(self, layer: int) -> list[torch.Tensor]:
        if layer not in self._base:
            self._base[layer] = self.layout.block_views(self.slots_L[layer], 0, self.slots_per_gpu)
        return self._base[layer]

    def views(self, span: Span, backups: dict[int, list[torch.Tensor]]) -> list[torch.Tensor]:
        bases = backups[span.layer] if span.backup else self.base_views(span.layer)
        return [b[span.start : span.start + span.count] for b in bases]

    def buffer(self, check: Check, backups: dict[int, list[torch.Tensor]]) -> torch.Tensor:
        return (backups[check.layer] if check.backup else self.base_views(check.layer))[check.view]

    # ---- transfers -------------------------------------------------------------------------
    def p2p_ops(self, piece: Stage, backups: dict[int, list[torch.Tensor]], tag: int) -> list[dist.P2POp]:
        ops = []
        for kind, items in ((dist.isend, piece.sends), (dist.irecv, piece.recvs)):
            count: dict[int, int] = {}
            for peer, span in items:
                for v in self.views(span, backups):
                    j = count.get(peer, 0)
                    count[peer] = j + 1
                    ops.append(dist.P2POp(kind, as_bytes(v), self.peers[peer], self.group, tag | (j & 0x3FF)))
        return ops

    def copy_all(self, pairs: list[tuple[Span, Span]], backups: dict[int, list[torch.Tensor]]) -> None:
        """Copy each (source, destination) pair of spans (backups, restores)."""
        for src, dst in pairs:
            for d, s in zip(self.views(dst, backups), self.views(src, backups), strict=True):
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


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN
