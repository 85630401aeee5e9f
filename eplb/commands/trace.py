"""``eplb trace``: describe a load trace, or convert between formats (eplb, SGLang, OpenEvolve)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from eplb.commands.common import add_json_out, emit

HELP = "describe a load trace or convert it (eplb safetensors/npz, SGLang dumps, OpenEvolve JSON)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from eplb.traces import FORMATS

    parser.add_argument("action", choices=("info", "convert"), help="what to do")
    parser.add_argument("inputs", nargs="+", type=Path, help="trace file(s); several = SGLang per_pass ranks")
    parser.add_argument("--format", choices=FORMATS, default="auto", help="input format (default: detect)")
    parser.add_argument("--out", type=Path, default=None, help="convert: output file")
    parser.add_argument("--to", choices=("eplb", "openevolve"), default="eplb", help="convert: output format")
    add_json_out(parser)


def describe(trace: Any) -> dict[str, Any]:
    total = trace.total_LE()
    return {
        "steps": trace.num_steps,
        "layers": trace.num_layers,
        "experts": trace.num_experts,
        "prefill_steps": int(trace.is_prefill_T.sum()),
        "routed_total": int(total.sum()),
        "meta": dict(trace.meta),
    }


def run(args: argparse.Namespace) -> int:
    from eplb.traces import load_trace, write_openevolve

    trace = load_trace(args.inputs, args.format)
    result = describe(trace)
    if args.action == "convert":
        if args.out is None:
            raise ValueError("convert needs --out")
        out = write_openevolve(trace, args.out) if args.to == "openevolve" else trace.save(args.out)
        result["out"] = str(out)
    emit(result, ("steps", "layers", "experts", "prefill_steps", "routed_total", "out"), args.json_out)
    return 0
