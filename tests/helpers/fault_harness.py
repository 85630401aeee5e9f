"""The fault harness's ranks (tests/test_fault_harness.py): faults through the manager, on real
Gloo ranks that end their processes by themselves (:func:`tests.helpers.swap_recovery.run_to_exit`).

:func:`manager_faults` runs rebalances back and forth between two placements; every odd one
carries one fault on rank ``at`` (``FAULTS``), every even one none and must apply, on a fresh
swap group where the fault dropped the last. After each failed rebalance every rank runs an
all-reduce and an all-to-all on the serving group.
:func:`manager_stalled_past_the_serving_timeout` has a peer asleep in a swap past the serving
group's own timeout. :func:`swap_group_collective_times_out` shows the swap group's own timeout
ending a collective a peer never joins.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from eplb.moe.spawn import RankContext
from tests.helpers.swap_recovery import (
    PASSES,
    STALL_S,
    TIMEOUT_S,
    _fire,
    _manager,
    _pass,
    _served,
    back_and_forth,
    serving_collectives,
)

FAULTS = ("late", "sigint", "shape_plan", "shape_slots")
"""Faults of :func:`manager_faults` on rank ``at``: ``late`` sleeps STALL_S (past the swaps'
timeout_s, below the serving group's) before chunk 1 of the swap is posted; ``sigint`` sends its
own process a real SIGINT once chunk 1 arrived; ``shape_plan``: rank 0's planner returns a plan
with a GPU's worth of slots more than the model has; ``shape_slots``: rank ``at``'s engine hands
the swap an extra slot tensor."""

CAUSE = {"late": "timeout", "sigint": "peer lost", "shape_plan": "shape", "shape_slots": "shape"}
"""What each fault's failed rebalance must report on every rank (RebalanceRecord.cause)."""


class ExtraSlots:
    """An engine's slot tensors with one extra tensor, on this rank only (``shape_slots``)."""

    def __init__(self, slot_tensors: Callable[[int], Mapping[str, torch.Tensor]]) -> None:
        self.slot_tensors, self.on = slot_tensors, False

    def __call__(self, layer: int) -> Mapping[str, torch.Tensor]:
        tensors = self.slot_tensors(layer)
        if not self.on:
            return tensors
        rows = next(iter(tensors.values())).shape[0]
        return {**tensors, "extra": torch.zeros(rows, 3)}


def bigger(placement: Any) -> Any:
    """``placement``'s model with one GPU's worth of slots more (a plan the model cannot hold)."""
    from eplb.placement.model import Placement

    G, E = placement.num_gpus, placement.num_logical
    P = placement.num_physical + G
    return Placement.trivial(placement.num_layers, E, G, num_redundant=P - E)


def manager_faults(ctx: RankContext, at: int, faults: Sequence[str]) -> dict[str, Any]:
    """Rebalance 2i+1 carries ``faults[i]`` on rank ``at``, rebalance 2i+2 none; what this rank saw."""
    from eplb.metrics import names
    from eplb.metrics.prometheus import PrometheusSink
    from eplb.metrics.sink import NullSink
    from tests.helpers.manager import FakePlan

    rebalances = [0]  # records so far: the rebalance in flight is number rebalances[0] + 1

    def fault_now() -> str | None:
        n = rebalances[0]
        return faults[n // 2] if n % 2 == 0 and n // 2 < len(faults) else None

    def planner(old: Any, new: Any) -> Callable[[np.ndarray, Any], Any]:
        def plan(load: np.ndarray, cur: Any) -> Any:
            if fault_now() == "shape_plan":
                return FakePlan(bigger(cur))
            return FakePlan(new if cur.same_slots(old) else old)

        return plan

    def fault(stage: str, chunk: int, bufs: list[torch.Tensor]) -> None:
        kind = fault_now()
        if ctx.rank != at or chunk != 1:
            return
        if kind == "late" and stage == "prepare":
            _fire("stall", STALL_S)
        elif kind == "sigint" and stage == "received":
            _fire("sigint", 0.0)

    sink = PrometheusSink() if ctx.rank == 0 else NullSink()
    manager, model, w, old, _ = _manager(ctx, planner, fault, sink)
    extra = model.slot_tensors = ExtraSlots(model.slot_tensors)  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(ctx.rank)
    serving, interrupted, groups = [], [], []
    for step in range(PASSES):
        time.sleep(0.001)  # the solve's thread runs meanwhile
        extra.on = ctx.rank == at and fault_now() == "shape_slots"
        if _pass(manager, model, g, model.cfg.hidden) is not None:
            interrupted.append(step)
        state = manager.state()
        if len(state.history) > rebalances[0]:  # the same pass on every rank
            rebalances[0] = len(state.history)
            groups.append(state.swap_groups)
            if state.history[-1].outcome == "failed":
                serving.append(serving_collectives(ctx))
        if rebalances[0] == 2 * len(faults):
            break
    state = manager.state()
    out: dict[str, Any] = {
        "history": [(r.outcome, r.cause, r.reason) for r in state.history],
        "phase": state.phase,
        "groups": groups,
        "interrupted": interrupted,
        "serving": [*serving, serving_collectives(ctx)],
        "err": _served(manager, model, w, g),
        "back_to_old": state.placement.same_slots(old),
    }
    manager.close()
    if ctx.rank == 0:
        out["failed_counts"] = {
            line.split('cause="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in sink.render().decode().splitlines()
            if line.startswith(names.REBALANCES + "{") and 'outcome="failed"' in line
        }
    return out


def manager_stalled_past_the_serving_timeout(
    ctx: RankContext, at: int, stall_s: float, timeout_s: float
) -> dict[str, Any]:
    """Rank ``at`` sleeps ``stall_s`` (past the swaps' ``timeout_s`` and the serving group's own
    timeout) in the first rebalance's swap, before chunk 1 is posted: the others give the swap up
    with an agreement (an all-reduce on the swap group) still posted, and so does the late rank
    once it wakes, each in one the other never joins (Gloo's worker threads wait in them until the
    swap group's timeout). Every rank serves on until a forward pass (its all-to-all on the
    serving group) fails, as an engine's would, and then ends: what it saw."""
    from tests.helpers.manager import RecordingSink

    def fault(stage: str, chunk: int, bufs: list[torch.Tensor]) -> None:
        if ctx.rank == at and (stage, chunk) == ("prepare", 1):
            _fire("stall", stall_s)

    manager, model, _, _, _ = _manager(ctx, back_and_forth, fault, RecordingSink(), timeout_s=timeout_s)
    g = torch.Generator().manual_seed(ctx.rank)
    out: dict[str, Any] = {"forward": None}
    began = time.monotonic()
    for _ in range(PASSES):
        time.sleep(0.001)
        try:
            _pass(manager, model, g, model.cfg.hidden)
        except RuntimeError as exc:  # Gloo: the serving group timed out, or a peer left it
            out["forward"] = f"{type(exc).__name__}: {str(exc)[-80:]}"
            break
    out["history"] = [(r.outcome, r.cause) for r in manager.state().history]
    out["seconds"] = time.monotonic() - began
    manager.close()
    return out


def swap_group_collective_times_out(ctx: RankContext) -> dict[str, Any]:
    """Rank 0 starts an all-reduce on a swap group that rank 1 never joins: how long rank 0 waited
    before Gloo gave up (the group's own timeout, not torch's 30 minutes), and the timeout."""
    from eplb.hotswap import swap_group
    from eplb.hotswap.control import group_store, root_store
    from eplb.hotswap.runtime import keep_for_good
    from tests.helpers.swap_faults import group_timeout_s

    group = swap_group(None, ctx.device, timeout_s=TIMEOUT_S)
    store = root_store(group_store(None))
    out: dict[str, Any] = {"group_timeout_s": group_timeout_s(group)}
    if ctx.rank == 0:
        began = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=group)
            out["error"] = None
        except RuntimeError as exc:
            out["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        out["waited_s"] = time.monotonic() - began
        store.set("test/all_reduce_done", "1")
    else:
        store.wait(["test/all_reduce_done"])  # stay until then: a peer gone would end it earlier
    keep_for_good(group)  # out of step now (rank 0 ran one collective more): as a swap given up
    return out
