"""Hot-swap expert weights to a new placement, in place, while serving; all or nothing on every rank.

Shape legend: L layers, P physical slots, G GPUs (ranks), S slots per GPU.

The public entry points: :func:`hot_swap` is :func:`prepare_swap` (plan and compile: host work an
engine may do ahead, on a helper thread) then :meth:`PreparedSwap.execute` (check, move into
staging, agree per chunk, vote, then commit or not), which every rank runs at the same point
(between two forward passes). Every weight tensor keeps its storage, so captured CUDA graphs stay
valid, and every rank ends with, for every layer, the old weights and maps or the new ones,
whatever a peer does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from eplb.hotswap.check import CheckValue, HotSwapShapeError, fingerprint, verdict
from eplb.hotswap.checksum import checksum_backends
from eplb.hotswap.commit import HotSwapError, Outcome, SwapRun
from eplb.hotswap.control import Cause, SwapControl, SwapFailure
from eplb.hotswap.layout import PlainLayout, SlotLayout
from eplb.hotswap.owned import drop, owned_group, refuse_serving, unchecked
from eplb.hotswap.plan import SwapPlan, plan_swap
from eplb.hotswap.program import ProgramSpec, SwapProgram, compile_swap
from eplb.hotswap.runtime import SwapRuntime
from eplb.placement.diff import diff_placements
from eplb.placement.model import Placement

FaultHook = Callable[[str, int, list[torch.Tensor]], None]
"""``fault(stage, chunk, buffers)``: tests inject failures. Stages: "check" (before this rank
publishes its check), "prepare" (before chunk ``chunk`` is posted), "received" (after it arrived,
with the staging rows it landed in, which the hook may corrupt), "vote" (before this rank votes),
"committed" (the swap was decided committed; before this rank copies it in). ``chunk`` is -1
outside chunks. An exception at "prepare" or "received" is recorded and settled by the chunk's
agreement (the swap fails on every rank, the group stays usable); anywhere else, and a
BaseException (KeyboardInterrupt) anywhere, makes this rank leave the swap."""


@dataclass(frozen=True, kw_only=True)
class HotSwapOptions:
    """How a hot-swap moves weights. Every rank must pass the same options."""

    staging_budget_bytes: int = 2 << 30
    """Most bytes one rank receives or copies per agreement (a chunk). Every expert a rank writes
    waits in its staging buffer until the swap commits, so that buffer holds the whole swap's
    writes on the rank (the manager swaps a few layers at a time)."""
    timeout_s: float = 60.0
    """Deadline of every wait of the swap: the check, each chunk (transfers and agreement), the
    vote. A rank that is this late, or whose heartbeat stops, fails the swap on every rank."""
    verify: bool = True
    """Checksum every moved expert (sender and receiver) and fail on a mismatch."""
    piece_fractions: tuple[float, ...] = (0.25, 0.5, 0.25)
    """How a chunk's arrivals at each GPU are cut into NCCL batches ("pieces"): the receiver
    checksums piece k while piece k+1 travels, so only the last piece's checksum follows the
    transfer."""
    checksum_backend: str = "auto"
    """auto (Triton on CUDA for rows of whole int32 words, else torch) | torch | triton."""
    pace_bytes_per_s: float | None = None
    """Pacing: chunk k is posted no sooner than (bytes the busiest GPU receives in the chunks before
    k) / this rate after the first one was, so the swap averages at most this rate into any GPU.
    Every rank computes the same schedule from the plan; a pause watches the swap's control like
    any wait. None: unpaced."""

    def __post_init__(self) -> None:
        if self.staging_budget_bytes < 1:
            raise ValueError(f"staging_budget_bytes must be >= 1, got {self.staging_budget_bytes}")
        if not self.piece_fractions or not all(f > 0 for f in self.piece_fractions):
            raise ValueError(f"piece_fractions must be positive numbers, got {self.piece_fractions}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        pace = self.pace_bytes_per_s
        if pace is not None and not (pace > 0 and pace < float("inf")):
            raise ValueError(f"pace_bytes_per_s must be None or a finite number > 0, got {pace}")
        if self.checksum_backend not in checksum_backends():
            raise ValueError(
                f"checksum_backend must be one of {checksum_backends()}, got {self.checksum_backend!r}"
            )


@dataclass(frozen=True, kw_only=True)
class HotSwapResult:
    """What a hot-swap did. ``ok`` False: every rank kept the old placement and the group is usable."""

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
    verify, agree, vote, commit). On CUDA without a fault hook the host does not wait for the
    transfers: "agree" then holds that wait too."""
    cause: Cause | None = None
    """Why it failed (``checksum``, ``error``; a caller that turns a ``HotSwapShapeError`` or a
    ``HotSwapError`` into a result, as the manager does, keeps its cause), the same on every rank."""
    rank: int | None = None
    """The rank the failure names (where the corrupted arrival landed, or that raised)."""

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


