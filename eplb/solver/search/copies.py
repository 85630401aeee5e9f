"""Expert copies across GPUs: what each GPU holds, and what a copy arriving there costs.

Shape legend: L layers, E logical experts, P physical slots, G GPUs, N nodes.

One ledger for every search: a copy is a (GPU, expert) pair held after the plan that was not held
before it (a replica moved within its GPU costs nothing); a copy to a node that held no replica
of the expert may count ``cross_node_weight`` instead of one.
"""

from __future__ import annotations

import numpy as np

from eplb.placement.model import Placement


def holds_per_gpu(phy2log_LP: np.ndarray, num_gpus: int, num_logical: int) -> np.ndarray:
    """int64 [L, G, E]: number of replicas of each expert on each GPU."""
    L, P = phy2log_LP.shape
    gpu_P = np.arange(P) // (P // num_gpus)
    flat = (np.arange(L)[:, None] * num_gpus + gpu_P[None, :]) * num_logical + phy2log_LP
    return np.bincount(flat.ravel(), minlength=L * num_gpus * num_logical).reshape(L, num_gpus, num_logical)


def arrivals_L(holds_LGE: np.ndarray, origin_LGE: np.ndarray) -> np.ndarray:
    """int64 [L]: expert copies across GPUs from ``origin`` (bool [L, G, E]) to ``holds`` (counts
    [L, G, E]): the (GPU, expert) pairs held now that were not held there before."""
    return np.asarray(((holds_LGE > 0) & ~origin_LGE).sum(axis=(1, 2)))


def arrival_costs(current: Placement, cross_node_weight: float) -> tuple[np.ndarray, np.ndarray]:
    """float64 [L, G, E] twice: (weighted, plain) cost of expert e arriving at GPU g from ``current``."""
    held_LGE = current.gpu_has_expert()
    L, G, E = held_LGE.shape
    plain_LGE = (~held_LGE).astype(np.float64)
    if cross_node_weight == 1.0:
        return plain_LGE, plain_LGE
    node_held_LNE = np.asarray(held_LGE.reshape(L, current.num_nodes, G // current.num_nodes, E).any(axis=2))
    node_of_gpu = np.arange(G) // current.gpus_per_node
    weighted_LGE = plain_LGE * np.where(node_held_LNE[:, node_of_gpu, :], 1.0, cross_node_weight)
    return weighted_LGE, plain_LGE
