"""Every shared flag is declared once, by the table, with one default and one help text.

The table is eplb.commands.flags.FLAGS (the server's flags, eplb.config.SERVER_FLAGS, and the
offline commands' own). These tests build a server's parser and every ``eplb`` subcommand's, and
check each option string against the table: a table flag is declared through it alone, with its
default and help (or the command's own default where the table's record says so, with a reason),
and an option string two parsers share is a table flag. A scan of the package's source finds any
``add_argument`` or ``set_defaults`` that names a table flag outside the table. The checks are
functions, so a test can show that each one fails on a parser that declares a flag twice.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
from collections.abc import Mapping
from pathlib import Path

import pytest

import eplb
from eplb.cli import COMMANDS, build_parser
from eplb.commands import flags as table
from eplb.config import SERVER_FLAGS, EplbConfig, add_cli_args
from eplb.flags import Flag
from eplb.integrations import engine_env

SERVER = "server"
"""The key of a server's parser (add_cli_args) among the parsers checked."""


def _options(flag: Flag) -> list[str]:
    """The option strings argparse gives ``flag`` (a BooleanOptionalAction adds ``--no-NAME``)."""
    if flag.action is not argparse.BooleanOptionalAction:
        return list(flag.names)
    return [o for name in flag.names for o in (name, "--no-" + name.removeprefix("--"))]


BY_OPTION = {option: flag for flag in table.FLAGS for option in _options(flag)}


def _parsers() -> dict[str, argparse.ArgumentParser]:
    """A server's parser and every subcommand's, by command name."""
    top = build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return {SERVER: add_cli_args(argparse.ArgumentParser()), **sub.choices}


def declaration_problems(parsers: Mapping[str, argparse.ArgumentParser]) -> list[str]:
    """What in ``parsers`` breaks the table's rule: a table flag declared otherwise than the table
    says (names, default, help, type, choices, ...), an option declared twice in one parser, or one
    that several parsers declare without the table."""
    problems: list[str] = []
    where: dict[str, list[str]] = {}
    for command, parser in parsers.items():
        as_table = None if command == SERVER else command
        for action in parser._actions:
            for option in action.option_strings:
                where.setdefault(option, []).append(command)
            flag = next((BY_OPTION[o] for o in action.option_strings if o in BY_OPTION), None)
            if flag is None:
                continue
            want = {
                "option_strings": _options(flag),
                "dest": flag.dest,
                "default": flag.default_for(as_table),
                "help": flag.help_for(as_table),
                "type": flag.parse,
                "choices": flag.choices,
                "nargs": flag.nargs if flag.nargs is not None else action.nargs,
                "metavar": flag.metavar,
            }
            for key, value in want.items():
                got = getattr(action, key)
                if got != value or type(got) is not type(value):
                    problems.append(f"{command} {flag.name}: {key} is {got!r}, the table's {value!r}")
    for option, commands in sorted(where.items()):
        if option in ("-h", "--help"):
            continue
        if len(commands) != len(set(commands)):
            problems.append(f"{option} is declared twice in {commands}")
        elif len(commands) > 1 and option not in BY_OPTION and option not in table.OWN_PER_COMMAND:
            problems.append(f"{option} is declared by {commands}, not by the table")
    return problems


