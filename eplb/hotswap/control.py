"""A hot-swap's control plane: check, votes and decision through the group's key-value store.

Collectives on the data group have no deadline and cannot be called back, so whatever must end on
time and the same on every rank goes through the c10d store, where every wait polls against a
deadline: the check that every rank runs the same swap, one vote per rank, and one decision key
per swap that the first writer sets (``compare_set``) and every rank follows. Heartbeats
(eplb.hotswap.heartbeat) tell a lost rank from a late one, and each commit is recorded per layer,
so a restarted rank can read the placement the others serve (:func:`committed_placement`). A
swap's keys live under its group's store prefix, which a group made again after a restart must
not share with the old one (torchrun's restart attempts and a new rendezvous store do not).
"""

from __future__ import annotations

import contextlib
import json
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import numpy as np
import torch.distributed as dist

from eplb.hotswap.heartbeat import (
    BEAT_S,
    Heartbeat,
    Watch,
    group_store,
    label_of,
    lost_after,
    position,
    root_store,
    step_of,
)
from eplb.placement.model import Placement

Cause = Literal["peer lost", "timeout", "checksum", "shape", "error"]
"""Why a swap failed: a rank died or left it, a rank was late (or the manager's watchdog ended the
swap), an arrival was corrupted, ranks disagreed on its shape, or an exception (a fault hook's,
``update_maps``') on a rank. ``peer lost`` and ``timeout`` end a swap with a
:class:`~eplb.hotswap.commit.HotSwapError`, ``checksum`` and ``error`` with a failed result, and
``shape`` with a :class:`~eplb.hotswap.check.HotSwapShapeError` before anything moved."""

POLL_S = 0.01
"""Longest pause between two looks at the store while waiting."""
_SEQ: dict[dist.ProcessGroup, int] = {}
"""Swaps started on each group (the group itself is the key: groups are never destroyed)."""
_T = TypeVar("_T")


class SwapFailure(Exception):
    """Why this swap is abandoned, the same on every rank that follows the decision.

    ``group_usable``: every rank settled every transfer it posted, so the group may run another
    collective. ``alive``: no process is known gone (False: a heartbeat stopped, a connection
    broke or the store is unreachable), so the ranks can all meet again, on a fresh group.
    """

    def __init__(
        self,
        cause: Cause,
        rank: int | None,
        detail: str,
        *,
        group_usable: bool = False,
        alive: bool = True,
    ) -> None:
        super().__init__(detail)
        self.cause, self.rank, self.detail = cause, rank, detail
        self.group_usable, self.alive = group_usable, alive

    def encode(self) -> str:
        return json.dumps(
            {
                "cause": self.cause,
                "rank": self.rank,
                "detail": self.detail,
                "usable": self.group_usable,
                "alive": self.alive,
            }
        )

    @classmethod
    def decode(cls, text: str) -> SwapFailure:
        d = json.loads(text)
        return cls(d["cause"], d["rank"], d["detail"], group_usable=bool(d["usable"]), alive=bool(d["alive"]))


@dataclass(frozen=True)
class Decision:
    """A swap's outcome: committed, or abandoned for ``failure``."""

    failure: SwapFailure | None

    @property
    def commit(self) -> bool:
        return self.failure is None

    @property
    def gives_up_group(self) -> bool:
        """Abandoned with a rank's transfers possibly unsettled: the group must not be used again."""
        return self.failure is not None and not self.failure.group_usable

    @classmethod
    def parse(cls, raw: bytes | str) -> Decision:
        text = raw.decode() if isinstance(raw, bytes) else raw
        return cls(None if text == _COMMIT else SwapFailure.decode(text))


_COMMIT = "commit"


def group_tag(peers: Sequence[int]) -> str:
    """A short, stable name of a group: its size and a digest of its global ranks."""
    return f"{len(peers)}x{zlib.crc32(np.asarray(peers, dtype=np.int64).tobytes()):08x}"


