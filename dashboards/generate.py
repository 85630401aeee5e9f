"""Write the Grafana expert-load dashboard (dashboards/eplb-expert-load.json), or check it (--check).

    python dashboards/generate.py            # rewrite the JSON
    python dashboards/generate.py --check    # exit 1 if a query names an unknown metric or label,
                                             # or if the committed JSON differs from what this writes

The command line only: ``panels.py`` builds the dashboard and ``promql.py`` checks its queries
against ``eplb.metrics.names``. This folder is scripts, not a package: they import each other by
file name, which Python resolves from the running script's own folder.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import panels
import promql

DASHBOARD_PATH = Path(__file__).resolve().parent / "eplb-expert-load.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="verify instead of writing; exit 1 on any problem"
    )
    parser.add_argument(
        "--out", type=Path, default=DASHBOARD_PATH, help="dashboard JSON path (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    dashboard = panels.build_dashboard()
    found = promql.problems(dashboard)
    text = panels.render(dashboard)
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            found.append(
                f"{args.out} differs from what the generator writes: run python dashboards/generate.py"
            )
        for line in found:
            print(f"dashboards/generate.py --check: {line}", file=sys.stderr)
        if not found:
            print(
                f"dashboards/generate.py --check: ok ({len(promql.queries(dashboard))} queries, {len(dashboard['panels'])} panels)"
            )
        return 1 if found else 0
    if found:
        for line in found:
            print(f"dashboards/generate.py: {line}", file=sys.stderr)
        return 1
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
