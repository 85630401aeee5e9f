"""``eplb solve`` writes its output folder all or nothing: stopped at any rename it makes (SIGKILL,
SIGINT, SIGTERM), the folder holds the whole old set or the whole new set, never a mix, and no
temporary file or folder is left once the next run has started (at once after SIGINT / SIGTERM).

The stops are deterministic: the subprocess wraps ``os.rename``, ``os.replace`` and
``eplb.fileio._exchange`` (the folder swap) and signals itself just before or just after the
N-th call, for every N a full run makes. Without an atomic exchange (other systems, some file
systems) the commit takes two renames; killed between them the folder is briefly absent, and the
next run's sweep puts the old set back.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from eplb.cli import main
from eplb.fileio import OutputPathError, OutputSet, sweep_stale, write_text

ROOT = Path(__file__).resolve().parents[1]
SOLVE = ["solve", "--preset", "tiny", "--steps", "30", "--ep-size", "4", "--nnodes", "1"]
SOLVE += ["--ep-num-redundant-experts", "4", "--eplb-algorithm", "deepseek", "--disable-tqdm"]

STOP_SCRIPT = """
import json, os, signal, sys
import eplb.fileio as fileio

point, when, signame, exchange, count_to = sys.argv[1:6]
calls = [0]

def stop_at(real):
    def wrapped(*args, **kwargs):
        calls[0] += 1
        hit = calls[0] == int(point)
        if hit and when == "before":
            os.kill(os.getpid(), getattr(signal, signame))
        result = real(*args, **kwargs)
        if hit and when == "after":
            os.kill(os.getpid(), getattr(signal, signame))
        return result
    return wrapped

os.rename, os.replace = stop_at(os.rename), stop_at(os.replace)
fileio._exchange = stop_at(fileio._exchange if exchange == "1" else (lambda a, b: False))
from eplb.cli import main
code = main(sys.argv[6:])
with open(count_to, "w") as f:
    json.dump(calls[0], f)
sys.exit(code)
"""

EXIT = {"SIGKILL": -signal.SIGKILL, "SIGINT": 130, "SIGTERM": 143}


def _state(folder: Path) -> dict[str, Any] | None:
    """What the folder holds, by content (safetensors' metadata order varies between runs)."""
    if not folder.exists():
        return None
    from safetensors import safe_open

    state: dict[str, Any] = {}
    for path in sorted(folder.iterdir()):
        if path.suffix == ".safetensors":
            with safe_open(str(path), framework="np") as f:
                state[path.name] = (f.metadata(), {k: f.get_tensor(k).tobytes() for k in f.keys()})  # noqa: SIM118
        else:
            state[path.name] = path.read_bytes()
    return state


def _restore(folder: Path, files: dict[str, bytes]) -> None:
    if folder.exists():
        for path in folder.iterdir():
            path.unlink()
    folder.mkdir(exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)


def _leftovers(tmp_path: Path) -> list[str]:
    """Temporary files and folders anywhere under ``tmp_path`` (eplb's start with a dot)."""
    return sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob(".*"))


