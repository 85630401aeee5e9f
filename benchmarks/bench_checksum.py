"""Slot checksum throughput alone: the Triton kernel (tile configs x grid sizes), run 2's kernel, torch.

Shape legend: S slots per GPU, n checksummed slots of each tensor.

Input: one layer of DeepSeek-V3-sized fp8 expert slots on one GPU (w13 [S, 4096, 7168] + w2
[S, 7168, 2048], S = 72, random bytes); each variant checksums n = 32 slots of both tensors (1.41
GB, two launches) into a fresh int64 vector, as the hot-swap's receiver does for one piece. Every
variant's numbers are first checked bit for bit against the plain-torch reference. Timed with CUDA
events, median of ``reps`` after a warm-up; TB/s = bytes read / time.

``--best FILE`` writes the fastest "tile,warps" on the full grid (for bench_hotswap's
``--checksum-tile``).

    python -m benchmarks.bench_checksum --json out.json --best best_tile
    TRITON_INTERPRET=1 python -m benchmarks.bench_checksum --small      # CPU smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import event_times_us, wall_times, write_result

CONFIGS = [(1024, 4), (2048, 4), (2048, 8), (4096, 8), (8192, 16)]
"""(tile words, warps) of the new kernel."""


def slots(device: torch.device, small: bool) -> dict[str, torch.Tensor]:
    S, H, inter = (6, 64, 32) if small else (72, 7168, 2048)
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=g)

    return {"w13": rand(S, 2 * inter, H), "w2": rand(S, H, inter)}


def median_s(fn: Callable[[], Any], reps: int, cuda: bool) -> float:
    """Median seconds of ``fn`` over ``reps`` runs after one warm-up (CUDA events on a GPU)."""
    if cuda:
        return statistics.median(event_times_us(fn, reps, warmup=1)) / 1e6
    return statistics.median(wall_times(fn, reps, warmup=1))


def main() -> int:
    from benchmarks.slot_checksum_run2 import run2_checksums
    from eplb.hotswap.checksum import block_checksums
    from eplb.kernels import slot_checksum

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--small", action="store_true", help="small shapes (CPU, Triton interpreter)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--best", type=Path, default=None)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 4
    bufs = slots(device, args.small)
    n = min(32, bufs["w13"].shape[0] - 1)
    words = {k: b.view(torch.int32).view(b.shape[0], b.shape[1], -1) for k, b in bufs.items()}
    rows = torch.arange(1, n + 1, dtype=torch.int64, device=device)  # not from slot 0
    pos = torch.arange(0, 2 * n, 2, dtype=torch.int64, device=device)
    nbytes = sum(b[:n].numel() for b in bufs.values())
    expected = {k: block_checksums([b[1 : n + 1]]) for k, b in bufs.items()}
    results: list[dict[str, Any]] = []

    def variant(label: str, run: Callable[[], dict[str, torch.Tensor]], **info: Any) -> None:
        got = run()
        exact = all(torch.equal(got[k].view(-1, 2).cpu(), expected[k].cpu()) for k in bufs)
        seconds = median_s(run, args.reps, cuda)
        row = {"variant": label, "tb_s": nbytes / seconds / 1e12, "exact": exact, **info}
        results.append(row)
        print(f"{label:<48} {row['tb_s']:7.3f} TB/s  exact={exact}", flush=True)

    def new_kernel(config: tuple[int, int], programs: int) -> Callable[[], dict[str, torch.Tensor]]:
        def run() -> dict[str, torch.Tensor]:
            out = {}
            for k, w in words.items():
                vec = torch.zeros(2 * n, dtype=torch.int64, device=device)
                slot_checksum.slot_checksum_into(w, rows, pos, vec, programs, config)
                out[k] = vec
            return out

        return run

    def run2(programs: int) -> Callable[[], dict[str, torch.Tensor]]:
        return lambda: {k: run2_checksums(w, rows, programs) for k, w in words.items()}

    print(
        f"device: {torch.cuda.get_device_name(device) if cuda else 'cpu'}, {sms} SMs, {nbytes / 1e9:.2f} GB"
    )
    overlap, full = max(1, 2 * sms // 3), 4 * sms  # as eplb.hotswap.group uses them
    for programs, where in ((overlap, "2/3 of the SMs"), (4 * sms, "4 x SMs")):
        variant(f"run-2 kernel, {where}", run2(programs), kernel="run2", programs=programs)
    for config in CONFIGS:
        for programs, where in ((overlap, "2/3 of the SMs"), (full, "4 x SMs")):
            label = f"new, tile {config[0]} x {config[1]} warps, {where}"
            variant(label, new_kernel(config, programs), kernel="new", config=config, programs=programs)
    for mult in (0.5, 1, 2, 8, 16):
        programs = max(1, int(mult * sms))
        label = f"new, default tile, {mult} x SMs"
        variant(label, new_kernel(slot_checksum.TILE_CONFIG, programs), kernel="new", programs=programs)
    variant("torch (block_checksums)", lambda: {k: block_checksums([b[1 : n + 1]]) for k, b in bufs.items()})
    full_rows = [r for r in results if "config" in r and r["programs"] == full and r["exact"]]
    best = max(full_rows, key=lambda r: r["tb_s"])
    print(
        f"best on the full grid: tile {best['config'][0]} x {best['config'][1]} warps, {best['tb_s']:.3f} TB/s"
    )
    if args.best:
        args.best.write_text(f"{best['config'][0]},{best['config'][1]}\n")
    if args.json:
        write_result(args.json, {"torch": torch.__version__, "sms": sms, "rows": results}, indent=2)
    return 0 if all(r["exact"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
