"""Every CLI and API input bounded before it is used: flag values, sizes, flags' types, trace files
larger than memory, a rank that dies under ``eplb demo``.

A bad value ends in one line on stderr and exit status 2, before anything is allocated from it; a
trace is mapped, not read, so one larger than memory costs page cache, and one larger than the
address space is refused in one line; a killed rank of the demo is reported in one line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from eplb.cli import main
from eplb.commands.sizes import MAX_DEMO_RANKS, workload_bytes
from eplb.config import SERVER_FLAGS, parse_config
from eplb.fileio import MemoryLimitError, check_memory, memory_headroom
from eplb.flags import float_in, int_in
from eplb.placement.model import Placement
from eplb.recorder.recorder import ExpertDistributionRecorder, RecorderConfig
from eplb.traces import Trace, load_trace
from eplb.traces.checks import MAX_SLOTS
from eplb.workloads import PRESETS, WorkloadConfig, generate
from tests.helpers.demo_session import demo_session, session, wait_for, wait_serving

ROOT = Path(__file__).resolve().parents[1]


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run ``eplb ARGV`` in-process; it must end in one stderr line and exit status 2."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's refusals exit, as argparse does
        code = exc.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert code == 2, (argv, code, err)
    assert err.count("\n") == 1 and err.startswith(f"eplb {argv[0]}: error: "), (argv, err)
    assert "Traceback" not in err
    return err


# ---- the shared parsers ----------------------------------------------------------------------
def _reference_int(text: str, low: int | None, high: int | None) -> int | None:
    """What a bounded whole-number flag must take: plain decimal digits, within the bounds."""
    body = text.strip()
    digits = body[1:] if body[:1] in "+-" else body
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 30:
        return None
    value = int(body)
    return value if (low is None or value >= low) and (high is None or value <= high) else None


@pytest.mark.parametrize("bounds", [(0, None), (1, 64), (None, 5)])
def test_int_in_takes_exactly_the_whole_numbers_in_its_range(bounds: tuple[int | None, int | None]) -> None:
    parse = int_in(*bounds)
    texts = ["0", "1", "-1", "64", "65", "5", "6", "+3", " 7", "1.0", "1e3", "0x10", "nan", "inf", "",
             "٣", "9" * 30, "9" * 31, "-" + "9" * 40, "1_000", "true"]  # fmt: skip
    for text in texts:
        expected = _reference_int(text, *bounds)
        if expected is None:
            with pytest.raises(argparse.ArgumentTypeError, match="expected a whole number"):
                parse(text)
        else:
            assert parse(text) == expected, text


def test_float_in_refuses_nan_infinities_and_values_out_of_range() -> None:
    positive, share = float_in(0, above=True), float_in(0, 1)
    for text in [
        "nan",
        "NaN",
        "-nan",
        "inf",
        "-inf",
        "Infinity",
        "1e400",
        "0",
        "-0.0",
        "-1",
        "x",
        "",
        "٣",
        "1_0",
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match="expected a finite number > 0"):
            positive(text)
    assert positive("1e-300") == 1e-300 and positive("3") == 3.0
    assert [share(t) for t in ("0", "1", "0.25", "-0.0")] == [0.0, 1.0, 0.25, 0.0]
    for text in ["1.0000001", "-1e-9", "nan"]:
        with pytest.raises(argparse.ArgumentTypeError, match=r"in \[0, 1\]"):
            share(text)
    long = "1" * 5000
    with pytest.raises(argparse.ArgumentTypeError) as exc:
        int_in(0)(long)
    assert len(str(exc.value)) < 120  # a huge value is not echoed whole


# ---- the cases, one line and exit 2 ----------------------------------------------------
TINY = ["--preset", "tiny", "--steps", "40", "--disable-tqdm"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["demo", "--nproc", "1", "--hidden", "0"], "error: --hidden: expected a whole number >= 1, got 0"),
        (["demo", "--nproc", "1", "--hidden", "-1"], "--hidden"),
        (["demo", "--nproc", "1", "--intermediate", "0"], "--intermediate"),
        (["demo", "--nproc", "1", "--duration-s", "nan"], "error: --duration-s: expected a finite number > 0"),
        (["demo", "--nproc", "1", "--duration-s", "-1"], "--duration-s"),
        (["demo", "--nproc", "1", "--duration-s", "inf"], "--duration-s"),
        (["demo", "--nproc", str(MAX_DEMO_RANKS + 1)], f"--nproc: expected a whole number in [1, {MAX_DEMO_RANKS}]"),
        (["demo", "--nproc", "x"], "--nproc"),
        (["demo", "--nproc", "1", "--metrics-port", "65536"], "--metrics-port"),
        (["demo", "--nproc", "1", "--num-experts", "0"], "--num-experts"),
        (["workload", "--seed", "-1"], "--seed"),
        (["workload", "--steps", "1.5"], "--steps"),
        (["simulate", *TINY, "--prefill-fraction", "nan"], "--prefill-fraction"),
        (["simulate", *TINY, "--cost-base-us", "inf"], "--cost-base-us"),
        (["simulate", *TINY, "--nvlink-gbps", "0"], "--nvlink-gbps"),
        (["sweep", *TINY, "--target", "nan"], "--target"),
        (["sweep", *TINY, "--intervals", "0"], "--intervals"),
        (["sweep", *TINY, "--tradeoff", "--budgets", "-1"], "--budgets"),
        (["solve", *TINY], "the following arguments are required: --out"),
        (["sweep", *TINY, "--intervals", "20", "--redundant", "4", "-inf"], "unrecognized arguments: -inf"),
        # Flags the command would ignore.
        (["demo", "--nproc", "2", "--ep-size", "4"], "--ep-size 4: the demo's EP ranks are the processes --nproc starts"),
        (["sweep", *TINY, "--intervals", "20", "--plots", "out"], "--plots: only --tradeoff draws a plot"),
        (["sweep", *TINY, "--init-expert-location", "x.json"], "--init-expert-location: eplb sweep starts every point"),
        (["demo", "--nproc", "1", "--init-expert-location", "/dev/null"], "/dev/null"),
        (["demo", "--nproc", "1", "--ep-dispatch-algorithm", "auto"], "the demo's model runs one dispatch mode"),
        # The server's flags (SGLang's names), in every command that takes them.
        (["simulate", *TINY, "--eplb-rebalance-num-iterations", "0"], "error: --eplb-rebalance-num-iterations: expected a whole number in [1, 1000000], got 0"),
        (["sweep", *TINY, "--eplb-rebalance-num-iterations", "-5"], "--eplb-rebalance-num-iterations"),
        (["solve", *TINY, "--out", "o", "--expert-distribution-recorder-buffer-size", "0"], "--expert-distribution-recorder-buffer-size"),
        (["simulate", *TINY, "--expert-distribution-recorder-buffer-size", "1e3"], "--expert-distribution-recorder-buffer-size"),
        (["demo", "--nproc", "1", "--expert-distribution-recorder-buffer-size", str(10**7)], "--expert-distribution-recorder-buffer-size"),
        (["simulate", *TINY, "--ep-num-redundant-experts", "-1"], "error: --ep-num-redundant-experts: expected a whole number"),
        (["sweep", *TINY, "--ep-num-redundant-experts", str(10**11)], "--ep-num-redundant-experts"),
        (["demo", "--nproc", "1", "--ep-num-redundant-experts", "nan"], "--ep-num-redundant-experts"),
        (["simulate", *TINY, "--eplb-max-moved-experts", "-1"], "--eplb-max-moved-experts"),
        (["demo", "--nproc", "1", "--eplb-max-moved-experts", "1.5"], "--eplb-max-moved-experts"),
        (["simulate", *TINY, "--eplb-shift-burst", "0"], "--eplb-shift-burst"),
        (["simulate", *TINY, "--eplb-rebalance-layers-per-chunk", "0"], "--eplb-rebalance-layers-per-chunk"),
        (["demo", "--nproc", "1", "--eplb-rebalance-layers-per-chunk", "-1"], "--eplb-rebalance-layers-per-chunk"),
        (["simulate", *TINY, "--eplb-rebalance-mode", "continuous", "--eplb-transfer-gbps", "nan"], "error: --eplb-transfer-gbps: expected a finite number > 0, got 'nan'"),
        (["simulate", *TINY, "--eplb-rebalance-mode", "continuous", "--eplb-transfer-gbps", "inf"], "--eplb-transfer-gbps"),
        (["demo", "--nproc", "1", "--eplb-transfer-gbps", "0"], "--eplb-transfer-gbps"),
        (["simulate", *TINY, "--eplb-min-rebalancing-utilization-threshold", "nan"], "--eplb-min-rebalancing-utilization-threshold"),
        (["sweep", *TINY, "--eplb-min-rebalancing-utilization-threshold", "1.5"], "--eplb-min-rebalancing-utilization-threshold"),
        (["solve", *TINY, "--out", "o", "--ep-size", "0"], "--ep-size"),
        (["simulate", *TINY, "--ep-size", "-4"], "--ep-size"),
        (["simulate", *TINY, "--nnodes", "0"], "--nnodes"),
        (["demo", "--nproc", "1", "--num-experts", "-1"], "--num-experts"),
        (["demo", "--nproc", "1", "--num-experts", str(10**6)], "--num-experts"),
    ],
)  # fmt: skip
def test_bad_values_end_in_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    assert needle in _error(capsys, argv)


def test_every_numeric_server_flag_is_bounded_where_parsed(capsys: pytest.CaptureFixture[str]) -> None:
    """The server's flags (eplb.config.SERVER_FLAGS) read numbers through int_in/float_in only: an
    engine's own parser (eplb.config.add_cli_args) refuses NaN, infinities, fractions and values out
    of range when it parses, in one line naming the flag, as eplb's commands do."""
    numeric = [flag for flag in SERVER_FLAGS if getattr(flag.parse, "__name__", "") in ("int", "float")]
    assert {flag.name for flag in numeric} >= {
        "--ep-num-redundant-experts", "--eplb-rebalance-num-iterations", "--expert-distribution-recorder-buffer-size",
        "--eplb-transfer-gbps", "--eplb-min-rebalancing-utilization-threshold", "--ep-size",
    }  # fmt: skip
    for flag in numeric:
        assert flag.parse not in (int, float), f"{flag.name} is parsed plainly"
        for bad in ("nan", "inf", "-1", "1e400", "x"):
            capsys.readouterr()
            with pytest.raises(SystemExit) as exc:
                parse_config([flag.name, bad], prog="server")
            err = capsys.readouterr().err.splitlines()
            assert exc.value.code == 2 and err[-1].startswith(f"server: error: argument {flag.name}"), (
                bad,
                err,
            )