class SwapControl:
    """One swap's keys (``eplb/hotswap/<seq>/...`` in the group's store) and waits, on one rank.

    Every wait polls with a deadline and raises :class:`SwapFailure` when the swap was decided
    elsewhere (another rank gave up), when a rank's heartbeat stands still (``peer lost``), or at
    the deadline (``timeout``, naming a rank that is behind). A store that cannot be reached counts
    as a lost peer (its host).
    """

    def __init__(
        self,
        store: dist.Store,
        *,
        rank: int,
        peers: Sequence[int],
        seq: int,
        timeout_s: float,
        name: str,
    ) -> None:
        self.store, self.rank, self.peers, self.seq = store, rank, list(peers), seq
        self.world, self.timeout_s = len(self.peers), timeout_s
        self.tag = group_tag(self.peers)
        """The ranks' name: the commit records are kept under it, for any group of these ranks."""
        self.beat_tag = f"{self.tag}.{zlib.crc32(name.encode()):08x}"
        """This group's name in heartbeat positions (``name``: the group's, the same on its ranks):
        its swaps are counted apart from those of another group of the same ranks."""
        self.root = root_store(store)
        self.heartbeat = Heartbeat.of(self.root, self.peers[rank])
        self.watch = Watch(self.root, self.peers, rank, lost_after(timeout_s))
        self.step, self.label = 0, "start"
        self.at(0, "check")

    @classmethod
    def for_group(cls, group: dist.ProcessGroup | None, timeout_s: float) -> SwapControl | None:
        """The next swap's control on ``group`` (collective order: every rank calls it once per swap)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
            return None
        world = dist.get_world_size(group)
        peers = [dist.get_global_rank(group, r) if group is not None else r for r in range(world)]
        pg = group if group is not None else dist.group.WORLD
        assert pg is not None, "an initialized default group"
        # Counted per group: a fresh group starts every rank at 1, even after a rank left a swap
        # before it counted it (interrupted before its check).
        _SEQ[pg] = seq = _SEQ.get(pg, 0) + 1
        return cls(
            group_store(group),
            rank=dist.get_rank(group),
            peers=peers,
            seq=seq,
            timeout_s=timeout_s,
            name=pg.group_name,
        )

    # ---- where this rank is -------------------------------------------------------------------
    def at(self, step: int, label: str) -> None:
        """This rank reached protocol step ``step`` (monotonic within the swap), named ``label``."""
        self.step, self.label = step, label
        self.heartbeat.position = position(self.beat_tag, self.seq, step, label)

    # ---- waits --------------------------------------------------------------------------------
    def wait(
        self, done: Callable[[], bool], *, deadline: float, what: str, spin: float | None = 1e-4
    ) -> None:
        """Until ``done()``, looking at the store every POLL_S seconds after the first 2 ms.

        ``spin``: the pause between two calls of a cheap ``done`` (0: a GPU event, poll it hot);
        None: ``done`` asks the store itself, so it is called with every look, backing off.
        """
        start = last = time.monotonic()
        pause = 2e-4 if spin is None else spin
        while not done():
            now = time.monotonic()
            if (spin is None or now - last >= POLL_S) and now - start > 2e-3:
                self.poll()
                last = now
                if now > deadline:
                    raise self.late(what)
            time.sleep(pause)
            if spin is None:  # back off: quick while the others are about to arrive, then calmer
                pause = min(2e-3 if now - start < 0.05 else POLL_S, pause * 1.5)

    def poll(self) -> None:
        """Raise if another rank decided this swap or a rank's heartbeat stopped."""
        decision = self.decided()
        if decision is not None and decision.failure is not None:
            raise decision.failure
        lost = self._store(self.watch.lost)
        if lost is not None:
            r, value, still = lost
            raise SwapFailure(
                "peer lost",
                r,
                f"peer lost: rank {r}'s heartbeat stopped {still:.1f} s ago (last at {label_of(value)}) "
                f"while rank {self.rank} was at {self.label}",
                alive=False,
            )

    def late(self, what: str) -> SwapFailure:
        """The failure of a wait past its deadline: a lost rank if one is, else the rank behind.

        The rank behind is blamed once its heartbeat moves (alive, so late); one that stands still
        is watched until it counts as lost (about ``lost_after``), so a dead rank is not a timeout.
        """
        first = self._store(self.watch.read)
        stop = time.monotonic() + 2 * self.watch.lost_after + 5 * BEAT_S
        while True:
            try:
                self.poll()
            except SwapFailure as failure:
                return failure
            beats = self._store(self.watch.read)
            behind = [r for r, v in beats.items() if step_of(v, self.beat_tag, self.seq) < self.step]
            absent = [r for r in range(self.world) if r != self.rank and r not in beats]
            blamed = next(iter(behind + absent), None)
            if blamed is None or blamed in absent or beats[blamed] != first.get(blamed):
                break
            if time.monotonic() > stop:
                break
            time.sleep(POLL_S)
        where = (
            "" if blamed is None else f"rank {blamed} (at {label_of(beats.get(blamed, '- never started'))}) "
        )
        return SwapFailure(
            "timeout",
            blamed,
            f"timeout: {where}timed out: rank {self.rank} waited {self.timeout_s} s for {what}",
        )

    def lost_peer(self, what: str, error: BaseException) -> SwapFailure:
        """A transfer or collective raised (a connection to a peer broke): find the rank that is lost.

        A broken connection is final, so this waits past the chunk's deadline if need be, until a
        heartbeat has stood still for long enough to name its rank (about ``lost_after``).
        """
        detail = f"{what}: {type(error).__name__}: {str(error)[:200]}"
        started = time.monotonic()
        first = self._store(self.watch.read)
        stop = started + 2 * self.watch.lost_after + 5 * BEAT_S
        while time.monotonic() < stop:
            try:
                self.poll()
            except SwapFailure as failure:
                failure.detail = f"{failure.detail}; {detail}"
                return failure
            time.sleep(POLL_S)
        # The watch discounts gaps in this rank's own looks (a busy machine spaces them out), so it
        # may not have named the rank yet: one whose heartbeat stood still over the whole wait is it.
        beats = self._store(self.watch.read)
        still = [r for r in sorted(first) if beats.get(r) == first[r]]
        if still:
            r, waited = still[0], time.monotonic() - started
            return SwapFailure(
                "peer lost",
                r,
                f"peer lost: rank {r}'s heartbeat stood still for the {waited:.1f} s waited "
                f"(at {label_of(first[r])}); {detail}",
                alive=False,
            )
        return SwapFailure("peer lost", None, f"peer lost: {detail}", alive=False)

    # ---- exchanges and the decision -----------------------------------------------------------
    def key(self, name: str, seq: int | None = None) -> str:
        return f"eplb/hotswap/{self.seq if seq is None else seq}/{name}"

    def exchange(self, name: str, value: str, *, deadline: float, what: str) -> list[str]:
        """Publish ``value`` and return every rank's (in rank order) once all are there."""
        keys = [self.key(f"{name}/{r}") for r in range(self.world)]
        self._store(self.store.set, keys[self.rank], value)
        self.wait(lambda: bool(self._store(self.store.check, keys)), deadline=deadline, what=what, spin=None)
        return [bytes(v).decode() for v in self._store(self.store.multi_get, keys)]

    def decided(self) -> Decision | None:
        key = self.key("decision")
        if not self._store(self.store.check, [key]):
            return None
        return Decision.parse(self._store(self.store.get, key))

    def decide(self, failure: SwapFailure | None) -> Decision:
        """Propose an outcome (None: commit); the first proposal of the swap is its decision."""
        proposal = _COMMIT if failure is None else failure.encode()
        return Decision.parse(self._store(self.store.compare_set, self.key("decision"), "", proposal))

    def give_up(self, failure: SwapFailure) -> Decision:
        """Propose ``failure``; the decision that stands (a commit, if every rank had voted yes)."""
        try:
            return self.decide(failure)
        except SwapFailure:  # the store is gone: decide alone (nothing commits without it)
            return Decision(failure)

    def left(self, exc: BaseException) -> SwapFailure:
        """This rank leaves the swap (an exception outside what the agreements settle)."""
        return SwapFailure(
            "peer lost",
            self.rank,
            f"peer lost: rank {self.rank} left the swap at {self.label} ({type(exc).__name__}: {exc})",
        )

    def finish(self) -> None:
        """Drop the previous swap's keys (every rank that took part in this one is done with them)."""
        if self.seq > 1:
            prev = self.seq - 1
            names = [f"check/{self.rank}", f"vote/{self.rank}"] + (["decision"] if self.rank == 0 else [])
            for name in names:
                with contextlib.suppress(Exception):  # cleanup only
                    self.store.delete_key(self.key(name, prev))

    def record_commit(self, target: Placement, layers: Sequence[int]) -> None:
        """Record ``layers`` of the committed ``target`` (every rank writes the same values)."""
        base = f"eplb/hotswap/committed/{self.tag}"
        meta = json.dumps(
            {
                "seq": self.seq,
                "num_physical": target.num_physical,
                "num_gpus": target.num_gpus,
                "num_nodes": target.num_nodes,
                "max_replicas": target.max_replicas,
            }
        )
        for layer in layers:  # the layers first: a reader that finds the meta finds its layers
            row = np.ascontiguousarray(target.phy2log_LP[layer], dtype=np.int32).tobytes()
            self._store(self.root.set, f"{base}/layer/{layer}", row)
        self._store(self.root.set, f"{base}/meta", meta)

    def _store(self, op: Callable[..., _T], *args: object) -> _T:
        try:
            return op(*args)
        except Exception as exc:
            raise SwapFailure(
                "peer lost",
                None,
                f"peer lost: the store is unreachable ({type(exc).__name__}: {str(exc)[:120]})",
                alive=False,
            ) from exc


