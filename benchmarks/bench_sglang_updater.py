"""SGLang's expert weight updater, its same-GPU copy path beside eplb's replacement's local part.

Shape legend: L layers, P physical slots, S slots per GPU, H hidden size, I intermediate size.

One GPU (or the CPU, ``--smoke``), one rank's slots (S = 9: DeepSeek-V3's 288 slots over 32 GPUs),
DeepSeek-V3's expert tensors (fp8 ``w13 [S, 2I, H]``, ``w2 [S, H, I]`` and their fp32 128 x 128
``scale_inv`` blocks), every slot of each layer of a chunk given another of the rank's experts
(moves that stay on the GPU). Timed in the same run, per chunk of ``--layers`` layers:

- ``sglang``: SGLang 0.5.23's ``update_expert_weights_single_layer`` for each layer of the chunk
  (its ``_update_expert_weights_raw`` loop): each expert copied into a temporary buffer, then back.
- ``eplb``: ``PreparedSwap.execute()`` of the replacement (eplb.integrations.sglang_updater) on the
  same tensors: local copies into staging, checksums of both sides, the commit's copy into the
  slots (``prepare_swap``, host work an engine does ahead, is timed apart as ``prepare``).

Both must leave the same bytes, and the bytes the new placement says (checked once per setting).
The slots start as the old placement says: replicas of an expert hold the same bytes, since the two
updaters may copy an expert from different replicas (eplb prefers one that stays, SGLang the first
slot); random bytes per slot made them disagree whenever a replica stayed. SGLang's file is loaded from the wheel
``python -m benchmarks.peers`` fetched, its imports stubbed (none is used on this path); on the
device machine carry ``.peers``.

    python -m benchmarks.bench_sglang_updater --json out/bench_sglang_updater.json   # CUDA
    python -m benchmarks.bench_sglang_updater --smoke                                # CPU
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import types
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.harness import wall_times, write_result
from benchmarks.peers import PEERS_DIR, fetch_sglang, sglang_dir
from eplb.hotswap.swap import PreparedSwap, prepare_swap
from eplb.integrations.sglang_updater import UpdaterConfig, slot_buffers
from eplb.placement.model import Placement

UPDATER_FILE = "sglang/srt/eplb/expert_location_updater.py"


def load_sglang_updater() -> types.ModuleType:
    """SGLang's ``expert_location_updater`` by file path, its SGLang (and einops) imports stubbed."""
    base = sglang_dir()
    path = base / UPDATER_FILE
    if not path.is_file():
        fetch_sglang()
        with zipfile.ZipFile(sorted((PEERS_DIR / "wheels").glob("sglang-*.whl"))[0]) as zf:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(zf.read(UPDATER_FILE))
    stubs: dict[str, dict[str, Any]] = {
        "einops": {},
        "sglang.srt.elastic_ep.elastic_ep": {
            "ElasticEPStateManager": type(
                "ElasticEPStateManager", (), {"instance": staticmethod(lambda: None)}
            )
        },
        "sglang.srt.environ": {
            "envs": types.SimpleNamespace(
                SGLANG_EPLB_P2P_BATCH_CHUNK_SIZE=types.SimpleNamespace(get=lambda: 1 << 30)
            )
        },
        "sglang.srt.eplb.expert_location": {
            "ExpertLocationMetadata": object,
            "get_global_expert_location_metadata": lambda: None,
        },
        "sglang.srt.runtime_context": {"get_device": lambda: None},
        "sglang.srt.utils": {"get_bool_env_var": lambda name, default="false": False},
    }
    for name, attrs in stubs.items():
        parts = name.split(".")
        for i in range(1, len(parts)):
            sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        module = types.ModuleType(name)
        for key, value in attrs.items():
            setattr(module, key, value)
        sys.modules.setdefault(name, module)
    spec = importlib.util.spec_from_file_location("_peer_sglang_updater", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def expert_tensors(
    phy2log_LS: np.ndarray, hidden: int, inter: int, device: torch.device
) -> dict[int, list[Any]]:
    """Per layer, DeepSeek-V3's four expert tensors [S, ...] (fp8 weights, fp32 block scales) as
    ``phy2log_LS`` places them: random bytes per expert, every replica of an expert the same bytes."""
    block = 128
    shapes = [
        ((2 * inter, hidden), torch.float8_e4m3fn),
        ((hidden, inter), torch.float8_e4m3fn),
        ((-(-2 * inter // block), -(-hidden // block)), torch.float32),
        ((-(-hidden // block), -(-inter // block)), torch.float32),
    ]
    E = int(phy2log_LS.max()) + 1
    S = phy2log_LS.shape[1]
    out = {}
    for layer, row_S in enumerate(phy2log_LS):
        slot_expert_S = torch.as_tensor(row_S, dtype=torch.long, device=device)
        out[layer] = [
            torch.randint(0, 256, (E, *shape, dtype.itemsize), dtype=torch.uint8, device=device)[
                slot_expert_S
            ]
            .view(dtype)
            .view(S, *shape)
            for shape, dtype in shapes
        ]
    return out


def placements(layers: int, S: int, seed: int) -> tuple[Placement, Placement]:
    """One GPU's S slots over S - 1 experts (one redundant), and a placement that moves every slot
    whose neighbour holds another expert (where both replicas of the redundant one are neighbours,
    one of them stays)."""
    rng = np.random.default_rng(seed)
    rows = np.array([rng.permutation(np.concatenate([np.arange(S - 1), [0]])) for _ in range(layers)])
    new_rows = np.roll(rows, 1, axis=1)
    return Placement.from_phy2log(rows, 1), Placement.from_phy2log(new_rows, 1)


def placed(start: list[Any], old_S: list[int], new_S: list[int]) -> list[Any]:
    """One layer's tensors as ``new_S`` places the experts ``start`` holds as ``old_S`` places them."""
    source_S = [old_S.index(e) for e in new_S]
    return [t.view(torch.uint8)[source_S] for t in start]  # fp8 has no CPU gather


def run_setting(
    sglang: types.ModuleType, layers: int, S: int, hidden: int, inter: int, reps: int, device: torch.device
) -> dict[str, Any]:
    """Both updaters on one chunk of ``layers`` layers, alternating between two placements."""
    chunk = tuple(range(layers))
    maps = placements(layers, S, seed=layers)
    weights = expert_tensors(maps[0].phy2log_LP, hidden, inter, device)
    slots_L = slot_buffers(weights, chunk, layers)
    options = UpdaterConfig().options()
    state: dict[str, Any] = {"at": 0, "prepared": None}
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else None
    temp = sglang.create_temp_buffers(weights[0])

    def sglang_chunk() -> None:
        a, b = maps[state["at"]], maps[1 - state["at"]]
        for layer in chunk:
            sglang.update_expert_weights_single_layer(
                routed_experts_weights=weights[layer],
                temp_buffers=temp,
                old_physical_to_logical_map=a.phy2log_LP[layer].tolist(),
                new_physical_to_logical_map=b.phy2log_LP[layer].tolist(),
                num_local_physical_experts=S,
                num_gpu_per_node=1,
                rank=0,
                world_size=1,
            )
        state["at"] = 1 - state["at"]

    def prepare() -> None:
        a, b = maps[state["at"]], maps[1 - state["at"]]
        state["prepared"] = prepare_swap(slots_L, a, b, layers=chunk, options=options)

    phases: list[dict[str, float]] = []

    def eplb_chunk() -> None:
        prepared = state["prepared"]
        assert isinstance(prepared, PreparedSwap)
        result = prepared.execute()
        assert result.ok, result.error
        phases.append(result.phase_seconds)
        state["at"] = 1 - state["at"]

    # From the same start, one move by each: the same bytes, and the bytes the new placement says.
    def same(a: list[Any], b: list[Any]) -> bool:
        return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True))

    start = [t.clone() for layer in chunk for t in weights[layer]]
    sglang_chunk()
    after_sglang = [t.clone() for layer in chunk for t in weights[layer]]
    for t, s in zip((t for layer in chunk for t in weights[layer]), start, strict=True):
        t.copy_(s)
    state["at"] = 0
    prepare()
    eplb_chunk()
    after_eplb = [t for layer in chunk for t in weights[layer]]
    n = len(weights[0])
    want = [
        t
        for layer in chunk
        for t in placed(
            start[layer * n : (layer + 1) * n],
            maps[0].phy2log_LP[layer].tolist(),
            maps[1].phy2log_LP[layer].tolist(),
        )
    ]
    same_bytes = same(after_sglang, after_eplb)
    sglang_expected, eplb_expected = same(after_sglang, want), same(after_eplb, want)
    del start, after_sglang, after_eplb, want
    sglang_s = wall_times(sglang_chunk, reps, warmup=1, sync=sync)
    prepare_s = wall_times(prepare, reps, warmup=1, sync=sync)
    prepare()
    phases.clear()
    eplb_s = wall_times(eplb_chunk, reps, warmup=0, sync=sync, setup=prepare)
    per_expert = sum(t[0].numel() * t.element_size() for t in weights[0])
    moved = int((maps[0].phy2log_LP != maps[1].phy2log_LP).sum())
    phase_ms = (
        {k: 1e3 * statistics.median(p.get(k, 0.0) for p in phases) for k in phases[0]} if phases else {}
    )
    return {
        "layers": layers,
        "slots": S,
        "bytes_per_expert": per_expert,
        "experts_moved": moved,
        "bytes_moved": moved * per_expert,
        "same_bytes": same_bytes,
        "sglang_expected": sglang_expected,
        "eplb_expected": eplb_expected,
        "sglang_ms": 1e3 * statistics.median(sglang_s),
        "eplb_ms": 1e3 * statistics.median(eplb_s),
        "eplb_prepare_ms": 1e3 * statistics.median(prepare_s),
        "eplb_phase_ms": phase_ms,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, one repetition")
    parser.add_argument(
        "--layers",
        type=int,
        nargs="+",
        help="layers per chunk, one setting each (default: 1 4 16; --smoke: 1 2)",
    )
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if args.smoke:
        hidden, inter, reps, chunks = 256, 128, 1, args.layers or [1, 2]
    else:
        hidden, inter, reps, chunks = 7168, 2048, args.reps, args.layers or [1, 4, 16]
    if min(chunks) < 1:
        raise ValueError(f"--layers must be >= 1, got {chunks}")
    sglang = load_sglang_updater()
    rows = [run_setting(sglang, c, 9, hidden, inter, reps, device) for c in chunks]
    print(f"device {device}, H={hidden} I={inter}, S=9, {reps} reps (median ms per chunk)")
    print(f"{'layers':>6} {'MB moved':>9} {'sglang':>9} {'eplb':>9} {'prepare':>8}  same  right  eplb phases")
    for r in rows:
        phases = " ".join(f"{k}={v:.2f}" for k, v in r["eplb_phase_ms"].items())
        print(
            f"{r['layers']:>6} {r['bytes_moved'] / 1e6:>9.1f} {r['sglang_ms']:>9.2f} {r['eplb_ms']:>9.2f} "
            f"{r['eplb_prepare_ms']:>8.2f}  {'yes' if r['same_bytes'] else 'NO':>4}  "
            f"{'yes' if r['sglang_expected'] and r['eplb_expected'] else 'NO':>5}  {phases}"
        )
    if args.json:
        write_result(
            args.json, {"device": str(device), "hidden": hidden, "intermediate": inter, "rows": rows}
        )
    ok = all(r["same_bytes"] and r["sglang_expected"] and r["eplb_expected"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
