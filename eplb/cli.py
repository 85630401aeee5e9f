"""The ``eplb`` command: a registry of subcommands, each in its own module, imported lazily.

A subcommand module defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``. Modules import heavy dependencies (torch, scipy, matplotlib) inside
``run``, so ``eplb --help`` stays fast and CPU-only installs never touch GPU stacks.

Errors in what the user gave (flags, input files, output paths) end with one line on stderr and
exit status 2 (a flag argparse refuses too: eplb.commands.common.Parser); Ctrl-C ends with one
line and 130. A MemoryError is the inputs asking for more than the machine holds where no check
sized them first: one line and 2 as well. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from eplb._version import __version__
from eplb.commands.common import Parser

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
    parser = Parser(
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
    try:
        # Building the parser imports numpy and the subcommands: an early Ctrl-C lands here.
        parser = build_parser()
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # named by the subcommand's parser: "eplb sweep: error: ..."
            getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    except KeyboardInterrupt:
        print("eplb: interrupted", file=sys.stderr)
        return 130
    except SystemExit as exc:
        return _refused(exc)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(args._module.run(args) or 0)
    except KeyboardInterrupt:
        print(f"eplb {args.command}: interrupted", file=sys.stderr)
        return 130
    except SystemExit as exc:  # a combination of flags a command's own parser refused
        return _refused(exc)
    except MemoryError as exc:
        # The checks before allocation (eplb.commands.sizes, eplb.fileio) should have said which
        # flag or file asks for too much; this is the net under them.
        detail = " ".join(str(exc).split()) or "an allocation failed"
        print(
            f"eplb {args.command}: error: out of memory ({detail}): the inputs ask for more than this "
            "machine holds",
            file=sys.stderr,
        )
        return 2
    except (ValueError, OSError) as exc:
        message = user_error(exc)
        if message is None:
            raise
        print(f"eplb {args.command}: error: {message}", file=sys.stderr)
        return 2


def _refused(exc: SystemExit) -> int:
    """The status of a parser's exit: --help and --version go on exiting 0; a refused flag (said
    in one line already, eplb.commands.common.Parser) is returned, as every other user error is."""
    if exc.code in (0, None):
        raise exc
    return exc.code if isinstance(exc.code, int) else 2


def user_error(exc: BaseException) -> str | None:
    """One line for an error in the user's input, or None when ``exc`` looks like a bug.

    ValueError is how eplb reports bad flags and files. An OSError counts when it names a path
    (a missing, unreadable or unwritable file); one without a path keeps its traceback.
    """
    if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError) and exc.filename is None:
        return None
    if isinstance(exc, OSError) and exc.filename is not None:
        text = f"{exc.filename}: {exc.strerror or exc}"
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
