"""``eplb dashboards``: export the Grafana dashboard and the Prometheus/Grafana provisioning files.

An installed wheel carries them as package data (``eplb/dashboards/``, copied there by setup.py);
a source checkout (an editable install) has them in the repository's ``dashboards/`` folder. Only
the data files are exported (JSON, YAML), never the scripts that generate them.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from eplb.commands import flags
from eplb.commands.common import emit

HELP = "export the Grafana dashboard and Prometheus/Grafana provisioning files into a folder"
SUFFIXES = (".json", ".yml", ".yaml")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="folder to write them into")
    flags.add(parser, "dashboards", "--json")


def dashboards_source() -> Path:
    """Where this install keeps the dashboard files (FileNotFoundError when it has none)."""
    import eplb

    package = Path(eplb.__file__).resolve().parent
    for candidate in (package / "dashboards", package.parent / "dashboards"):
        if (candidate / "eplb-expert-load.json").is_file():
            return candidate
    raise FileNotFoundError("this eplb install carries no dashboard files (eplb/dashboards/ is missing)")


def dashboard_files(source: Path) -> list[Path]:
    """The data files under ``source``, relative to it, sorted."""
    return sorted(p.relative_to(source) for p in source.rglob("*") if p.is_file() and p.suffix in SUFFIXES)


def run(args: argparse.Namespace) -> int:
    source = dashboards_source()
    out_dir: Path = args.out
    written = []
    for rel in dashboard_files(source):
        target = out_dir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / rel, target)
        written.append(str(rel))
    out = out_dir.resolve()
    result = {
        "files": written,
        "prometheus": f"prometheus --config.file={out / 'prometheus.yml'}",
        "grafana": (
            f"EPLB_DASHBOARDS_DIR={out} GF_PATHS_PROVISIONING={out / 'provisioning'} "
            "grafana-server --homepath /usr/share/grafana"
        ),
    }
    emit(result, list(result), args.json_out)
    return 0
