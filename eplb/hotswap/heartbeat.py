"""Liveness of a group's ranks during a hot-swap: one heartbeat thread per process, and a watch.

Every process that takes part in a swap sets ``eplb/hotswap/hb/<global rank>`` in the root store
(shared by all groups) to ``<count> <position>`` every BEAT_S seconds from a daemon thread, where
the position says which swap and which step of it the rank is at. A :class:`Watch` reads the
others' values: a rank whose value stands still for :func:`lost_after` is lost (its process is
gone or frozen); one that counts but shows an earlier step is behind (late, alive).
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Sequence
from typing import ClassVar

import torch.distributed as dist

BEAT_S = 0.1
"""Heartbeat period."""


def lost_after(timeout_s: float) -> float:
    """How long a heartbeat may stand still before its rank counts as lost (well inside timeout_s)."""
    return min(1.0, max(3 * BEAT_S, timeout_s / 2))


class Heartbeat:
    """Sets ``eplb/hotswap/hb/<global rank>`` to ``<count> <position>`` every BEAT_S seconds.

    One per process and root store, on a daemon thread with its own store connection (a clone),
    so a rank whose main thread is busy or asleep still beats; it stops when the store goes away
    or the process leaves torch.distributed.
    """

    _running: ClassVar[dict[int, tuple[dist.Store, Heartbeat]]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, store: dist.Store, global_rank: int) -> None:
        self.store, self.key = store, f"eplb/hotswap/hb/{global_rank}"
        self.position = "-"
        """What this rank does now: ``<group>:<seq>:<step>:<label>`` (set by the swap's control)."""
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"eplb-heartbeat-{global_rank}")

    @classmethod
    def of(cls, root: dist.Store, global_rank: int) -> Heartbeat:
        with cls._lock:
            entry = cls._running.get(id(root))
            if entry is None or entry[1].stopped.is_set():
                clone = getattr(root, "clone", None)
                beat = cls(clone() if clone is not None else root, global_rank)
                cls._running[id(root)] = (root, beat)  # holds the root store: its id stays unique
                beat.thread.start()
                return beat
            return entry[1]

    def _run(self) -> None:
        count = 0
        while not self.stopped.is_set():
            if not dist.is_initialized():  # the process left its groups: nobody watches any more
                self.stopped.set()
                return
            try:
                self.store.set(self.key, f"{count} {self.position}")
            except Exception:  # the store is gone (its host ended): nothing left to beat into
                self.stopped.set()
                return
            count += 1
            self.stopped.wait(BEAT_S)

    @classmethod
    def stop_all(cls) -> None:
        with cls._lock:
            for _, beat in cls._running.values():
                beat.stopped.set()


atexit.register(Heartbeat.stop_all)


def root_store(store: dist.Store) -> dist.Store:
    """The store under every prefix (heartbeats and commit records are shared by all groups)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def group_store(group: dist.ProcessGroup | None) -> dist.Store:
    """The store of ``group`` (keys under its own prefix)."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_process_group_store(group if group is not None else c10d._get_default_group())


class Watch:
    """One rank's view of the other ranks' heartbeats (store errors propagate to the caller)."""

    def __init__(self, root: dist.Store, peers: Sequence[int], rank: int, lost_after_s: float) -> None:
        self.root, self.rank, self.lost_after = root, rank, lost_after_s
        self.keys = {r: f"eplb/hotswap/hb/{g}" for r, g in enumerate(peers) if r != rank}
        self._seen: dict[int, tuple[str, float]] = {}
        self._last = time.monotonic()

    def read(self) -> dict[int, str]:
        """The current value of every other rank that has a heartbeat."""
        have = [r for r in self.keys if r in self._seen or self.root.check([self.keys[r]])]
        values = self.root.multi_get([self.keys[r] for r in have]) if have else []
        return {r: bytes(v).decode() for r, v in zip(have, values, strict=True)}

    def lost(self) -> tuple[int, str, float] | None:
        """(rank, its last value, seconds it stood still) of a rank lost since watching, else None.

        Reads at most every BEAT_S / 2; a gap in this rank's own looks (it was busy or asleep) does
        not count, so only a stall seen while watching does.
        """
        now = time.monotonic()
        gap = now - self._last
        if gap < BEAT_S / 2:
            return None
        if gap > 2 * BEAT_S:  # not watching meanwhile: move every clock on by the time not seen
            self._seen = {r: (v, t + gap - BEAT_S) for r, (v, t) in self._seen.items()}
        self._last = now
        for r, value in self.read().items():
            old = self._seen.get(r)
            if old is None or old[0] != value:
                self._seen[r] = (value, now)
            elif now - old[1] > self.lost_after:
                return r, value, now - old[1]
        return None


def position(tag: str, seq: int, step: int, label: str) -> str:
    """A heartbeat position: step ``step`` (``label``) of swap ``seq`` on group ``tag``."""
    return f"{tag}:{seq}:{step}:{label.replace(' ', '_')}"


def step_of(beat: str, tag: str, seq: int) -> float:
    """The step a heartbeat shows in swap ``seq`` of group ``tag`` (-1 before it, inf after)."""
    parts = beat.split(" ", 1)[-1].split(":")
    if len(parts) != 4 or parts[0] != tag:
        return -1.0
    s, step = int(parts[1]), int(parts[2])
    return -1.0 if s < seq else float("inf") if s > seq else float(step)


def label_of(beat: str) -> str:
    """What a heartbeat says its rank is doing."""
    parts = beat.split(" ", 1)[-1].split(":")
    return parts[3].replace("_", " ") if len(parts) == 4 else parts[-1]
