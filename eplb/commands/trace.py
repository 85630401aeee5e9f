"""``eplb trace``: describe a load trace, or convert between formats (eplb, SGLang, OpenEvolve).

Output paths are checked before the input is read; a conversion and its JSON report are written
together, so a failure leaves neither.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from eplb.commands import flags
from eplb.commands.common import check_outputs, emit, progress_callback

HELP = "describe a load trace or convert it (eplb safetensors/npz, SGLang dumps, OpenEvolve JSON)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from eplb.traces import FORMATS

    parser.add_argument("action", choices=("info", "convert"), help="what to do")
    parser.add_argument("inputs", nargs="+", type=Path, help="trace file(s); several = SGLang per_pass ranks")
    parser.add_argument("--format", choices=FORMATS, default="auto", help="input format (default: detect)")
    parser.add_argument("--out", type=Path, default=None, help="convert: output file")
    parser.add_argument("--to", choices=("eplb", "openevolve"), default="eplb", help="convert: output format")
    flags.add(parser, "trace", "--disable-tqdm", "--json")


def describe(trace: Any) -> dict[str, Any]:
    total = trace.total_LE()
    return {
        "steps": trace.num_steps,
        "layers": trace.num_layers,
        "experts": trace.num_experts,
        "prefill_steps": int(trace.is_prefill_F.sum()),
        "routed_total": int(total.sum()),
        "meta": dict(trace.meta),
        **({"note": trace.prefill_note()} if not trace.prefill_known else {}),
    }


def run(args: argparse.Namespace) -> int:
    from eplb.fileio import OutputSet
    from eplb.traces import load_trace, write_openevolve

    if args.action == "convert" and args.out is None:
        raise ValueError("convert needs --out")
    if args.action == "info" and args.out is not None:
        raise ValueError("--out: info writes no trace (convert does); --json takes the report")
    check_outputs(args.out if args.action == "convert" else None, args.json_out)
    with progress_callback(disable=args.disable_tqdm, desc="read") as report:
        trace = load_trace(args.inputs, args.format, progress=report)
    result = describe(trace)
    keys = ("steps", "layers", "experts", "prefill_steps", "routed_total", "note", "out")
    with OutputSet(parents=True) as outputs:
        if args.action == "convert":
            openevolve = args.to == "openevolve"
            unit = "step" if openevolve else "B"
            with progress_callback(disable=args.disable_tqdm, desc="write", unit=unit) as report:
                if openevolve:
                    out = write_openevolve(trace, args.out, outputs=outputs, progress=report)
                else:
                    out = trace.save(args.out, outputs=outputs, progress=report)
            result["out"] = str(out)
        emit(result, keys, args.json_out, outputs=outputs)
    return 0
