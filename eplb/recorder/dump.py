"""Recorder dump files: this project's safe format and SGLang's layouts, written from plain arrays.

Shape legend: F steps (the passes kept), L layers, E logical experts, P physical slots, G GPUs, T
tokens, K top-k.

Dumps let a recording be replayed offline (``eplb simulate``, SGLang's own tooling), so both
formats hold plain tensors and numbers only. What to write, and whether it is summed over ranks,
is the recorder's call (``ExpertDistributionRecorder.dump``); this module only lays it out on disk.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eplb.fileio import atomic_path
from eplb.placement.balance import balancedness
from eplb.traces import Trace

DUMP_FORMATS = ("eplb", "sglang")
PER_TOKEN_FORMAT = "eplb-per-token"
INT32_MAX = np.iinfo(np.int32).max


@dataclass(frozen=True, kw_only=True)
class WindowDump:
    """A recorded window (stat or per_pass mode), as one rank writes it."""

    mode: str
    """stat | per_pass: which SGLang layout ``fmt="sglang"`` writes."""
    pass_ids: list[int]
    """[F] counted-pass index of each kept pass, oldest first."""
    phys_FLP: np.ndarray
    """int64 [F, L, P]: slot counts per pass."""
    logical_FLE: np.ndarray
    """int64 [F, L, E]: the same counts per expert (each pass through its own placement)."""
    prefill_F: np.ndarray
    """int64 [F]: 1 where the pass carried prefill (on some rank, when summed)."""
    tokens_F: np.ndarray
    """int64 [F]: tokens processed in the pass (over the ranks, when summed)."""
    phy2log_LP: np.ndarray
    """The live placement's slot -> expert map (SGLang's ``last_physical_to_logical_map``)."""
    num_gpus: int
    """G, for the utilisation rate of the stat layout."""
    rank: int
    """The writing rank."""
    ranks_summed: int
    """How many ranks' counts the arrays hold (1: this rank's own)."""
    prefill_only: bool
    """The recorder's ``prefill_only`` setting (kept in the trace's metadata)."""
    top_k: int
    """The recorder's ``top_k`` setting (kept in the trace's metadata)."""


def check_dump_format(fmt: str, mode: str) -> None:
    """Raise ``ValueError`` unless a recorder in ``mode`` can dump in ``fmt``."""
    if fmt not in DUMP_FORMATS:
        raise ValueError(f"unknown dump format {fmt!r}; choose 'eplb' or 'sglang'")
    if mode == "per_token" and fmt != "eplb":
        raise ValueError("per_token recordings dump only in the eplb format (npz)")


def save_window(window: WindowDump, path: Path, *, fmt: str) -> Path:
    """Write a stat or per_pass window to ``path`` in ``fmt``.

    - ``fmt="eplb"``: an :class:`eplb.traces.Trace` of expert counts [F, L, E], oldest pass first,
      written by ``Trace.save`` (safetensors, or npz by suffix).
    - ``fmt="sglang"``: stat -> ``torch.save({"rank", "logical_count": int32 [F, L, E],
      "average_utilization_rate_over_window"})``; per_pass -> ``{"records": [{"forward_pass_id",
      "rank", "global_physical_count" [L, P], "logical_count" [L, E]}],
      "last_physical_to_logical_map"}``. Plain tensors, ints and floats only, so
      ``torch.load(weights_only=True)`` and ``eplb.traces.load_trace`` read them.
    """
    check_dump_format(fmt, window.mode)
    logical_FLE, phys_FLP = window.logical_FLE, window.phys_FLP
    if logical_FLE.size and logical_FLE.max() > INT32_MAX:
        raise OverflowError("a pass's summed expert count exceeds int32; dump fewer ranks at once")
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "eplb":
        meta = {
            "source": "eplb-recorder",
            "mode": window.mode,
            "ranks_summed": window.ranks_summed,
            "rank": window.rank,
            "forward_pass_ids": list(window.pass_ids),
            "prefill_only": window.prefill_only,
            "top_k": window.top_k,
        }
        trace = Trace(
            logical_FLE.astype(np.int32),
            window.prefill_F.astype(bool),
            window.tokens_F.astype(np.int64),
            meta,
        )
        return trace.save(path)
    if window.mode == "stat":
        obj: dict[str, object] = {
            "rank": window.rank,
            "logical_count": torch.from_numpy(logical_FLE.astype(np.int32)),
            "average_utilization_rate_over_window": utilization_rate(phys_FLP.sum(axis=0), window.num_gpus),
        }
    else:
        records = [
            {
                "forward_pass_id": pass_id,
                "rank": window.rank,
                "global_physical_count": torch.from_numpy(phys_FLP[f].astype(np.int32)),
                "logical_count": torch.from_numpy(logical_FLE[f].astype(np.int32)),
            }
            for f, pass_id in enumerate(window.pass_ids)
        ]
        obj = {
            "records": records,
            "last_physical_to_logical_map": torch.from_numpy(window.phy2log_LP.copy()),
        }
    with atomic_path(path, parents=True) as tmp:
        torch.save(obj, str(tmp))
    return path


def save_per_token(path: Path, ids_TLK: np.ndarray, pass_T: np.ndarray, dropped: int) -> Path:
    """Write per_token ids: an npz with ``topk_ids`` int32 [T, L, K], ``forward_pass_id`` int64 [T]
    and ``dropped_tokens`` (tokens past the budget)."""
    with atomic_path(path, parents=True) as tmp, tmp.open("wb") as f:
        np.savez_compressed(
            f,
            format=np.array(PER_TOKEN_FORMAT),
            version=np.array("1"),
            topk_ids=ids_TLK,
            forward_pass_id=pass_T,
            dropped_tokens=np.array(dropped, dtype=np.int64),
        )
    return path


def utilization_rate(phys_LP: np.ndarray, num_gpus: int) -> float:
    """Mean over layers of GPU balancedness (mean/max GPU load) for slot counts [L, P]."""
    L, P = phys_LP.shape
    gpu_load_LG = phys_LP.reshape(L, num_gpus, P // num_gpus).sum(axis=2)
    return float(balancedness(gpu_load_LG).mean()) if L else 1.0
