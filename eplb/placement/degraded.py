"""Placements over the ranks still alive: dead ranks' slots hold -1, every logical expert is served.

Shape legend: L layers, E logical experts, P physical slots, R max replicas, G GPUs (EP ranks), N
nodes; a primed count (G', P') is the survivors' part of it.

A :class:`Placement` fills every slot, so a degraded placement is kept twice: ``survivors`` is a
plain Placement over the live GPUs alone (G' GPUs, P' = G' * S slots, live GPU i is the i-th live
rank), on which every solver, scoring and simulation function works unchanged; the full-size maps
(``phy2log_LP`` [L, P] with -1 in dead ranks' slots, ``log2phy_LER`` naming full slot ids) are what
an engine that keeps its slot buffers after losing a rank reads. :func:`reload_report` counts the
transfer from the live placement: experts whose every replica was on a dead rank are reloaded
from a source the caller names, the others are copied from a survivor's replica.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from eplb.placement.model import INT32, Placement

RELOAD_SOURCES = ("peer", "host", "checkpoint")
"""Where an expert with no replica left on a live rank is reloaded from: another process's
replica (a standby or another DP group), a pinned host copy, the checkpoint on disk."""
SURVIVOR = "survivor"
"""The source of a copy of an expert that a live rank still holds (``ReloadReport.bytes_by_source``)."""


def check_alive(alive: Any, num_gpus: int) -> np.ndarray:
    """bool [G] from a mask of live ranks (bools or 0/1); ValueError for a wrong length or no rank alive."""
    arr = np.asarray(alive)
    if arr.ndim != 1 or arr.size != num_gpus:
        raise ValueError(f"alive_ranks must list {num_gpus} ranks (one per EP rank), got shape {arr.shape}")
    if arr.size and not (
        arr.dtype == np.bool_ or (np.issubdtype(arr.dtype, np.integer) and np.isin(arr, (0, 1)).all())
    ):
        raise ValueError("alive_ranks must hold booleans (or 0/1), one per EP rank")
    alive_G = arr.astype(bool)
    if not alive_G.any():
        raise ValueError("alive_ranks: no rank is alive")
    return alive_G


def survivor_nodes(alive_G: np.ndarray, num_nodes: int) -> int:
    """N' for the live GPUs: the nodes that keep a GPU, when each keeps as many; else 1 (a
    Placement needs equal nodes, so uneven survivors plan as one node)."""
    per_node = alive_G.reshape(num_nodes, -1).sum(axis=1)
    kept = per_node[per_node > 0]
    return int(kept.size) if (kept == kept[0]).all() else 1


def live_slots(alive_G: np.ndarray, slots_per_gpu: int) -> np.ndarray:
    """int64 [P']: the full slot ids of the live GPUs, ascending (the survivors' slot order)."""
    return np.flatnonzero(np.repeat(alive_G, slots_per_gpu))


def survivors_phy2log(placement: Placement, alive_G: np.ndarray) -> np.ndarray:
    """int32 [L, P']: what the live GPUs hold of ``placement`` (experts lost with the dead ranks absent)."""
    return placement.phy2log_LP[:, live_slots(alive_G, placement.slots_per_gpu)]


def orphans(placement: Placement, alive_G: np.ndarray) -> np.ndarray:
    """bool [L, E]: experts whose every replica is on a dead rank (they need a reload)."""
    held_LGE = placement.gpu_has_expert()
    return np.asarray(~held_LGE[:, alive_G, :].any(axis=1))


@dataclass(frozen=True, eq=False)
class DegradedPlacement:
    """A placement over the live ranks, with the engine's full slot numbering (dead slots -1)."""

    survivors: Placement
    """The live GPUs' placement (G' GPUs, P' slots; live GPU i is the i-th live rank)."""
    alive_G: np.ndarray
    """bool [G]: the ranks alive."""
    num_nodes: int
    """N of the full topology."""
    phy2log_LP: np.ndarray
    """int32 [L, P]: logical expert of each slot, -1 in dead ranks' slots."""
    log2phy_LER: np.ndarray
    """int32 [L, E, R]: full slot ids of each expert's replicas (live slots only), padded with -1;
    R = P - E + 1, the engine's buffer shape."""
    logcnt_LE: np.ndarray
    """int32 [L, E]: replicas of each expert (>= 1), all on live ranks."""

    @classmethod
    def from_survivors(cls, survivors: Placement, alive_G: np.ndarray, num_nodes: int) -> DegradedPlacement:
        """The full-size maps of ``survivors``, the placement over the live GPUs of ``alive_G``."""
        alive_G = np.asarray(alive_G, dtype=bool)
        G = alive_G.size
        S = survivors.slots_per_gpu
        if int(alive_G.sum()) != survivors.num_gpus:
            raise ValueError(f"{survivors.num_gpus} survivor GPUs but {int(alive_G.sum())} ranks alive")
        L, E, P = survivors.num_layers, survivors.num_logical, G * S
        slots = live_slots(alive_G, S).astype(INT32)
        phy2log_LP = np.full((L, P), -1, dtype=INT32)
        phy2log_LP[:, slots] = survivors.phy2log_LP
        log2phy_LER = np.full((L, E, P - E + 1), -1, dtype=INT32)
        # The survivors' replica columns fit: P' - E + 1 <= P - E + 1 replicas at most.
        compact_LER = survivors.log2phy_LER[:, :, : min(survivors.max_replicas, P - E + 1)]
        used = compact_LER >= 0
        log2phy_LER[:, :, : compact_LER.shape[2]] = np.where(used, slots[np.maximum(compact_LER, 0)], -1)
        out = cls(survivors, alive_G, num_nodes, phy2log_LP, log2phy_LER, survivors.logcnt_LE.copy())
        return out.validate()

    @property
    def num_gpus(self) -> int:
        return int(self.alive_G.size)

    def validate(self) -> DegradedPlacement:
        """Check that dead slots hold -1, live ones a valid placement, and that log2phy agrees."""
        p2l, l2p, cnt = self.phy2log_LP, self.log2phy_LER, self.logcnt_LE
        for name, arr in (("phy2log", p2l), ("log2phy", l2p), ("logcnt", cnt)):
            if arr.dtype != INT32:
                raise ValueError(f"{name} must be int32, got {arr.dtype}")
        G, S = self.num_gpus, self.survivors.slots_per_gpu
        if p2l.shape[1] != G * S or self.num_nodes < 1 or G % self.num_nodes:
            raise ValueError(
                f"phy2log has {p2l.shape[1]} slots for {G} ranks of {S} slots over {self.num_nodes} nodes"
            )
        self.survivors.validate()
        slots = live_slots(self.alive_G, S)
        dead = np.ones(p2l.shape[1], dtype=bool)
        dead[slots] = False
        if (p2l[:, dead] != -1).any():
            raise ValueError("a dead rank's slot holds an expert (dead slots must hold -1)")
        if not np.array_equal(p2l[:, slots], self.survivors.phy2log_LP):
            raise ValueError("phy2log's live slots disagree with the survivors' placement")
        if not np.array_equal(cnt, self.survivors.logcnt_LE):
            raise ValueError("logcnt disagrees with the survivors' placement")
        used = l2p >= 0
        if not np.array_equal(used.sum(axis=2), cnt) or dead[np.where(used, l2p, slots[0])].any():
            raise ValueError("log2phy must list each expert's live slots only, padded with -1")
        layer_LER = np.broadcast_to(np.arange(p2l.shape[0])[:, None, None], l2p.shape)
        expert_LER = np.broadcast_to(np.arange(cnt.shape[1])[None, :, None], l2p.shape)
        if not np.array_equal(p2l[layer_LER[used], l2p[used]], expert_LER[used]):
            raise ValueError("log2phy and phy2log disagree: a listed slot holds another expert")
        return self


@dataclass(frozen=True, kw_only=True)
class ReloadReport:
    """The transfer from the live placement to a degraded one: what stays, is copied, is reloaded."""

    reload_LE: np.ndarray
    """bool [L, E]: experts whose every replica was on a dead rank; they are reloaded from ``source``."""
    source: str
    """Where those are reloaded from (:data:`RELOAD_SOURCES`)."""
    reloads: int
    """Loads from ``source``: one per reloaded (layer, expert), the fewest any plan needs."""
    survivor_copies: int
    """(layer, GPU, expert) arrivals copied across GPUs from a live replica (a reloaded expert's
    further replicas are copied from where it was reloaded)."""
    survivor_cross_node_copies: int
    """Those of them whose node held no replica of the expert before."""
    kept_slots: int
    """Live slots whose expert stays (no transfer)."""
    changed_slots: int
    """Live slots whose expert changes."""
    bytes_per_expert: int
    """Bytes of one expert's weights in one layer (0: unknown)."""

    @property
    def bytes_reloaded(self) -> int:
        return self.reloads * self.bytes_per_expert

    @property
    def bytes_moved(self) -> int:
        """Bytes copied across GPUs between survivors."""
        return self.survivor_copies * self.bytes_per_expert

    @property
    def bytes_by_source(self) -> dict[str, int]:
        """Bytes that arrive from each source: survivors' replicas, and the reload source."""
        return {SURVIVOR: self.bytes_moved, self.source: self.bytes_reloaded}

    def reload_list(self) -> list[tuple[int, int]]:
        """(layer, expert) pairs to reload, layer-major."""
        return [(int(layer), int(expert)) for layer, expert in np.argwhere(self.reload_LE)]

    def summary(self) -> dict[str, Any]:
        """JSON-ready counts and bytes."""
        return {
            "reload_experts": int(self.reload_LE.sum()),
            "reloads": self.reloads,
            "survivor_copies": self.survivor_copies,
            "survivor_cross_node_copies": self.survivor_cross_node_copies,
            "kept_slots": self.kept_slots,
            "changed_slots": self.changed_slots,
            "bytes_by_source": self.bytes_by_source,
        }


def reload_report(
    current: Placement, new: DegradedPlacement, source: str = "checkpoint", bytes_per_expert: int = 0
) -> ReloadReport:
    """Count the transfer from ``current`` (over every rank) to ``new`` (over the live ones).

    Two phases: each expert no live rank holds is reloaded once per layer from ``source``, into
    the first live GPU that holds it in ``new``; then every (GPU, expert) pair held in ``new``
    that was not held (or just reloaded) there is one copy across GPUs from a live replica (more
    replicas of it on that GPU are local copies). So a plan's reloads are the fewest possible,
    one per lost expert, and its copies count every other byte that crosses GPUs.
    """
    if source not in RELOAD_SOURCES:
        raise ValueError(f"unknown reload source {source!r}; choose from {RELOAD_SOURCES}")
    alive_G = new.alive_G
    if alive_G.size != current.num_gpus or new.survivors.num_logical != current.num_logical:
        raise ValueError("the degraded placement does not fit the current one (ranks or experts differ)")
    before_LGE = current.gpu_has_expert()[:, alive_G, :]
    after_LGE = new.survivors.gpu_has_expert()
    reload_LE = np.asarray(~before_LGE.any(axis=1))
    # Phase 1: the reload lands on the first live GPU holding the expert in ``new``.
    first_LE = np.argmax(after_LGE, axis=1)
    layer, expert = np.nonzero(reload_LE)
    held_LGE = before_LGE.copy()
    held_LGE[layer, first_LE[layer, expert], expert] = True
    copies_LGE = after_LGE & ~held_LGE
    node_of_live = np.flatnonzero(alive_G) // current.gpus_per_node
    same_node_GG = (node_of_live[:, None] == node_of_live[None, :]).astype(np.int64)
    node_held_LGE = np.einsum("lhe,gh->lge", held_LGE.astype(np.int64), same_node_GG) > 0
    old_LP = survivors_phy2log(current, alive_G)
    changed = int((old_LP != new.survivors.phy2log_LP).sum())
    return ReloadReport(
        reload_LE=reload_LE,
        source=source,
        reloads=int(reload_LE.sum()),
        survivor_copies=int(copies_LGE.sum()),
        survivor_cross_node_copies=int((copies_LGE & ~node_held_LGE).sum()),
        kept_slots=int(old_LP.size - changed),
        changed_slots=changed,
        bytes_per_expert=int(bytes_per_expert),
    )
