"""A property-based sweep of every subcommand's numeric and path arguments (hypothesis).

The flags come from the parsers themselves (every option whose value is read as an int, a float
or a path, and the strings that hold numbers or paths: ``--rank-failure``, ``--solver-option``,
``--init-expert-location``), so a flag added later is swept too. Each example adds one to three
drawn values to a cheap valid command line (the tiny preset, a few dozen steps, one demo rank) and
runs ``eplb`` in-process, under a per-example deadline. Whatever the values, the run must end in
exit status 0 or 2, never with a traceback or past the deadline; a 2 must be one line on stderr;
and a value the oracle below knows to be invalid must give 2, never 0.

The oracle is written from what each flag means, not from eplb's parsers: no count is negative,
fractional or non-finite; the flags in ``POSITIVE`` are never 0; those in ``AT_MOST_ONE`` are
shares; a port is at most 65535; an input path must be a readable file of the right kind; an output
path must be writable (not a FIFO, a device, a symlink or under a file).

The examples are derandomized (the same each run) and few: a few seconds per subcommand on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eplb.cli import build_parser, main
from eplb.config import SERVER_FLAGS
from eplb.traces import Trace

EXAMPLES = int(os.environ.get("EPLB_SWEEP_EXAMPLES", "50"))
"""Examples per subcommand (EPLB_SWEEP_EXAMPLES: more, for a longer hunt)."""
DEADLINE_S = 60
"""One run's bound: anything longer counts as a hang (a valid run here takes a second or two)."""

POSITIVE = {
    "--nproc", "--hidden", "--intermediate", "--token-divisor", "--duration-s", "--num-groups",
    "--target", "--intervals", "--periodic-intervals", "--nvlink-gbps", "--internode-gbps",
    "--eplb-rebalance-num-iterations", "--expert-distribution-recorder-buffer-size",
    "--eplb-shift-burst", "--eplb-rebalance-layers-per-chunk", "--ep-size", "--nnodes",
    "--num-experts", "--eplb-transfer-gbps",
}  # fmt: skip
"""Flags for which 0 means nothing: a count of ranks, widths, rates, intervals, windows."""
AT_MOST_ONE = {"--prefill-fraction", "--target", "--eplb-min-rebalancing-utilization-threshold"}
"""Shares and balancedness: in [0, 1]."""
PORTS = {"--metrics-port"}
HEAVY = {"--steps", "--hidden", "--intermediate", "--ep-num-redundant-experts", "--redundant", "--duration-s"}
"""Flags whose large valid values make long runs: drawn small, or far past any memory."""
INPUT_PATHS = {"--trace", "inputs", "--sglang-peer", "--init-expert-location"}
OUTPUT_PATHS = {"--out", "--json", "--plots"}
HELD_FIXED = {"--nproc", "--metrics-port"}
"""Drawn only as invalid values: a valid --nproc above 1 spawns rank processes, and a valid
port binds one (each covered by its own tests)."""


@dataclass(frozen=True)
class Value:
    text: str
    invalid: bool
    """The oracle's verdict: True when no meaning of the flag admits this value."""


@dataclass(frozen=True)
class Arg:
    name: str
    """Option string, or the positional's dest."""
    kind: str
    """int, float, input, output, rank-failure, solver-option."""
    many: bool


def _swept(parser: argparse.ArgumentParser) -> list[Arg]:
    """The parser's numeric and path arguments, as declared."""
    found = []
    for action in parser._actions:
        name = action.option_strings[0] if action.option_strings else action.dest
        type_name = getattr(action.type, "__name__", "")
        many = action.nargs in ("+", "*")
        if name in ("--rank-failure",):
            found.append(Arg(name, "rank-failure", False))
        elif name == "--solver-option":
            found.append(Arg(name, "solver-option", False))
        elif name in INPUT_PATHS:
            found.append(Arg(name, "input", many))
        elif name in OUTPUT_PATHS or type_name == "Path":
            found.append(Arg(name, "output" if name in OUTPUT_PATHS else "input", many))
        elif type_name in ("int", "float"):
            found.append(Arg(name, type_name, many))
    return found


