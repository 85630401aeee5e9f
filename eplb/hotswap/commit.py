"""Run a checked hot-swap on this rank: every chunk into staging, the vote, then commit or not.

The commit point is the swap's decision (eplb.hotswap.control): before it, no slot and no map has
changed anywhere (arrivals wait in staging), so a swap that is not committed needs nothing but
local state to undo (``restore_maps``, when ``update_maps`` already ran); after it, each rank
finishes alone (copies staging into its slots, then the maps) and a peer lost then no longer
matters. The decision is "commit" only when every rank voted yes, i.e. every chunk landed intact
and was agreed on every rank; any rank that gives up first (a deadline, a lost peer, an
exception outside the agreements) decides "abort" for all, and a rank that cannot reach the store
aborts alone. Each commit is recorded per layer in the store for a restarted rank
(eplb.hotswap.control.committed_placement).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from eplb.hotswap.control import Cause, Decision, SwapControl, SwapFailure
from eplb.hotswap.group import GroupRun
from eplb.hotswap.plan import SwapPlan
from eplb.hotswap.program import SwapProgram
from eplb.hotswap.runtime import SwapRuntime, keep_for_good
from eplb.placement.model import Placement

log = logging.getLogger("eplb.hotswap.commit")

_ABANDONED: list[tuple[torch.Tensor | None, list[GroupRun]]] = []
"""Staging buffers and runs of swaps given up with transfers in flight: a late arrival lands there."""


class HotSwapError(RuntimeError):
    """The swap was given up without every rank's vote, or this rank could not finish its side.

    ``cause``: ``peer lost`` (a rank died or left the swap, or the store is unreachable),
    ``timeout`` (a rank was late past ``timeout_s``, or the manager's watchdog ended the swap) or
    ``error``; ``rank``: the rank it names (None: unknown). ``committed``: this rank holds the new
    placement (weights and maps) of every layer of the swap, else the old one. ``consistent`` is
    False when this rank is in neither state: ``update_maps`` or ``restore_maps`` raised here (the
    maps are undefined; ``committed`` says which weights the slots hold), or the commit's copy of
    staging into the slots failed (the slots are undefined). ``alive`` is False when a process may
    be gone (a heartbeat stopped, a connection broke, the store is unreachable); True when every
    rank is alive (late or interrupted), so all can meet again on a fresh group. The group's ranks
    may be out of step (transfers still posted) or gone: do not use it for another collective;
    a swap needs a group of its own (:func:`eplb.hotswap.runtime.swap_group`, or the one
    ``hot_swap`` makes without a group, which it drops itself), never the one the model serves
    with, so giving one up leaves serving intact. The group is kept alive for good, so what it
    left posted holds up no process's exit (:func:`eplb.hotswap.runtime.keep_for_good`).
    """

    def __init__(
        self,
        message: str,
        *,
        cause: Cause,
        rank: int | None,
        committed: bool = False,
        consistent: bool = True,
        alive: bool = True,
    ) -> None:
        super().__init__(message)
        self.cause, self.rank, self.committed, self.consistent = cause, rank, committed, consistent
        self.alive = alive

    @classmethod
    def of(cls, failure: SwapFailure) -> HotSwapError:
        """The error of a swap given up for ``failure`` (nothing committed)."""
        return cls(failure.detail, cause=failure.cause, rank=failure.rank, alive=failure.alive)


@dataclass(frozen=True)
class Outcome:
    """How the swap ended on this rank: committed (``failure`` None) or not, and why."""

    failure: SwapFailure | None


class SwapRun:
    """One execution of a checked swap on this rank (see the module docstring for the protocol)."""

    def __init__(
        self,
        rt: SwapRuntime,
        program: SwapProgram,
        control: SwapControl | None,
        fault: Callable[[str, int, list[torch.Tensor]], None] | None,
        update_maps: Callable[[], None] | None,
        restore_maps: Callable[[], None] | None,
        *,
        pace_bytes_per_s: float | None = None,
    ) -> None:
        self.rt, self.program, self.control, self.fault = rt, program, control, fault
        self.update_maps, self.restore_maps = update_maps, restore_maps
        self.pace_bytes_per_s = pace_bytes_per_s
        self.early_maps = update_maps is not None and restore_maps is not None
        self.maps_touched = False
        self.runs: list[GroupRun] = []
        self.step = 0
        self.decision: Decision | None = None
        """The swap's decision once this rank knows it (a caller that sees an exception reads it)."""

    def execute(self, plan: SwapPlan, target: Placement, layers: tuple[int, ...]) -> Outcome:
        leaving: BaseException | None = None
        try:
            vote = self._transfer(plan)
            if vote is None and self.early_maps:
                vote = self._maps_first()
            decision = self._vote(vote)
        except SwapFailure as failure:
            decision = self._give_up(failure)
        except BaseException as exc:  # KeyboardInterrupt included: leave, consistent, then re-raise
            leaving = exc
            decision = self._give_up(self._left(exc))
        self.decision = decision
        if decision.commit:
            self._commit(target, layers, leaving)
        else:
            assert decision.failure is not None
            self._undo(decision.failure)
        if leaving is not None:
            raise leaving
        return Outcome(decision.failure)

    # ---- before the commit point ---------------------------------------------------------------
    def _transfer(self, plan: SwapPlan) -> SwapFailure | None:
        """Every chunk into staging, agreed chunk by chunk: None, or this rank's reason to vote no."""
        rt, ctl = self.rt, self.control
        tag = ((ctl.seq & 1) << 30) if ctl is not None else 0
        settled, failed = 0, False
        errors: list[str] = []
        mismatched: list[tuple[int, int]] = []
        due_s = pace_offsets(plan, self.pace_bytes_per_s)
        started = time.monotonic()
        for g, prog in enumerate(self.program.groups):
            # At most one group stays open while the next is posted.
            while len(self.runs) - settled > (1 if prog.overlaps_previous else 0):
                failed |= self._settle(self.runs[settled], errors, mismatched)
                settled += 1
            if failed:
                break
            if due_s[prog.chunk] > 0:
                self._pace(prog.chunk, started + due_s[prog.chunk])
            self._at(f"chunk {prog.chunk}")
            self.runs.append(GroupRun.start(rt, prog, tag, self.fault, slot=g % 2, control=ctl))
        while settled < len(self.runs):
            failed |= self._settle(self.runs[settled], errors, mismatched)
            settled += 1
        if not failed:
            return None
        rank = rt.rank
        if errors:
            return SwapFailure("error", rank, f"error: rank {rank}: {'; '.join(errors)}", group_usable=True)
        if mismatched:
            k, row = mismatched[0]
            t = plan.transfers[plan.chunks[k].transfers[row]]
            return SwapFailure(
                "checksum",
                t.dst_gpu,
                f"checksum: checksum mismatch in {len(mismatched)} transfer(s), first expert {t.expert} "
                f"of layer {t.layer} from rank {t.src_gpu} to rank {t.dst_gpu} (chunk {k})",
                group_usable=True,
            )
        return SwapFailure("error", None, "error: another rank failed", group_usable=True)

    def _pace(self, chunk: int, due: float) -> None:
        """Wait until chunk ``chunk`` is due (pacing), watching the swap's control meanwhile."""
        self._at(f"chunk {chunk} pace")  # on every rank alike: the schedule is the plan's
        with self.rt.timed("pace"):
            if self.control is None:
                time.sleep(max(0.0, due - time.monotonic()))
            else:
                self.control.wait(
                    lambda: time.monotonic() >= due,
                    deadline=due + self.control.timeout_s,
                    what=f"chunk {chunk}'s pace",
                    spin=1e-3,
                )

    def _settle(self, run: GroupRun, errors: list[str], mismatched: list[tuple[int, int]]) -> bool:
        self._at(f"chunk {run.prog.chunk} agreement")
        out = run.finish()
        errors += out.errors
        mismatched += [(run.prog.chunk, row) for row in out.mismatched]
        return out.failed

    def _maps_first(self) -> SwapFailure | None:
        """``update_maps`` before the vote (``restore_maps`` undoes it unless the swap commits)."""
        assert self.update_maps is not None
        self._at("update maps")
        self.maps_touched = True
        try:
            with self.rt.timed("maps"):
                self.update_maps()
        except Exception as exc:
            rank = self.rt.rank
            return SwapFailure(
                "error",
                rank,
                f"error: rank {rank}: update_maps: {type(exc).__name__}: {exc}",
                group_usable=True,
            )
        return None

    def _vote(self, mine: SwapFailure | None) -> Decision:
        """Every rank's vote; the most telling failure among them (or commit) is proposed."""
        ctl = self.control
        if ctl is None:
            return Decision(mine)
        self._fault("vote")
        self._at("vote")
        with self.rt.timed("vote"):
            deadline = time.monotonic() + ctl.timeout_s
            raw = ctl.exchange(
                "vote", "" if mine is None else mine.encode(), deadline=deadline, what="every rank's vote"
            )
            failures = [SwapFailure.decode(v) for v in raw if v]
            # A rank's own error names the cause best, then a corrupted arrival, then anything.
            chosen = next((f for f in failures if f.cause == "error" and f.rank is not None), None)
            chosen = chosen or next((f for f in failures if f.cause == "checksum"), None)
            return ctl.decide(chosen or (failures[0] if failures else None))

    def _give_up(self, failure: SwapFailure) -> Decision:
        return self.control.give_up(failure) if self.control is not None else Decision(failure)

    def _left(self, exc: BaseException) -> SwapFailure:
        if self.control is not None:
            return self.control.left(exc)
        return SwapFailure(
            "peer lost", 0, f"peer lost: this rank left the swap ({type(exc).__name__}: {exc})"
        )

    # ---- after the decision --------------------------------------------------------------------
    def _commit(self, target: Placement, layers: tuple[int, ...], leaving: BaseException | None) -> None:
        """Copy staging into the slots, then the maps; an interruption waits until both are done."""
        self._at("commit")
        ctl, rt = self.control, self.rt
        if ctl is not None:
            try:
                ctl.record_commit(target, layers)
            except SwapFailure as failure:  # the store is gone; this rank still commits
                log.warning("hot-swap committed but not recorded: %s", failure.detail)
        pending = leaving
        try:
            self._fault("committed")
        except BaseException as exc:
            pending = pending or exc
        for _ in range(3):  # idempotent: an interrupted copy is simply made again
            try:
                with rt.timed("commit"):
                    rt.copy_all(self.program.commit)
                break
            except BaseException as exc:
                pending = pending or exc
        else:
            raise self._undefined(f"could not copy the committed swap into its slots ({pending})", False)
        if self.update_maps is not None and not self.early_maps:
            try:
                self.update_maps()
            except BaseException as exc:
                raise self._undefined(
                    f"update_maps raised after the commit ({type(exc).__name__}: {exc})", True
                ) from exc
        rt.release_staging()
        if ctl is not None:
            ctl.finish()
        if pending is not None and leaving is None:
            raise pending

    def _undo(self, failure: SwapFailure) -> None:
        """Not committed: nothing to copy back; the old maps, if the new ones went in already."""
        if self.maps_touched and self.restore_maps is not None:
            try:
                self.restore_maps()
            except BaseException as exc:
                raise HotSwapError(
                    f"{failure.detail}; and restore_maps raised ({type(exc).__name__}: {exc})",
                    cause=failure.cause,
                    rank=failure.rank,
                    consistent=False,
                    alive=failure.alive,
                ) from exc
        if failure.group_usable:
            self.rt.release_staging()
            if self.control is not None:
                self.control.finish()
            return
        _ABANDONED.append((self.rt.staging_flat, self.runs))
        del _ABANDONED[:-4]
        keep_for_good(self.rt.group)  # what it left posted must not hold up the process's exit
        if self.rt.device.type == "cuda" and not all(run.settled() for run in self.runs):
            _abort_communicator(self.rt.group)

    def _undefined(self, what: str, committed: bool) -> HotSwapError:
        """This rank could not finish its side: its maps (or slots) are undefined."""
        rank = self.rt.rank
        return HotSwapError(
            f"error: rank {rank}: {what}", cause="error", rank=rank, committed=committed, consistent=False
        )

    def _at(self, label: str) -> None:
        self.step += 1
        if self.control is not None:
            self.control.at(self.step, label)

    def _fault(self, stage: str) -> None:
        if self.fault is not None:
            self.fault(stage, -1, [])


def pace_offsets(plan: SwapPlan, bytes_per_s: float | None) -> list[float]:
    """Seconds after the first chunk at which each chunk of ``plan`` may be posted: the bytes the
    busiest GPU receives in the chunks before it over ``bytes_per_s`` (all 0 when unpaced). The
    same on every rank (the plan is)."""
    offsets, total = [], 0
    for chunk in plan.chunks:
        offsets.append(0.0 if bytes_per_s is None else total / bytes_per_s)
        got: dict[int, int] = {}
        for i in chunk.transfers:
            t = plan.transfers[i]
            if not t.is_local:
                got[t.dst_gpu] = got.get(t.dst_gpu, 0) + plan.bytes_per_expert
        total += max(got.values(), default=0)
    return offsets


def _abort_communicator(group: dist.ProcessGroup | None) -> None:
    """Abort the group's NCCL communicators: kernels waiting for a lost peer exit, streams move on."""
    pg = group if group is not None else dist.group.WORLD
    try:
        if pg is not None and "nccl" in str(dist.get_backend(pg)):
            pg.abort()
    except Exception as exc:  # best effort: the group is given up either way
        log.warning("could not abort the hot-swap's communicator: %s", exc)
