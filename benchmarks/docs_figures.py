"""The figures docs/simulate.md quotes, from one run of the commands it shows.

``python -m benchmarks.docs_figures`` runs ``eplb simulate`` (default settings, with the plots
under docs/img/simulate), the same workload with every algorithm and dispatch mode, and ``eplb
sweep``; keeps what they printed and the few numbers the text quotes in
``benchmarks/results/docs_simulate.json``; and rewrites the regions of docs/simulate.md between
``<!-- figures:NAME -->`` and ``<!-- /figures:NAME -->`` from that file. ``--render`` rewrites the
regions from the stored file without running anything; ``--check`` exits 1 when the document
differs from what the stored file renders (tests/test_docs_examples.py runs it), so a figure
cannot be edited by hand out of step with the run it came from.

About two minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import textwrap
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "simulate.md"
RESULT = ROOT / "benchmarks" / "results" / "docs_simulate.json"
MORE_ALGORITHMS = (
    "none deepseek deepseek_hierarchical deepseek:dynamic scipy scipy:dynamic scipy:weighted none:fake"
)
COMMANDS = {
    "default": "eplb simulate --plots docs/img/simulate --json out/docs/result.json",
    "more": f"eplb simulate --algorithms {MORE_ALGORITHMS} --no-timeline --json out/docs/more.json",
    "sweep": "eplb sweep --target 0.8 --algorithm scipy --json out/docs/sweep.json",
}
"""What each run executes from the repository root (shown in the document as run)."""
REGION = re.compile(r"(<!-- figures:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /figures:(?P=name) -->)", re.S)


# ---- running ------------------------------------------------------------------------------------
def run_command(command: str) -> dict[str, Any]:
    """Run one command, keeping its output (without progress bars), wall time and CPU time."""
    argv = [sys.executable, "-m", "eplb", *command.split()[1:]]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"command": command, "stdout": done.stdout, "stderr": done.stderr, "wall_s": wall, "cpu_s": cpu}


def moe_seconds_by_kind(result: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """Modeled MoE seconds of the scored prefill and decode steps, per run (from the timeline)."""
    from eplb.workloads import WorkloadConfig, generate

    meta = result["trace"]
    cfg = WorkloadConfig(preset=meta["model"], num_steps=result["steps"], seed=result["config"]["seed"])
    prefill_F = generate(cfg).is_prefill_F[result["scored_from"] :]
    out = {}
    for name, series in result["timeline"].items():
        moe_us = [float(x) for x in series["moe_us"][result["scored_from"] :]]
        out[name] = {
            "prefill": sum(x for x, p in zip(moe_us, prefill_F, strict=True) if p) / 1e6,
            "decode": sum(x for x, p in zip(moe_us, prefill_F, strict=True) if not p) / 1e6,
        }
    return out


def machine() -> dict[str, Any]:
    from benchmarks.harness import _version, run_info

    info = run_info()
    model = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in _read("/proc/cpuinfo").splitlines()
            if ln.startswith("model name")
        ),
        info["cpu"],
    )
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True, check=False).stdout.strip()  # fmt: skip
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True, check=False).stdout.strip()  # fmt: skip
    return {
        **info,
        "cpu_model": model,
        "scipy": _version("scipy"),
        "load_average": os.getloadavg()[0],
        "commit": commit + (" with uncommitted changes" if dirty else ""),
    }


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def collect() -> dict[str, Any]:
    """Run every command; keep their output and the numbers the text quotes."""
    (ROOT / "out" / "docs").mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    runs = {name: run_command(command) for name, command in COMMANDS.items()}
    default = json.loads((ROOT / "out" / "docs" / "result.json").read_text())
    more = json.loads((ROOT / "out" / "docs" / "more.json").read_text())
    sweep = json.loads((ROOT / "out" / "docs" / "sweep.json").read_text())
    info = machine()
    info["load_average"] = [load_before, os.getloadavg()[0]]
    generated = re.search(r"workload: (\d+) steps", runs["sweep"]["stderr"])
    return {
        "info": info,
        "runs": runs,
        "default": {
            "summaries": {r["name"]: r for r in default["runs"]},
            "steps": default["steps"],
            "prefill_steps": default["prefill_steps"],
            "slots": expert_slots(default),
            "moe_seconds": moe_seconds_by_kind(default),
        },
        "more": {"summaries": {r["name"]: r for r in more["runs"]}},
        "sweep": {"steps": int(generated[1]) if generated else None, "points": len(sweep["points"])},
    }


def expert_slots(result: Mapping[str, Any]) -> int:
    """Expert slots of the simulated model: layers x physical slots."""
    from eplb.workloads import PRESETS

    preset = PRESETS[result["trace"]["model"]]
    return preset.num_layers * (preset.num_experts + int(result["config"]["num_redundant"]))


# ---- rendering ----------------------------------------------------------------------------------
def _output_block(run: Mapping[str, Any]) -> str:
    """The command and what it printed, as a reader sees it (progress bars left out)."""
    printed = (run["stderr"] + run["stdout"]).split("\n")
    lines = [
        ln for ln in printed if ln.strip() and "\r" not in ln and "it/s]" not in ln and "s/it]" not in ln
    ]
    return "```\n" + "\n".join([f"$ {run['command']}", *lines]) + "\n```\n"


def _table_only(run: Mapping[str, Any]) -> str:
    keep = [
        ln for ln in run["stdout"].splitlines() if ln.startswith(("run ", "---", "none", "deepseek", "scipy"))
    ]
    return "```\n" + "\n".join(keep) + "\n```\n"


def render(data: Mapping[str, Any]) -> dict[str, str]:
    """Every region's text, from the stored run (paragraphs wrapped at 100 columns)."""
    from eplb.simulate.results import format_bytes

    m, runs = data["info"], data["runs"]
    d = data["default"]
    s = d["summaries"]
    none, ds, sp = s["none:static"], s["deepseek:static"], s["scipy:static"]
    slots = d["slots"]
    moe = d["moe_seconds"]
    decode_share = 1 - d["prefill_steps"] / d["steps"]
    same_scipy = {k: sp[k] for k in ("experts_moved", "balancedness_p5")} == {
        k: data["more"]["summaries"]["scipy:static"][k] for k in ("experts_moved", "balancedness_p5")
    }
    load = "–".join(f"{x:.1f}" for x in m["load_average"])
    regions = {
        "machine": (
            f"Run on {m['date'][:10]} on this project's development machine ({m['cpus']} cores of an "
            f"{m['cpu_model']}, shared, load average {load}; Python {m['python']}, numpy {m['numpy']}, "
            f"SciPy {m['scipy']}), at commit {m['commit']}, by `python -m benchmarks.docs_figures`:\n"
        ),
        "default-output": _output_block(runs["default"]),
        "default-says": (
            f"{runs['default']['wall_s']:.1f} s wall in all ({runs['default']['cpu_s']:.1f} s of CPU). What it "
            f"says: both planners lift prefill balancedness from {none['balancedness_prefill_mean']:.2f} to "
            f"{ds['balancedness_prefill_mean']:.2f} (deepseek) and {sp['balancedness_prefill_mean']:.2f} "
            f"(scipy). DeepSeek's greedy repacks from scratch and moves about "
            f"{ds['experts_moved_per_rebalance']:,.0f} of the {slots:,} expert slots at every rebalance "
            f"({format_bytes(ds['bytes_moved'])} in all, a modeled {ds['stall_seconds']:.1f} s of stalls); "
            f"the SciPy solver moves about {sp['experts_moved_per_rebalance']:,.0f} per rebalance "
            f"({format_bytes(sp['bytes_moved'])}, {sp['stall_seconds']:.1f} s), and its modeled speed-up "
            f"net of transfers is {sp['speedup_vs_none']:.3f}x against {ds['speedup_vs_none']:.3f}x. The "
            f"speed-up is far below the balancedness gain because decode steps ({decode_share:.0%} of steps "
            f"here) are bound by reading active experts' weights, which balancing does not change: from "
            f"the JSON's timeline, the scored decode steps take {moe['none:static']['decode']:.1f} s of "
            f"modeled MoE time without balancing ({moe['deepseek:static']['decode']:.1f} s and "
            f"{moe['scipy:static']['decode']:.1f} s with the planners), while the prefill steps drop from "
            f"{moe['none:static']['prefill']:.1f} s (none) to {moe['deepseek:static']['prefill']:.1f} s "
            f"(deepseek) and {moe['scipy:static']['prefill']:.1f} s (scipy). "
            + (
                "The SciPy solver's budgets are counts, not seconds, so its row is the same in the "
                "second run below."
                if same_scipy
                else "The SciPy solver's row differs slightly in the second run below (a wall-clock budget "
                "was in force)."
            )
            + "\n"
        ),
        "more-intro": (
            f"More runs on the same workload and settings (same run of the script, `--algorithms "
            f"{MORE_ALGORITHMS}`, {runs['more']['wall_s']:.1f} s wall):\n"
        ),
        "more-output": _table_only(runs["more"]),
        "sweep-intro": (
            f"A sweep on the same workload ({data['sweep']['steps'] or 2000} steps; "
            f"{data['sweep']['points']} simulations, {runs['sweep']['wall_s']:.0f} s wall):\n"
        ),
        "sweep-output": _output_block(runs["sweep"]),
    }
    return {k: v if v.startswith("```") else textwrap.fill(v, width=100) + "\n" for k, v in regions.items()}