def _numbers(arg: Arg) -> st.SearchStrategy[Value]:
    name, integer = arg.name, arg.kind == "int"
    bad = ["nan", "NaN", "inf", "-inf", "abc", "", "0x10", "1e", "-1", "-7", "-0.5", "-" + "9" * 25]
    # Python's int() and float() read these; whether a flag does is the parser's choice.
    odd = ["١", "1_0", " 4", "+3"]
    if integer:
        bad += ["0.5", "1.5", "2e3", "1.0"]
    small = ["1", "2", "3", "5"] + ([] if integer else ["0.25", "0.5", "1e-3"])
    big = ["9" * 20, "9" * 40] if name in HEAVY else ["999999", "9" * 12, "9" * 20, "9" * 40]
    if not integer:
        big += ["1e300", "1e308"]

    def verdict(text: str) -> Value:
        if text in bad:
            return Value(text, True)
        if text in odd:
            return Value(text, False)
        number = float(text)
        invalid = (
            (number == 0 and name in POSITIVE)
            or (number > 1 and name in AT_MOST_ONE)
            or (number > 65535 and name in PORTS)
        )
        return Value(text, invalid)

    if name in HELD_FIXED:
        return st.sampled_from([*bad, "0"] if name in POSITIVE else [*bad, "70000"]).map(verdict)
    return st.one_of(
        st.sampled_from(bad), st.sampled_from(["0", *small]), st.sampled_from(big), st.sampled_from(odd)
    ).map(verdict)


@dataclass(frozen=True)
class Files:
    inputs: dict[str, bool]
    """Input path -> whether the oracle calls it invalid."""
    outputs: dict[str, bool]


def _files(root: Path) -> Files:
    root.mkdir(parents=True, exist_ok=True)
    (root / "folder").mkdir(exist_ok=True)
    (root / "file").write_text("a file")
    (root / "empty.safetensors").write_bytes(b"")
    (root / "garbage.bin").write_bytes(np.random.default_rng(0).bytes(4096))
    (root / "bad.json").write_text('{"physical_to_logical_map": [[1e400, -1, "x"]]}')
    if not (root / "fifo").exists():
        os.mkfifo(root / "fifo")
    if not (root / "link").exists():
        os.symlink(root / "file", root / "link")
    counts = np.random.default_rng(1).integers(0, 50, size=(60, 4, 16)).astype(np.int32)
    valid = Trace.from_counts(counts, is_prefill=np.arange(60) % 3 == 0, meta={"top_k": 2})
    valid.save(root / "valid.safetensors")
    valid.save(root / "valid.npz")
    inputs = {
        str(root / "missing.safetensors"): True,
        str(root / "folder"): True,
        str(root / "file" / "under"): True,
        str(root / "empty.safetensors"): True,
        str(root / "garbage.bin"): True,
        str(root / "bad.json"): True,
        str(root / "fifo"): True,
        "/dev/null": True,
        str(root / "valid.safetensors"): False,
        str(root / "valid.npz"): False,
    }
    outputs = {
        str(root / "new" / "out.json"): False,
        str(root / "odd name\nwith a newline.json"): False,
        str(root / "folder"): False,  # a folder output (solve, --plots) may be one
        str(root / "file" / "under"): True,
        str(root / "fifo"): True,
        str(root / "link"): True,
        "/dev/null": True,
    }
    return Files(inputs, outputs)


def _values(arg: Arg, files: Files) -> st.SearchStrategy[list[Value]]:
    if arg.kind in ("int", "float"):
        one = _numbers(arg)
    elif arg.kind == "input":
        one = st.sampled_from(sorted(files.inputs)).map(lambda p: Value(p, files.inputs[p]))
    elif arg.kind == "output":
        one = st.sampled_from(sorted(files.outputs)).map(lambda p: Value(p, files.outputs[p]))
    elif arg.kind == "rank-failure":
        number = _numbers(Arg("--rank-failure", "int", False))
        one = st.tuples(number, number).map(
            lambda pair: Value(f"{pair[0].text}:{pair[1].text}", pair[0].invalid or pair[1].invalid)
        )
    else:
        number = _numbers(Arg("--solver-option", "float", False))
        one = number.map(lambda v: Value(f"time_budget_s={v.text}", v.invalid))
    return st.lists(one, min_size=1, max_size=2 if arg.many else 1)