def test_huge_sizes_are_refused_before_allocation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--steps and redundant counts past memory or past a placement's slots, in every command
    that takes them: refused at once, naming the flag and the limit, before any array exists."""
    real_empty = np.empty

    def small_only(shape: object, *args: object, **kwargs: object) -> np.ndarray:
        size = math.prod(shape) if isinstance(shape, tuple) else int(shape)  # type: ignore[call-overload]
        assert size < 1 << 28, f"allocated {shape} before refusing"
        return real_empty(shape, *args, **kwargs)  # type: ignore[call-overload,no-any-return]

    monkeypatch.setattr(np, "empty", small_only)
    headroom, _ = memory_headroom()
    steps = str(headroom // workload_bytes(1, 4, 16) + 1)  # one step more than memory holds
    out = str(tmp_path / "out")
    for command in (["workload"], ["simulate"], ["sweep"], ["solve", "--out", out], ["demo", "--nproc", "1"]):
        err = _error(capsys, [*command, "--preset", "tiny", "--steps", steps])
        assert f"--steps {steps} of the tiny workload" in err and "more than this process can have" in err
    for command in (["simulate", *TINY], ["solve", "--out", out, *TINY], ["demo", "--nproc", "1"]):
        err = _error(capsys, [*command, "--ep-num-redundant-experts", str(MAX_SLOTS)])
        assert f"past the {MAX_SLOTS} physical slots" in err
    assert f"past the {MAX_SLOTS}" in _error(capsys, ["sweep", *TINY, "--redundant", "4", str(MAX_SLOTS)])
    assert "--ep-size" in _error(capsys, ["simulate", *TINY, "--ep-size", str(MAX_SLOTS + 1)])
    err = _error(capsys, ["demo", "--nproc", "2", "--hidden", "100000", "--intermediate", "100000"])
    assert "--hidden 100000 --intermediate 100000" in err
    assert not (tmp_path / "out").exists()


def test_the_workload_size_bound_covers_what_generate_allocates() -> None:
    """workload_bytes is what a generated trace holds (its arrays, measured), not less."""
    for preset in ("tiny", "mixtral-8x7b"):
        trace = generate(WorkloadConfig(preset=preset, num_steps=300, seed=1))
        held = trace.counts_FLE.nbytes + trace.is_prefill_F.nbytes + trace.num_tokens_F.nbytes
        m = PRESETS[preset]
        assert held <= workload_bytes(300, m.num_layers, m.num_experts) <= 1.1 * held


def test_check_memory_names_what_asked_and_the_limit() -> None:
    headroom, bound = memory_headroom()
    check_memory(headroom, "exactly the headroom")
    with pytest.raises(
        MemoryLimitError, match=f"--steps 7 needs .* more than this process can have: .*{bound}"
    ):
        check_memory(headroom + 1, "--steps 7")


def test_a_memory_error_no_check_caught_still_ends_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import eplb.commands.workload

    def run(args: argparse.Namespace) -> int:
        raise MemoryError("Unable to allocate 745. GiB for an array with shape (100000000000,)")

    monkeypatch.setattr(eplb.commands.workload, "run", run)
    err = _error(capsys, ["workload"])
    assert "out of memory (Unable to allocate 745. GiB" in err


def test_trace_info_refuses_an_output_it_would_not_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = Trace.from_counts(np.ones((3, 2, 4), np.int32)).save(tmp_path / "t.safetensors")
    err = _error(capsys, ["trace", "info", str(src), "--out", str(tmp_path / "o.npz")])
    assert "--out: info writes no trace" in err and not (tmp_path / "o.npz").exists()


def test_the_demo_starts_from_its_init_expert_location(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One rank skips every rebalance, so the placement it ends on is the one it was given; one
    that does not fit the model is refused before any rank starts."""
    phy2log = np.array([[15, *np.roll(np.arange(15), 2), 7]] * 4)  # every expert, 7 twice: not trivial
    given = Placement.from_phy2log(phy2log, 1)
    path = tmp_path / "loc.json"
    path.write_text(json.dumps(given.to_sglang_dict()))
    capsys.readouterr()
    assert (
        main(["demo", "--nproc", "1", "--steps", "3", "--init-expert-location", str(path), "--json", "-"])
        == 0
    )
    assert json.loads(capsys.readouterr().out)["phy2log"] == phy2log.tolist()
    small = tmp_path / "small.json"
    small.write_text(json.dumps(Placement.trivial(4, 16, 1, 2).to_sglang_dict()))
    err = _error(capsys, ["demo", "--nproc", "1", "--init-expert-location", str(small)])
    assert "P=18] on 1 GPUs / 1 nodes, but the tiny model on --nproc 1 needs [L=4, E=16, P=17]" in err


