"""DeepSeek's published EPLB algorithm (global and hierarchical), in numpy, and its policy objects.

Shape legend: x any leading dimensions (rows: layers, or layers x nodes), E logical experts, P
physical slots, U items to pack, B bins (packs), L layers, N nodes, G GPUs, S slots per GPU.

This is this project's own implementation of the algorithm DeepSeek describes (and SGLang vendors):

1. replicate: give each redundant slot, one at a time, to the expert with the largest
   load / replicas;
2. pack: place items heaviest first into the lightest bin that still has room (every bin takes the
   same number of items);
3. hierarchical: first pack expert groups onto nodes, then replicate and pack within each node.

Arithmetic mirrors the reference (float32 loads, bins summed in float64, first index on ties) so the
maps agree with it. Every loop runs over items or slots, never over layers: each step is a numpy
operation on all rows at once.

:data:`DEEPSEEK` and :data:`DEEPSEEK_HIERARCHICAL` are the registry's ``deepseek`` and
``deepseek_hierarchical`` policies: they plan on the window's plain sum, as SGLang runs them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eplb.solver.policies.protocol import PlacementRequest
from eplb.solver.types import SolveOptions, Topology

INT64 = np.int64


def replicate(weight_xE: np.ndarray, num_physical: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Replica counts that minimise the largest load per replica, greedily.

    Args:
        weight_xE: float32 [x, E] load of each logical expert.
        num_physical: P >= E slots to fill.

    Returns:
        phy2log_xP int64 [x, P] (slot p < E holds expert p; redundant slots in the order given),
        rank_xP int64 [x, P] (replica index of each slot within its expert), logcnt_xE int64 [x, E].
    """
    x, E = weight_xE.shape
    assert num_physical >= E
    weight = weight_xE.astype(np.float32, copy=False)
    phy2log = np.tile(np.arange(num_physical, dtype=INT64), (x, 1))
    rank = np.zeros((x, num_physical), dtype=INT64)
    logcnt = np.ones((x, E), dtype=INT64)
    rows = np.arange(x)
    for slot in range(E, num_physical):
        best = np.argmax(weight / logcnt.astype(np.float32), axis=1)
        phy2log[:, slot] = best
        rank[:, slot] = logcnt[rows, best]
        logcnt[rows, best] += 1
    return phy2log, rank, logcnt


