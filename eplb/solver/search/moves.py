"""The moves of the budgeted search: its state, each layer's best swap and replica change, applying them.

Shape legend: Z scenarios, L layers, E logical experts, P physical slots, G GPUs, S slots per GPU, l
layers (being searched), B bins (the partner GPUs of the hot one), Q partner slots, J giver slots, e
experts (receiving a replica), c candidate moves, k touched experts (those a move touches,
before and after it: four per layer).

A swap is the step every search takes (eplb.solver.search.swap: partners, candidates, the swap
itself); what is this search's own is its objective, soft balancedness, whose hot GPU is the one
with the largest expected share of the soft maximum, and the replica changes and copy prices.
Budgeted plans from the live placement, periodic, continuous and degraded alike, all run it
(eplb.solver.search.budget).

Loads are in units of the layer's mean GPU load (per scenario), so a layer's soft maximum
``smax = (sum_g x_g**32)**(1/32)`` is at least 1 and its soft balancedness is ``1 / smax``.
Copies are priced exactly with two arrays kept up to date: what expert e arriving at GPU g would
cost (0 if g holds it now or held it before the plan) and what e leaving g would refund (its
arrival cost, if it is g's last replica). The power 32 and its root are five squarings and five
square roots: several times faster than ``np.power`` on these arrays.

A slot carries its expert's load times its share (eplb.placement.share): ``1 / count`` (an even
split), or where the share model follows the replicas' nodes (static maps) the share it gives,
recomputed for the moved experts after each move. A proposal's gain assumes the shares of an even split (a swap carries the slots'
loads as they are); the state after the move is exact, so the next proposals start from the truth.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from eplb.placement.share import ShareModel
from eplb.solver.scoring.served import expectation
from eplb.solver.search.copies import holds_per_gpu
from eplb.solver.search.swap import SwapCandidates, lightest_partners, swap_slots

GIVER_SLOTS = 8
"""Replica changes: candidate slots to take from, per layer (light GPUs, cheap givers first)."""
RECEIVERS = 2
"""Replica changes: the hot GPU's heaviest experts that may gain a replica."""
_TOL = 1e-9


@dataclass
class CopyPrices:
    """Arrival costs and departure refunds of one kind of copy count, kept current with ``holds``."""

    base_LGE: np.ndarray
    """float64 [L, G, E]: cost of e arriving at g if g did not hold it before the plan (else 0)."""
    arrive_LGE: np.ndarray
    """float64 [L, G, E]: base where g holds no replica of e now, else 0."""
    leave_LGE: np.ndarray
    """float64 [L, G, E]: base where g holds exactly one replica of e now, else 0."""

    @classmethod
    def of(cls, base_LGE: np.ndarray, holds_LGE: np.ndarray) -> CopyPrices:
        return cls(base_LGE, np.where(holds_LGE == 0, base_LGE, 0.0), np.where(holds_LGE == 1, base_LGE, 0.0))

    @classmethod
    def at_origin(cls, base_LGE: np.ndarray) -> CopyPrices:
        """:meth:`of` for the holds of the placement the costs count from, where ``base_LGE`` is 0
        wherever a replica is held: arriving costs the base itself and nothing refunds (the same
        arrays without the two passes over [L, G, E], about 2 ms at DeepSeek-V3's shape; np.zeros
        rather than zeros_like: its pages are only touched where a refund appears)."""
        return cls(base_LGE, base_LGE.copy(), np.zeros(base_LGE.shape, dtype=base_LGE.dtype))

    def update(self, holds_LGE: np.ndarray, layer: int, gpus: list[int], experts: list[int]) -> None:
        for g, e in zip(gpus, experts, strict=True):
            h, b = holds_LGE[layer, g, e], self.base_LGE[layer, g, e]
            self.arrive_LGE[layer, g, e] = b if h == 0 else 0.0
            self.leave_LGE[layer, g, e] = b if h == 1 else 0.0


@dataclass
class MoveState:
    """The budgeted search's state (arrays updated in place by the apply functions)."""

    phy2log_LP: np.ndarray
    """int64 [L, P]."""
    cnt_LE: np.ndarray
    """int64 [L, E]: replicas per expert."""
    norm_ZLE: np.ndarray
    """float64 [Z, L, E]: expert load / mean GPU load of the layer."""
    item_ZLP: np.ndarray
    """float64 [Z, L, P]: load each slot carries."""
    gpu_ZLG: np.ndarray
    """float64 [Z, L, G]."""
    holds_LGE: np.ndarray
    """int16 [L, G, E]: replicas of e on g."""
    weighted: CopyPrices
    """Copies with cross-node ones weighted."""
    plain: CopyPrices | None
    """Plain copies; None when only the weighted count is limited (or they coincide)."""
    num_gpus: int
    dispatch: ShareModel = field(default_factory=lambda: ShareModel("dynamic"))
    """How the server splits an expert's tokens: shares that follow the replicas' nodes (static
    maps, recomputed after each move of a replicated expert) or an even split."""
    node_has_LNE: np.ndarray | None = None
    """bool [L, N, E]: whether node n holds a replica of e; kept only where shares follow nodes,
    where every swap proposal asks it (deriving it from ``holds_LGE`` each time
    copied [l, G, E] per proposal: a sixth of the search)."""

    @property
    def slots_per_gpu(self) -> int:
        return self.phy2log_LP.shape[1] // self.num_gpus