# ---- API types ---------------------------------------------------------------------------------
def test_the_recorder_takes_only_bools_for_its_flags() -> None:
    rec = ExpertDistributionRecorder(RecorderConfig(mode="stat", window=3), Placement.trivial(1, 4, 2, 2))
    rec.start()
    for bad in ["no", "", 1, 0, 0.5, None, torch.tensor(True), np.float64(1.0)]:
        with pytest.raises(TypeError, match="has_prefill must be a bool"):
            rec.begin_pass(has_prefill=bad, num_tokens=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="any_rank_prefill must be a bool"):
        rec.begin_pass(has_prefill=False, num_tokens=3, any_rank_prefill="no")  # type: ignore[arg-type]
    rec.begin_pass(has_prefill=np.bool_(True), num_tokens=3, any_rank_prefill=None)  # type: ignore[arg-type]
    rec.end_pass()
    rec.begin_pass(has_prefill=False, num_tokens=3, any_rank_prefill=True)


# ---- traces larger than memory -----------------------------------------------------------------
def sparse_trace(path: Path, nbytes: int, layers: int = 58, experts: int = 256) -> int:
    """An eplb safetensors trace of about ``nbytes`` of zero counts that takes no disk (a hole
    made by truncate); returns its steps."""
    F = nbytes // (layers * experts * 4)
    sizes = {"counts": F * layers * experts * 4, "is_prefill": F, "num_tokens": F * 8}
    dtypes = {"counts": ("I32", [F, layers, experts]), "is_prefill": ("U8", [F]), "num_tokens": ("I64", [F])}
    header: dict[str, object] = {}
    at = 0
    for name, (dtype, shape) in dtypes.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + sizes[name]]}
        at += sizes[name]
    header["__metadata__"] = {"format": "eplb-trace", "version": "1", "meta": "{}"}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + at)
    return F


