"""This rank's side of a hot-swap: its slot and staging buffers, their views, its collectives.

Shape legend: S slots per GPU, V views per slot; spans and checks come from eplb.hotswap.program.

Compiled programs name rows by :class:`~eplb.hotswap.program.Span` (rows of a layer's slot buffer
or of the staging buffer); :class:`SwapRuntime` turns them into tensor views, point-to-point ops
and copies, and holds the one staging buffer that every expert this rank receives or copies
waits in until the swap commits. Data and each group's agreement go over ``group`` (NCCL on
GPUs, Gloo on CPU) as raw bytes; the check and the decision go through the store
(eplb.hotswap.control). Running a group on top of this is eplb.hotswap.group's concern. The
process groups themselves are made here: :func:`swap_group` (a timeout of its own, from the swaps'
``timeout_s``), and a group a swap gave up is kept for good (:func:`keep_for_good`).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from eplb.hotswap.layout import SlotLayout
from eplb.hotswap.program import Check, Span, Stage
from eplb.placement.model import Placement

_CONTROL_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}
_KEPT: list[dist.ProcessGroup] = []
"""Groups given up (:func:`keep_for_good`)."""
_ALIGN = 512


@dataclass
class SwapRuntime:
    """This rank's slot buffers, staging buffer and process group, for one hot-swap."""

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
    staging_flat: torch.Tensor | None = None
    staging: list[torch.Tensor] = field(default_factory=list)
    """One view [staging rows, ...] of ``staging_flat`` per slot view."""
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
            _agree_device(group, device, world),
            sms,
        )

    def bind(self, group: dist.ProcessGroup) -> None:
        """Run on ``group`` from now on: a group over the same ranks, in the same order, as the one
        this runtime was made with (a swap group that ``hot_swap`` makes at the check)."""
        assert dist.get_process_group_ranks(group) == self.peers, "a group over the same ranks"
        self.group, self.agree_device = group, _agree_device(group, self.device, self.world_size)

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
    def all_reduce_async(self, t: torch.Tensor) -> tuple[torch.Tensor, dist.Work | None]:
        """Start summing ``t`` over ranks (on the group's device): (the tensor summed into, work)."""
        if self.world_size == 1:
            return t, None
        on = t if t.device == self.agree_device else t.to(self.agree_device)
        return on, dist.all_reduce(on, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over ranks in place, stream-ordered (the CUDA path queues it behind a group)."""
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    # ---- buffers ---------------------------------------------------------------------------
    def staging_bytes(self, rows: int) -> int:
        return sum(_aligned(rows * _nbytes(shape, dtype)) for shape, dtype in self.view_shapes)

    def reserve_staging(self, rows: int) -> None:
        """Allocate the staging buffer: ``rows`` experts (every one this swap writes on this rank)."""
        nbytes = self.staging_bytes(rows)
        if self.staging_flat is None or self.staging_flat.numel() < nbytes:
            self.staging_flat = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
        self.staging, offset = [], 0
        for shape, dtype in self.view_shapes:
            n = rows * _nbytes(shape, dtype)
            self.staging.append(self.staging_flat[offset : offset + n].view(dtype).view(rows, *shape))
            offset += _aligned(n)

    def release_staging(self) -> None:
        self.staging_flat, self.staging = None, []

    def base_views(self, layer: int) -> list[torch.Tensor]:
        if layer not in self._base:
            self._base[layer] = self.layout.block_views(self.slots_L[layer], 0, self.slots_per_gpu)
        return self._base[layer]

    def views(self, span: Span) -> list[torch.Tensor]:
        bases = self.staging if span.staging else self.base_views(span.layer)
        return [b[span.start : span.start + span.count] for b in bases]

    def buffer(self, check: Check) -> torch.Tensor:
        return (self.staging if check.staging else self.base_views(check.layer))[check.view]

    # ---- transfers -------------------------------------------------------------------------
    def p2p_ops(self, piece: Stage, tag: int) -> list[dist.P2POp]:
        ops = []
        for kind, items in ((dist.isend, piece.sends), (dist.irecv, piece.recvs)):
            count: dict[int, int] = {}
            for peer, span in items:
                for v in self.views(span):
                    j = count.get(peer, 0)
                    count[peer] = j + 1
                    ops.append(dist.P2POp(kind, as_bytes(v), self.peers[peer], self.group, tag | (j & 0x3FF)))
        return ops

    def copy_all(self, pairs: list[tuple[Span, Span]]) -> None:
        """Copy each (source, destination) pair of spans (the commit: staging into the slots)."""
        for src, dst in pairs:
            for d, s in zip(self.views(dst), self.views(src), strict=True):
                d.copy_(s)


def _agree_device(group: dist.ProcessGroup | None, device: torch.device, world: int) -> torch.device:
    """Where the agreements' all-reduces run: the host for Gloo, else the slots' device."""
    return torch.device("cpu") if world == 1 or "gloo" in str(dist.get_backend(group)) else device


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


def swap_group(
    serving: dist.ProcessGroup | None, device: torch.device, *, timeout_s: float
) -> dist.ProcessGroup:
    """A new process group over the ranks of ``serving`` for hot-swaps alone: Gloo for CPU slot
    buffers, NCCL for CUDA ones, with a timeout of its own (:func:`swap_group_timeout_s` of the
    swaps' ``timeout_s``, ``HotSwapOptions.timeout_s``).

    A swap given up with transfers still posted (a late or interrupted peer: HotSwapError) leaves
    its group out of step, and the next collective on it may abort the process (Gloo: a size
    mismatch, then ``terminate``). So swaps run on a group of their own, never on the one the model
    serves with, and the caller drops this one after a HotSwapError and makes another once every
    rank is back (``hot_swap`` without a group does this itself: eplb.hotswap.owned).

    Collective over the ranks of ``serving`` only (``use_local_synchronization``): each of them
    calls it at the same point. torch names the group after its ranks and the number of groups
    the calling process holds (:func:`group_count`), so every rank must hold as many groups as the
    others, or the ranks wait for each other under different names until the group's timeout.
    Groups given up are kept, never destroyed: destroying one would lower that count and hand the
    next group the name, and store keys, of an earlier one.
    """
    ranks = (
        dist.get_process_group_ranks(serving) if serving is not None else list(range(dist.get_world_size()))
    )
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=swap_group_timeout_s(timeout_s))
    group = dist.new_group(ranks, backend=backend, timeout=timeout, use_local_synchronization=True)
    if backend == "nccl":
        # NCCL builds a communicator at its first operation, which every rank must join: here,
        # rather than in a swap's point-to-point batches, which leave some ranks out.
        dist.all_reduce(torch.zeros(1, device=device), group=group)
    return group


def swap_group_timeout_s(timeout_s: float) -> float:
    """The timeout of a swap group whose swaps have ``timeout_s``: three times it, at least 10 s,
    at most 5 minutes more than it.

    Every wait of a swap ends within ``timeout_s`` or the swap is given up, so on a group in step
    no operation lasts longer; the group's timeout ends what a swap given up left posted (on Gloo
    an all-reduce or a receive the peers never join holds a worker thread until then: torch's
    default is 30 minutes). The floor leaves room to make the group (its ranks meet in the store)
    and NCCL's first communicator.
    """
    return max(10.0, min(3.0 * timeout_s, timeout_s + 300.0))


def keep_for_good(group: dist.ProcessGroup | None) -> None:
    """Keep a group that a swap gave up alive for the rest of the process, its exit included.

    Its operations may still be posted (an all-reduce or receive a peer never joins), and Gloo's
    destructor joins the worker threads that run them, so destroying it (``destroy_process_group``,
    or the interpreter's exit) would wait for them until the group's timeout; and destroying a
    group would hand its name to the next one (:func:`swap_group`). So its reference count is
    raised once for good: the process ends without running its destructor (``_KEPT`` alone would
    not do: the interpreter clears module globals at exit, and the last reference would go then).

    Why not end that work instead: Gloo's ``abort()`` and ``shutdown()`` wake neither a worker
    thread in an all-reduce a peer never joins nor the peer's in its own (measured, torch 2.13),
    and the group's own timeout (:func:`swap_group_timeout_s`) ends it only minutes later with
    the default ``timeout_s``. Measured through the manager (tests/test_fault_harness.py, a peer
    asleep past the serving group's timeout, a swap group of 24 s): with this, every process
    exits 1.8 s after its end at 2 ranks, 3.7-4.3 s at 4 (as long as processes that met no
    fault take there, on a loaded 2-core host); without it, 12-14 s after, in
    ``~ProcessGroupGloo``.
    """
    if group is None or any(g is group for g in _KEPT):
        return
    _KEPT.append(group)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


def group_count() -> int:
    """How many process groups this process holds (the default group included): part of the name
    torch gives the next group made with ``use_local_synchronization`` (see :func:`swap_group`)."""
    from torch.distributed import distributed_c10d as c10d

    return len(c10d._world.pg_names)


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