def apply(text: str, regions: Mapping[str, str]) -> str:
    """``text`` with every region replaced; every region must exist exactly once."""
    found = [m["name"] for m in REGION.finditer(text)]
    missing = sorted(set(regions) - set(found))
    if missing or len(found) != len(set(found)):
        raise ValueError(f"{DOC}: regions missing {missing} or repeated in {found}")
    return REGION.sub(lambda m: m[1] + regions.get(m["name"], m["body"]) + m[4], text)


def rendered_document() -> tuple[str, str]:
    """(the document now, the document as the stored run renders it)."""
    text = DOC.read_text()
    return text, apply(text, render(json.loads(RESULT.read_text())))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.docs_figures", description=__doc__.splitlines()[0]
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--render", action="store_true", help="rewrite the document from the stored run only")
    mode.add_argument(
        "--check", action="store_true", help="exit 1 if the document differs from the stored run"
    )
    args = parser.parse_args(argv)
    if not (args.render or args.check):
        from benchmarks.harness import write_result

        data = collect()
        info = data.pop("info")
        write_result(RESULT, data, info=info)
    now, rendered = rendered_document()
    if args.check:
        if now != rendered:
            print(f"{DOC} is out of step with {RESULT}: run python -m benchmarks.docs_figures --render")
            return 1
        return 0
    DOC.write_text(rendered)
    print(f"{DOC}: figures from {RESULT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
