"""``--ep-dispatch-algorithm auto``: each pass runs ``lp`` or ``static``, whichever the model says is faster.

Shape legend: L layers, E logical experts, P physical slots, G GPUs, n passes (a grid of pass
sizes).

``lp`` balances a pass's tokens better than the static maps, but its kernels cost 20-40 µs per
layer where static's cost 1.5-4 (eplb.policy.cost_model.DISPATCH_KERNEL_TABLES). Balance pays only
where the busiest GPU is bound by its tokens (large prefill passes); a decode pass is bound by the
weights its active experts read, so there ``lp`` only adds its kernels. Per placement this module
models both modes on a grid of pass sizes, from values every rank holds (the placement, and the
recorded passes its rebalance planned from, summed over the ranks; without them, the placement's
replica counts stand for the load): each layer's balancedness under static's shares and under the
``lp`` rule (eplb.remap.lp_rule) on the window's largest passes, and for a pass of ``N`` global
tokens, ``N * top_k`` routed copies, each layer's time under the cost model (``a + max(b * active,
c * tokens)``): the busiest GPU's tokens the mean over that balancedness, its active experts
expected from the window's popularity (static: only the replicas its maps reach; ``lp``: every
replica of a loaded expert). ``lp`` runs where the sum over layers of that gain exceeds the sum of what its
kernels cost beyond static's at the rank's tokens (``N / G``) for the pass's phase. A pass then
looks its size up on the grid (the largest grid size at most its own), so every rank, given the
pass's global token count and phase, picks the same mode without a collective or a clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from eplb.placement.balance import balancedness
from eplb.placement.model import Placement
from eplb.placement.share import ShareModel, gpu_share_LEG, lp_gpu_load
from eplb.policy.cost_model import CostModel, DispatchKernelCost

if TYPE_CHECKING:
    from eplb.remap.lp_rule import LpTables

GRID_TOKENS = 2.0 ** np.arange(0.0, 22.25, 0.25)
"""Global tokens per pass the choice is modeled at: 1 to 4Mi, four points per doubling."""
SAMPLE_PASSES = 16
"""The window's largest passes whose balance under each mode the choice is modeled on."""


