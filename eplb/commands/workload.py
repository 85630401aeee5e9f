"""``eplb workload``: generate a synthetic expert-load trace and report its calibration figure.

Output paths are checked before the (long) generation; the trace and the JSON report are written
together, so a failure leaves neither.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from eplb.commands import flags
from eplb.commands.common import (
    check_outputs,
    emit,
    json_to_stdout,
    progress_callback,
    write_json,
)
from eplb.commands.sizes import check_workload

HELP = "generate a synthetic expert-load trace (model presets, seeded)"

IMBALANCE_KEY = "imbalance_without_balancing"
"""The calibration figure's key: max / mean GPU load with experts in identity order (the inverse
of balancedness, per layer and prefill step, averaged; ``eplb.workloads.unbalanced_imbalance``)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add(parser, "workload", "--preset", "--steps", "--prefill-fraction", "--ep-size")
    parser.add_argument("--out", type=Path, default=None, help="write the trace here (.safetensors or .npz)")
    flags.add(parser, "workload", "--seed", "--disable-tqdm", "--json")


def default_ep_size(num_experts: int) -> int:
    """The largest divisor of ``num_experts`` up to ``eplb.commands.flags.WORKLOAD_EP_SIZE``."""
    return max(d for d in range(1, min(num_experts, flags.WORKLOAD_EP_SIZE) + 1) if num_experts % d == 0)


def run(args: argparse.Namespace) -> int:
    from eplb.fileio import OutputSet
    from eplb.workloads import WorkloadConfig, generate, unbalanced_imbalance

    cfg = WorkloadConfig(preset=args.preset, num_steps=args.steps, seed=args.seed)
    if args.prefill_fraction is not None:
        cfg = cfg.with_(prefill_fraction=args.prefill_fraction)
    num_experts = cfg.model.num_experts
    ep_size = default_ep_size(num_experts) if args.ep_size is None else args.ep_size
    if ep_size < 1 or num_experts % ep_size:
        raise ValueError(f"--ep-size {ep_size} does not divide the {num_experts} experts")
    check_outputs(args.out, args.json_out)
    check_workload(args)
    with progress_callback(disable=args.disable_tqdm, desc="generate", unit="step") as report:
        trace = generate(cfg, progress=report)
    result = {
        "preset": cfg.preset,
        "steps": trace.num_steps,
        "prefill_steps": int(trace.is_prefill_F.sum()),
        "layers": trace.num_layers,
        "experts": trace.num_experts,
        "ep_size": ep_size,
        IMBALANCE_KEY: unbalanced_imbalance(trace, ep_size) if trace.num_steps else None,
    }
    with OutputSet(parents=True) as outputs:
        if args.out is not None:
            with progress_callback(disable=args.disable_tqdm, desc="write", unit="B") as report:
                result["out"] = str(trace.save(args.out, outputs=outputs, progress=report))
        if not json_to_stdout(args.json_out):  # stdout stays one JSON document otherwise
            emit(result, [k for k in result if k != IMBALANCE_KEY], None)
            if result[IMBALANCE_KEY] is not None:
                print(
                    f"imbalance without balancing: {result[IMBALANCE_KEY]:.3f} (max / mean GPU load of "
                    f"the prefill steps at EP{ep_size}, experts in identity order; 1 is perfect: the "
                    "inverse of balancedness, which is mean / max)"
                )
        write_json(result, args.json_out, outputs=outputs)
    return 0
