"""Hot-swap expert weights to a new placement, in place, while serving; roll back on any failure.

Shape legend: L layers, P physical slots, G GPUs (ranks), S slots per GPU.

The public entry points: :func:`hot_swap` is :func:`prepare_swap` (plan and compile: host work an
engine may do ahead, on a helper thread) then :meth:`PreparedSwap.execute` (move, agree per chunk,
update the maps, or roll back), which every rank runs at the same point (between two forward
passes). Every weight tensor keeps its storage, so captured CUDA graphs stay valid, and a failed
swap leaves every rank on the old placement, exactly.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from eplb.hotswap.checksum import checksum_backends
from eplb.hotswap.group import GroupRun
from eplb.hotswap.layout import PlainLayout, SlotLayout
from eplb.hotswap.plan import SwapPlan, plan_swap
from eplb.hotswap.program import GroupProgram, compile_group
from eplb.hotswap.runtime import SwapRuntime
from eplb.placement.diff import diff_placements
from eplb.placement.model import Placement

FaultHook = Callable[[str, int, list[torch.Tensor]], None]
"""``fault(stage, chunk, buffers)``: tests inject failures ("prepare": before a chunk is posted;
"received": after it arrived, with the received buffers, which the hook may corrupt)."""


@dataclass(frozen=True, kw_only=True)
class HotSwapOptions:
    """How a hot-swap moves weights. Every rank must pass the same options."""

    staging_budget_bytes: int = 2 << 30
    """Most bytes one rank writes per agreement (arrivals and local copies, a chunk); slots a chunk
    both reads and overwrites are backed up first, in one buffer of at most about this size."""
    timeout_s: float = 60.0
    """Longest wait for one chunk's transfers before the swap counts as failed."""
    verify: bool = True
    """Checksum every moved expert (sender and receiver) and fail on a mismatch."""
    piece_fractions: tuple[float, ...] = (0.25, 0.5, 0.25)
    """How a chunk's arrivals at each GPU are cut into NCCL batches ("pieces"): the receiver
    checksums piece k while piece k+1 travels, so only the last piece's checksum follows the
    transfer; a small first piece starts the link early when sources are backed up first."""
    checksum_backend: str = "auto"
    """auto (Triton on CUDA for rows of whole int32 words, else torch) | torch | triton."""

    def __post_init__(self) -> None:
        if self.staging_budget_bytes < 1:
            raise ValueError(f"staging_budget_bytes must be >= 1, got {self.staging_budget_bytes}")
        if not self.piece_fractions or not all(f > 0 for f in self.piece_fractions):
            raise ValueError(f"piece_fractions must be positive numbers, got {self.piece_fractions}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.checksum_backend not in checksum_backends():
            raise ValueError(
                f"checksum_backend must be one of {checksum_backends()}, got {self.checksum_backend!r}"
            )


@dataclass(frozen=True, kw_only=True)
class HotSwapResult:
    """What a hot-swap did. ``ok`` False means every rank rolled back to the old placement."""

    ok: bool
    layers: tuple[int, ...]
    error: str | None
    seconds: float
    """Wall time of the call (``hot_swap``: prepare and execute; ``execute``: execute only)."""
    experts_moved: int
    """Expert copies that crossed GPUs (all ranks)."""
    bytes_moved: int
    """Bytes that crossed GPUs (all ranks)."""
    local_copies: int
    chunks: int
    phase_seconds: dict[str, float]
    """This rank's host time per phase (prepare: plan, compile, check; execute: setup, post, wait,
    verify, agree, restore), rollback included. On CUDA without a fault hook the host does not
    wait for the transfers: "agree" then holds that wait too."""

    @classmethod
    def not_started(cls, layers: tuple[int, ...], error: str) -> HotSwapResult:
        """A swap that failed before any byte moved (nothing to roll back)."""
        return cls(
            ok=False,
            layers=layers,
            error=error,
            seconds=0.0,
            experts_moved=0,
            bytes_moved=0,
            local_copies=0,
            chunks=0,
            phase_seconds={},
        )


class HotSwapError(RuntimeError):
    """The swap failed and so did the rollback: this rank's weights are in an undefined state."""


class PreparedSwap:
    """A planned and checked swap of this rank's slots, ready to :meth:`execute` once.

    Check (one small all-reduce on a CPU group; with ``check=True`` part of prepare, else the start
    of execute): reserve the backup buffer, and make sure every rank is about to run the same swap.

    Execute, per chunk ("group"; eplb.hotswap.group): back up the slots the group both reads and
    overwrites, post its pieces (``batch_isend_irecv``), receive straight into the destination
    slots, checksum what was sent and what arrived while the next piece travels, wait (with a
    deadline), then agree once: one all-reduce of failure flags and checksums over the data group.
    A group that backs nothing up and writes no slot the previous group reads is posted before that
    group is agreed (at most two groups are open). Slots are written through views with ``copy_``
    or received into directly. The maps are updated (``update_maps``) only after every group was
    agreed.

    On any failure (an exception on any rank, a timeout, a checksum mismatch) every rank learns it
    at that group's agreement, settles the group posted after it, lets their transfers finish,
    copies the backups back, computes the same partial state (eplb.hotswap.plan.SwapPlan.state_after)
    and swaps back to the old placement, exactly: weights are copied, never recomputed. The result
    says what failed. If the rollback itself fails, :class:`HotSwapError` is raised (weights undefined).
    """

    def __init__(
        self,
        runtime: SwapRuntime,
        plan: SwapPlan,
        cur_LP: np.ndarray,
        layers: tuple[int, ...],
        options: HotSwapOptions,
        num_nodes: int,
        moved: tuple[int, int, int],
        programs: list[GroupProgram],
        fingerprint: int,
    ) -> None:
        self.runtime, self.plan, self.cur_LP, self.layers = runtime, plan, cur_LP, layers
        self.options, self.num_nodes, self.moved, self.programs = options, num_nodes, moved, programs
        self.executed = False
        self.checked = False
        self.fingerprint = fingerprint
        # Index tensors were copied to the device on the preparing thread's stream.
        self.bound: torch.cuda.Event | None = None
        if runtime.device.type == "cuda":
            self.bound = torch.cuda.Event()
            self.bound.record(torch.cuda.current_stream(runtime.device))

    def check(self) -> None:
        """Collective (a CPU all-reduce): reserve the backups; raise unless every rank runs this swap."""
        if self.checked:
            return
        with self.runtime.timed("check"):
            self.runtime.check_same_swap(
                self.fingerprint, max((self.runtime.backup_bytes(p) for p in self.programs), default=0)
            )
        self.checked = True

    def execute(
        self, *, update_maps: Callable[[], None] | None = None, fault: FaultHook | None = None
    ) -> HotSwapResult:
        """Move the weights (collective); ``update_maps`` runs after every weight landed and was agreed.

        Runs :meth:`check` first unless it ran already (``prepare_swap(check=True)``).
        """
        if self.executed:
            raise RuntimeError("a prepared swap runs once; prepare again from the current placement")
        self.executed = True
        start = time.perf_counter()
        self.check()
        if self.bound is not None:
            torch.cuda.current_stream(self.runtime.device).wait_event(self.bound)
        failure = self._run(self.programs, 0, fault)
        error = None
        if failure is not None:
            done, errors, restore_error, posted = failure
            error = "; ".join(errors) or "another rank failed"
            partial = tuple(range(done, posted))
            state = self.plan.state_after(self.cur_LP, done=done, partial=partial)
            try:
                back = self._compile(self._plan(state, self.cur_LP))
                self.runtime.reserve_backups(max((self.runtime.backup_bytes(p) for p in back), default=0))
                again = self._run(back, 1, None, fatal=restore_error is not None)
                if not back and self.runtime.agree_flags(False, restore_error is not None)[1]:
                    again = (0, ["a restore failed on some rank"], None, 0)
            except HotSwapError:
                raise
            except Exception as exc:
                raise HotSwapError(f"hot-swap failed ({error}) and so did its rollback ({exc})") from exc
            if again is not None:
                raise HotSwapError(
                    f"hot-swap failed ({error}) and so did its rollback ({'; '.join(again[1])})"
                )
        elif update_maps is not None:
            update_maps()
        self.runtime.backup_flat = None
        experts, nbytes, local = self.moved
        return HotSwapResult(
            ok=failure is None,
            layers=self.layers,
            error=error,
            seconds=time.perf_counter() - start,
            experts_moved=experts,
            bytes_moved=nbytes,
            local_copies=local,
            chunks=len(self.plan.chunks),
            phase_seconds=dict(self.runtime.phase_seconds),
        )

    def _run(
        self, programs: list[GroupProgram], epoch: int, fault: FaultHook | None, fatal: bool = False
    ) -> tuple[int, list[str], str | None, int] | None:
        """Run every group; None on success, else on every rank (first failed group, errors,
        restore error, groups posted): groups from the failed one on were undone."""
        rt = self.runtime
        runs: list[GroupRun] = []
        settled = 0
        failed_at: int | None = None
        errors: list[str] = []

        def settle_next() -> None:
            nonlocal settled, failed_at
            out = runs[settled].finish()
            if out.fatal:
                raise HotSwapError("a failed chunk's backups could not be restored on some rank")
            if out.failed:
                failed_at = settled if failed_at is None else failed_at
                errors.extend(out.errors)
            settled += 1

        for g, prog in enumerate(programs):
            # At most one group stays open while the next is posted, and only one that may overlap.
            while len(runs) - settled > (1 if prog.overlaps_previous else 0):
                settle_next()
            if failed_at is not None:
                break
            runs.append(GroupRun.start(rt, prog, epoch, fault, slot=g % 2, fatal=fatal and g == 0))
        while settled < len(runs):
            settle_next()
        if failed_at is None:
            return None
        restore_error = None
        for run in reversed(runs[failed_at:]):  # overlapping groups back nothing up: any order
            restore_error = run.restore() or restore_error
        return failed_at, errors, restore_error, len(runs)

    def _plan(self, from_LP: np.ndarray, to_LP: np.ndarray) -> SwapPlan:
        return _plan_between(self.runtime, self.options, self.num_nodes, self.layers, from_LP, to_LP)

    def _compile(self, plan: SwapPlan) -> list[GroupProgram]:
        return _compile_all(self.runtime, self.options, plan)


def _plan_between(
    rt: SwapRuntime,
    options: HotSwapOptions,
    num_nodes: int,
    layers: tuple[int, ...],
    from_LP: np.ndarray,
    to_LP: np.ndarray,
) -> SwapPlan:
    with rt.timed("plan"):
        return plan_swap(
            from_LP,
            to_LP,
            num_gpus=rt.world_size,
            num_nodes=num_nodes,
            bytes_per_expert=rt.bytes_per_expert,
            chunk_bytes=options.staging_budget_bytes,
            layers=layers,
        )


def _compile_all(rt: SwapRuntime, options: HotSwapOptions, plan: SwapPlan) -> list[GroupProgram]:
    with rt.timed("compile"):
        return [
            compile_group(
                plan,
                k,
                rank=rt.rank,
                piece_fractions=options.piece_fractions,
                view_shapes=rt.view_shapes,
                device=rt.device,
                verify=options.verify,
                checksum_backend=options.checksum_backend,
            )
            for k in range(len(plan.chunks))
        ]


def prepare_swap(
    slots_L: Sequence[Mapping[str, torch.Tensor]],
    old: Placement,
    new: Placement,
    *,
    layers: Sequence[int] | None = None,
    group: dist.ProcessGroup | None = None,
    options: HotSwapOptions | None = None,
    layout: SlotLayout | None = None,
    check: bool = True,
) -> PreparedSwap:
    """Plan, compile and check the swap of this rank's slots of ``layers`` from ``old`` to ``new``.

    The plan (eplb.hotswap.plan) leaves unchanged slots alone, copies within a GPU where it can,
    spreads cross-GPU sources over the holders and cuts chunks of at most ``staging_budget_bytes``
    written per rank; compiling (eplb.hotswap.program) turns this rank's part of each chunk into
    messages of consecutive slots, pieces, backups and checksum tasks.

    ``slots_L[l]`` maps tensor names to this rank's slot buffers [S, ...] of layer l (weights,
    scales), in the engine layout that ``layout`` describes. With ``check`` (collective over the
    ranks of ``group``: one small CPU all-reduce) it reserves the backup buffer (at most about
    ``staging_budget_bytes``, held until executed); without, it is host work only (a helper thread
    may run it) and :meth:`PreparedSwap.execute` checks first.
    """
    options = options or HotSwapOptions()
    runtime = SwapRuntime.create(
        slots_L, old, group, layout or PlainLayout(), options.timeout_s, options.verify
    )
    if old.phy2log_LP.shape != new.phy2log_LP.shape or (old.num_gpus, old.num_nodes) != (
        new.num_gpus,
        new.num_nodes,
    ):
        raise ValueError("old and new placements differ in shape or topology")
    layer_list = tuple(sorted(set(range(old.num_layers) if layers is None else (int(x) for x in layers))))
    cur_LP = old.phy2log_LP
    tgt_LP = cur_LP.copy()
    tgt_LP[list(layer_list)] = new.phy2log_LP[list(layer_list)]
    target = Placement.from_phy2log(
        tgt_LP, old.num_gpus, old.num_nodes, max_replicas=max(old.max_replicas, new.max_replicas)
    )
    diff = diff_placements(old, target, runtime.bytes_per_expert)
    moved = (diff.experts_moved_across_gpus, diff.bytes_across_gpus, diff.local_copies)
    plan = _plan_between(runtime, options, old.num_nodes, layer_list, cur_LP, tgt_LP)
    # What moves, in the foundation's terms; the plan moves exactly that (one receive per arrival).
    assert diff.experts_moved_across_gpus == plan.cross_gpu_transfers, "one receive per arrival"
    programs = _compile_all(runtime, options, plan)
    fingerprint = _fingerprint(cur_LP, tgt_LP, layer_list, options)
    prepared = PreparedSwap(
        runtime, plan, cur_LP, layer_list, options, old.num_nodes, moved, programs, fingerprint
    )
    if check:
        prepared.check()
    return prepared


def hot_swap(
    slots_L: Sequence[Mapping[str, torch.Tensor]],
    old: Placement,
    new: Placement,
    *,
    layers: Sequence[int] | None = None,
    group: dist.ProcessGroup | None = None,
    options: HotSwapOptions | None = None,
    layout: SlotLayout | None = None,
    update_maps: Callable[[], None] | None = None,
    fault: FaultHook | None = None,
) -> HotSwapResult:
    """Move this rank's slots of ``layers`` from ``old`` to ``new`` (collective over ``group``).

    :func:`prepare_swap` then :meth:`PreparedSwap.execute`; ``update_maps`` runs after every
    weight has landed and been agreed on (it should copy the new maps into place).
    """
    start = time.perf_counter()
    prepared = prepare_swap(slots_L, old, new, layers=layers, group=group, options=options, layout=layout)
    result = prepared.execute(update_maps=update_maps, fault=fault)
    return replace(result, seconds=time.perf_counter() - start)


def _fingerprint(
    cur_LP: np.ndarray, tgt_LP: np.ndarray, layers: tuple[int, ...], options: HotSwapOptions
) -> int:
    """A 32-bit digest of the swap's input, to check that every rank plans the same swap."""
    digest = zlib.crc32(np.ascontiguousarray(cur_LP, dtype=np.int32).tobytes())
    digest = zlib.crc32(np.ascontiguousarray(tgt_LP, dtype=np.int32).tobytes(), digest)
    shape = (options.staging_budget_bytes, int(options.verify), *options.piece_fractions)
    digest = zlib.crc32(np.asarray(shape, dtype=np.float64).tobytes(), digest)
    return zlib.crc32(np.asarray(layers, dtype=np.int64).tobytes(), digest)