def make_move_state(
    scenarios_ZLE: np.ndarray,
    phy2log_LP: np.ndarray,
    cnt_LE: np.ndarray,
    weighted_LGE: np.ndarray,
    plain_LGE: np.ndarray | None,
    dispatch: ShareModel | None = None,
    *,
    at_origin: bool = False,
    share_LP: np.ndarray | None = None,
) -> MoveState:
    """The search state of placement ``phy2log_LP`` with arrival costs from the plan's start
    (``weighted_LGE``, ``plain_LGE``: float64 [L, G, E], eplb.solver.search.copies.arrival_costs).

    ``dispatch``: how the server splits an expert's tokens (None: evenly over its replicas).
    ``at_origin``: ``phy2log_LP`` is the placement the costs count from (the costs are 0 wherever
    it holds a replica, as eplb.solver.search.copies.arrival_costs gives them).
    ``share_LP``: the slot shares of ``phy2log_LP`` under ``dispatch`` (float64 [L, P]), where the
    caller has them (else computed here).
    """
    G = weighted_LGE.shape[1]
    p2l = phy2log_LP.astype(np.int64)
    cnt = cnt_LE.astype(np.int64)
    mean_ZL = scenarios_ZLE.sum(axis=-1) / G
    norm_ZLE = scenarios_ZLE / np.where(mean_ZL > 0, mean_ZL, 1.0)[..., None]
    L, P = p2l.shape
    layer = np.arange(L)[:, None]
    dispatch = dispatch or ShareModel("dynamic")
    if share_LP is None:
        share_LP = dispatch.share_LP(p2l, cnt, G)
    assert share_LP.shape == p2l.shape, "one share per slot"
    item_ZLP = norm_ZLE[:, layer, p2l] * share_LP
    gpu_ZLG = item_ZLP.reshape(-1, L, G, P // G).sum(axis=-1)
    # int16: the proposals gather from it at random, and a quarter of int64's bytes stays in cache
    # (a GPU holds at most P replicas of an expert).
    assert np.iinfo(np.int16).max >= P, "replica counts per GPU fit int16"
    holds = holds_per_gpu(p2l, G, cnt.shape[1]).astype(np.int16)

    def prices(base_LGE: np.ndarray) -> CopyPrices:
        return CopyPrices.at_origin(base_LGE) if at_origin else CopyPrices.of(base_LGE, holds)

    plain = None if plain_LGE is None else prices(plain_LGE)
    N = dispatch.num_nodes
    node_has = np.asarray(holds.reshape(L, N, G // N, -1).any(axis=2)) if dispatch.follows_nodes else None
    return MoveState(
        p2l,
        cnt,
        norm_ZLE,
        item_ZLP,
        gpu_ZLG,
        holds,
        prices(weighted_LGE),
        plain,
        G,
        dispatch,
        node_has,
    )


@dataclass(frozen=True)
class MoveProposal:
    """Each searched layer's best move (arrays over the searched layers)."""

    net_l: np.ndarray
    """Gain minus copy_cost times the weighted copies (-inf: none fits)."""
    gain_l: np.ndarray
    weighted_l: np.ndarray
    plain_l: np.ndarray
    replica_l: np.ndarray
    """bool: a replica change (else a swap)."""
    slot_a_l: np.ndarray
    """Swap: the hot GPU's slot."""
    slot_b_l: np.ndarray
    """Swap: the partner slot; replica change: the slot given away."""
    expert_l: np.ndarray
    """Replica change: the expert that gains the slot."""


def _pow32(x: np.ndarray) -> np.ndarray:
    """x**32, in place."""
    for _ in range(5):
        np.multiply(x, x, out=x)
    return x


def _inv_root32(u: np.ndarray) -> np.ndarray:
    """u**(-1/32), in place."""
    for _ in range(5):
        np.sqrt(u, out=u)
    return np.reciprocal(u, out=u)


def _soft_gain(U_Zlxy: np.ndarray, base_Zl: np.ndarray) -> np.ndarray:
    """Soft balancedness gained per candidate, ``U ** (-1/32) - base``, in place in ``U``."""
    return np.subtract(_inv_root32(U_Zlxy), base_Zl[..., None, None], out=U_Zlxy)


def propose(
    state: MoveState,
    layers: np.ndarray,
    weights_Z: np.ndarray,
    copy_cost: float,
    left_w: float,
    left_p: float,
    swaps_only_l: np.ndarray | None = None,
) -> MoveProposal:
    """The best move of each of ``layers`` (swap or replica change) that fits the budget left;
    only swaps where ``swaps_only_l`` [l] is set."""
    G = state.num_gpus
    nl = layers.size
    rows = np.arange(nl)
    x_ZlG = state.gpu_ZLG[:, layers]
    xp_ZlG = _pow32(x_ZlG.copy())
    U_Kl = xp_ZlG.sum(axis=-1)
    base_Zl = _inv_root32(U_Kl.copy())
    # Hot GPU: the largest expected share of the soft maximum; partners: the lightest GPUs.
    hot_l = expectation(weights_Z, xp_ZlG / U_Kl[..., None]).argmax(axis=1)
    num_partners = max(1, min(G - 1, max(4, G // 4)))
    partners_lB = lightest_partners(expectation(weights_Z, x_ZlG), hot_l, num_partners)
    if state.dispatch.follows_nodes and state.dispatch.num_nodes > 1:
        # Replicated experts move only within their node here (_keeps_static_shares): add the
        # hot GPU's node's other GPUs, which need not be among the lightest of all.
        gpn = G // state.dispatch.num_nodes
        node_lB = (hot_l // gpn)[:, None] * gpn + np.arange(gpn)
        mates_lB = np.where(node_lB == hot_l[:, None], partners_lB[:, :1], node_lB)
        partners_lB = np.concatenate([partners_lB, mates_lB], axis=1)
    ctx = _Context(
        state, layers, rows, hot_l, x_ZlG, xp_ZlG, U_Kl, base_Zl, weights_Z, copy_cost, left_w, left_p
    )
    swap = _best_swap(ctx, partners_lB)
    repl = _best_replica_change(ctx)
    unstack = _best_unstack(ctx)
    if unstack is not None:
        sub, moves_u = unstack
        take = moves_u.net_l > repl.net_l[sub]
        merged = [f.copy() for f in _fields(repl)]
        for field_l, u_l in zip(merged, _fields(moves_u), strict=True):
            field_l[sub] = np.where(take, u_l, field_l[sub])
        repl = MoveProposal(*merged)
    use = repl.net_l > swap.net_l
    if swaps_only_l is not None:
        use &= ~swaps_only_l
    return MoveProposal(*(np.where(use, r, s) for r, s in zip(_fields(repl), _fields(swap), strict=True)))


def _fields(p: MoveProposal) -> tuple[np.ndarray, ...]:
    return (p.net_l, p.gain_l, p.weighted_l, p.plain_l, p.replica_l, p.slot_a_l, p.slot_b_l, p.expert_l)


@dataclass(frozen=True)
class _Context:
    state: MoveState
    layers: np.ndarray
    rows: np.ndarray
    hot_l: np.ndarray
    x_ZlG: np.ndarray
    xp_ZlG: np.ndarray
    U_Kl: np.ndarray
    base_Zl: np.ndarray
    weights_Z: np.ndarray
    copy_cost: float
    left_w: float
    left_p: float

    def subset(self, sub: np.ndarray) -> _Context:
        """The same context over the searched layers ``sub`` (rows into ``layers``)."""
        return _Context(
            self.state,
            self.layers[sub],
            np.arange(sub.size),
            self.hot_l[sub],
            self.x_ZlG[:, sub],
            self.xp_ZlG[:, sub],
            self.U_Kl[:, sub],
            self.base_Zl[:, sub],
            self.weights_Z,
            self.copy_cost,
            self.left_w,
            self.left_p,
        )

    def best(
        self,
        gain_lc: np.ndarray,
        weighted_lc: np.ndarray,
        plain_lc: np.ndarray,
        ok_lc: np.ndarray,
        moves_of: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]],
        replica: bool,
    ) -> MoveProposal:
        """Each layer's best candidate among those that fit; ``moves_of`` maps each layer's best
        candidate index [l] to its slot a, slot b and expert (only the chosen candidates are
        looked up: the per-candidate tables would cost more than the search around them)."""
        ok_lc &= weighted_lc <= self.left_w + _TOL
        if self.state.plain is not None:
            ok_lc &= plain_lc <= self.left_p + _TOL
        net_lc = np.where(ok_lc, gain_lc - self.copy_cost * weighted_lc, -np.inf)
        rows = self.rows
        best_l = net_lc.argmax(axis=1)
        slot_a_l, slot_b_l, expert_l = moves_of(best_l)
        return MoveProposal(
            net_l=net_lc[rows, best_l],
            gain_l=gain_lc[rows, best_l],
            weighted_l=weighted_lc[rows, best_l],
            plain_l=plain_lc[rows, best_l],
            replica_l=np.full(rows.size, replica),
            slot_a_l=slot_a_l,
            slot_b_l=slot_b_l,
            expert_l=expert_l,
        )


def _copy_terms(
    prices: CopyPrices,
    flat_lSQ: np.ndarray,
    hot_b_lQ: np.ndarray,
    partner_b_lQ: np.ndarray,
    hot_a_lS: np.ndarray,
) -> np.ndarray:
    """float64 [l, S, Q]: copies a swap of hot slot s and partner q adds (negative: refunds).

    Flat [L, G, E] indices (a 1-D take is several times faster than indexing with three
    broadcast arrays) of: ``flat_lSQ`` (layer, partner's GPU, hot slot's expert), ``hot_b_lQ``
    (layer, hot GPU, partner slot's expert), ``partner_b_lQ`` (layer, partner's GPU, partner
    slot's expert), ``hot_a_lS`` (layer, hot GPU, hot slot's expert).
    """
    arrive, leave = prices.arrive_LGE.reshape(-1), prices.leave_LGE.reshape(-1)
    cost_lSQ = arrive.take(flat_lSQ)
    cost_lSQ += (arrive.take(hot_b_lQ) - leave.take(partner_b_lQ))[:, None, :]
    cost_lSQ -= leave.take(hot_a_lS)[:, :, None]
    return cost_lSQ


def _best_swap(ctx: _Context, partners_lB: np.ndarray) -> MoveProposal:
    st, rows, hot_l = ctx.state, ctx.rows, ctx.hot_l
    S = st.slots_per_gpu
    nl = rows.size
    lay_l1, hot_l1 = ctx.layers[:, None], hot_l[:, None]
    cand = SwapCandidates.of(st.item_ZLP, st.phy2log_LP, ctx.layers, hot_l, partners_lB, S)
    gpu_lQ = cand.gpu_lQ
    xh_Zl = ctx.x_ZlG[:, rows, hot_l]
    xg_ZlQ = ctx.x_ZlG[:, rows[:, None], gpu_lQ]
    # The rest of the sum of powers, without the two GPUs that change.
    rest_ZlQ = (ctx.U_Kl - ctx.xp_ZlG[:, rows, hot_l])[..., None] - ctx.xp_ZlG[:, rows[:, None], gpu_lQ]
    d_ZlSQ = cand.delta_ZlSQ()
    U_new = _pow32(d_ZlSQ + xh_Zl[..., None, None])
    np.subtract(xg_ZlQ[:, :, None, :], d_ZlSQ, out=d_ZlSQ)
    U_new += _pow32(d_ZlSQ)
    U_new += rest_ZlQ[:, :, None, :]
    np.maximum(U_new, 1.0, out=U_new)  # loads in units of the mean: the sum of powers is >= 1
    gain_lc = expectation(ctx.weights_Z, _soft_gain(U_new, ctx.base_Zl)).reshape(nl, -1)

    ea_lS, eb_lQ = cand.expert_a_lS, cand.expert_b_lQ
    # Flat indices into the [L, G, E] arrays (a 1-D take is several times faster than indexing
    # with three broadcast arrays).
    E = st.holds_LGE.shape[2]
    hot_row_l1 = (lay_l1 * st.num_gpus + hot_l1) * E
    partner_row_lQ = (lay_l1 * st.num_gpus + gpu_lQ) * E
    flat_lSQ = partner_row_lQ[:, None, :] + ea_lS[:, :, None]
    where = (flat_lSQ, hot_row_l1 + eb_lQ, partner_row_lQ + eb_lQ, hot_row_l1 + ea_lS)
    weighted_lc = _copy_terms(st.weighted, *where).reshape(nl, -1)
    plain_lc = weighted_lc if st.plain is None else _copy_terms(st.plain, *where).reshape(nl, -1)
    ok_lSQ = cand.distinct_lSQ()
    if st.dispatch.follows_nodes:
        ok_lSQ &= _keeps_static_shares(st, lay_l1, hot_l1, ea_lS, eb_lQ, gpu_lQ, flat_lSQ, where[1])
    ok_lc = ok_lSQ.reshape(nl, -1)

    def moves_of(best_l: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (*cand.slots(best_l), np.zeros(nl, np.int64))

    return ctx.best(gain_lc, weighted_lc, plain_lc, ok_lc, moves_of, False)


def _keeps_static_shares(
    st: MoveState,
    lay_l1: np.ndarray,
    hot_l1: np.ndarray,
    ea_lS: np.ndarray,
    eb_lQ: np.ndarray,
    gpu_lQ: np.ndarray,
    flat_lSQ: np.ndarray,
    hot_b_lQ: np.ndarray,
) -> np.ndarray:
    """bool [l, S, Q]: static dispatch, swaps whose slots keep their shares, so the swap's gain is
    exact: a replicated expert moves only within its node, to a GPU without a replica of it.
    ``flat_lSQ`` and ``hot_b_lQ`` as for :func:`_copy_terms`.

    Its node's ranks still reach it there; across nodes its share would follow the new node set
    (eplb.placement.share), which the proposal does not price. Single replicas move freely.
    """
    N = st.dispatch.num_nodes
    gpn = st.num_gpus // N
    same_node_lQ = (gpu_lQ // gpn) == (hot_l1 // gpn)
    multi_a_lS = st.cnt_LE[lay_l1, ea_lS] > 1
    multi_b_lQ = st.cnt_LE[lay_l1, eb_lQ] > 1
    a_at_partner_lSQ = st.holds_LGE.reshape(-1).take(flat_lSQ) > 0
    b_at_hot_lQ = st.holds_LGE.reshape(-1).take(hot_b_lQ) > 0
    assert st.node_has_LNE is not None, "static dispatch keeps node_has_LNE"
    E = st.holds_LGE.shape[2]
    node_has = st.node_has_LNE.reshape(-1)
    node_flat_lSQ = ((lay_l1 * N + gpu_lQ // gpn) * E)[:, None, :] + ea_lS[:, :, None]
    a_to_new_node_lSQ = ~node_has.take(node_flat_lSQ)
    b_to_new_node_lQ = ~node_has.take((lay_l1 * N + hot_l1 // gpn) * E + eb_lQ)
    a_ok = ~multi_a_lS[:, :, None] | (same_node_lQ[:, None, :] & ~a_at_partner_lSQ) | a_to_new_node_lSQ
    b_ok = ~multi_b_lQ | (same_node_lQ & ~b_at_hot_lQ) | b_to_new_node_lQ
    return np.asarray(a_ok & b_ok[:, None, :])


def _best_replica_change(ctx: _Context) -> MoveProposal:
    st, rows, hot_l = ctx.state, ctx.rows, ctx.hot_l
    S = st.slots_per_gpu
    nl = rows.size
    P = st.phy2log_LP.shape[1]
    p2l_lP = st.phy2log_LP[ctx.layers]
    cnt_lE = st.cnt_LE[ctx.layers]
    item_lP = expectation(ctx.weights_Z, st.item_ZLP[:, ctx.layers])
    # Receivers: the experts of the hot GPU's heaviest replicas.
    hot_slots_lS = hot_l[:, None] * S + np.arange(S)
    num_receivers = min(RECEIVERS, S)
    heavy_le = np.argsort(-item_lP[rows[:, None], hot_slots_lS], axis=1, kind="stable")[:, :num_receivers]
    ex_le = p2l_lP[rows[:, None], hot_slots_lS[rows[:, None], heavy_le]]
    # Givers: slots of experts with another replica, off the hot GPU: light GPUs and a small rise
    # of the giver's other replicas first.
    cnt_lP = cnt_lE[rows[:, None], p2l_lP]
    gpu_P = np.arange(P) // S
    giver_lP = (cnt_lP >= 2) & (gpu_P != hot_l[:, None])
    score_lP = expectation(ctx.weights_Z, ctx.x_ZlG)[:, gpu_P] + item_lP / np.maximum(cnt_lP - 1, 1)
    J = min(GIVER_SLOTS, P)
    slot_lJ = np.argsort(np.where(giver_lP, score_lP, np.inf), axis=1, kind="stable")[:, :J]
    valid_lJ = giver_lP[rows[:, None], slot_lJ]
    ok_leJ = np.broadcast_to(valid_lJ[:, None, :], (nl, num_receivers, J))
    return _replica_changes(ctx, ex_le, slot_lJ, ok_leJ)


def _best_unstack(ctx: _Context) -> tuple[np.ndarray, MoveProposal] | None:
    """(layers' rows, their best moves): replica changes that free a stacked slot of the hot GPU.

    Only layers whose hot GPU holds two replicas or more of one expert: such a slot is given to
    one of the heaviest experts per replica that the hot GPU does not hold, or to the layer's
    lightest. The greedy counts can leave a very hot expert twice on one GPU while every other GPU
    holds it too; there no swap helps (every partner holds it) and no giver off the hot GPU exists
    (vLLM's ``extreme_weight_imbalance`` stayed at max/mean 1.593 under a move budget). None: no
    such layer.
    """
    st, hot_l = ctx.state, ctx.hot_l
    S = st.slots_per_gpu
    hot_holds_lE = st.holds_LGE[ctx.layers, hot_l].astype(np.int64)
    sub = np.flatnonzero(hot_holds_lE.max(axis=1) >= 2)
    if sub.size == 0:
        return None
    sctx = ctx.subset(sub)
    rows = sctx.rows
    hot_slots_lS = sctx.hot_l[:, None] * S + np.arange(S)
    p2l_lS = st.phy2log_LP[sctx.layers[:, None], hot_slots_lS]
    stacked_lS = hot_holds_lE[sub[:, None], p2l_lS] >= 2
    per_replica_lE = expectation(sctx.weights_Z, st.norm_ZLE[:, sctx.layers]) / np.maximum(
        st.cnt_LE[sctx.layers], 1
    )
    off_hot_lE = np.where(hot_holds_lE[sub] == 0, per_replica_lE, -np.inf)
    heavy_lr = np.argsort(-off_hot_lE, axis=1, kind="stable")[:, :RECEIVERS]
    ex_le = np.concatenate([heavy_lr, per_replica_lE.argmin(axis=1)[:, None]], axis=1)
    receiver_ok_le = np.concatenate(
        [off_hot_lE[rows[:, None], heavy_lr] > -np.inf, np.ones((rows.size, 1), dtype=bool)], axis=1
    )
    ok_leJ = receiver_ok_le[:, :, None] & stacked_lS[:, None, :]
    return sub, _replica_changes(sctx, ex_le, hot_slots_lS, ok_leJ)


def _replica_changes(
    ctx: _Context, ex_le: np.ndarray, slot_lJ: np.ndarray, ok_leJ: np.ndarray
) -> MoveProposal:
    """Each layer's best replica change among receivers ``ex_le`` [l, e] taking one of the slots
    ``slot_lJ`` [l, J], where ``ok_leJ`` allows the pair (and the slot's expert is not the receiver)."""
    st, rows = ctx.state, ctx.rows
    G, S = st.num_gpus, st.slots_per_gpu
    nl = rows.size
    lay_l1 = ctx.layers[:, None]
    p2l_lP = st.phy2log_LP[ctx.layers]
    cnt_lE = st.cnt_LE[ctx.layers]
    num_receivers, J = ex_le.shape[1], slot_lJ.shape[1]
    ey_lJ = p2l_lP[rows[:, None], slot_lJ]
    gj_lJ = slot_lJ // S

    norm_ZlE = st.norm_ZLE[:, ctx.layers]
    cx_le = cnt_lE[rows[:, None], ex_le]
    cy_lJ = cnt_lE[rows[:, None], ey_lJ]
    wx_Zle = norm_ZlE[:, rows[:, None], ex_le]
    wy_ZlJ = norm_ZlE[:, rows[:, None], ey_lJ]
    x_new_Zle = wx_Zle / (cx_le + 1)
    y_new_ZlJ = wy_ZlJ / np.maximum(cy_lJ - 1, 1)
    g_G = np.arange(G)
    lay_l11 = ctx.layers[:, None, None]
    # Flat [L, G, E] indices: a 1-D take is several times faster than three broadcast arrays.
    E = st.holds_LGE.shape[2]
    holds = st.holds_LGE.reshape(-1)
    gpu_row_l1G = ((lay_l11 * G + g_G) * E)[:, 0]
    hx_leG = holds.take(gpu_row_l1G[:, None, :] + ex_le[:, :, None])
    hy_lJG = holds.take(gpu_row_l1G[:, None, :] + ey_lJ[:, :, None])
    # New GPU loads [Z, l, e, J, G]: every replica of x lighter, every replica of y heavier, and
    # the given slot now holding x's new share instead of y's.
    Z = wy_ZlJ.shape[0]
    new = np.empty((Z, nl, num_receivers, J, G))
    new[...] = (ctx.x_ZlG[:, :, None, :] + hx_leG[None] * (x_new_Zle - wx_Zle / cx_le)[..., None])[
        :, :, :, None, :
    ]
    new += hy_lJG[None, :, None, :, :] * (y_new_ZlJ - wy_ZlJ / cy_lJ)[:, :, None, :, None]
    new += (gj_lJ[:, :, None] == g_G)[None, :, None] * (
        x_new_Zle[..., None, None] - y_new_ZlJ[:, :, None, :, None]
    )
    U_new = np.maximum(_pow32(new).sum(axis=-1), 1.0)
    gain_lc = expectation(ctx.weights_Z, _soft_gain(U_new, ctx.base_Zl)).reshape(nl, -1)

    giver_row_lJ = (lay_l1 * G + gj_lJ) * E
    x_at_giver_leJ = giver_row_lJ[:, None, :] + ex_le[:, :, None]
    y_at_giver_lJ = giver_row_lJ + ey_lJ

    def copies(prices: CopyPrices) -> np.ndarray:
        arrive_leJ = prices.arrive_LGE.reshape(-1).take(x_at_giver_leJ)
        return (arrive_leJ - prices.leave_LGE.reshape(-1).take(y_at_giver_lJ)[:, None, :]).reshape(nl, -1)

    weighted_lc = copies(st.weighted)
    plain_lc = weighted_lc if st.plain is None else copies(st.plain)
    ok_lc = (ok_leJ & (ex_le[:, :, None] != ey_lJ[:, None, :])).reshape(nl, -1)

    def moves_of(best_l: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        # candidate c = e * J + j: receiver e, giver slot j
        return np.zeros(nl, np.int64), slot_lJ[rows, best_l % J], ex_le[rows, best_l // J]

    return ctx.best(gain_lc, weighted_lc, plain_lc, ok_lc, moves_of, True)


def apply_swap(state: MoveState, layer: int, a: int, b: int) -> None:
    """Slots ``a`` and ``b`` of ``layer`` trade experts."""
    items = state.item_ZLP[:, layer]
    ga, gb = a // state.slots_per_gpu, b // state.slots_per_gpu
    ea, eb = swap_slots(state.phy2log_LP[layer], items, state.holds_LGE[layer], a, b, ga, gb)
    if state.dispatch.follows_nodes and max(state.cnt_LE[layer, ea], state.cnt_LE[layer, eb]) > 1:
        _reshare(state, layer, (ea, eb))  # a replicated expert moved: its shares follow its replicas
    else:  # single replicas take all their expert's tokens wherever they sit
        delta_Z = items[:, a] - items[:, b]
        state.gpu_ZLG[:, layer, ga] += delta_Z
        state.gpu_ZLG[:, layer, gb] -= delta_Z
    _update_prices(state, layer, [ga, ga, gb, gb], [ea, eb, eb, ea])


def apply_replica_change(state: MoveState, layer: int, slot: int, expert: int) -> None:
    """``slot`` of ``layer`` is given to ``expert`` (its expert keeps its other replicas)."""
    S, G = state.slots_per_gpu, state.num_gpus
    p2l = state.phy2log_LP[layer]
    giver = int(p2l[slot])
    p2l[slot] = expert
    cnt = state.cnt_LE[layer]
    cnt[expert] += 1
    cnt[giver] -= 1
    if state.dispatch.follows_nodes:
        _reshare(state, layer, (giver, expert))
    else:
        touched = np.flatnonzero((p2l == expert) | (p2l == giver))
        state.item_ZLP[:, layer, touched] = state.norm_ZLE[:, layer, p2l[touched]] / cnt[p2l[touched]]
        state.gpu_ZLG[:, layer] = state.item_ZLP[:, layer].reshape(-1, G, S).sum(axis=-1)
    g = slot // S
    state.holds_LGE[layer, g, giver] -= 1
    state.holds_LGE[layer, g, expert] += 1
    _update_prices(state, layer, [g, g], [giver, expert])


@dataclass(frozen=True)
class Unstack:
    """A composite replica change of one layer: ``expert`` is stacked (two replicas or more) on
    several GPUs, and one stacked slot of each is given to another expert at once. No single move
    pays there: freeing one GPU's slot raises the expert's other replicas, and the other stacked
    GPU becomes the hottest."""

    layer: int
    expert: int
    changes: tuple[tuple[int, int], ...]
    """(slot, the expert that gains it), in the order applied."""
    gain: float
    """Soft balancedness gained (exact: measured on the state)."""
    weighted: float
    plain: float


def stacked_layers(state: MoveState) -> np.ndarray:
    """int64 [l]: the layers where some expert is stacked on two GPUs or more."""
    return np.flatnonzero(((state.holds_LGE >= 2).sum(axis=1) >= 2).any(axis=1))


def best_unstack(state: MoveState, layer: int, weights_Z: np.ndarray) -> Unstack | None:
    """``layer``'s composite unstack that gains most (the state as it was), or None where none gains.

    The expert: the heaviest per replica of those stacked on two GPUs or more. Its stacked slots
    go, one per such GPU, either all to the lightest experts per replica or all to the heaviest
    that the GPU lacks (each GPU's receiver chosen after the slots before it changed hands).
    """
    S = state.slots_per_gpu
    holds_GE = state.holds_LGE[layer]
    stacked_E = np.flatnonzero((holds_GE >= 2).sum(axis=0) >= 2)
    if stacked_E.size == 0:
        return None
    per_replica_E = expectation(weights_Z, state.norm_ZLE[:, layer]) / np.maximum(state.cnt_LE[layer], 1)
    x = int(stacked_E[np.argmax(per_replica_E[stacked_E])])
    p2l = state.phy2log_LP[layer]
    slots = [
        g * S + int(np.flatnonzero(p2l[g * S : (g + 1) * S] == x)[-1])
        for g in np.flatnonzero(holds_GE[:, x] >= 2)
    ]
    before = soft_balancedness(state, layer, weights_Z)
    plain_prices = state.plain or state.weighted
    best: Unstack | None = None
    for heaviest in (False, True):
        changes: list[tuple[int, int]] = []
        weighted = plain = 0.0
        for slot in slots:
            g = slot // S
            score_E = np.where(state.holds_LGE[layer, g] == 0, per_replica_E, np.nan)
            score_E[x] = np.nan
            if np.isnan(score_E).all():
                break
            y = int(np.nanargmax(score_E) if heaviest else np.nanargmin(score_E))
            # g keeps a replica of x (it held two or more): nothing is refunded.
            weighted += float(state.weighted.arrive_LGE[layer, g, y])
            plain += float(plain_prices.arrive_LGE[layer, g, y])
            apply_replica_change(state, layer, slot, y)
            changes.append((slot, y))
        gain = soft_balancedness(state, layer, weights_Z) - before
        for slot, _ in reversed(changes):
            apply_replica_change(state, layer, slot, x)
        if len(changes) == len(slots) and (best is None or gain > best.gain):
            best = Unstack(layer, x, tuple(changes), gain, weighted, plain)
    return best if best is not None and best.gain > _TOL else None


def apply_unstack(state: MoveState, unstack: Unstack) -> None:
    """Apply ``unstack``'s replica changes (made by :func:`best_unstack` on the same state)."""
    for slot, expert in unstack.changes:
        apply_replica_change(state, unstack.layer, slot, expert)


def soft_balancedness(state: MoveState, layer: int, weights_Z: np.ndarray) -> float:
    """Expected soft balancedness ``1 / smax`` of ``layer`` in the state as it is."""
    u_Z = _pow32(state.gpu_ZLG[:, layer].copy()).sum(axis=-1)
    return float(expectation(weights_Z, _inv_root32(np.maximum(u_Z, 1.0))))


def _reshare(state: MoveState, layer: int, experts: tuple[int, int]) -> None:
    """Shares that follow nodes: recompute those of ``experts`` in ``layer``, their slots' and GPUs' loads."""
    assert state.dispatch.follows_nodes
    p2l = state.phy2log_LP[layer]
    E, G, S = state.cnt_LE.shape[1], state.num_gpus, state.slots_per_gpu
    replicated: list[tuple[int, np.ndarray]] = []
    for e in set(experts):
        slots = np.flatnonzero(p2l == e)
        if slots.size == 1:  # a single replica takes all its expert's tokens
            state.item_ZLP[:, layer, slots[0]] = state.norm_ZLE[:, layer, e]
        else:
            replicated.append((e, slots))
    if replicated:
        shares = state.dispatch.expert_shares(
            [slots.tolist() for _, slots in replicated], [layer * E + e for e, _ in replicated], G, S
        )
        for (e, slots), share in zip(replicated, shares, strict=True):
            state.item_ZLP[:, layer, slots] = state.norm_ZLE[:, layer, e, None] * share
    state.gpu_ZLG[:, layer] = state.item_ZLP[:, layer].reshape(-1, G, S).sum(axis=-1)


def warm_shares(
    state: MoveState,
    layer_l: np.ndarray,
    replica_l: np.ndarray,
    slot_a_l: np.ndarray,
    slot_b_l: np.ndarray,
    expert_l: np.ndarray,
) -> None:
    """Shares that follow nodes: ask the share model, in one call, for the shares of the
    replicated experts that each layer's proposed move (arrays as :class:`MoveProposal`'s)
    touches, before and after it. It memoises them, so applying a move and undoing it find
    them: one call per move costs tens of numpy ops on tiny arrays, one call per round a few more."""
    assert state.dispatch.follows_nodes
    n = layer_l.size
    if n == 0:
        return
    rows = np.arange(n)
    before_lP = state.phy2log_LP[layer_l]
    after_lP = before_lP.copy()
    # The move puts x at slot b, whose expert y leaves it (a swap puts y at slot a).
    y_l = before_lP[rows, slot_b_l]
    x_l = np.where(replica_l, expert_l, before_lP[rows, slot_a_l])
    after_lP[rows, slot_b_l] = x_l
    swap_l = ~replica_l
    after_lP[rows[swap_l], slot_a_l[swap_l]] = y_l[swap_l]
    p2l_kP = np.concatenate([before_lP, before_lP, after_lP, after_lP])
    expert_k = np.concatenate([x_l, y_l, x_l, y_l])
    at_kP = p2l_kP == expert_k[:, None]
    count_k = np.count_nonzero(at_kP, axis=1)
    replicated_k = count_k >= 2
    if not replicated_k.any():
        return
    slots = np.nonzero(at_kP[replicated_k])[1].tolist()
    bounds = [0, *np.cumsum(count_k[replicated_k]).tolist()]
    E = state.cnt_LE.shape[1]
    offset_k = np.tile(layer_l, 4) * E + expert_k
    state.dispatch.expert_shares(
        [slots[lo:hi] for lo, hi in itertools.pairwise(bounds)],
        offset_k[replicated_k].tolist(),
        state.num_gpus,
        state.slots_per_gpu,
    )


def _update_prices(state: MoveState, layer: int, gpus: list[int], experts: list[int]) -> None:
    """After a move: the copy prices and node holdings of the (GPU, expert) pairs it touched."""
    state.weighted.update(state.holds_LGE, layer, gpus, experts)
    if state.plain is not None:
        state.plain.update(state.holds_LGE, layer, gpus, experts)
    if state.node_has_LNE is not None:
        gpn = state.num_gpus // state.node_has_LNE.shape[1]
        for g, e in zip(gpus, experts, strict=True):
            node = g // gpn
            state.node_has_LNE[layer, node, e] = state.holds_LGE[
                layer, node * gpn : (node + 1) * gpn, e
            ].any()
