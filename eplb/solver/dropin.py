"""A drop-in for DeepSeek's ``rebalance_experts`` entry point, returning int32 tensors.

Shape legend: L layers, E logical experts, P physical slots (``num_replicas``), R max replicas.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from eplb.solver.policies.deepseek import DeepSeekPolicy, log2phy_from_rank
from eplb.solver.policies.protocol import load_policy
from eplb.solver.solve import solve
from eplb.solver.types import SolveOptions, Topology, as_load_array, check_shapes

if TYPE_CHECKING:
    import torch


def rebalance_experts(
    weight: Any,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    options: SolveOptions | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek's signature and output layout, this project's solver behind it.

    Args:
        weight: [L, E] load per logical expert (torch or numpy; [W, L, E] windows are accepted too).
        num_replicas: P physical slots, divisible by ``num_gpus``.
        num_groups: expert groups (hierarchical packing); num_nodes: nodes; num_gpus: GPUs.
        options: solver options; ``options.algorithm`` picks the algorithm (default auto).
            ``deepseek`` reproduces DeepSeek's own choice: hierarchical when ``num_groups`` is
            divisible by ``num_nodes`` (and divides E), global otherwise.

    Returns:
        int32 CPU tensors ``phy2log [L, P]``, ``log2phy [L, E, R]`` (R = the largest replica count,
        padded with -1) and ``logcnt [L, E]``.
    """
    import torch

    options = options or SolveOptions()
    topology = Topology(
        num_gpus=num_gpus, num_nodes=num_nodes, num_physical=num_replicas, num_groups=num_groups
    )
    load_WLE = as_load_array(weight)
    _, _, E = load_WLE.shape
    check_shapes(load_WLE.shape[1], E, topology, None)
    algorithm = options.algorithm
    if algorithm == "deepseek" and topology.hierarchical_ok(E):
        algorithm = "deepseek_hierarchical"
    policy = load_policy(algorithm)
    if isinstance(policy, DeepSeekPolicy):
        # DeepSeek plans on the plain sum and orders each expert's replicas by replica rank.
        phy2log, rank = policy.place_with_rank(load_WLE.sum(axis=0), topology)
        logcnt = np.stack([np.bincount(row, minlength=E) for row in phy2log]).astype(np.int32)
        log2phy = log2phy_from_rank(phy2log, rank, E, int(logcnt.max()))
        phy2log32 = phy2log.astype(np.int32)
    else:
        # Only the placement is returned: no held-out plan to score it.
        plan = solve(load_WLE, topology, None, replace(options, holdout_passes=0))
        pl = plan.placement
        logcnt = pl.logcnt_LE
        log2phy = np.ascontiguousarray(pl.log2phy_LER[:, :, : int(logcnt.max())])
        phy2log32 = pl.phy2log_LP
    return (
        torch.from_numpy(np.ascontiguousarray(phy2log32, dtype=np.int32)),
        torch.from_numpy(np.ascontiguousarray(log2phy, dtype=np.int32)),
        torch.from_numpy(np.ascontiguousarray(logcnt, dtype=np.int32)),
    )
