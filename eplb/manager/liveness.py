"""Whether the manager's ranks are all still there: waits on collectives that end when one is lost.

A collective with a lost peer does not always fail on every rank: on Gloo (torch 2.13, 4 ranks,
one ended by ``os._exit``) the ranks next to the lost one in an all-reduce's ring fail within
0.25 s ("Connection closed by peer"), but the rank after them waits for a message that the ranks
that failed will never send, until the group's timeout; ``abort()`` and ``shutdown()`` of a
Gloo group do not wake it. So the manager starts each of its collectives asynchronously and
waits with a look, every :data:`LOOK_S` that it is still waiting, at

- the other ranks' heartbeats (eplb.hotswap.heartbeat: a daemon thread per process counts in the
  store every 0.1 s; one that stands still for ``lost_after`` while this rank waits is gone), and
- the group's recovery key in the store, which a rank that begins a recovery sets
  (eplb.manager.rendezvous),

and raises :class:`RankLost` when either says so, or when the collective itself fails. The
collective is abandoned there: its group is never used again (the survivors make one of their
own, eplb.manager.recovery). A collective that completes within :data:`LOOK_S` reads nothing
from the store.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import torch.distributed as dist

from eplb.hotswap.heartbeat import Heartbeat, Watch, group_store, label_of, root_store

LOOK_S = 0.05
"""Longest a wait goes without looking at the heartbeats and the recovery key."""
BEGUN_KEY = "eplb/manager/recovery/begun"
"""Set (under the group's store prefix) by the first rank that begins a recovery of the group."""


class RankLost(Exception):
    """A rank of the manager's group is gone, or another rank began a recovery: the group's
    collectives cannot be trusted again. ``ranks``: global ranks known to be gone (may be empty)."""

    def __init__(self, detail: str, ranks: Iterable[int] = ()) -> None:
        super().__init__(detail)
        self.ranks = tuple(sorted(set(int(r) for r in ranks)))


class Liveness:
    """This rank's heartbeat, and its view of the others', for one process group.

    ``members``: the group's global ranks in group order; ``me``: this rank's index there.
    Making one starts this process's heartbeat thread (one per process and store).
    """

    def __init__(
        self, group: dist.ProcessGroup | None, members: Sequence[int], me: int, lost_after_s: float
    ) -> None:
        self.store = group_store(group)
        self.root = root_store(self.store)
        self.members, self.me = list(members), me
        self.heartbeat = Heartbeat.of(self.root, self.members[me])
        self.watch = Watch(self.root, self.members, me, lost_after_s)

    def check(self, what: str) -> None:
        """Raise :class:`RankLost` if a recovery began or a rank's heartbeat stopped (store
        errors count as a lost rank: the store's host may be the one gone)."""
        try:
            if self.store.check([BEGUN_KEY]):
                raise RankLost(
                    f"{what}: rank(s) began a recovery ({bytes(self.store.get(BEGUN_KEY)).decode()})"
                )
            lost = self.watch.lost()
        except RankLost:
            raise
        except Exception as exc:
            raise RankLost(
                f"{what}: the store is unreachable ({type(exc).__name__}: {str(exc)[:120]})"
            ) from exc
        if lost is not None:
            r, value, still = lost
            rank = self.members[r]
            raise RankLost(
                f"{what}: rank {rank}'s heartbeat stopped {still:.1f} s ago (last at {label_of(value)})",
                ranks=(rank,),
            )

    def wait(self, work: dist.Work | None, what: str) -> None:
        """Wait for ``work`` (an async collective's handle) or raise :class:`RankLost`."""
        if work is None:
            return
        if not work.is_completed():
            try:
                future = work.get_future()
            except RuntimeError:  # Gloo's point-to-point handles: no future, and never "completed"
                future = None  # before wait(): that wait is bounded by the group's timeout alone
            if future is not None:
                done = threading.Event()
                future.add_done_callback(lambda _: done.set())
                while not done.wait(LOOK_S):
                    self.check(what)
        try:
            work.wait()
        except RuntimeError as exc:  # a connection broke (Gloo: "Connection closed by peer")
            raise RankLost(f"{what} failed: {type(exc).__name__}: {str(exc)[:200]}") from exc
