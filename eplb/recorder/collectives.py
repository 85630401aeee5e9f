"""The recorder's collectives over its process groups: the prefill flag, window sums, dump facts.

Shape legend: F steps (the passes kept).

Each is a no-op (returns its input) outside torch.distributed or in a group of one rank, so a
single-process recorder never imports or waits on anything distributed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def rank_and_world(group: Any) -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def reduce_pass_facts(
    prefill_F: np.ndarray, tokens_F: np.ndarray, group: Any, device: torch.device
) -> tuple[np.ndarray, np.ndarray]:
    """Over the ranks (collective): prefill if on any rank, tokens summed; int64 [F] each."""
    import torch.distributed as dist

    facts = torch.from_numpy(np.stack([prefill_F, tokens_F], axis=1)).to(device)
    prefill = facts[:, 0].clone()
    dist.all_reduce(prefill, op=dist.ReduceOp.MAX, group=group)
    tokens = facts[:, 1].clone()
    dist.all_reduce(tokens, op=dist.ReduceOp.SUM, group=group)
    return prefill.cpu().numpy(), tokens.cpu().numpy()


def dist_active(group: Any) -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1)


def all_reduce_sum(t: torch.Tensor, group: Any) -> torch.Tensor:
    if not dist_active(group):
        return t
    import torch.distributed as dist

    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t


def any_rank(flag: bool, group: Any, device: torch.device) -> bool:
    """Whether ``flag`` is set on some rank of ``group`` (every rank must call this)."""
    if not dist_active(group):
        return flag
    import torch.distributed as dist

    backend = dist.get_backend(group)
    flag_device = device if backend == "nccl" else torch.device("cpu")
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=flag_device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


__all__ = ["all_reduce_sum", "any_rank", "dist_active", "rank_and_world", "reduce_pass_facts"]
