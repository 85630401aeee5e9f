"""Hot-swap expert weights to a new placement, in place, while serving; roll back on any failure.

Shape legend: L layers, P physical slots, G GPUs (ranks), S slots per GPU.

``hot_swap(slots_L, old, new, layers=...)`` runs on every rank at the same point (between two
forward passes). It plans the moves (eplb.hotswap_plan: unchanged slots untouched, same-GPU copies
local, cross-GPU sources spread over holders), then per chunk:

1. local copies, then one ``torch.distributed.batch_isend_irecv`` batch: each block of consecutive
   slots goes as one message per tensor, straight from the source slots to the destination slots
   (or to staging when a destination is read in the same chunk); the sender checksums what it
   sent while the bytes travel (eplb.hotswap_checksum);
2. wait (with a deadline), checksum what arrived, copy to the other slots that need the same expert;
3. agree across ranks: one all_reduce over a CPU control group of failure flags and
   (+sender - receiver) checksums, zero when every expert arrived intact; then commit staged slots.

Every weight tensor keeps its storage: slots are written through views with ``copy_`` or received
into directly. When chunks do not conflict, chunk k+1 is posted before chunk k is verified, so the
link stays busy. The maps are updated (``update_maps``) only after all weights have landed.

On any failure (an exception on any rank, a timeout, a checksum mismatch) every rank learns it at
the next agreement, computes the same partial state (eplb.hotswap_plan.SwapPlan.state_after) and
swaps back to the old placement, exactly: weights are copied, never recomputed. The result says
what failed. If the rollback itself fails, :class:`HotSwapError` is raised (weights undefined).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from eplb.hotswap_exec import ChunkRun, SwapRuntime
from eplb.hotswap_layout import PlainLayout, SlotLayout
from eplb.hotswap_plan import SwapPlan, plan_swap
from eplb.placement import Placement
from eplb.placement_diff import diff_placements

FaultHook = Callable[[str, int, list[torch.Tensor]], None]
"""``fault(stage, chunk, buffers)``: tests inject failures ("prepare": before a chunk is posted;
"received": after it arrived, with the received buffers, which the hook may corrupt)."""


@dataclass(frozen=True, kw_only=True)
class HotSwapOptions:
    """How a hot-swap moves weights."""

    staging_budget_bytes: int = 2 << 30
    """Peak bytes in flight on one rank (received experts and staging, two chunks when overlapped)."""
    timeout_s: float = 60.0
    """Longest wait for one chunk's transfers before the swap counts as failed."""
    verify: bool = True
    """Checksum every moved expert (sender and receiver) and fail on a mismatch."""
    overlap_chunks: bool = True
    """Post the next chunk before the current one is verified when their slots do not conflict."""

    def __post_init__(self) -> None:
        if self.staging_budget_bytes < 1:
            raise ValueError(f"staging_budget_bytes must be >= 1, got {self.staging_budget_bytes}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


@dataclass(frozen=True, kw_only=True)
class HotSwapResult:
    """What a hot-swap did. ``ok`` False means every rank rolled back to the old placement."""

    ok: bool
    layers: tuple[int, ...]
    error: str | None
    seconds: float
    experts_moved: int
    """Expert copies that crossed GPUs (all ranks)."""
    bytes_moved: int
    """Bytes that crossed GPUs (all ranks)."""
    local_copies: int
    chunks: int
    phase_seconds: dict[str, float]
    """This rank's host time per phase (check, plan, start, wait, verify, agree, commit), rollback included."""


class HotSwapError(RuntimeError):
    """The swap failed and so did the rollback: this rank's weights are in an undefined state."""


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

    ``slots_L[l]`` maps tensor names to this rank's slot buffers [S, ...] of layer l (weights,
    scales), in the engine layout that ``layout`` describes. ``update_maps`` runs after every
    weight has landed and been agreed on (it should copy the new maps into place).
    """
    options = options or HotSwapOptions()
    start = time.perf_counter()
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
    runtime.check_same_plan_input(_fingerprint(cur_LP, tgt_LP, layer_list))
    chunk_bytes = max(options.staging_budget_bytes // (2 if options.overlap_chunks else 1), 1)

    def plan_between(from_LP: np.ndarray, to_LP: np.ndarray) -> SwapPlan:
        with runtime.timed("plan"):
            return plan_swap(
                from_LP,
                to_LP,
                num_gpus=old.num_gpus,
                num_nodes=old.num_nodes,
                bytes_per_expert=runtime.bytes_per_expert,
                chunk_bytes=chunk_bytes,
                layers=layer_list,
            )

    plan = plan_between(cur_LP, tgt_LP)
    # What moves, in the foundation's terms; the plan moves exactly that (one receive per arrival).
    target = Placement.from_phy2log(
        tgt_LP, old.num_gpus, old.num_nodes, max_replicas=max(old.max_replicas, new.max_replicas)
    )
    diff = diff_placements(old, target, runtime.bytes_per_expert)
    assert diff.experts_moved_across_gpus == plan.cross_gpu_transfers, "one receive per arrival"
    outcome = _execute(runtime, plan, options.overlap_chunks, fault, epoch=0)
    error = None
    if outcome is not None:
        error = outcome.error
        rollback = plan_between(plan.state_after(cur_LP, done=outcome.done, partial=outcome.partial), cur_LP)
        try:
            again = _execute(runtime, rollback, options.overlap_chunks, None, epoch=1)
        except Exception as exc:
            raise HotSwapError(f"hot-swap failed ({error}) and so did its rollback ({exc})") from exc
        if again is not None:
            raise HotSwapError(f"hot-swap failed ({error}) and so did its rollback ({again.error})")
    elif update_maps is not None:
        update_maps()
    return HotSwapResult(
        ok=outcome is None,
        layers=layer_list,
        error=error,
        seconds=time.perf_counter() - start,
        experts_moved=diff.experts_moved_across_gpus,
        bytes_moved=diff.bytes_across_gpus,
        local_copies=diff.local_copies,
        chunks=len(plan.chunks),
        phase_seconds=dict(runtime.phase_seconds),
    )


@dataclass(frozen=True)
class _Failure:
    error: str
    done: int
    partial: tuple[int, ...]


def _execute(
    runtime: SwapRuntime, plan: SwapPlan, overlap: bool, fault: FaultHook | None, epoch: int
) -> _Failure | None:
    """Run every chunk of ``plan``; None on success, else where it stopped (same on every rank).

    A staged commit is a local device copy after the chunk was agreed; if one fails, the swapped
    pair of slots it belonged to may both be lost, so that case raises :class:`HotSwapError` on
    every rank (at the next agreement) instead of rolling back.
    """
    n = len(plan.chunks)
    runs: dict[int, ChunkRun] = {}
    commit_error: str | None = None
    for k in range(n):
        if k not in runs:
            runs[k] = runtime.start_chunk(plan, k, epoch, fault)
        if overlap and k + 1 < n and plan.chunks[k + 1].may_overlap_previous:
            runs[k + 1] = runtime.start_chunk(plan, k + 1, epoch, fault)
        run = runs[k]
        runtime.finish_chunk(run, fault)
        runtime.write_direct(plan, run)
        failed, commit_failed = runtime.agree(plan, run, commit_error is not None)
        if commit_failed:
            raise HotSwapError(
                f"a staged write of chunk {k - 1} failed on some rank: {commit_error or 'elsewhere'}"
            )
        if failed:
            posted = tuple(sorted(i for i in runs if i >= k))
            for i in posted:
                runtime.drain(runs[i])
            errors = "; ".join(e for i in posted for e in runs[i].errors) or "another rank failed"
            return _Failure(errors, k, posted)
        commit_error = runtime.commit(plan, run)
    # The last chunk's staged writes (if it had any) get their own agreement.
    if n and plan.chunks[-1].staged and runtime.agree(None, None, commit_error is not None)[1]:
        raise HotSwapError(
            f"a staged write of chunk {n - 1} failed on some rank: {commit_error or 'elsewhere'}"
        )
    return None


def _fingerprint(cur_LP: np.ndarray, tgt_LP: np.ndarray, layers: tuple[int, ...]) -> int:
    """A 32-bit digest of the swap's input, to check that every rank plans the same swap."""
    digest = zlib.crc32(np.ascontiguousarray(cur_LP, dtype=np.int32).tobytes())
    digest = zlib.crc32(np.ascontiguousarray(tgt_LP, dtype=np.int32).tobytes(), digest)
    return zlib.crc32(np.asarray(layers, dtype=np.int64).tobytes(), digest)
