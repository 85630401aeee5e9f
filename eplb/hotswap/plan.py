"""Plan a hot-swap: which slot sends which expert to which slots, in which order and chunks.

Shape legend: L layers, P physical slots, G GPUs, S slots per GPU, E logical experts.

Every rank computes the same plan from the two placements (pure host work), so sends and receives
match without talking. Writes happen in place, so the plan orders them (a slot is overwritten
only after everything reading it) and cuts them into chunks, each agreed on once, such that a
failed chunk can always be undone from slots whose content is known.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components


@dataclass(frozen=True)
class Transfer:
    """One expert's weights, read from one slot, written to one or more slots of one GPU."""

    layer: int
    expert: int
    src_slot: int
    dst_slots: tuple[int, ...]
    src_gpu: int
    dst_gpu: int

    @property
    def is_local(self) -> bool:
        return self.src_gpu == self.dst_gpu


@dataclass(frozen=True)
class Chunk:
    """Transfers executed together: one batch of sends/receives, one verification, one commit."""

    transfers: tuple[int, ...]
    """Indices into :attr:`SwapPlan.transfers`."""
    staged: frozenset[tuple[int, int]]
    """(layer, slot) destinations written through staging at commit (they are read in this chunk)."""
    may_overlap_previous: bool
    """No slot this chunk writes is read by the previous chunk: it may start before that one is agreed."""


@dataclass(frozen=True)
class SwapPlan:
    """Every rank computes the same plan from the same inputs."""

    transfers: tuple[Transfer, ...]
    chunks: tuple[Chunk, ...]
    num_gpus: int
    slots_per_gpu: int
    bytes_per_expert: int

    @property
    def cross_gpu_transfers(self) -> int:
        return sum(not t.is_local for t in self.transfers)

    @property
    def local_copies(self) -> int:
        return sum(t.is_local for t in self.transfers)

    def bytes_received(self) -> np.ndarray:
        """int64 [G]: bytes arriving at each GPU from other GPUs."""
        got = np.zeros(self.num_gpus, dtype=np.int64)
        for t in self.transfers:
            if not t.is_local:
                got[t.dst_gpu] += self.bytes_per_expert
        return got

    def state_after(self, cur_LP: np.ndarray, *, done: int, partial: Sequence[int] = ()) -> np.ndarray:
        """int32 [L, P]: known slot contents when chunks < ``done`` were agreed and committed.

        Chunks in ``partial`` started but were not agreed: their direct destinations are unknown
        (-1), their staged ones still hold the old content.
        """
        state = np.array(cur_LP, dtype=np.int32, copy=True)
        for k in range(done):
            for i in self.chunks[k].transfers:
                t = self.transfers[i]
                state[t.layer, list(t.dst_slots)] = t.expert
        for k in partial:
            chunk = self.chunks[k]
            for i in chunk.transfers:
                t = self.transfers[i]
                for d in t.dst_slots:
                    if (t.layer, d) not in chunk.staged:
                        state[t.layer, d] = -1
        return state


def plan_swap(
    cur_LP: np.ndarray,
    tgt_LP: np.ndarray,
    *,
    num_gpus: int,
    num_nodes: int = 1,
    bytes_per_expert: int,
    chunk_bytes: int,
    layers: Sequence[int] | None = None,
) -> SwapPlan:
    """Plan the moves that turn ``cur_LP`` into ``tgt_LP`` for ``layers`` (default: all).

    ``cur_LP`` (int32 [L, P]) is what every slot holds now (-1: content unknown, never a source);
    ``tgt_LP`` what it must hold. Unchanged slots are left alone. For each (layer, GPU, expert)
    whose changed slots need that expert, one :class:`Transfer` fills them: a local copy when the
    GPU already holds the expert, else one cross-GPU send from a holder; holders are chosen on the
    same node first and then by the fewest bytes already assigned to send, so receives spread over
    the ranks that hold a source. Within a GPU, an unchanged slot is the preferred source (it is
    never overwritten).

    Transfer u must run no later than transfer t when t writes u's source. Cycles (two slots
    trading experts) run in one chunk, and a destination read in its own chunk is written through
    a staging buffer at the chunk's commit. Chunks follow a topological order and carry at most
    ``chunk_bytes`` arriving at each GPU (a cycle larger than that gets a chunk of its own).

    Invariant (for an executor that writes chunk by chunk in place): after any chunk is committed,
    every expert of the old placement still sits in a slot whose content is known. eplb.hotswap's
    executor needs less: it stages every write and copies all of them in at one commit.
    """
    cur = np.asarray(cur_LP)
    tgt = np.asarray(tgt_LP)
    if cur.shape != tgt.shape or cur.ndim != 2:
        raise ValueError(f"current {cur.shape} and target {tgt.shape} must both be [L, P]")
    L, P = tgt.shape
    if num_gpus < 1 or P % num_gpus or num_nodes < 1 or num_gpus % num_nodes:
        raise ValueError(f"P={P} slots, {num_gpus} GPUs and {num_nodes} nodes do not divide evenly")
    if (tgt < 0).any():
        raise ValueError("target placement holds negative expert ids")
    if chunk_bytes < 1 or bytes_per_expert < 0:
        raise ValueError("chunk_bytes must be >= 1 and bytes_per_expert >= 0")
    layer_list = sorted(set(range(L) if layers is None else (int(x) for x in layers)))
    if layer_list and not 0 <= layer_list[0] <= layer_list[-1] < L:
        raise ValueError(f"layers must lie in [0, {L})")
    S = P // num_gpus
    gpus_per_node = num_gpus // num_nodes
    send_load = np.zeros(num_gpus, dtype=np.int64)
    transfers: list[Transfer] = []
    units: list[list[int]] = []
    for layer in layer_list:
        first = len(transfers)
        transfers.extend(
            _layer_transfers(layer, cur[layer], tgt[layer], S, gpus_per_node, send_load, bytes_per_expert)
        )
        units.extend(_ordered_units(transfers, first, len(transfers)))
    chunks = _pack_chunks(transfers, units, num_gpus, bytes_per_expert, chunk_bytes)
    return SwapPlan(tuple(transfers), chunks, num_gpus, S, bytes_per_expert)