@dataclass(frozen=True)
class AutoDispatch:
    """Per pass size and phase, whether ``lp`` runs (else static), for one placement."""

    tokens_n: np.ndarray
    """float64 [n]: the grid of global tokens per pass (ascending)."""
    gain_us_n: np.ndarray
    """float64 [n]: modeled MoE µs per pass that ``lp`` saves over static (all layers)."""
    extra_us_decode_n: np.ndarray
    """float64 [n]: µs per pass its kernels cost beyond static's in a decode pass (all layers)."""
    extra_us_prefill_n: np.ndarray
    """float64 [n]: the same in a prefill pass."""

    @classmethod
    def of(
        cls,
        placement: Placement,
        window_WLE: np.ndarray | None,
        *,
        top_k: int,
        cost: CostModel,
        kernels: DispatchKernelCost,
    ) -> AutoDispatch:
        """The choice on ``placement`` for passes like those of ``window_WLE`` (the recorded passes
        [W, L, E] it was planned from; None or empty: the replica counts), ``top_k`` experts per
        token, priced by ``cost`` and ``kernels``."""
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        L, E, G = placement.num_layers, placement.num_logical, placement.num_gpus
        if window_WLE is None or not len(window_WLE):
            sample_WLE = placement.logcnt_LE[None].astype(np.float64)
        else:
            if window_WLE.shape[1:] != (L, E):
                raise ValueError(f"window shape {window_WLE.shape} != [W, {L}, {E}] of the placement")
            sample_WLE = largest_passes(window_WLE).astype(np.float64)
        static_b_L, lp_b_L = _balancedness_L(placement, sample_WLE)
        load_LE = sample_WLE.sum(axis=0)
        total_L1 = load_LE.sum(axis=1, keepdims=True)
        # A layer without load: every expert alike.
        popularity_LE = np.where(total_L1 > 0, load_LE / np.maximum(total_L1, 1e-300), 1.0 / E)
        tokens_n = GRID_TOKENS
        routed_n = tokens_n * top_k
        # Probability that an expert receives at least one of the pass's copies (independent draws).
        loaded_LnE = -np.expm1(-popularity_LE[:, None, :] * routed_n[None, :, None])
        static_share_LP = ShareModel("static", placement.num_nodes).placement_share_LP(placement)
        static_receives_LEG = gpu_share_LEG(placement, (static_share_LP > 0).astype(np.float64))
        static_active_Ln = np.matmul(loaded_LnE, static_receives_LEG).max(axis=-1)
        lp_active_Ln = np.matmul(loaded_LnE, gpu_share_LEG(placement, np.ones(static_share_LP.shape))).max(
            axis=-1
        )
        mean_Ln = np.broadcast_to(routed_n / G, (L, tokens_n.size))
        static_us_Ln = cost.layer_times_us(
            (mean_Ln / static_b_L[:, None])[..., None], static_active_Ln[..., None]
        )
        lp_us_Ln = cost.layer_times_us((mean_Ln / lp_b_L[:, None])[..., None], lp_active_Ln[..., None])
        gain_n = (static_us_Ln - lp_us_Ln).sum(axis=0)
        rank_tokens_n = tokens_n / G
        extra = {
            phase: L * (kernels.layer_us("lp", rank_tokens_n, np.full(tokens_n.shape, phase))
                        - kernels.layer_us("static", rank_tokens_n, np.full(tokens_n.shape, phase)))
            for phase in (False, True)
        }  # fmt: skip
        return cls(tokens_n, gain_n, extra[False], extra[True])

    def lp_n(self, tokens_n: np.ndarray, prefill_n: np.ndarray) -> np.ndarray:
        """bool [n]: whether each pass of ``tokens_n`` global tokens (and phase) runs ``lp``."""
        at_n = np.clip(np.searchsorted(self.tokens_n, np.asarray(tokens_n), side="right") - 1, 0, None)
        extra_n = np.where(
            np.asarray(prefill_n, dtype=bool), self.extra_us_prefill_n[at_n], self.extra_us_decode_n[at_n]
        )
        return self.gain_us_n[at_n] > extra_n

    def mode(self, tokens: int, prefill: bool) -> str:
        """``lp`` or ``static`` for one pass of ``tokens`` global tokens."""
        return "lp" if bool(self.lp_n(np.array([tokens]), np.array([prefill]))[0]) else "static"


def largest_passes(window_WLE: np.ndarray) -> np.ndarray:
    """The ``SAMPLE_PASSES`` passes of ``window_WLE`` with the most routed tokens, in window order:
    where the choice matters, and whose balance is least noisy."""
    routed_W = window_WLE.sum(axis=(1, 2), dtype=np.float64)
    keep = np.sort(np.argsort(-routed_W, kind="stable")[:SAMPLE_PASSES])
    return window_WLE[keep]


def _balancedness_L(placement: Placement, sample_WLE: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 [L] each: mean over the sampled passes of each layer's balancedness (mean / max GPU
    tokens) under static's shares and under the ``lp`` rule (1 where a layer has no load)."""
    static_share_LEG = ShareModel("static", placement.num_nodes).gpu_share_LEG(placement)
    load_LWE = sample_WLE.transpose(1, 0, 2)
    static_LWG = np.matmul(load_LWE, static_share_LEG)
    lp_LWG = lp_gpu_load(load_LWE, _lp_tables(placement)).astype(np.float64)
    return _layer_balancedness(static_LWG), _layer_balancedness(lp_LWG)


def _layer_balancedness(tokens_LWG: np.ndarray) -> np.ndarray:
    return np.maximum(balancedness(tokens_LWG).mean(axis=1), 1e-6)


def _lp_tables(placement: Placement) -> LpTables:
    """The ``lp`` rule's tables (imported here: eplb.remap's package loads torch)."""
    from eplb.remap.lp_rule import lp_tables

    return lp_tables(placement)
