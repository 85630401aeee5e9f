"""Failure-aware placement: a second replica, in another domain, for as many experts as balance allows.

Shape legend: L layers, E logical experts, P physical slots, G GPUs, N nodes, S slots per GPU, R
max replicas (tables over replica counts), c candidate moves; a domain is a GPU or a node.

An expert whose every replica lies in one GPU (or node) is lost with it and must be reloaded
(eplb.solver.degraded): one load per (layer, expert), whatever its load, so what a loss reloads is
set by the placement before it. :func:`spread_replicas` rewrites a placement in four steps per
layer, all deterministic (ties to the lower id):

1. **Cover** (:func:`cover_counts`): replicas move, one at a time, from experts that can spare
   one to the hottest experts with one replica, in the same slots. The donor is the expert whose
   replicas then carry least of its load each (times the largest share one replica gets:
   the share model's ``max_share_R``: ``1 / count`` for an even split), and it gives only while
   that stays within :data:`COVER_CAP` times a GPU's mean load, so no replica outweighs a GPU.
   The placement is rewritten in the fewest slots (eplb.solver.search.migration.retarget_replicas).
2. **Spread**: while an expert has two replicas more in one domain than in another (hottest
   expert first), its replica on the busiest GPU of its fullest domain trades slots with a slot
   of one of its emptiest domains, the one whose two GPUs then peak lowest, among those whose
   expert ends no less evenly spread and that leave no domain orphaning more load than the worst
   did.
3. **Even**: each domain ends with its quota of the layer's lost experts (those confined to one
   domain), as even as the domains allow; the extra ones go to the domains that have lost the
   fewest over the layers before, so that one domain's loss reloads no more than another's over
   the model: a single replica in a domain over quota trades slots with a replica, in a domain
   under quota, of an expert that stays in two domains, the pair whose two GPUs then peak lowest.
4. **Polish**: while the busiest GPU peaks above the placement given (an even split over
   replicas), it swaps one of its slots with another GPU's where both then peak lower, keeping
   every domain's lost experts, each expert's spread over domains and over nodes: the swap step
   every search takes (eplb.solver.search.swap), scored by the pair's new peak, with those
   constraints.

A row repaired in place keeps its copies but packs the covered counts worse than a fresh packing
does; :func:`failure_aware_phy2log` (what ``solve`` runs with ``failure_domain``) therefore takes,
per layer, the better of the policy's row repaired and a fresh packing of the same counts
relabelled onto the live placement, by the score the policy plans with, net of copies.

On the deepseek-v3 preset at EP32 (docs/benchmarks.md, bench_rank_failure) that turns 20.2-20.9 GB
of reloads on losing one rank into 17.9 GB (7 experts per layer, the fewest 32 redundant slots
allow), at about the same balancedness.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from eplb.placement.balance import balancedness
from eplb.placement.share import ShareModel
from eplb.solver.scoring.served import layer_scores
from eplb.solver.search.copies import arrivals_L, holds_per_gpu
from eplb.solver.search.migration import relabel, retarget_replicas
from eplb.solver.search.static_pack import static_spread_phy2log
from eplb.solver.search.swap import SwapCandidates, critical_gpu, pair_peak, swap_slots, trade_counts

if TYPE_CHECKING:
    from eplb.placement.model import Placement
    from eplb.solver.predict import Prediction
    from eplb.solver.types import SolveOptions, Topology

MAX_TRADES_PER_EXPERT = 64
"""Deterministic cap on the trades one expert's spread may take (each evens its domains by one)."""
MAX_POLISH_SWAPS = 256
"""Deterministic cap on the swaps one layer's polish may take."""
COVER_CAP = 1.0
"""A donor gives up a replica only while each of its replicas then carries at most this many
times a GPU's mean load (its load times the largest share one replica gets): a hot expert keeps
the replicas that stop one replica from outweighing a GPU, the rest cover colder experts."""