def source_problems(source: str, name: str) -> list[str]:
    """Calls in ``source`` that declare a table flag, or set its default, outside the table."""
    dests = {flag.dest for flag in table.FLAGS}
    problems = []
    for node in ast.walk(ast.parse(source, name)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr == "add_argument":
            named = [a.value for a in node.args if isinstance(a, ast.Constant) and a.value in BY_OPTION]
            problems += [f"{name}:{node.lineno}: add_argument({o!r})" for o in named]
        elif node.func.attr == "set_defaults":
            problems += [
                f"{name}:{node.lineno}: set_defaults({k.arg}=...)" for k in node.keywords if k.arg in dests
            ]
    return problems


def test_every_parser_takes_its_shared_flags_from_the_table() -> None:
    assert declaration_problems(_parsers()) == []


def test_no_module_declares_a_table_flag_itself() -> None:
    root = Path(eplb.__file__).parent
    found = [
        problem
        for path in sorted(root.rglob("*.py"))
        for problem in source_problems(path.read_text(), str(path.relative_to(root)))
    ]
    assert found == []


def test_a_flag_declared_twice_or_with_another_default_is_found() -> None:
    """Each check fails where it should: the table's --seed with another default, --steps declared
    beside the table's, an option two commands share outside the table, and such a call in source."""
    simulate, sweep, demo = (argparse.ArgumentParser() for _ in range(3))
    table.add(simulate, "simulate", "--seed", "--steps")
    seed = table.FLAG["--seed"]
    sweep.add_argument("--seed", type=seed.parse, default=1, help=seed.help_for("sweep"))
    table.add(demo, "demo", "--steps")
    demo.add_argument("--steps-per-rank", "--fancy", type=int)
    simulate.add_argument("--fancy", type=int)
    problems = declaration_problems({"simulate": simulate, "sweep": sweep, "demo": demo})
    assert problems == [
        "sweep --seed: default is 1, the table's 0",
        "--fancy is declared by ['simulate', 'demo'], not by the table",
    ]
    twice = argparse.ArgumentParser(conflict_handler="resolve")
    table.add(twice, "simulate", "--steps")
    twice.add_argument("--steps", type=int, default=5000, help="steps")
    assert any("--steps" in p for p in declaration_problems({"simulate": twice}))
    set_default = argparse.ArgumentParser()
    table.add(set_default, "demo", "--eplb-rebalance-mode")
    set_default.set_defaults(eplb_rebalance_mode="periodic")
    assert declaration_problems({"demo": set_default}) == [
        "demo --eplb-rebalance-mode: default is 'periodic', the table's 'continuous'"
    ]
    source = 'p.add_argument("--ep-size", type=int, default=32)\np.set_defaults(enable_eplb=True)\n'
    assert source_problems(source, "x.py") == [
        "x.py:1: add_argument('--ep-size')",
        "x.py:2: set_defaults(enable_eplb=...)",
    ]


def test_the_server_flags_are_eplb_configs_fields_with_its_defaults() -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(EplbConfig)}
    assert sorted(flag.dest for flag in SERVER_FLAGS) == sorted(defaults)
    for flag in SERVER_FLAGS:
        assert flag.default == defaults[flag.dest], flag.name
        assert not flag.elsewhere, f"{flag.name}: the server's table takes no command's default"
    parsed = vars(add_cli_args(argparse.ArgumentParser()).parse_args([]))
    assert EplbConfig.from_namespace(argparse.Namespace(**parsed)) == EplbConfig()


def test_every_other_default_names_its_commands_and_why() -> None:
    parsers = _parsers()
    for flag in table.FLAGS:
        for other in flag.elsewhere:
            assert other.why.strip() and other.shown.strip(), flag.name
            for command in other.commands:
                assert command in COMMANDS, (flag.name, command)
                options = {o for a in parsers[command]._actions for o in a.option_strings}
                assert flag.name in options, f"{command} takes no {flag.name}, yet has a default for it"
        commands = [c for other in flag.elsewhere for c in other.commands]
        assert len(commands) == len(set(commands)), f"{flag.name}: two defaults for one command"


def test_the_replays_take_the_servers_interval() -> None:
    """The schedule's defaults are the server's in every replay: no command-level interval."""
    for name in ("--eplb-rebalance-mode", "--eplb-rebalance-num-iterations", "--eplb-max-moved-experts"):
        for command in table.OFFLINE:
            assert table.FLAG[name].default_for(command) == table.FLAG[name].default


@pytest.mark.parametrize("command", [SERVER, *COMMANDS])
def test_every_help_renders(command: str) -> None:
    text = _parsers()[command].format_help()
    for action in _parsers()[command]._actions:
        flag = next((BY_OPTION[o] for o in action.option_strings if o in BY_OPTION), None)
        if flag is not None:
            assert flag.help_for(None if command == SERVER else command).split()[0] in text


def test_the_engine_variables_of_mirrored_flags_come_from_the_table() -> None:
    mirrored = {flag.name: flag.env for flag in SERVER_FLAGS if flag.env is not None}
    assert mirrored == {
        "--eplb-rebalance-mode": engine_env.MODE_ENV,
        "--eplb-max-moved-experts": engine_env.MAX_MOVED_ENV,
        "--eplb-shift-burst": engine_env.SHIFT_BURST_ENV,
        "--eplb-initial-full-plan": engine_env.INITIAL_FULL_PLAN_ENV,
    }
    assert set(mirrored.values()) <= set(engine_env.SHARED_ENV)
    # A bad variable's error names the variable, not the flag it mirrors.
    with pytest.raises(ValueError, match=r"^EPLB_SHIFT_BURST must be >= 1"):
        engine_env.read_engine_env({"EPLB_SHIFT_BURST": "0"})
    settings = engine_env.read_engine_env({})
    assert (settings.mode, settings.initial_full_plan) == (
        table.FLAG["--eplb-rebalance-mode"].default,
        table.FLAG["--eplb-initial-full-plan"].default,
    )