def committed_placement(
    initial: Placement,
    *,
    group: dist.ProcessGroup | None = None,
    store: dist.Store | None = None,
    peers: Sequence[int] | None = None,
) -> Placement:
    """The placement the ranks of a group committed last: ``initial`` with every layer a committed
    swap changed taken from the record that swap left in the store.

    For a rank that restarts after its group lost it: the survivors keep serving on this placement.
    ``peers``: the global ranks of the group the swaps ran on (default: ``group``'s).
    """
    if store is None:
        store = group_store(group)
    if peers is None:
        world = dist.get_world_size(group)
        peers = [dist.get_global_rank(group, r) if group is not None else r for r in range(world)]
    root = root_store(store)
    base = f"eplb/hotswap/committed/{group_tag(peers)}"
    if not root.check([f"{base}/meta"]):
        return initial
    meta = json.loads(bytes(root.get(f"{base}/meta")).decode())
    if (meta["num_physical"], meta["num_gpus"]) != (initial.num_physical, initial.num_gpus):
        raise ValueError(f"the recorded placement ({meta}) does not fit the initial one")
    phy2log = initial.phy2log_LP.copy()
    for layer in range(initial.num_layers):
        key = f"{base}/layer/{layer}"
        if root.check([key]):
            phy2log[layer] = np.frombuffer(bytes(root.get(key)), dtype=np.int32)
    return Placement.from_phy2log(
        phy2log,
        initial.num_gpus,
        initial.num_nodes,
        max_replicas=max(initial.max_replicas, meta["max_replicas"]),
    )