class PreparedSwap:
    """A planned and checked swap of this rank's slots, ready to :meth:`execute` once.

    Check (through the store, eplb.hotswap.check; with ``check=True`` part of prepare, else the
    start of execute): reserve the staging buffer and make sure every rank is about to run the
    same swap. Execute (eplb.hotswap.commit): move every chunk into staging and agree on it, vote,
    then commit (copy staging into the slots) or not, as the swap's one decision says.
    """

    def __init__(
        self,
        runtime: SwapRuntime,
        plan: SwapPlan,
        layers: tuple[int, ...],
        options: HotSwapOptions,
        moved: tuple[int, int, int],
        program: SwapProgram,
        value: CheckValue,
        target: Placement,
    ) -> None:
        self.runtime, self.plan, self.layers, self.options = runtime, plan, layers, options
        self.moved, self.program, self.value, self.target = moved, program, value, target
        self.executed = False
        self.checked = False
        self.given_up = False
        """The swap gave its group up (alike on every rank; or this rank left it before knowing
        its decision): the group must not run another collective. A swap group of our own is
        then dropped (eplb.hotswap.owned)."""
        self.control: SwapControl | None = None
        self._run: SwapRun | None = None
        self._started = 0.0
        self._lock = threading.Lock()
        self._abort: SwapFailure | None = None
        """Set by :meth:`abort` (another thread): proposed as the decision once the control exists."""
        # Index tensors were copied to the device on the preparing thread's stream.
        self.bound: torch.cuda.Event | None = None
        if runtime.device.type == "cuda":
            self.bound = torch.cuda.Event()
            self.bound.record(torch.cuda.current_stream(runtime.device))

    def check(self, fault: FaultHook | None = None) -> None:
        """Collective (through the store): reserve staging; raise unless every rank runs this swap.

        HotSwapShapeError (a rank's shapes differ), ValueError (placements differ) or RuntimeError
        (no memory for staging): on every rank, nothing moved, the group usable. HotSwapError: a
        rank was lost or late.
        """
        if self.checked:
            return
        rt = self.runtime
        self.given_up = True  # until every rank's check is in (what follows refuses alike)
        try:
            with rt.timed("check"):
                if rt.group is None and (own := owned_group(rt.device, self.options.timeout_s)) is not None:
                    rt.bind(own)
                staged = True
                try:
                    rt.reserve_staging(self.program.staging_rows)
                except Exception:  # out of memory here is reported on every rank below
                    staged = False
                control = SwapControl.for_group(rt.group, self.options.timeout_s)
                with self._lock:
                    self.control, pending = control, self._abort
                if pending is not None and control is not None:
                    control.give_up(pending)
                value = replace(self.value, staged=staged)
                try:
                    values = [value] if self.control is None else run_check(self.control, value, fault)
                    self.given_up = False
                    verdict(values, rt.staging_bytes(self.program.staging_rows))
                except BaseException:
                    rt.release_staging()
                    raise
        finally:
            if self.given_up:
                drop(rt.group)
        self.checked = True

    def execute(
        self,
        *,
        update_maps: Callable[[], None] | None = None,
        restore_maps: Callable[[], None] | None = None,
        fault: FaultHook | None = None,
    ) -> HotSwapResult:
        """Move the weights (collective); the maps follow them at the commit.

        With ``restore_maps``, ``update_maps`` runs before this rank votes (its exception fails the
        swap on every rank) and ``restore_maps`` puts the old maps back when the swap is not
        committed; without, ``update_maps`` runs after the commit. Returns a failed result when
        every rank voted (nothing changed anywhere); raises :class:`HotSwapError` when the swap was
        given up without them. Runs :meth:`check` first unless it ran already.
        """
        if self.executed:
            raise RuntimeError("a prepared swap runs once; prepare again from the current placement")
        self.executed = True
        self._started = time.perf_counter()
        self.check(fault)
        self.given_up = True  # until the swap's decision is known here
        try:
            if self.bound is not None:
                torch.cuda.current_stream(self.runtime.device).wait_event(self.bound)
            self._run = SwapRun(
                self.runtime,
                self.program,
                self.control,
                fault,
                update_maps,
                restore_maps,
                pace_bytes_per_s=self.options.pace_bytes_per_s,
            )
            outcome = self._run.execute(self.plan, self.target, self.layers)
        finally:
            decision = self._run.decision if self._run is not None else None
            self.given_up = decision is None or decision.gives_up_group
            if self.given_up:
                drop(self.runtime.group)
        return self._result(outcome, time.perf_counter() - self._started)

    def decided(self) -> HotSwapResult:
        """What :meth:`execute` would have returned, after it raised something else (this rank was
        interrupted, e.g. by KeyboardInterrupt, and re-raised once its side was done): the swap's
        decision as a result, or HotSwapError when it was given up without every rank's vote or
        before this rank knew a decision (the other ranks then see this rank leave)."""
        decision = self._run.decision if self._run is not None else None
        if decision is None:
            rank = self.runtime.rank
            raise HotSwapError(
                f"peer lost: rank {rank} left the swap before its decision", cause="peer lost", rank=rank
            )
        return self._result(Outcome(decision.failure), time.perf_counter() - self._started)

    def abort(self, detail: str) -> None:
        """End this swap on every rank, from any thread (the manager's watchdog, while a peer hangs):
        propose a ``timeout`` failure naming ``detail`` as its decision, now or as soon as its
        control exists. Every rank's waits see it and give the swap up (HotSwapError); a swap
        already decided keeps its decision (the first proposal wins)."""
        failure = SwapFailure("timeout", None, f"timeout: {detail}")
        with self._lock:
            self._abort, control = failure, self.control
        if control is not None:
            control.give_up(failure)

    def where(self) -> str:
        """The protocol step this rank is at (``check``, ``chunk 1 agreement``, ``vote``, ...)."""
        control = self.control
        return "check" if control is None else control.label

    def _result(self, outcome: Outcome, seconds: float) -> HotSwapResult:
        failure = outcome.failure
        if failure is not None and not failure.group_usable:
            raise HotSwapError.of(failure)
        experts, nbytes, local = self.moved
        return HotSwapResult(
            ok=failure is None,
            layers=self.layers,
            error=None if failure is None else failure.detail,
            seconds=seconds,
            experts_moved=experts,
            bytes_moved=nbytes,
            local_copies=local,
            chunks=len(self.plan.chunks),
            phase_seconds=dict(self.runtime.phase_seconds),
            cause=None if failure is None else failure.cause,
            rank=None if failure is None else failure.rank,
        )


