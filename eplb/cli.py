"""The ``eplb`` command: a registry of subcommands, each in its own module, imported lazily.

A subcommand module defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``. Modules import heavy dependencies (torch, scipy, matplotlib) inside
``run``, so ``eplb --help`` stays fast and CPU-only installs never touch GPU stacks.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from eplb._version import __version__

# name -> module; the order is the order shown in --help.
COMMANDS: dict[str, str] = {
    "workload": "eplb.commands.workload",
    "trace": "eplb.commands.trace",
    "simulate": "eplb.commands.simulate",
    "sweep": "eplb.commands.sweep",
    "solve": "eplb.commands.solve",
    "demo": "eplb.commands.demo",
    "dashboards": "eplb.commands.dashboards",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="eplb",
        description="Expert-parallel load balancing for Mixture-of-Experts serving.",
    )
    parser.add_argument("--version", action="version", version=f"eplb {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_module=module, _parser=p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args._module.run(args) or 0)
    except (ValueError, FileNotFoundError) as exc:
        # User errors (bad flags, bad files) end with one clear line, not a traceback.
        print(f"eplb {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