def failure_aware_phy2log(
    phy2log_LP: np.ndarray,
    prediction: Prediction,
    topology: Topology,
    current: Placement | None,
    options: SolveOptions,
    stats: dict[str, float],
) -> np.ndarray:
    """int64 [L, P]: the policy's ``phy2log_LP`` made failure-aware (``options.failure_domain``).

    Two candidates per layer, both through the steps of :func:`spread_replicas`: the policy's row
    repaired in place (it keeps its copies but packs the covered counts worse), and a fresh
    packing of the same covered counts (eplb.solver.search.static_pack's, with the dispatch's
    largest shares; relabelled onto ``current``). Each layer takes the one whose expected
    balancedness as the server dispatches, minus ``options.copy_cost`` per copy from ``current``,
    is higher (ties: the repaired row); the chosen rows are evened out over the layers once more.
    """
    G, N, P = topology.num_gpus, topology.num_nodes, topology.num_physical
    point_LE = prediction.point_LE
    E = point_LE.shape[1]
    policy_LP = np.asarray(phy2log_LP, dtype=np.int64)
    domain_P, D = _domains(P, G, N, options.failure_domain)
    if D < 2:  # one domain: nothing survives its loss, so nothing to spread
        _record(stats, policy_LP, policy_LP, _Scores(point_LE, G, domain_P, D), 0, 0.0, 0.0)
        stats["spread_fresh_layers"] = 0.0
        return policy_LP
    share = ShareModel(options.dispatch, N)
    repaired_LP, repaired_L, covered = _spread(policy_LP, point_LE, G, options.failure_domain, share)
    count_LE = holds_per_gpu(repaired_LP, G, E).sum(axis=1)
    fresh_LP = static_spread_phy2log(point_LE, count_LE, share.max_share_R(P - E + 1, G, P // G), G, N)
    if current is not None:
        fresh_LP = relabel(fresh_LP, current.phy2log_LP, G, N, keep_nodes=share.follows_nodes)
    fresh_LP, fresh_L, _ = _spread(fresh_LP, point_LE, G, options.failure_domain, share)

    def score_L(candidate_LP: np.ndarray) -> np.ndarray:
        return layer_scores(candidate_LP, prediction.scenarios_ZLE, prediction.scenario_weights_Z, G, share)

    def value_L(candidate_LP: np.ndarray) -> np.ndarray:
        if current is None:
            return score_L(candidate_LP)
        copies_L = arrivals_L(holds_per_gpu(candidate_LP, G, E), current.gpu_has_expert())
        return score_L(candidate_LP) - (options.copy_cost or 0.0) * copies_L

    take_fresh_L = value_L(fresh_LP) > value_L(repaired_LP) + 1e-12
    chosen_LP = np.where(take_fresh_L[:, None], fresh_LP, repaired_LP)
    out, final_L, _ = _spread(chosen_LP, point_LE, G, options.failure_domain, share)
    trades_L = np.where(take_fresh_L, fresh_L, repaired_L) + final_L
    cost = float(score_L(policy_LP).mean() - score_L(out).mean())
    _record(stats, policy_LP, out, _Scores(point_LE, G, domain_P, D), covered, float(np.sum(trades_L)), cost)
    stats["spread_fresh_layers"] = float(take_fresh_L.sum())
    return out


def spread_replicas(
    phy2log_LP: np.ndarray,
    load_LE: np.ndarray,
    num_gpus: int,
    num_nodes: int,
    domain: str,
    stats: dict[str, float],
    *,
    share: ShareModel | None = None,
) -> np.ndarray:
    """int64 [L, P]: ``phy2log_LP`` repaired in place by the steps of the module docstring, for
    ``domain`` (gpu | node) and the forecast ``load_LE``; ``share``: how the server splits an
    expert's tokens (the largest share one replica gets caps the cover; default an even split).
    ``spread_cost`` in ``stats``: forecast balancedness under an even split over replicas, before
    minus after."""
    before_LP = np.asarray(phy2log_LP, dtype=np.int64)
    share = share or ShareModel("dynamic", num_nodes)
    assert share.num_nodes == num_nodes, "the share model's nodes are the topology's"
    out, trades_L, covered = _spread(before_LP, load_LE, num_gpus, domain, share)
    domain_P, D = _domains(before_LP.shape[1], num_gpus, num_nodes, domain)
    scores = _Scores(load_LE, num_gpus, domain_P, D)
    cost = scores.of(before_LP)[0] - scores.of(out)[0]
    _record(stats, before_LP, out, scores, covered, float(np.sum(trades_L)), cost)
    return out


def _domains(P: int, G: int, N: int, domain: str) -> tuple[np.ndarray, int]:
    """(int64 [P] the domain of each slot, D the number of domains)."""
    width = P // G if domain == "gpu" else P // N
    return np.arange(P) // width, P // width


def _record(
    stats: dict[str, float],
    before_LP: np.ndarray,
    after_LP: np.ndarray,
    scores: _Scores,
    covered: int,
    swaps: float,
    cost: float,
) -> None:
    """The stats of one failure-aware rewrite (Plan.stats documents the keys)."""
    before, after = scores.of(before_LP), scores.of(after_LP)
    stats["spread_covered"] = float(covered)
    stats["spread_swaps"] = swaps
    stats["spread_changed_slots"] = float((before_LP != after_LP).sum())
    stats["spread_cost"] = float(cost)
    stats["lost_load_before"], stats["lost_load_after"] = before[1], after[1]
    stats["lost_experts_before"], stats["lost_experts_after"] = before[2], after[2]


def _spread(
    phy2log_LP: np.ndarray, load_LE: np.ndarray, num_gpus: int, domain: str, share: ShareModel
) -> tuple[np.ndarray, np.ndarray, int]:
    """(int64 [L, P] the rows rewritten, int64 [L] the trades of each layer, replicas moved by the cover)."""
    out = np.asarray(phy2log_LP, dtype=np.int64).copy()
    L, P = out.shape
    E = load_LE.shape[1]
    G, S = num_gpus, P // num_gpus
    num_nodes = share.num_nodes
    domain_P, D = _domains(P, G, num_nodes, domain)
    trades_L = np.zeros(L, dtype=np.int64)
    if D < 2:
        return out, trades_L, 0
    count_LE = holds_per_gpu(out, G, E).sum(axis=1)
    target_LE = cover_counts(count_LE, load_LE, share.max_share_R(P - E + 1, G, S), G)
    covered = int(np.maximum(target_LE - count_LE, 0).sum())
    # The polish brings each layer's busiest GPU back down to where the rows given peaked.
    layer_LP = np.arange(L)[:, None]
    item_LP = load_LE[layer_LP, out] / count_LE[layer_LP, out]
    peak_L = item_LP.reshape(L, G, S).sum(axis=2).max(axis=1)
    out = retarget_replicas(out, target_LE, load_LE, G)
    node_P = np.arange(P) // (P // num_nodes)
    lost_so_far_D = np.zeros(D, dtype=np.int64)
    for layer in range(L):
        row, load = out[layer], load_LE[layer]
        trades_L[layer] = (
            _spread_layer(row, load, G, S, domain_P, D, E)
            + _even_layer(row, load, G, S, domain_P, D, E, lost_so_far_D)
            + _polish_layer(row, load, G, S, domain_P, node_P, E, float(peak_L[layer]))
        )
    return out, trades_L, covered


def cover_counts(count_LE: np.ndarray, load_LE: np.ndarray, share_R: np.ndarray, num_gpus: int) -> np.ndarray:
    """int64 [L, E]: ``count_LE`` with replicas moved to the hottest single experts (step 1).

    ``share_R`` [R + 1]: the largest share of its expert's load one of R replicas gets.
    """
    target_LE = count_LE.astype(np.int64).copy()
    for layer in range(target_LE.shape[0]):
        row, load = target_LE[layer], load_LE[layer]
        cap = COVER_CAP * float(load.sum()) / num_gpus
        singles = np.flatnonzero(row == 1)
        singles = singles[np.lexsort((singles, -load[singles]))].tolist()
        heap = [(float(load[e] * share_R[row[e] - 1]), int(e)) for e in np.flatnonzero(row > 2)]
        heapq.heapify(heap)
        for taker in singles:
            if not heap or heap[0][0] > cap:
                break
            _, donor = heapq.heappop(heap)
            row[donor] -= 1
            row[taker] = 2
            if row[donor] > 2:
                heapq.heappush(heap, (float(load[donor] * share_R[row[donor] - 1]), donor))
    return target_LE


def _spread_layer(
    row_P: np.ndarray, load_E: np.ndarray, G: int, S: int, domain_P: np.ndarray, D: int, E: int
) -> int:
    """Step 2 on one layer's row, in place; returns the trades made."""
    count_E, item_P, gpu_G = _loads(row_P, load_E, G, S, E)
    held_DE = _holds(domain_P, row_P, E)
    # Load of the experts whose every replica lies in each domain (what losing it orphans).
    lost_D = ((held_DE == count_E[None, :]) * load_E[None, :]).sum(axis=1)
    trades = 0
    hot = np.flatnonzero(count_E > 1)
    for expert in hot[np.lexsort((hot, -load_E[hot]))].tolist():
        for _ in range(MAX_TRADES_PER_EXPERT):
            col = held_DE[:, expert]
            if col.max() - col.min() < 2:
                break
            src_dom = int(np.argmax(col))
            mine = np.flatnonzero((row_P == expert) & (domain_P == src_dom))
            slot_a = int(mine[np.argmax(gpu_G[mine // S])])
            cand_c = np.flatnonzero(np.isin(domain_P, np.flatnonzero(col == col.min())) & (row_P != expert))
            if cand_c.size == 0:
                break
            partner_c = row_P[cand_c]
            # The partner's spread after the trade: one more replica in src_dom, one fewer in its own.
            rows_cD = held_DE[:, partner_c].T.copy()
            spread_before_c = rows_cD.max(axis=1) - rows_cD.min(axis=1)
            rows_cD[np.arange(cand_c.size), domain_P[cand_c]] -= 1
            rows_cD[:, src_dom] += 1
            ok_c = rows_cD.max(axis=1) - rows_cD.min(axis=1) <= spread_before_c
            # Nor may any domain's loss orphan more load than the worst one does now.
            lost_cD = np.broadcast_to(lost_D, (cand_c.size, D)).copy()
            dom_c = domain_P[cand_c]
            rows = np.arange(cand_c.size)
            if held_DE[src_dom, expert] == count_E[expert]:
                lost_cD[:, src_dom] -= load_E[expert]
            lost_cD[rows, dom_c] -= np.where(
                held_DE[dom_c, partner_c] == count_E[partner_c], load_E[partner_c], 0.0
            )
            lost_cD[:, src_dom] += np.where(rows_cD[:, src_dom] == count_E[partner_c], load_E[partner_c], 0.0)
            ok_c &= lost_cD.max(axis=1) <= lost_D.max() + 1e-12 * max(lost_D.max(), 1.0)
            if not ok_c.any():
                break
            cand_c, lost_cD = cand_c[ok_c], lost_cD[ok_c]
            pick = int(np.argmin(_peaks(gpu_G, item_P, slot_a, cand_c, S)))  # the lowest slot among ties
            slot_b = int(cand_c[pick])
            lost_D[:] = lost_cD[pick]
            _trade(row_P, item_P, gpu_G, held_DE, domain_P, S, slot_a, slot_b)
            trades += 1
    return trades


def _even_layer(
    row_P: np.ndarray,
    load_E: np.ndarray,
    G: int,
    S: int,
    domain_P: np.ndarray,
    D: int,
    E: int,
    lost_so_far_D: np.ndarray,
) -> int:
    """Step 3 on one layer's row, in place; adds each domain's lost experts to ``lost_so_far_D``."""
    count_E, item_P, gpu_G = _loads(row_P, load_E, G, S, E)
    held_DE = _holds(domain_P, row_P, E)
    lost_D = (held_DE == count_E[None, :]).sum(axis=1)
    total = int(lost_D.sum())
    # The domains that have lost the fewest so far take the extra ones (then those holding more now).
    order = np.lexsort((np.arange(D), -lost_D, lost_so_far_D))
    quota_D = np.full(D, total // D, dtype=np.int64)
    quota_D[order[: total % D]] += 1
    trades = 0
    while (lost_D > quota_D).any():
        src_dom = int(np.argmax(lost_D - quota_D))  # the lowest domain among the most over
        single_a = np.flatnonzero((domain_P == src_dom) & (count_E[row_P] == 1))
        # Partners: replicas in a domain under quota of experts not then confined to src_dom and
        # no less evenly spread (one replica leaves its domain, one arrives in src_dom).
        cand_c = np.flatnonzero((lost_D < quota_D)[domain_P] & (count_E[row_P] > 1))
        partner_c = row_P[cand_c]
        rows_cD = held_DE[:, partner_c].T.copy()
        spread_before_c = rows_cD.max(axis=1) - rows_cD.min(axis=1)
        rows_cD[np.arange(cand_c.size), domain_P[cand_c]] -= 1
        rows_cD[:, src_dom] += 1
        ok_c = (rows_cD.max(axis=1) - rows_cD.min(axis=1) <= spread_before_c) & (
            rows_cD[:, src_dom] < count_E[partner_c]
        )
        cand_c = cand_c[ok_c]
        if single_a.size == 0 or cand_c.size == 0:
            break
        delta_ac = item_P[cand_c][None, :] - item_P[single_a][:, None]
        peak_ac = pair_peak(gpu_G[single_a // S][:, None], gpu_G[cand_c // S][None, :], delta_ac)
        best = int(np.argmin(peak_ac))  # row-major: the lowest single, then the lowest partner
        slot_a, slot_b = int(single_a[best // cand_c.size]), int(cand_c[best % cand_c.size])
        _trade(row_P, item_P, gpu_G, held_DE, domain_P, S, slot_a, slot_b)
        lost_D = (held_DE == count_E[None, :]).sum(axis=1)
        trades += 1
    lost_so_far_D += lost_D
    return trades


def _polish_layer(
    row_P: np.ndarray,
    load_E: np.ndarray,
    G: int,
    S: int,
    domain_P: np.ndarray,
    node_P: np.ndarray,
    E: int,
    target: float,
) -> int:
    """Step 4 on one layer's row, in place: swaps off the busiest GPU while it peaks above ``target``."""
    count_E, item_P, gpu_G = _loads(row_P, load_E, G, S, E)
    gpu_P = np.arange(row_P.size) // S
    others_G = np.delete(np.tile(np.arange(G), (G, 1)), np.arange(G) * (G + 1)).reshape(G, 1, G - 1)
    holds_GE, held_DE, node_NE = (_holds(part_P, row_P, E) for part_P in (gpu_P, domain_P, node_P))
    single_P = count_E[row_P] == 1
    swaps = 0
    one = np.ones(1)
    for _ in range(MAX_POLISH_SWAPS):
        hot_1 = critical_gpu(gpu_G[None, None], gpu_G.mean(keepdims=True)[None], one)
        g = int(hot_1[0])
        peak = float(gpu_G[g])
        if peak <= target * (1 + 1e-9):
            break
        # Partners: every other GPU, in order.
        cand = SwapCandidates.of(
            item_P[None, None], row_P[None], np.zeros(1, np.int64), hot_1, others_G[g], S
        )
        a_s, b_c = cand.hot_slots_lS[0], cand.partner_lQ[0]
        ea, eb = cand.expert_a_lS[0][:, None], cand.expert_b_lQ[0][None, :]
        delta = cand.delta_ZlSQ()[0, 0]
        new_peak = pair_peak(np.float64(peak), gpu_G[gpu_P[b_c]][None, :], delta)
        ok = cand.distinct_lSQ()[0] & (holds_GE[gpu_P[b_c][None, :], ea] == 0) & (holds_GE[g, eb] == 0)
        cross = domain_P[a_s][:, None] != domain_P[b_c][None, :]
        ok &= ~cross | (single_P[a_s][:, None] == single_P[b_c][None, :])
        ok &= _keeps_spread(held_DE, count_E, ea, eb, domain_P[a_s][:, None], domain_P[b_c][None, :])
        ok &= _keeps_spread(node_NE, count_E, ea, eb, node_P[a_s][:, None], node_P[b_c][None, :])
        ok &= new_peak < peak * (1 - 1e-9)
        if not ok.any():
            break
        flat = int(np.argmin(np.where(ok, new_peak, np.inf)))
        slot_a, slot_b = int(a_s[flat // b_c.size]), int(b_c[flat % b_c.size])
        xa, xb = int(row_P[slot_a]), int(row_P[slot_b])
        for arr, idx in ((holds_GE, gpu_P), (node_NE, node_P)):
            trade_counts(arr, int(idx[slot_a]), int(idx[slot_b]), xa, xb)
        _trade(row_P, item_P, gpu_G, held_DE, domain_P, S, slot_a, slot_b)
        single_P[slot_a], single_P[slot_b] = single_P[slot_b], single_P[slot_a]
        swaps += 1
    return swaps


def _keeps_spread(
    held_XE: np.ndarray, count_E: np.ndarray, ea: np.ndarray, eb: np.ndarray, xa: np.ndarray, xb: np.ndarray
) -> np.ndarray:
    """bool: whether moving ``ea`` from part ``xa`` to ``xb`` (and ``eb`` back) leaves each no less
    evenly spread over the parts (a node or a domain) than before."""
    out = np.ones(np.broadcast(ea, eb).shape, dtype=bool)
    same = xa == xb
    for e, src, dst in ((ea, xa, xb), (eb, xb, xa)):
        col_src, col_dst = held_XE[src, e], held_XE[dst, e]
        # Moving one replica from src to dst: no worse when src held more than dst.
        out &= same | (count_E[e] == 1) | (col_src > col_dst)
    return out


def _loads(row_P: np.ndarray, load_E: np.ndarray, G: int, S: int, E: int) -> tuple[np.ndarray, ...]:
    """(replicas of each expert [E], the load each slot carries [P], each GPU's load [G]): an even split."""
    count_E = np.bincount(row_P, minlength=E)
    item_P = load_E[row_P] / count_E[row_P]
    return count_E, item_P, item_P.reshape(G, S).sum(axis=1)


def _holds(part_P: np.ndarray, row_P: np.ndarray, E: int) -> np.ndarray:
    """int64 [parts, E]: replicas of each expert in each part of the slots (a GPU, node or domain)."""
    out = np.zeros((int(part_P.max()) + 1, E), dtype=np.int64)
    np.add.at(out, (part_P, row_P), 1)
    return out


def _peaks(gpu_G: np.ndarray, item_P: np.ndarray, slot_a: int, cand_c: np.ndarray, S: int) -> np.ndarray:
    """float64 [c]: the higher of the two GPUs' loads after ``slot_a`` trades with each candidate."""
    return pair_peak(gpu_G[slot_a // S], gpu_G[cand_c // S], item_P[cand_c] - item_P[slot_a])


def _trade(
    row_P: np.ndarray,
    item_P: np.ndarray,
    gpu_G: np.ndarray,
    held_DE: np.ndarray,
    domain_P: np.ndarray,
    S: int,
    slot_a: int,
    slot_b: int,
) -> None:
    """Swap the experts of two slots, and the loads and domain counts that follow them."""
    delta = item_P[slot_b] - item_P[slot_a]
    gpu_G[slot_a // S] += delta
    gpu_G[slot_b // S] -= delta
    swap_slots(row_P, item_P, held_DE, slot_a, slot_b, int(domain_P[slot_a]), int(domain_P[slot_b]))


@dataclass(frozen=True)
class _Scores:
    """What a failure-aware rewrite reports, for the forecast ``load_LE`` and the slots' domains."""

    load_LE: np.ndarray
    num_gpus: int
    domain_P: np.ndarray
    num_domains: int

    def of(self, phy2log_LP: np.ndarray) -> tuple[float, float, float]:
        """(balancedness of the load under an even split, the mean over layers of the largest
        share of a layer's load whose every replica lies in one domain, the largest number of
        (layer, expert) pairs one domain's loss leaves with no replica, over the model)."""
        load_LE, G, domain_P, D = self.load_LE, self.num_gpus, self.domain_P, self.num_domains
        L, E = load_LE.shape
        count_LE = holds_per_gpu(phy2log_LP, G, E).sum(axis=1)
        layer_LP = np.arange(L)[:, None]
        item_LP = load_LE[layer_LP, phy2log_LP] / count_LE[layer_LP, phy2log_LP]
        balance = float(balancedness(item_LP.reshape(L, G, -1).sum(axis=2)).mean())
        held_LDE = np.zeros((L, D, E), dtype=np.int64)
        np.add.at(held_LDE, (np.broadcast_to(layer_LP, phy2log_LP.shape), domain_P[None, :], phy2log_LP), 1)
        only_LDE = held_LDE == count_LE[:, None, :]
        total_L = np.maximum(load_LE.sum(axis=1), 1e-300)
        lost_LD = (only_LDE * load_LE[:, None, :]).sum(axis=2) / total_L[:, None]
        return balance, float(lost_LD.max(axis=1).mean()), float(only_LDE.sum(axis=(0, 2)).max())
