"""``eplb workload``: generate a synthetic expert-load trace and report its calibration figure."""

from __future__ import annotations

import argparse
from pathlib import Path

from eplb.commands.common import add_json_out, add_seed, emit

HELP = "generate a synthetic expert-load trace (model presets, seeded)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from eplb.workloads import PRESETS

    parser.add_argument("--preset", choices=sorted(PRESETS), default="deepseek-v3", help="model shape")
    parser.add_argument("--steps", type=int, default=4000, help="forward passes (default: %(default)s)")
    parser.add_argument("--prefill-fraction", type=float, default=None, help="share of prefill passes")
    parser.add_argument("--ep-size", type=int, default=32, help="EP size for the reported imbalance")
    parser.add_argument("--out", type=Path, default=None, help="write the trace here (.safetensors or .npz)")
    add_seed(parser)
    add_json_out(parser)


def run(args: argparse.Namespace) -> int:
    from eplb.workloads import WorkloadConfig, generate, unbalanced_imbalance

    cfg = WorkloadConfig(preset=args.preset, num_steps=args.steps, seed=args.seed)
    if args.prefill_fraction is not None:
        cfg = cfg.with_(prefill_fraction=args.prefill_fraction)
    if cfg.model.num_experts % args.ep_size:
        raise ValueError(f"--ep-size {args.ep_size} does not divide the {cfg.model.num_experts} experts")
    trace = generate(cfg)
    result = {
        "preset": cfg.preset,
        "steps": trace.num_steps,
        "prefill_steps": int(trace.is_prefill_T.sum()),
        "layers": trace.num_layers,
        "experts": trace.num_experts,
        "ep_size": args.ep_size,
        "unbalanced_max_over_mean": unbalanced_imbalance(trace, args.ep_size) if trace.num_steps else None,
    }
    if args.out is not None:
        result["out"] = str(trace.save(args.out))
    emit(result, list(result), args.json_out)
    return 0