def test_a_mapped_trace_equals_the_saved_one_and_shares_the_files_pages(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    trace = Trace.from_counts(
        rng.integers(0, 1000, size=(37, 3, 8)),
        is_prefill=rng.random(37) < 0.5,
        num_tokens=rng.integers(0, 5000, size=37),
        meta={"top_k": 2},
    )
    path = trace.save(tmp_path / "t.safetensors")
    loaded = load_trace(path)
    assert loaded.equals(trace)
    assert not loaded.counts_FLE.flags.writeable and not loaded.counts_FLE.flags.owndata  # a view of the map
    npz = load_trace(trace.save(tmp_path / "t.npz"))
    assert npz.equals(trace)
    empty = Trace.from_counts(np.zeros((0, 2, 4), np.int32), is_prefill=np.zeros(0, bool))
    assert load_trace(empty.save(tmp_path / "e.safetensors")).equals(empty)


def _python(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``script`` in a fresh interpreter from the repository root."""
    return subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120, cwd=ROOT
    )


_RSS_SCRIPT = """
import json, sys
from eplb.commands.trace import describe
from eplb.traces import load_trace

def anon():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))

before = anon()
trace = load_trace(sys.argv[1])
facts = describe(trace)  # touches every count
print(json.dumps({"grew": anon() - before, "steps": facts["steps"], "routed": facts["routed_total"]}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_large_trace_costs_page_cache_not_process_memory(tmp_path: Path) -> None:
    """512 MiB of counts read and summed: the process's own (anonymous) memory grows by less than
    a tenth of that; reading the file whole would grow it by all of it."""
    nbytes = 512 << 20
    steps = sparse_trace(tmp_path / "big.safetensors", nbytes)
    done = _python(_RSS_SCRIPT, str(tmp_path / "big.safetensors"))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert (result["steps"], result["routed"]) == (steps, 0)
    assert result["grew"] < nbytes // 10, result


_CAPPED_SCRIPT = """
import resource, sys
from eplb.cli import main

with open("/proc/self/status") as status:
    mapped = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
cap = mapped + (1 << 30)
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS, /proc")
def test_traces_larger_than_the_address_space_are_refused_in_one_line(tmp_path: Path) -> None:
    """A 10 GiB sparse trace, and a 2 GiB file of another format (read whole), with 1 GiB of
    address space left: one line each, exit 2, in seconds."""
    sparse_trace(tmp_path / "huge.safetensors", 10 << 30)
    json_like = tmp_path / "huge.json"
    with open(json_like, "wb") as f:
        f.write(b"{")
        f.truncate(2 << 30)
    for path, how in (
        (tmp_path / "huge.safetensors", "mapping"),
        (json_like, "reading the trace file whole"),
    ):
        start = time.monotonic()
        done = _python(_CAPPED_SCRIPT, "trace", "info", str(path))
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert done.stderr.startswith(f"eplb trace: error: {path}: {how}"), done.stderr
        assert "RLIMIT_AS" in done.stderr and "Traceback" not in done.stderr
        assert time.monotonic() - start < 30


# ---- a rank that dies under eplb demo ----------------------------------------------------------
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSEGV"])
def test_a_killed_rank_ends_the_demo_in_one_line(sig: str) -> None:
    with demo_session("--nproc", "2", "--steps", "20000") as demo:
        wait_serving(demo)
        ranks = [pid for pid, cmd in session(demo.pid).items() if "spawn_main" in cmd]
        assert len(ranks) == 1  # rank 0 runs in the demo's own process
        os.kill(ranks[0], getattr(signal, sig))
        sent = time.monotonic()
        wait_for(lambda: not session(demo.pid), 30, "processes of the demo outlived the killed rank")
        gone = time.monotonic() - sent
        _, err = demo.communicate(timeout=30)
    assert (demo.returncode, err) == (1, f"eplb demo: rank 1 died (killed by {sig})\n")
    assert gone < 10
