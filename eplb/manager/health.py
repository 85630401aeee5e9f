"""The hot-swap's own process group, apart from the one the model serves with, and whether the
manager may still swap.

A swap given up without every rank's vote (:class:`eplb.hotswap.HotSwapError`: a peer late,
interrupted or lost) leaves every layer of every rank on the old or the new placement, weights
and maps, but its group out of step: transfers may still be posted, and the next collective on
it could abort the process. So the manager swaps on a group of its own
(:func:`eplb.hotswap.runtime.swap_group`) and :class:`SwapGroups` turns such a swap into a failed
result and, by what the error says:

- every rank alive and this one consistent (a late or interrupted peer): *drops* the swap group
  (kept, never used again) and serves on; the manager makes a fresh one at the next rebalance
  boundary, which every rank reaches on the same pass through the serving group
  (:meth:`SwapGroups.renew`), once the ranks agree they hold the same placement;
- a rank possibly gone (a heartbeat stopped, a connection broke, the store is unreachable):
  stops, and names the rank (:attr:`SwapGroups.lost`): the manager's survivors then form a group
  of their own and serve on (eplb.manager.recovery), or stop for good when they cannot;
- this rank's maps or slots undefined: *stops* for good: the manager serves on the placement it
  holds and runs no collective and no rebalance again.

Either way the failure is logged and reported (its reason names the cause: ``peer lost`` or
``timeout``, and the rank).
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from eplb.hotswap.runtime import group_count, swap_group
from eplb.hotswap.swap import HotSwapError, HotSwapOptions, HotSwapResult, PreparedSwap
from eplb.manager.collectives import RankAgreement
from eplb.placement.model import Placement

log = logging.getLogger("eplb.manager.health")


class SwapGroups:
    """This rank's swap group: made with the manager, dropped after a swap given up, made again.

    Making one is collective over the serving group's ranks (every rank constructs the manager at
    the same point, and renews at the same rebalance boundary). One rank: no group (a swap has no
    peer).
    """

    def __init__(
        self,
        serving: dist.ProcessGroup | None,
        agree: RankAgreement,
        device: torch.device,
        rank: int,
        *,
        timeout_s: float = HotSwapOptions.timeout_s,
    ) -> None:
        self.serving, self.agree, self.device, self.rank = serving, agree, device, rank
        self.timeout_s = timeout_s
        """The swaps' ``timeout_s`` (the manager's swap options): the swap groups' own timeout
        follows from it (eplb.hotswap.runtime.swap_group_timeout_s)."""
        self.group: dist.ProcessGroup | None = None
        """The group swaps run on now (None with one rank, or once dropped)."""
        self.made = 0
        """Swap groups made so far (1 after start-up with several ranks, one more per renewal)."""
        self.dropped: str | None = None
        """Why the last swap group was dropped; a fresh one is made at the next rebalance boundary."""
        self.stopped: str | None = None
        """Why this manager may never swap (nor run a collective) again; None while it may."""
        self.lost: tuple[int, ...] | None = None
        """After a swap that lost a peer (``alive`` False): the ranks of the group it named (may be
        empty); the manager's survivors then recover without them (eplb.manager.recovery)."""
        self._given_up: list[dist.ProcessGroup] = []
        if agree.world_size > 1:
            if not all(agree.same(group_count())):
                raise ValueError(
                    "the ranks hold different numbers of process groups, so the hot-swap's group "
                    "would get a different name on each: make the same groups on every rank "
                    "before the manager"
                )
            self._make()

    @property
    def running(self) -> bool:
        """The manager may still record and rebalance (collectives included)."""
        return self.stopped is None

    @property
    def usable(self) -> bool:
        """A swap may run now: a swap group is in place."""
        return self.stopped is None and self.dropped is None

    def execute(
        self, layers: tuple[int, ...], prepared: PreparedSwap, **kwargs: Any
    ) -> tuple[HotSwapResult, BaseException | None]:
        """Run ``prepared.execute(**kwargs)``: (its result, None), a failed result for a swap the
        check refused (nothing moved, the group usable) or given up (HotSwapError: the group is
        dropped or the manager stops), or (what the swap's decision made of it, the exception)
        when this rank was interrupted (KeyboardInterrupt): the caller re-raises that once its
        state is where every other rank's is."""
        leaving: BaseException | None = None
        try:
            try:
                return prepared.execute(**kwargs), None
            except HotSwapError:
                raise
            except (ValueError, RuntimeError) as exc:  # the check refused it on every rank alike
                refused = HotSwapResult.not_started(layers, f"{type(exc).__name__}: {exc}")
                return replace(
                    refused, cause=getattr(exc, "cause", None), rank=getattr(exc, "rank", None)
                ), None
            except BaseException as exc:  # this rank was interrupted; its side of the swap is done
                leaving = exc
                return prepared.decided(), leaving
        except HotSwapError as exc:
            self._lose(exc)
            return replace(
                HotSwapResult.not_started(layers, str(exc)), cause=exc.cause, rank=exc.rank
            ), leaving

    def renew(self, placement: Placement) -> str | None:
        """After a dropped group, at a rebalance boundary (collective over the serving group, on
        the same pass on every rank): a fresh swap group when every rank holds the same placement;
        None, or why not (the manager stops)."""
        assert self.dropped is not None and self.stopped is None, "renew only a dropped swap group"
        digest = zlib.crc32(np.ascontiguousarray(placement.phy2log_LP, dtype=np.int32).tobytes())
        same_placement, same_groups = self.agree.same(digest, group_count())
        if not same_placement:
            self.stopped = "after a swap given up, the ranks disagree on the placement they hold"
        elif not same_groups:
            self.stopped = "the ranks disagree on how many process groups they hold"
        if self.stopped is not None:
            log.error("rank %d: %s; rebalancing stopped", self.rank, self.stopped)
            return self.stopped
        self._make()
        log.warning(
            "rank %d: a fresh hot-swap group (swap group %d) replaces the one dropped", self.rank, self.made
        )
        self.dropped = None
        return None

    def note(self, kept: list[int]) -> str:
        """What a failure's reason adds once the swap group is dropped or the manager stopped."""
        if self.stopped is not None:
            return (
                f"; the process group is unusable ({self.stopped}): serving on the placement held "
                f"(layers {kept} of this rebalance stay applied), rebalancing stopped"
            )
        return (
            f"; the swap's process group was dropped (serving goes on, on its own group): serving on "
            f"the placement held (layers {kept} of this rebalance stay applied), a fresh swap group "
            "at the next rebalance"
        )

    def _make(self) -> None:
        self.group = swap_group(self.serving, self.device, timeout_s=self.timeout_s)
        self.made += 1

    def _lose(self, exc: HotSwapError) -> None:
        if self.group is not None:
            self._given_up.append(self.group)  # kept, never destroyed (see swap_group)
        self.group = None
        if not exc.consistent:
            self.stopped = f"rank {self.rank}'s maps or slots are undefined"
        elif not exc.alive:
            self.stopped = "a rank may be gone"
            self.lost = () if exc.rank is None or exc.rank == self.rank else (exc.rank,)
        else:
            self.dropped = str(exc)
        log.error(
            "rank %d: a hot-swap was given up (%s: %s); serving on the placement held, %s",
            self.rank,
            type(exc).__name__,
            exc,
            "rebalancing stopped" if self.stopped else "its group dropped",
        )
