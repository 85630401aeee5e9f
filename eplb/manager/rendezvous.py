"""Who serves on after a rank is lost: the survivors agree on their members through the store.

Every rank that begins a recovery of a group publishes an :class:`Arrival` (what it holds: its
placement's digest, its process groups, its passes and window, whether it can reload and change
its serving group) under the group's store prefix, and sets the group's recovery key (so the
others' waits end, eplb.manager.liveness). It then waits until every rank of the group is
accounted for: arrived, or named lost (by the caller or by a swap's error), or its heartbeat
stood still for ``lost_after`` while it waited; or until ``timeout_s``. Then it proposes the
ranks arrived as the members (``compare_set``: the first proposal is the decision) and reads the
decision, and every member reads every member's arrival: every survivor decides from the same
data, whoever proposed and whatever its clock said. A rank that arrives after a decision that
left it out raises :class:`RankLossError` (it may not serve with them).

The store must outlive the lost rank. When the lost rank hosted it (a ``tcp://`` or ``env://``
rendezvous whose master is rank 0), every store call fails at once (``DistNetworkError: Broken
pipe``, measured within 50 ms on Gloo, torch 2.13) and so does every survivor's recovery.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass

import torch.distributed as dist

from eplb.hotswap.heartbeat import Watch
from eplb.manager.liveness import BEGUN_KEY

POLL_S = 0.02
"""Pause between two looks at the store while the members are not decided."""
PREFIX = "eplb/manager/recovery"


class RankLossError(RuntimeError):
    """The survivors of a lost rank cannot serve on together (the message says why); the manager
    has stopped (phase ``stopped``)."""


@dataclass(frozen=True, kw_only=True)
class Arrival:
    """What one rank holds when it begins a recovery (every member reads every member's)."""

    rank: int
    """Global rank."""
    placement: int
    """crc32 of the live placement's phy2log."""
    groups: int
    """Process groups this process holds (part of the name of the next group, see swap_group)."""
    passes: int
    counted: int
    window: tuple[int, int]
    """[first, end) counted-pass ids the recorder's window holds."""
    loader: bool
    """The caller passed a loader (the lost experts can be reloaded on this rank)."""
    can_regroup: bool
    """The engine can serve on another group (it has ``set_world``)."""

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, raw: bytes | str) -> Arrival:
        d = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
        d["window"] = tuple(d["window"])
        return cls(**d)


@dataclass(frozen=True)
class Members:
    """The decision: who serves on, and what each of them holds."""

    ranks: tuple[int, ...]
    """Global ranks, ascending (a member's index here is its rank in the survivors' group)."""
    arrivals: dict[int, Arrival]
    lost: tuple[int, ...]
    """Ranks of the group left out (global)."""
    accounted: bool
    """The proposal came once every rank was accounted for (False: at the deadline)."""


def accounted_for(world: Collection[int], here: Collection[int], gone: Collection[int]) -> bool:
    """Whether every rank of ``world`` arrived or is known gone."""
    return set(world) <= set(here) | set(gone)


@dataclass(frozen=True, kw_only=True)
class Loss:
    """A rank loss as this rank begins its recovery of a group."""

    world: tuple[int, ...]
    """The group's global ranks, in group order."""
    me: int
    """This rank's global rank."""
    arrival: Arrival
    """What this rank holds, published to the others."""
    named_lost: tuple[int, ...]
    """Global ranks known gone (the engine's word, a swap's error); one that arrives in time serves on."""
    why: str
    """What found the loss: logged, and set under the group's recovery key for the others."""


def rendezvous(
    store: dist.Store, root: dist.Store, loss: Loss, *, timeout_s: float, lost_after_s: float
) -> Members:
    """Publish ``loss.arrival`` and return the members every survivor reads (see the module's doc).

    ``store``: the old group's store (its prefix); ``root``: the store under every prefix (the
    heartbeats). RankLossError when the store is unreachable or the decision left this rank out.
    """
    try:
        return _rendezvous(store, root, loss, timeout_s, lost_after_s)
    except RankLossError:
        raise
    except Exception as exc:  # DistNetworkError, ...: the store's host may be the lost rank
        raise RankLossError(
            f"rank {loss.me}: the store is unreachable ({type(exc).__name__}: {str(exc)[:160]}), so the "
            "survivors cannot agree on who serves on: host the store outside the ranks"
        ) from exc


def _rendezvous(
    store: dist.Store, root: dist.Store, loss: Loss, timeout_s: float, lost_after_s: float
) -> Members:
    world, me, named_lost = list(loss.world), loss.me, set(loss.named_lost)
    if not store.check([BEGUN_KEY]):
        store.set(BEGUN_KEY, f"rank {me}: {loss.why}"[:500])
    store.set(f"{PREFIX}/here/{me}", loss.arrival.encode())
    decision_key = f"{PREFIX}/members"
    watch = Watch(root, world, world.index(me), lost_after_s)
    still = _Stalls(watch, world, lost_after_s)
    deadline = time.monotonic() + timeout_s
    here: set[int] = {me}
    while not store.check([decision_key]):
        here |= {r for r in world if r not in here and store.check([f"{PREFIX}/here/{r}"])}
        gone = named_lost | still.update()
        timed_out = time.monotonic() > deadline
        if accounted_for(world, here, gone) or timed_out:
            proposal = json.dumps({"ranks": sorted(here), "accounted": not timed_out})
            store.compare_set(decision_key, "", proposal)
            break
        time.sleep(POLL_S)
    decided = json.loads(bytes(store.get(decision_key)).decode())
    ranks = tuple(int(r) for r in decided["ranks"])
    if me not in ranks:
        raise RankLossError(
            f"rank {me} began its recovery after the survivors had agreed to serve on without it "
            f"(ranks {list(ranks)}): it may not serve with them"
        )
    values = store.multi_get([f"{PREFIX}/here/{r}" for r in ranks])
    arrivals = {r: Arrival.decode(bytes(v)) for r, v in zip(ranks, values, strict=True)}
    lost = tuple(r for r in world if r not in ranks)
    return Members(ranks, arrivals, lost, bool(decided["accounted"]))


class _Stalls:
    """The ranks whose heartbeat stood still for ``lost_after_s`` while this rank watched."""

    def __init__(self, watch: Watch, world: list[int], lost_after_s: float) -> None:
        self.watch, self.world, self.lost_after = watch, world, lost_after_s
        self.seen: dict[int, tuple[str, float]] = {}

    def update(self) -> set[int]:
        now = time.monotonic()
        for r, value in self.watch.read().items():
            old = self.seen.get(r)
            if old is None or old[0] != value:
                self.seen[r] = (value, now)
        return {self.world[r] for r, (_, since) in self.seen.items() if now - since > self.lost_after}
