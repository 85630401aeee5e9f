"""Save and load a placement (and optional dispatch weights) in this project's format.

Shape legend: L layers, E logical experts, P physical slots, R max replicas.

A safetensors file with ``phy2log`` int32 [L, P], ``log2phy`` int32 [L, E, R], ``logcnt`` int32
[L, E] and, for weighted dispatch, ``dispatch_weights`` float32 [L, E, R]; the metadata carries
the format tag and the topology (GPUs, nodes). Loading validates the placement, so a corrupt or
inconsistent file is a ValueError, never a half-read placement. Saving is atomic (eplb.fileio).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from eplb.fileio import OutputSet, atomic_path, read_input, safetensors_header
from eplb.placement.model import MAX_PLACEMENT_FILE_BYTES, Placement

FORMAT_NAME = "eplb-placement"
FORMAT_VERSION = "1"


def save_placement(
    path: str | Path,
    placement: Placement,
    weights_LER: np.ndarray | None = None,
    meta: dict[str, Any] | None = None,
    *,
    outputs: OutputSet | None = None,
) -> Path:
    """Write ``placement`` (and per-replica weights, if any) as safetensors; returns the path.

    The file is atomic; with ``outputs`` it is staged there and appears when that set commits.
    """
    from safetensors.numpy import save_file

    path = Path(path)
    tensors = {
        "phy2log": np.ascontiguousarray(placement.phy2log_LP, dtype=np.int32),
        "log2phy": np.ascontiguousarray(placement.log2phy_LER, dtype=np.int32),
        "logcnt": np.ascontiguousarray(placement.logcnt_LE, dtype=np.int32),
    }
    if weights_LER is not None:
        if weights_LER.shape != placement.log2phy_LER.shape:
            raise ValueError(
                f"weights shape {weights_LER.shape} != log2phy shape {placement.log2phy_LER.shape}"
            )
        tensors["dispatch_weights"] = np.ascontiguousarray(weights_LER, dtype=np.float32)
    header = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "num_gpus": str(placement.num_gpus),
        "num_nodes": str(placement.num_nodes),
        "meta": json.dumps(meta or {}, sort_keys=True),
    }
    with atomic_path(path, outputs=outputs) as tmp:
        save_file(tensors, str(tmp), metadata=header)
    return path


def load_placement(path: str | Path) -> tuple[Placement, np.ndarray | None]:
    """Read a file written by :func:`save_placement`: (validated placement, weights or None).

    The file is read through eplb.fileio.read_input (a regular file of at most
    ``MAX_PLACEMENT_FILE_BYTES``)."""
    from safetensors.numpy import load

    path = Path(path)
    data = read_input(path, limit=MAX_PLACEMENT_FILE_BYTES, what="placement file")
    try:
        header, _ = safetensors_header(data)
        tensors = load(data)
    except Exception as exc:  # safetensors raises its own error type for corrupt headers
        raise ValueError(f"{path}: not a readable placement file ({type(exc).__name__}: {exc})") from None
    if header.get("format") != FORMAT_NAME or header.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path}: not an eplb placement file (format {header.get('format')!r})")
    missing = {"phy2log", "log2phy", "logcnt"} - tensors.keys()
    if missing:
        raise ValueError(f"{path}: placement file lacks {sorted(missing)}")
    try:
        placement = Placement.from_deepseek(
            tensors["phy2log"],
            tensors["log2phy"],
            tensors["logcnt"],
            num_gpus=int(header["num_gpus"]),
            num_nodes=int(header["num_nodes"]),
        )
    except (KeyError, ValueError) as exc:
        raise ValueError(f"{path}: inconsistent placement ({exc})") from None
    weights = tensors.get("dispatch_weights")
    if weights is not None and weights.shape != placement.log2phy_LER.shape:
        raise ValueError(
            f"{path}: dispatch_weights shape {weights.shape} != log2phy {placement.log2phy_LER.shape}"
        )
    return placement, weights