def _layer_transfers(
    layer: int,
    cur_P: np.ndarray,
    tgt_P: np.ndarray,
    S: int,
    gpus_per_node: int,
    send_load: np.ndarray,
    bytes_per_expert: int,
) -> list[Transfer]:
    G = cur_P.shape[0] // S
    cur, tgt = cur_P.tolist(), tgt_P.tolist()
    changed = [c != t for c, t in zip(cur, tgt, strict=True)]
    holders: dict[int, list[int]] = {}
    for s, e in enumerate(cur):
        if e >= 0:
            holders.setdefault(e, []).append(s)
    out: list[Transfer] = []
    for g in range(G):
        lo, hi = g * S, (g + 1) * S
        need = sorted((tgt[d], d) for d in range(lo, hi) if changed[d])
        for e in sorted({e for e, _ in need}):
            dsts = tuple(d for x, d in need if x == e)
            held = holders.get(e, [])
            local = [s for s in held if lo <= s < hi]
            if local:
                src, src_gpu = _prefer_unchanged(local, changed), g
            else:
                if not held:
                    raise ValueError(f"expert {e} of layer {layer} is in no slot with known content")
                holder_gpus = sorted({s // S for s in held})
                near = [h for h in holder_gpus if h // gpus_per_node == g // gpus_per_node]
                src_gpu = min(near or holder_gpus, key=lambda h: (send_load[h], (h - g) % G))
                src = _prefer_unchanged([s for s in held if s // S == src_gpu], changed)
                send_load[src_gpu] += bytes_per_expert
            out.append(Transfer(layer, e, src, dsts, src_gpu, g))
    return out


def _prefer_unchanged(slots: list[int], changed: list[bool]) -> int:
    """The first slot that keeps its content, else the first slot."""
    return next((s for s in slots if not changed[s]), slots[0])


def _ordered_units(transfers: list[Transfer], first: int, stop: int) -> list[list[int]]:
    """Strongly connected groups of one layer's transfers, in a topological order of 'reads before write'."""
    n = stop - first
    if n == 0:
        return []
    writer = {d: i for i in range(n) for d in transfers[first + i].dst_slots}
    edges = [
        (u, writer[transfers[first + u].src_slot])
        for u in range(n)
        if transfers[first + u].src_slot in writer
    ]
    edges = [(u, t) for u, t in edges if u != t]
    if not edges:  # nothing reads a slot another transfer writes: any order, one transfer per unit
        return [[first + i] for i in range(n)]
    rows = np.array([u for u, _ in edges], dtype=np.int64)
    cols = np.array([t for _, t in edges], dtype=np.int64)
    graph = coo_matrix((np.ones(len(edges)), (rows, cols)), shape=(n, n)).tocsr()
    _, label = connected_components(graph, directed=True, connection="strong")
    members: dict[int, list[int]] = {}
    for i, c in enumerate(label.tolist()):
        members.setdefault(c, []).append(i)
    succ: dict[int, set[int]] = {c: set() for c in members}
    indeg = dict.fromkeys(members, 0)
    for u, t in edges:
        cu, ct = int(label[u]), int(label[t])
        if cu != ct and ct not in succ[cu]:
            succ[cu].add(ct)
            indeg[ct] += 1
    # Kahn's algorithm; ties broken by the smallest member so every rank gets the same order.
    ready = [(members[c][0], c) for c in members if indeg[c] == 0]
    heapq.heapify(ready)
    order: list[list[int]] = []
    while ready:
        _, c = heapq.heappop(ready)
        order.append([first + i for i in members[c]])
        for nxt in succ[c]:
            indeg[nxt] -= 1
            if indeg[nxt] == 0:
                heapq.heappush(ready, (members[nxt][0], nxt))
    assert len(order) == len(members), "condensation of a graph is acyclic"
    return order


def _pack_chunks(
    transfers: list[Transfer],
    units: list[list[int]],
    num_gpus: int,
    bytes_per_expert: int,
    chunk_bytes: int,
) -> tuple[Chunk, ...]:
    groups: list[list[int]] = []
    used = np.zeros(num_gpus, dtype=np.int64)
    for unit in units:
        need = np.zeros(num_gpus, dtype=np.int64)
        for i in unit:
            need[transfers[i].dst_gpu] += bytes_per_expert
        if groups and groups[-1] and not (used + need <= chunk_bytes).all():
            groups.append([])
            used[:] = 0
        if not groups:
            groups.append([])
        groups[-1].extend(unit)
        used += need
    chunks: list[Chunk] = []
    prev_reads: set[tuple[int, int]] = set()
    for group in groups:
        reads = {(transfers[i].layer, transfers[i].src_slot) for i in group}
        writes = {(transfers[i].layer, d) for i in group for d in transfers[i].dst_slots}
        chunks.append(Chunk(tuple(group), frozenset(writes & reads), not (writes & prev_reads)))
        prev_reads = reads
    return tuple(chunks)
