"""The swap step every local search takes: the hot GPU, its partners, the candidate swaps, the swap.

Shape legend: Z scenarios, l layers (being searched), G GPUs, S slots per GPU, P physical slots, B
bins (partner GPUs, or the parts replicas are counted in: GPUs, nodes or failure domains), Q
partner slots, E logical experts.

A layer improves by trading the contents of two slots: one of its *hot* GPU's and one of a
*partner* GPU's. Every search here takes that step with these functions, and differs only in what
it scores and what it allows:

- eplb.solver.search.budget (with eplb.solver.search.moves): plans from the live placement
  (periodic, continuous and degraded), soft balancedness per expert copy within a move budget,
  swaps and replica changes, the share model's constraints (static maps: replicated experts stay
  on their nodes);
- eplb.solver.search.local_search: the polish of a fresh plan, the exact expected balancedness,
  no costs;
- eplb.solver.search.spread: the failure-aware polish, the busiest GPU's peak, keeping replicas
  spread over GPUs, nodes and failure domains;
- eplb.solver.search.milp: a MILP repacking of the hot GPU and its partners (another algorithm
  than a swap search: it takes the hot GPU and the partners from here, and nothing else).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def critical_gpu(
    gpu_ZlG: np.ndarray, mean_Zl: np.ndarray, weights_Z: np.ndarray, power: int = 2
) -> np.ndarray:
    """int [l]: the hot GPU, the one credited the most urgency: each scenario credits its busiest
    GPU its weight times ``(mean / peak) ** power``.

    ``power`` 2: the GPU whose reduction gains the most expected balancedness to first order
    (d(mean/peak)/d(peak) = -mean/peak**2; scaled by the mean, scenarios sharing one total per
    layer, that is (mean/peak)**2); 0: the busiest in the most scenario weight. One scenario: its
    busiest GPU (the lowest index among ties).
    """
    Z, nl, G = gpu_ZlG.shape
    peak_Zl = gpu_ZlG.max(axis=-1)
    ratio_Zl = np.where(peak_Zl > 0, mean_Zl / np.where(peak_Zl > 0, peak_Zl, 1.0), 0.0)
    urgency_lG = np.zeros((nl, G))
    np.add.at(
        urgency_lG,
        (np.broadcast_to(np.arange(nl), (Z, nl)), gpu_ZlG.argmax(axis=-1)),
        weights_Z[:, None] * ratio_Zl**power,
    )
    return np.asarray(urgency_lG.argmax(axis=1))


def lightest_partners(expected_lG: np.ndarray, hot_l: np.ndarray, count: int) -> np.ndarray:
    """int [l, B]: the ``count`` GPUs of least expected load other than the hot one (ties: the lower id)."""
    light_lG = np.array(expected_lG, dtype=np.float64)
    light_lG[np.arange(hot_l.size), hot_l] = np.inf
    return np.argsort(light_lG, axis=1, kind="stable")[:, :count]


@dataclass(frozen=True)
class SwapCandidates:
    """Every swap of a hot GPU's slot s with a partner GPU's slot q, per searched layer; a
    candidate's flat index is ``s * Q + q``."""

    hot_slots_lS: np.ndarray
    """int [l, S]: the hot GPU's slots."""
    partner_lQ: np.ndarray
    """int [l, Q]: the partner GPUs' slots, partner by partner."""
    gpu_lQ: np.ndarray
    """int [l, Q]: each partner slot's GPU."""
    a_ZlS: np.ndarray
    """float64 [Z, l, S]: the load each hot slot carries."""
    b_ZlQ: np.ndarray
    """float64 [Z, l, Q]: the load each partner slot carries."""
    expert_a_lS: np.ndarray
    """int [l, S]: the hot slots' experts."""
    expert_b_lQ: np.ndarray
    """int [l, Q]: the partner slots' experts."""

    @classmethod
    def of(
        cls,
        item_ZLP: np.ndarray,
        phy2log_LP: np.ndarray,
        layers: np.ndarray,
        hot_l: np.ndarray,
        partners_lB: np.ndarray,
        slots_per_gpu: int,
    ) -> SwapCandidates:
        """The candidates of ``layers`` (rows of ``item_ZLP`` [Z, L, P] and ``phy2log_LP`` [L, P])
        between each layer's hot GPU ``hot_l`` and its partners ``partners_lB``."""
        nl, S = layers.size, slots_per_gpu
        lay_l1 = layers[:, None]
        hot_slots_lS = hot_l[:, None] * S + np.arange(S)
        partner_lQ = (partners_lB[:, :, None] * S + np.arange(S)).reshape(nl, -1)
        return cls(
            hot_slots_lS=hot_slots_lS,
            partner_lQ=partner_lQ,
            gpu_lQ=np.repeat(partners_lB, S, axis=1),
            a_ZlS=item_ZLP[:, lay_l1, hot_slots_lS],
            b_ZlQ=item_ZLP[:, lay_l1, partner_lQ],
            expert_a_lS=phy2log_LP[lay_l1, hot_slots_lS],
            expert_b_lQ=phy2log_LP[lay_l1, partner_lQ],
        )

    @property
    def num_partner_slots(self) -> int:
        return self.partner_lQ.shape[1]

    def delta_ZlSQ(self) -> np.ndarray:
        """float64 [Z, l, S, Q]: what the hot GPU gains (and the partner's GPU loses) by each swap."""
        return self.b_ZlQ[:, :, None, :] - self.a_ZlS[..., None]

    def distinct_lSQ(self) -> np.ndarray:
        """bool [l, S, Q]: the two slots hold different experts (else the swap changes nothing)."""
        return self.expert_a_lS[:, :, None] != self.expert_b_lQ[:, None, :]

    def slots(self, best_l: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(hot slot, partner slot) [l] of each layer's candidate ``best_l`` (flat indices)."""
        rows, Q = np.arange(best_l.size), self.num_partner_slots
        return self.hot_slots_lS[rows, best_l // Q], self.partner_lQ[rows, best_l % Q]


def pair_peak(hot_x: np.ndarray, partner_x: np.ndarray, delta_x: np.ndarray) -> np.ndarray:
    """The higher of two GPUs' loads after a swap moves ``delta_x`` from the partner to the hot GPU."""
    return np.maximum(hot_x + delta_x, partner_x - delta_x)


def swap_slots(
    phy2log_P: np.ndarray, item_xP: np.ndarray, holds_BE: np.ndarray, a: int, b: int, part_a: int, part_b: int
) -> tuple[int, int]:
    """Slots ``a`` and ``b`` of one layer trade experts, loads (``item_xP`` [..., P]) and the
    replica counts of the parts they lie in (``holds_BE``: GPUs, nodes or domains), in place.

    Returns (the expert that was in a, the expert that was in b).
    """
    ea, eb = int(phy2log_P[a]), int(phy2log_P[b])
    phy2log_P[a], phy2log_P[b] = eb, ea
    item_xP[..., [a, b]] = item_xP[..., [b, a]]
    trade_counts(holds_BE, part_a, part_b, ea, eb)
    return ea, eb


def trade_counts(holds_BE: np.ndarray, part_a: int, part_b: int, ea: int, eb: int) -> None:
    """Expert ``ea`` moves from part ``part_a`` to ``part_b`` and ``eb`` back, in the counts ``holds_BE``."""
    holds_BE[part_a, ea] -= 1
    holds_BE[part_a, eb] += 1
    holds_BE[part_b, eb] -= 1
    holds_BE[part_b, ea] += 1