def _base(command: str, root: Path) -> list[str]:
    """A cheap command line that succeeds as it is."""
    tiny = ["--preset", "tiny", "--steps", "60", "--disable-tqdm"]
    return {
        "workload": ["workload", *tiny, "--out", str(root / "w.npz")],
        "trace": ["trace", "info", str(root / "valid.safetensors"), "--disable-tqdm"],
        "simulate": ["simulate", *tiny, "--no-timeline", "--eplb-rebalance-num-iterations", "20"],
        "sweep": ["sweep", *tiny, "--intervals", "20", "--redundant", "4"],
        "solve": ["solve", *tiny, "--out", str(root / "solved")],
        "demo": ["demo", "--nproc", "1", "--steps", "5"],
        "dashboards": ["dashboards", "--out", str(root / "dashboards")],
    }[command]


class Hang(BaseException):
    """A run past DEADLINE_S (a BaseException, so no handler of eplb's takes it for an error)."""


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    def fire(signum: int, frame: object) -> None:
        raise Hang(f"no answer in {seconds} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_eplb(argv: list[str]) -> tuple[int, str]:
    """``eplb ARGV`` in-process: (exit status, stderr)."""
    err, out = io.StringIO(), io.StringIO()
    with _deadline(DEADLINE_S), contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's own exits
            code = exc.code if isinstance(exc.code, int) else 2
    return code, err.getvalue()


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    top = build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


COMMANDS = sorted(_subcommands())


def test_every_subcommand_has_swept_arguments() -> None:
    for command, parser in _subcommands().items():
        assert _swept(parser), command
    assert {a.name for a in _swept(_subcommands()["demo"])} >= {"--hidden", "--duration-s", "--json"}


def test_the_server_flags_are_swept_in_every_command_that_takes_them() -> None:
    """Every numeric server flag (SGLang's names, eplb.config.SERVER_FLAGS) is among the swept
    arguments of each subcommand whose parser has it, so the oracle sees their bounds too."""
    numeric = {flag.name for flag in SERVER_FLAGS if getattr(flag.parse, "__name__", "") in ("int", "float")}
    assert "--eplb-transfer-gbps" in numeric and "--ep-num-redundant-experts" in numeric
    taken = {}
    for command, parser in _subcommands().items():
        declared = {action.option_strings[0] for action in parser._actions if action.option_strings}
        taken[command] = declared & numeric
        assert taken[command] <= {arg.name for arg in _swept(parser)}, command
    for command in ("simulate", "sweep", "solve", "demo"):
        assert taken[command], command


@pytest.mark.parametrize("command", COMMANDS)
def test_no_value_gives_a_traceback_a_hang_or_success_when_invalid(
    command: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = tmp_path_factory.mktemp(f"sweep-{command}")
    files = _files(root)
    swept = _swept(_subcommands()[command])
    base = _base(command, root)
    assert run_eplb(base)[0] == 0, "the base command line must succeed"

    pairs = st.sampled_from(swept).flatmap(lambda arg: _values(arg, files).map(lambda values: (arg, values)))

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(st.lists(pairs, min_size=1, max_size=3, unique_by=lambda pair: pair[0].name))
    def check(drawn: list[tuple[Arg, list[Value]]]) -> None:
        argv = list(base)
        for arg, values in drawn:
            if arg.name in ("inputs",):  # the positional: replace trace's input files
                argv = [argv[0], argv[1], *(v.text for v in values), *argv[3:]]
            else:
                argv += (
                    [arg.name, *(v.text for v in values)] if arg.many else [f"{arg.name}={values[0].text}"]
                )
        code, err = run_eplb(argv)
        assert "Traceback" not in err, (argv, err)
        assert code in (0, 2), (argv, code, err)
        if code == 2:
            assert err.count("\n") == 1 and err.startswith(f"eplb {command}: error: "), (argv, err)
        invalid = [v.text for _, values in drawn for v in values if v.invalid]
        assert not invalid or code == 2, (" ".join(argv), "succeeded with", invalid)

    check()
