"""SGLang 0.5.23's window reaches eplb's planner oldest pass first: SGLang's own recorder and
``EPLBManager`` cadence (tests.helpers.sglang_order_checks) against the passes counted here.

SGLang's manager first rebalances after interval + 1 recorded passes, then every interval
passes; its circular buffer holds the last ``buffer`` of them with the write index kept across
dumps, so with the buffer equal to the interval the newest pass sits in row 0 every time.
eplb.integrations.sglang.sglang_time_order must give the last ``buffer`` passes in order.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _windows(site: Path, buffer: int, interval: int, rebalances: int) -> list[dict[str, list[int]]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EPLB_", "VLLM_", "SGLANG_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", "tests.helpers.sglang_order_checks", str(buffer), str(interval),
               str(rebalances), str(out)]  # fmt: skip
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and out.is_file(), done.stderr[-4000:]
        windows: list[dict[str, list[int]]] = json.loads(out.read_text())["windows"]
    return windows


@pytest.mark.parametrize(("buffer", "interval"), [(5, 5), (4, 7), (1, 3), (6, 6)])
def test_sglangs_window_is_put_in_time_order(engine_site: Path, buffer: int, interval: int) -> None:
    rebalances = 4
    windows = _windows(engine_site, buffer, interval, rebalances)
    assert len(windows) == rebalances
    for k, window in enumerate(windows):
        seen = interval + 1 + k * interval  # passes recorded when SGLang dumps its window k
        expected = list(range(seen - buffer + 1, seen + 1))  # pass n counts n tokens (1-based)
        assert window["eplb"] == expected, (k, window)
        assert sorted(window["sglang"]) == expected  # the same passes, in SGLang's rows
        if buffer == interval:
            assert window["sglang"][0] == seen  # the newest pass in row 0, every time


def test_a_window_is_rolled_only_when_it_is_the_circular_buffers() -> None:
    import types

    import torch

    from eplb.integrations.sglang import sglang_time_order

    window = torch.arange(5).reshape(5, 1, 1)
    circular = types.SimpleNamespace(_buffer=torch.zeros(5, 1, 1), _curr_index=2)
    assert sglang_time_order(window, circular).flatten().tolist() == [2, 3, 4, 0, 1]
    other_length = types.SimpleNamespace(_buffer=torch.zeros(4, 1, 1), _curr_index=2)
    unbounded = types.SimpleNamespace(_buffer=torch.zeros(5, 1, 1), _size=5)  # SGLang's _InfiniteBuffer
    for buffer in (other_length, unbounded):
        assert sglang_time_order(window, buffer) is window
    load_LE = window[0]
    assert sglang_time_order(load_LE, circular) is load_LE  # a load file's [L, E]
    assert sglang_time_order(window) is window  # no SGLang recorder in this process
