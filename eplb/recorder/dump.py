"""Recorder dumps: this project's safe format and SGLang's layouts.

Shape legend: F passes kept, L layers, E logical experts, P physical slots, G GPUs, N tokens, K top-k.

- ``fmt="eplb"`` (stat, per_pass): an :class:`eplb.traces.Trace` of expert counts [F, L, E],
  oldest pass first, written by ``Trace.save`` (safetensors, or npz by suffix).
  per_token: an npz with ``topk_ids`` int32 [N, L, K] and ``forward_pass_id`` int64 [N].
- ``fmt="sglang"``: stat -> ``torch.save({"rank", "logical_count": int32 [F, L, E],
  "average_utilization_rate_over_window"})``; per_pass -> ``{"records": [{"forward_pass_id",
  "rank", "global_physical_count" [L, P], "logical_count" [L, E]}], "last_physical_to_logical_map"}``.
  Plain tensors, ints and floats only, so ``torch.load(weights_only=True)`` and
  ``eplb.traces.load_trace`` read them.

With ``reduce`` under torch.distributed, counts (and token numbers) are summed over the ranks
with ``all_reduce`` (every rank must call), a pass counts as prefill if it was on any rank, and
rank 0 writes the file (other ranks return None). per_token dumps are per rank: with several
ranks, the rank is added to the file name.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from eplb.placement.balance import balancedness
from eplb.traces import Trace

if TYPE_CHECKING:
    from eplb.recorder.recorder import ExpertDistributionRecorder

PER_TOKEN_FORMAT = "eplb-per-token"
INT32_MAX = np.iinfo(np.int32).max


def dump_recorder(rec: ExpertDistributionRecorder, path: Path, *, fmt: str, reduce: bool) -> Path | None:
    if fmt not in ("eplb", "sglang"):
        raise ValueError(f"unknown dump format {fmt!r}; choose 'eplb' or 'sglang'")
    rank, world = _rank_and_world(rec.group)
    if rec.config.mode == "per_token":
        if fmt != "eplb":
            raise ValueError("per_token recordings dump only in the eplb format (npz)")
        return _dump_per_token(rec, path if world == 1 else path.with_suffix(f".rank{rank}.npz"))
    reduce = reduce and world > 1
    infos, phys_FLP = rec.window_passes(reduce=reduce)
    versions = [info.map_version for info in infos]
    logical_FLE = rec.to_logical(phys_FLP, versions)
    prefill_F = np.array([info.had_prefill for info in infos], dtype=np.int64)
    tokens_F = np.array([info.num_tokens for info in infos], dtype=np.int64)
    if reduce:
        import torch.distributed as dist

        facts = torch.from_numpy(np.stack([prefill_F, tokens_F], axis=1)).to(rec.device)
        prefill = facts[:, 0].clone()
        dist.all_reduce(prefill, op=dist.ReduceOp.MAX, group=rec.group)
        tokens = facts[:, 1].clone()
        dist.all_reduce(tokens, op=dist.ReduceOp.SUM, group=rec.group)
        prefill_F, tokens_F = prefill.cpu().numpy(), tokens.cpu().numpy()
        if rank != 0:
            return None
    if logical_FLE.size and logical_FLE.max() > INT32_MAX:
        raise OverflowError("a pass's summed expert count exceeds int32; dump fewer ranks at once")
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "eplb":
        meta = {
            "source": "eplb-recorder",
            "mode": rec.config.mode,
            "ranks_summed": world if reduce else 1,
            "rank": rank,
            "forward_pass_ids": [info.pass_id for info in infos],
            "prefill_only": rec.config.prefill_only,
            "top_k": rec.config.top_k,
        }
        trace = Trace(logical_FLE.astype(np.int32), prefill_F.astype(bool), tokens_F.astype(np.int64), meta)
        return trace.save(path)
    if rec.config.mode == "stat":
        obj: dict[str, object] = {
            "rank": rank,
            "logical_count": torch.from_numpy(logical_FLE.astype(np.int32)),
            "average_utilization_rate_over_window": utilization_rate(
                phys_FLP.sum(axis=0), rec.placement.num_gpus
            ),
        }
    else:
        records = [
            {
                "forward_pass_id": info.pass_id,
                "rank": rank,
                "global_physical_count": torch.from_numpy(phys_FLP[f].astype(np.int32)),
                "logical_count": torch.from_numpy(logical_FLE[f].astype(np.int32)),
            }
            for f, info in enumerate(infos)
        ]
        obj = {
            "records": records,
            "last_physical_to_logical_map": torch.from_numpy(rec.placement.phy2log_LP.copy()),
        }
    torch.save(obj, str(path))
    return path


def utilization_rate(phys_LP: np.ndarray, num_gpus: int) -> float:
    """Mean over layers of GPU balancedness (mean/max GPU load) for slot counts [L, P]."""
    L, P = phys_LP.shape
    gpu_load_LG = phys_LP.reshape(L, num_gpus, P // num_gpus).sum(axis=2)
    return float(balancedness(gpu_load_LG).mean()) if L else 1.0


def _dump_per_token(rec: ExpertDistributionRecorder, path: Path) -> Path:
    ids_NLK, pass_N, dropped = rec.recorded_tokens()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        np.savez_compressed(
            f,
            format=np.array(PER_TOKEN_FORMAT),
            version=np.array("1"),
            topk_ids=ids_NLK,
            forward_pass_id=pass_N,
            dropped_tokens=np.array(dropped, dtype=np.int64),
        )
    return path


def _rank_and_world(group: Any) -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1
