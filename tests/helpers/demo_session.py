"""``eplb demo`` in a real subprocess of its own session, and what the signal tests read of it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def session(sid: int) -> dict[int, str]:
    """Live processes of session ``sid``: pid -> command line."""
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat[3]) == sid and stat[0] != "Z":
            found[int(entry)] = cmdline
    return found


def wait_for(condition: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@contextmanager
def demo_session(*argv: str) -> Iterator[subprocess.Popen[str]]:
    """``eplb demo ARGV`` in its own session (as a terminal or a service manager runs it), its
    output piped; whatever of the session is left at the end is killed."""
    demo = subprocess.Popen(
        [sys.executable, "-m", "eplb", "demo", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        yield demo
    finally:
        for pid in session(demo.pid):
            os.kill(pid, signal.SIGKILL)


def wait_serving(demo: subprocess.Popen[str]) -> None:
    """Until the demo prints a pass line: every rank joined the group and serves."""
    assert demo.stdout is not None
    while "pass" not in (line := demo.stdout.readline()):
        assert line, "the demo ended before serving"
