"""The degraded plan: a placement over the ranks still alive that moves as few bytes as balance allows.

Shape legend: W window (passes), L layers, E logical experts, P physical slots, G GPUs (EP ranks), N nodes.

``solve`` with ``SolveOptions.alive_ranks`` runs three steps:

1. :func:`survivors`: the live GPUs' part of the current placement and the experts lost with the
   dead ranks. Each lost expert takes one slot of an expert that keeps another replica: the lost
   experts get one replica each, the donors are, one at a time, the experts whose load per replica
   stays lowest after giving one up, and eplb.solver.search.migration.retarget_replicas places them
   (a donor gives up its replica on its busiest GPU, a lost expert takes a freed slot on the least
   loaded GPU, the heaviest first). This repaired placement changes one live slot per lost expert,
   the fewest any plan can; every other replica on a survivor stays.
2. ``solve`` plans from the repaired placement on the survivors' topology as from any live
   placement: the same forecast, move search, copy price and gate, so a move is made only where it
   pays for its copies.
3. :func:`finish`: the plan if its gate applies it, else the repaired placement, as a
   ``DegradedPlacement`` (dead slots -1), with the transfer counted against the real live placement
   (eplb.placement.degraded.reload_report): the lost experts reloaded from ``reload_source``, the
   rest copied from survivors. The degraded plan is always applied: the old one uses dead ranks.

No degraded plan reloads less: every expert with a replica on a survivor keeps it (it is never
reloaded), and each expert lost with every replica is loaded once per layer, into one slot (its
further replicas are copies from there), the fewest any plan that serves it needs. What a loss
reloads is set before it, by the placement: ``failure_domain`` (eplb.solver.search.spread) lowers it.

Every step is deterministic (ties broken by expert id), so every survivor computes the same plan.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace

import numpy as np

from eplb.placement.degraded import (
    DegradedPlacement,
    check_alive,
    reload_report,
    survivor_nodes,
    survivors_phy2log,
)
from eplb.placement.model import Placement
from eplb.solver.policies.protocol import load_policy
from eplb.solver.predict import predict
from eplb.solver.search.copies import holds_per_gpu
from eplb.solver.search.migration import retarget_replicas
from eplb.solver.search.split import lp_split
from eplb.solver.types import Plan, SolveOptions, Topology


@dataclass(frozen=True)
class Loss:
    """The live placement cut to the survivors, and its repair (step 1)."""

    alive_G: np.ndarray
    """bool [G]: the ranks alive."""
    topology: Topology
    """The survivors' topology (G' GPUs, P' slots; uneven nodes plan as one)."""
    current: Placement
    """The live placement over every rank."""
    repaired: Placement
    """The survivors' slots with each lost expert in one donor's slot."""
    point_LE: np.ndarray
    """float64 [L, E]: the forecast the repair used."""


def survivors(
    load_WLE: np.ndarray, topology: Topology, current: Placement | None, options: SolveOptions
) -> Loss:
    """Step 1 for a checked window ``load_WLE`` [W, L, E]; ValueError when the survivors cannot serve."""
    if current is None:
        raise ValueError("alive_ranks: a degraded plan starts from the live placement (pass current)")
    alive_G = check_alive(options.alive_ranks, topology.num_gpus)
    S = topology.slots_per_gpu
    E = current.num_logical
    live = int(alive_G.sum())
    if live * S < E:
        raise ValueError(
            f"alive_ranks: {live} live ranks hold {live * S} slots ({S} each), fewer than the {E} logical "
            "experts; every expert cannot be served"
        )
    nodes = survivor_nodes(alive_G, topology.num_nodes)
    compact = Topology(num_gpus=live, num_nodes=nodes, num_physical=live * S, num_groups=topology.num_groups)
    method = load_policy(options.algorithm).prediction(options, load_WLE.shape[0])
    point_LE = predict(load_WLE, options, method).point_LE
    live_LP = survivors_phy2log(current, alive_G).astype(np.int64)
    target_LE = _repair_counts(holds_per_gpu(live_LP, live, E).sum(axis=1), point_LE)
    repaired_LP = retarget_replicas(live_LP, target_LE, point_LE, live)
    repaired = Placement.from_phy2log(repaired_LP, live, nodes, max_replicas=live * S - E + 1)
    return Loss(alive_G, compact, current, repaired, point_LE)


def _repair_counts(count_LE: np.ndarray, load_LE: np.ndarray) -> np.ndarray:
    """int64 [L, E]: ``count_LE`` with each lost expert (count 0) at one replica, paid for by donors.

    Per layer, each replica a lost expert needs comes from the expert (with two or more) whose load
    per replica after giving one up is lowest, ties to the lower id: the donors that lose least.
    """
    target_LE = count_LE.astype(np.int64).copy()
    for layer in np.flatnonzero((count_LE == 0).any(axis=1)):
        row, load = target_LE[layer], load_LE[layer]
        lost = np.flatnonzero(row == 0)
        row[lost] = 1
        heap = [(float(load[e]) / (row[e] - 1), int(e)) for e in np.flatnonzero(row > 1)]
        heapq.heapify(heap)
        for _ in range(lost.size):
            assert heap, "P' >= E leaves a donor for every lost expert"
            _, donor = heapq.heappop(heap)
            row[donor] -= 1
            if row[donor] > 1:
                heapq.heappush(heap, (float(load[donor]) / (row[donor] - 1), donor))
    return target_LE


def finish(loss: Loss, inner: Plan, options: SolveOptions) -> Plan:
    """Step 3: the degraded plan from the survivors' ``inner`` plan (solved from ``loss.repaired``);
    its verdict (always applied, in words) is ``solve``'s to give (eplb.policy.decision.judge)."""
    chosen = inner.placement if inner.apply else loss.repaired
    weights_LER = inner.dispatch_weights_LER
    if not inner.apply and options.weighted:
        weights_LER = lp_split(loss.point_LE, chosen)
    degraded = DegradedPlacement.from_survivors(chosen, loss.alive_G, loss.current.num_nodes)
    report = reload_report(loss.current, degraded, options.reload_source, options.bytes_per_expert)
    dead = np.flatnonzero(~loss.alive_G).tolist()
    stats = dict(inner.stats)
    stats.update(
        lost_ranks=float(len(dead)),
        reload_experts=float(report.reload_LE.sum()),
        reloads=float(report.reloads),
        survivor_copies=float(report.survivor_copies),
        kept_slots=float(report.kept_slots),
        rebalanced=float(inner.apply),
    )
    predicted = (
        inner.predicted_balancedness
        if inner.apply
        else stats.get("current_balancedness", inner.predicted_balancedness)
    )
    return replace(
        inner,
        placement=chosen,
        dispatch_weights_LER=weights_LER,
        diff=None,
        predicted_balancedness=float(predicted),
        stats=stats,
        degraded=degraded,
        reload=report,
    )