def run_check(control: SwapControl, value: CheckValue, fault: FaultHook | None) -> list[CheckValue]:
    """Every rank's check value; a lost or late rank raises HotSwapError (after deciding so)."""
    try:
        if fault is not None:
            fault("check", -1, [])
        deadline = time.monotonic() + control.timeout_s
        raw = control.exchange("check", value.encode(), deadline=deadline, what="every rank's check")
    except SwapFailure as failure:
        decided = control.give_up(failure)
        assert decided.failure is not None, "nothing commits before every rank checked"
        raise HotSwapError.of(decided.failure) from None
    except BaseException as exc:
        control.give_up(control.left(exc))
        raise
    return [CheckValue.decode(v) for v in raw]


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
    fault: FaultHook | None = None,
) -> PreparedSwap:
    """Plan, compile and check the swap of this rank's slots of ``layers`` from ``old`` to ``new``.

    The plan (eplb.hotswap.plan) leaves unchanged slots alone, copies within a GPU where it can,
    spreads cross-GPU sources over the holders and cuts chunks of at most ``staging_budget_bytes``
    written per rank; compiling (eplb.hotswap.program) turns this rank's part of each chunk into
    messages of consecutive slots, pieces and checksum tasks, and its staging rows.

    ``slots_L[l]`` maps tensor names to this rank's slot buffers [S, ...] of layer l (weights,
    scales), in the engine layout that ``layout`` describes. ``group``: the swap's own process
    group (:func:`eplb.hotswap.runtime.swap_group`), never the one the model serves with (the
    default group is refused: ValueError), since a swap given up with transfers in flight leaves
    its group unusable; None: a swap group of its own over the default group's ranks, made at the
    check and dropped after a swap given up (eplb.hotswap.owned; one process: none). With
    ``check`` (collective over the ranks of the group, through its store) it reserves the staging
    buffer (every expert the swap writes on this rank, held until executed) and makes sure every
    rank runs this swap: a rank whose placements or buffers do not fit (another shape) takes part
    and every rank raises HotSwapShapeError naming it. Without, it is host work only (a helper
    thread may run it) and raises such errors on its own; :meth:`PreparedSwap.execute` checks
    first. Every rank that checks a swap executes it.
    """
    options = options or HotSwapOptions()
    refuse_serving(group)
    device = next((t.device for tensors in slots_L for t in tensors.values()), torch.device("cpu"))
    unfit: ValueError | None = None
    with unchecked(group, device, options.timeout_s):  # a rank that leaves here skips the check
        layer_list = tuple(sorted(set(range(old.num_layers) if layers is None else (int(x) for x in layers))))
        try:
            runtime = SwapRuntime.create(
                slots_L, old, group, layout or PlainLayout(), options.timeout_s, options.verify
            )
            if old.phy2log_LP.shape != new.phy2log_LP.shape or (old.num_gpus, old.num_nodes) != (
                new.num_gpus,
                new.num_nodes,
            ):
                raise ValueError(
                    f"old and new placements differ in shape or topology: {_shape(old)} and {_shape(new)}"
                )
        except ValueError as exc:  # the placements or buffers do not fit: a shape problem of this rank
            unfit = exc
        if unfit is None:
            prepared = _compiled(runtime, old, new, layer_list, options)
        elif not check:
            raise _shape_error(group, unfit) from unfit
    if unfit is not None:
        _check_unfit(device, group, options.timeout_s, str(unfit), fault)
        raise _shape_error(group, unfit) from unfit
    if check:
        prepared.check(fault)
    return prepared