def _stopped_run(tmp_path: Path, argv: list[str], point: int, when: str, sig: str, exchange: bool) -> int:
    count = tmp_path / "calls.json"
    done = subprocess.run(
        [sys.executable, "-c", STOP_SCRIPT, str(point), when, sig, str(int(exchange)), str(count), *argv],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert done.returncode == (0 if point == 0 else EXIT[sig]), done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    if point == 0:
        calls = int(json.loads(count.read_text()))
        count.unlink()
        return calls
    return 0


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_solve_stopped_at_every_rename_leaves_the_old_or_the_new_set(tmp_path: Path, exchange: bool) -> None:
    out = tmp_path / "plan"
    argv = [*SOLVE, "--out", str(out), "--json", str(out / "result.json")]
    assert main([*argv, "--seed", "0"]) == 0
    old = _state(out)
    old_files = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main([*argv, "--seed", "1"]) == 0
    new = _state(out)
    assert old is not None and new is not None and sorted(old) == sorted(new) and len(old) == 5
    assert all(old[name] != new[name] for name in old if name != "trtllm_extra_llm_api_options.yaml")
    _restore(out, old_files)
    new_argv = [*argv, "--seed", "1"]
    points = _stopped_run(tmp_path, new_argv, 0, "before", "SIGKILL", exchange)  # counts the renames
    assert points >= (1 if exchange else 3)
    signals = ["SIGKILL", "SIGINT", "SIGTERM"] if exchange else ["SIGKILL", "SIGINT"]
    for point in range(1, points + 1):
        for when in ("before", "after"):
            for sig in signals:
                _restore(out, old_files)
                _stopped_run(tmp_path, new_argv, point, when, sig, exchange)
                case = (point, when, sig)
                if sig != "SIGKILL":
                    assert _state(out) in (old, new), case
                    assert _leftovers(tmp_path) == [], case  # cleaned up on the way out
                    continue
                if not exchange and _state(out) is None:
                    # Killed between the two renames: the next run's sweep puts the old set back.
                    sweep_stale(out)
                    assert _state(out) == old, case
                assert _state(out) in (old, new), case
                # The next run sweeps what the killed one left, then commits its own set.
                assert main([*argv, "--seed", "0"]) == 0
                assert _state(out) == old and _leftovers(tmp_path) == [], case


def test_a_first_run_killed_at_its_rename_leaves_no_folder_or_the_new_set(tmp_path: Path) -> None:
    out = tmp_path / "plan"
    argv = [*SOLVE, "--out", str(out)]
    points = _stopped_run(tmp_path, argv, 0, "before", "SIGKILL", True)
    for point in range(1, points + 1):
        for when in ("before", "after"):
            _stopped_run(tmp_path, argv, point, when, "SIGKILL", True)
            state = _state(out)
            assert state is None or len(state) == 4, (point, when)
            assert main(argv) == 0
            assert _leftovers(tmp_path) == [] and len(_state(out) or {}) == 4
            for path in out.iterdir():
                path.unlink()
            out.rmdir()


def test_output_folder_holds_only_its_set(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan"
    argv = [*SOLVE, "--out", str(out)]
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert main(argv) == 2  # refused before any work: the folder would be replaced as a whole
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds notes.txt" in err
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and _leftovers(tmp_path) == []
    (out / "notes.txt").unlink()
    assert main([*argv, "--json", str(out / "sub" / "r.json")]) == 2
    assert "subfolder" in capsys.readouterr().err
    # A symlink to the folder: the folder it names is replaced, the symlink stays.
    os.symlink(out, tmp_path / "link")
    assert main([*SOLVE, "--out", str(tmp_path / "link"), "--json", str(tmp_path / "r.json")]) == 0
    assert (tmp_path / "link").is_symlink() and len(list(out.iterdir())) == 4
    assert json.loads((tmp_path / "r.json").read_text())["placement"] == str(
        tmp_path / "link" / "placement.safetensors"
    )


def test_a_killed_writer_of_one_file_leaves_nothing_after_the_next_write(tmp_path: Path) -> None:
    target = tmp_path / "r.json"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    (tmp_path / f".r.json.{int(dead.stdout)}.abcdefgh.tmp").write_text("partial")  # its writer is gone
    live = tmp_path / f".r.json.{os.getpid()}.abcdefgh.tmp"  # this process runs: kept
    live.write_text("live")
    write_text(target, "{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name, "r.json"]
    with OutputSet(folder=tmp_path / "set") as outputs:
        write_text(tmp_path / "set" / "a", "a", outputs=outputs)
        with pytest.raises(OutputPathError, match="twice"):
            write_text(tmp_path / "set" / "a", "b", outputs=outputs)
    assert (tmp_path / "set" / "a").read_text() == "a"
