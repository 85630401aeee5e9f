"""How each dispatch mode spreads a logical expert's tokens over its replicas, in simulation.

Shape legend: F steps, L layers, E logical experts, P physical slots, R max replicas, G GPUs, S
slots per GPU.

Each mode's share model (eplb.placement.share) gives the matrices:

- dynamic: each expert's tokens split evenly over its replicas (a uniform pick per token).
- weighted: the solver's per-replica weights [L, E, R]; an even split when it gave none.
- static: tokens originate evenly from all ranks and each rank sends an expert's tokens to the
  one replica its static map picks (eplb.placement.dispatch_map), so a replica's share is the fraction of
  ranks mapped to it (eplb.placement.share.static_weights).
- fake: uniformly random routing over all slots, independent of the trace (SGLang's benchmark
  mode); see :func:`fake_gpu_load`.
- lp: each batch's tokens of a replicated expert water-filled over its GPUs (eplb.simulate.dispatch_lp).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eplb.config import DISPATCH_ALGORITHMS
from eplb.placement.balance import balancedness
from eplb.placement.model import Placement
from eplb.placement.share import ShareModel, gpu_share_LEG
from eplb.simulate.dispatch_lp import lp_matrices_parts, take_gpus


@dataclass(frozen=True)
class DispatchMatrices:
    """Per-layer matrices that turn logical load into GPU load: ``load_FE @ share_EG``."""

    share_LEG: np.ndarray
    """float32 [L, E, G]: fraction of an expert's tokens each GPU receives."""
    replicas_LEG: np.ndarray
    """float32 [L, E, G]: replicas of an expert on a GPU that receive tokens (active experts when loaded)."""

    def take_gpus(self, keep_G: np.ndarray) -> DispatchMatrices:
        """These matrices over the GPUs ``keep_G`` (a bool mask or indices over G): the same
        routing, the other GPUs' columns dropped (a lost rank under a placement not replanned)."""
        return DispatchMatrices(take_gpus(self.share_LEG, keep_G), self.replicas_LEG[:, :, keep_G])

    def summed_balancedness(self, load_LE: np.ndarray) -> float:
        """Model balancedness (mean over layers) of a summed logical load [L, E] under these matrices
        (float32, as the simulator's per-step scores; eplb.placement.model_balancedness is the float64
        figure of an even or weighted split)."""
        gpu_LG = np.matmul(load_LE[:, None, :].astype(np.float32), self.share_LEG)[:, 0]
        return float(balancedness(gpu_LG).mean())


def dispatch_matrices(
    placement: Placement, mode: str, weights_LER: np.ndarray | None = None
) -> DispatchMatrices:
    """The share and active-replica matrices of ``placement`` under a dispatch ``mode`` (its share
    model, eplb.placement.share; ``weights_LER`` are read where the mode reads weights)."""
    if mode not in DISPATCH_ALGORITHMS:  # the simulator models the modes offered as flags
        raise ValueError(f"unknown dispatch mode {mode!r}; choose from {DISPATCH_ALGORITHMS}")
    model = ShareModel(mode, placement.num_nodes)
    if model.per_batch:
        return DispatchMatrices(*lp_matrices_parts(placement))
    share_LP = model.placement_share_LP(placement, weights_LER if model.weighted else None)
    share_LEG = gpu_share_LEG(placement, share_LP)
    # A replica that gets no share (static maps may skip one) never becomes an active expert.
    receives_LP = share_LP > 0
    L, E, G = share_LEG.shape
    replicas_LEG = np.zeros((L, E, G), dtype=np.float32)
    layer_LP = np.broadcast_to(np.arange(L)[:, None], receives_LP.shape)
    gpu_LP = np.broadcast_to(placement.gpu_of_slot()[None, :], receives_LP.shape)
    np.add.at(replicas_LEG, (layer_LP, placement.phy2log_LP, gpu_LP), receives_LP)
    return DispatchMatrices(share_LEG.astype(np.float32), replicas_LEG)


def fake_gpu_load(
    routed_FL: np.ndarray, num_gpus: int, slots_per_gpu: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Fake dispatch: (tokens float32 [F, L, G], expected active slots float32 [F, L, G]).

    Every routed token lands on a uniformly random slot, so GPU counts are one multinomial draw
    per step and layer; a GPU's active slots are the expected number of distinct slots hit.
    """
    F, L = routed_FL.shape
    pvals = np.full(num_gpus, 1.0 / num_gpus)
    tokens_FLG = rng.multinomial(routed_FL.reshape(-1).astype(np.int64), pvals).reshape(F, L, num_gpus)
    active_FLG = slots_per_gpu * (1.0 - (1.0 - 1.0 / slots_per_gpu) ** tokens_FLG)
    return tokens_FLG.astype(np.float32), active_FLG.astype(np.float32)