def _compiled(
    runtime: SwapRuntime, old: Placement, new: Placement, layer_list: tuple[int, ...], options: HotSwapOptions
) -> PreparedSwap:
    """Plan and compile this rank's part of the swap of ``layer_list`` from ``old`` to ``new``."""
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
    with runtime.timed("compile"):
        spec = ProgramSpec(
            rank=runtime.rank,
            piece_fractions=options.piece_fractions,
            view_shapes=runtime.view_shapes,
            device=runtime.device,
            verify=options.verify,
            checksum_backend=options.checksum_backend,
        )
        program = compile_swap(plan, spec)
    shape_key = (options.staging_budget_bytes, int(options.verify), *options.piece_fractions)
    value = CheckValue(
        fingerprint=fingerprint(cur_LP, tgt_LP, layer_list, shape_key),
        shape=f"{_shape(old)} layers {len(layer_list)} bytes/expert {runtime.bytes_per_expert}",
        staged=True,
    )
    return PreparedSwap(runtime, plan, layer_list, options, moved, program, value, target)


def _check_unfit(
    device: torch.device,
    group: dist.ProcessGroup | None,
    timeout_s: float,
    problem: str,
    fault: FaultHook | None,
) -> None:
    """This rank's slots or placements do not fit the swap: take part in the check (on the group
    every rank checks on), so that every rank raises HotSwapShapeError naming the first such rank
    (one process: nothing to check)."""
    if group is None:
        group = owned_group(device, timeout_s)
    control = SwapControl.for_group(group, timeout_s)
    if control is None:
        return
    try:
        values = run_check(control, CheckValue(fingerprint=0, shape="", staged=True, problem=problem), fault)
    except BaseException:  # given up (a rank lost, late or interrupted): alike on every rank
        drop(group)
        raise
    verdict(values, 0)


def _shape_error(group: dist.ProcessGroup | None, problem: ValueError) -> HotSwapShapeError:
    rank = _rank_in(group)
    return HotSwapShapeError(f"shape: rank {rank} cannot run this hot-swap: {problem}", rank=rank)


def _rank_in(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _shape(p: Placement) -> str:
    return f"[L={p.num_layers}, P={p.num_physical}] on {p.num_gpus} GPUs, {p.num_nodes} node(s)"


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
    restore_maps: Callable[[], None] | None = None,
    fault: FaultHook | None = None,
) -> HotSwapResult:
    """Move this rank's slots of ``layers`` from ``old`` to ``new`` (collective over ``group``, or
    without one over the default group's ranks, on a swap group of its own: see prepare_swap).

    :func:`prepare_swap` then :meth:`PreparedSwap.execute`; ``update_maps`` should copy the new
    maps into place, ``restore_maps`` the old ones (see execute).
    """
    start = time.perf_counter()
    prepared = prepare_swap(
        slots_L, old, new, layers=layers, group=group, options=options, layout=layout, fault=fault
    )
    result = prepared.execute(update_maps=update_maps, restore_maps=restore_maps, fault=fault)
    return replace(result, seconds=time.perf_counter() - start)
