"""Package discovery, ``kernels/`` shipped as ``eplb.kernels``, and the dashboards as package data.

Metadata lives in pyproject.toml; only what needs code is here: the package list (``kernels/``
must never install as a top-level ``kernels`` module, which belongs to another PyPI project), and
copying the Grafana/Prometheus files of ``dashboards/`` (JSON and YAML only, not the scripts that
generate them) into the built package as ``eplb/dashboards/``, where ``eplb dashboards --out DIR``
finds them in an installed wheel.
"""

from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
DASHBOARDS = ROOT / "dashboards"
DASHBOARD_SUFFIXES = (".json", ".yml", ".yaml")


def dashboard_files() -> list[Path]:
    """The dashboard data files, relative to ``dashboards/`` (none in a tree without the folder)."""
    if not DASHBOARDS.is_dir():
        return []
    return sorted(
        p.relative_to(DASHBOARDS)
        for p in DASHBOARDS.rglob("*")
        if p.is_file() and p.suffix in DASHBOARD_SUFFIXES
    )


class BuildPyWithDashboards(build_py):
    """build_py, then the dashboard files into ``<build>/eplb/dashboards/``."""

    def run(self) -> None:
        super().run()
        for rel in dashboard_files():
            target = Path(self.build_lib) / "eplb" / "dashboards" / rel
            self.mkpath(str(target.parent))
            self.copy_file(str(DASHBOARDS / rel), str(target))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        shipped = [str(Path(self.build_lib) / "eplb" / "dashboards" / rel) for rel in dashboard_files()]
        return [*super().get_outputs(include_bytecode), *shipped]


setup(
    packages=[*find_packages(include=["eplb", "eplb.*"]), "eplb.kernels"],
    package_dir={"eplb.kernels": "kernels"},
    cmdclass={"build_py": BuildPyWithDashboards},
)