def balanced_packing(weight_xU: np.ndarray, num_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack U items into B bins of U/B items each, heaviest item first into the lightest open bin.

    Args:
        weight_xU: float [x, U] item weights; U divisible by ``num_bins``.

    Returns:
        bin_xU int64 [x, U] (bin of each item), rank_xU int64 [x, U] (position inside its bin).
    """
    x, U = weight_xU.shape
    assert U % num_bins == 0
    per_bin = U // num_bins
    if per_bin == 1:
        return np.tile(np.arange(U, dtype=INT64), (x, 1)), np.zeros((x, U), dtype=INT64)
    weight32 = weight_xU.astype(np.float32, copy=False)
    order_xU = np.argsort(-weight32, axis=1, kind="stable")
    rows = np.arange(x)
    bin_load = np.zeros((x, num_bins), dtype=np.float64)
    bin_count = np.zeros((x, num_bins), dtype=INT64)
    bin_of = np.empty((x, U), dtype=INT64)
    rank_of = np.empty((x, U), dtype=INT64)
    for step in range(U):
        item = order_xU[:, step]
        chosen = np.argmin(np.where(bin_count < per_bin, bin_load, np.inf), axis=1)
        bin_of[rows, item] = chosen
        rank_of[rows, item] = bin_count[rows, chosen]
        bin_load[rows, chosen] += weight32[rows, item].astype(np.float64)
        bin_count[rows, chosen] += 1
    return bin_of, rank_of


def _inverse(perm_xU: np.ndarray) -> np.ndarray:
    """int64 [x, U]: the inverse permutation of each row."""
    inv = np.empty_like(perm_xU)
    np.put_along_axis(inv, perm_xU, np.broadcast_to(np.arange(perm_xU.shape[1]), perm_xU.shape), axis=1)
    return inv


def deepseek_rebalance(
    weight_LE: np.ndarray, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DeepSeek's hierarchical EPLB; ``num_groups = num_nodes = 1`` gives the global variant.

    Args:
        weight_LE: float [L, E] load per logical expert (converted to float32 as the reference does).
        num_physical: P, divisible by ``num_gpus``; ``num_gpus`` divisible by ``num_nodes``;
            E divisible by ``num_groups``; ``num_groups`` divisible by ``num_nodes`` (checked by the caller).

    Returns:
        phy2log_LP int64 [L, P], rank_LP int64 [L, P] (replica index of each slot), logcnt_LE int64 [L, E].
    """
    weight = np.asarray(weight_LE, dtype=np.float32)
    L, E = weight.shape
    group_size = E // num_groups
    groups_per_node = num_groups // num_nodes
    experts_per_node = E // num_nodes
    slots_per_gpu = num_physical // num_gpus

    # 1. expert groups onto nodes; "mlog" numbers experts node by node.
    group_load = weight.reshape(L, num_groups, group_size).sum(axis=-1)
    group_node, group_rank = balanced_packing(group_load, num_nodes)
    log2mlog = (
        ((group_node * groups_per_node + group_rank) * group_size)[:, :, None] + np.arange(group_size)
    ).reshape(L, E)
    mlog2log = _inverse(log2mlog)

    # 2. replicas within each node: rows are (layer, node).
    mlog_load = np.take_along_axis(weight, mlog2log, axis=1).reshape(L * num_nodes, experts_per_node)
    phy2mlog, phy_rank, mlogcnt = replicate(mlog_load, num_physical // num_nodes)

    # 3. replicas onto the node's GPUs, each replica carrying an even share of its expert.
    replica_load = np.take_along_axis(mlog_load / mlogcnt.astype(np.float32), phy2mlog, axis=1)
    gpu, rank_in_gpu = balanced_packing(replica_load, num_gpus // num_nodes)
    pphy2phy = _inverse(gpu * slots_per_gpu + rank_in_gpu)

    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1).reshape(L, num_nodes, -1)
    pphy2mlog = (pphy2mlog + (np.arange(num_nodes) * experts_per_node)[None, :, None]).reshape(L, -1)
    phy2log = np.take_along_axis(mlog2log, pphy2mlog, axis=1)
    rank = np.take_along_axis(phy_rank, pphy2phy, axis=1).reshape(L, -1)
    logcnt = np.take_along_axis(mlogcnt.reshape(L, -1), log2mlog, axis=1)
    return phy2log, rank, logcnt


def log2phy_from_rank(
    phy2log_LP: np.ndarray, rank_LP: np.ndarray, num_logical: int, max_replicas: int
) -> np.ndarray:
    """int32 [L, E, R]: each expert's slots ordered by replica rank, padded with -1 (DeepSeek's layout)."""
    L, P = phy2log_LP.shape
    log2phy = np.full((L, num_logical, max_replicas), -1, dtype=np.int32)
    layer = np.broadcast_to(np.arange(L)[:, None], (L, P))
    log2phy[layer, phy2log_LP, rank_LP] = np.broadcast_to(np.arange(P, dtype=np.int32), (L, P))
    return log2phy


@dataclass(frozen=True)
class DeepSeekPolicy:
    """DeepSeek's EPLB (greedy replicate + balanced packing), global or hierarchical, on the window sum."""

    name: str
    hierarchical: bool
    migration_aware: bool = False
    budget_aware: bool = False
    priced: bool = False

    def prediction(self, options: SolveOptions, num_passes: int) -> str:
        # SGLang runs DeepSeek's algorithm on the plain sum of the window.
        return "sum" if options.prediction == "auto" else options.prediction

    def place_with_rank(self, load_LE: np.ndarray, topology: Topology) -> tuple[np.ndarray, np.ndarray]:
        """(phy2log int64 [L, P], replica rank int64 [L, P]) as DeepSeek's code returns them."""
        num_logical = load_LE.shape[1]
        if self.hierarchical and not topology.hierarchical_ok(num_logical):
            raise ValueError(
                f"deepseek_hierarchical needs num_groups ({topology.num_groups}) to divide the experts "
                f"({num_logical}) and to be divisible by num_nodes ({topology.num_nodes})"
            )
        groups, nodes = (topology.num_groups, topology.num_nodes) if self.hierarchical else (1, 1)
        phy2log, rank, _ = deepseek_rebalance(
            load_LE, topology.num_physical, groups, nodes, topology.num_gpus
        )
        return phy2log, rank

    def place(self, request: PlacementRequest) -> np.ndarray:
        return self.place_with_rank(request.prediction.point_LE, request.topology)[0]


DEEPSEEK = DeepSeekPolicy("deepseek", hierarchical=False)
DEEPSEEK_HIERARCHICAL = DeepSeekPolicy("deepseek_hierarchical", hierarchical=True)
