"""Engine load windows kept as eplb traces: vLLM's windows through the plugin, bounded, never fatal."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from eplb.integrations.vllm import DUMP_ENV, EplbVllmPolicy
from eplb.traces import load_trace
from eplb.traces.window_log import ROW_MEANING, WindowLog, WindowLogs


def windows(seed: int, n: int, shape: tuple[int, int] = (3, 8)) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1000, size=shape).astype(np.float64) for _ in range(n)]


def test_vllm_plugin_keeps_every_window_it_plans_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(DUMP_ENV, str(tmp_path / "dump"))
    EplbVllmPolicy.reset()
    got = windows(0, 3)
    got.insert(1, np.zeros((3, 8)))  # a profile run's empty window is not load: not kept
    for load_LE in got:
        phy2log = EplbVllmPolicy.rebalance_experts(torch.from_numpy(load_LE), 12, 1, 1, 4)
        assert tuple(phy2log.shape) == (3, 12)
    (path,) = (tmp_path / "dump").iterdir()
    assert path.name == "vllm_expert_load_3x8.safetensors"
    trace = load_trace(path)
    expected = np.stack([w for w in got if w.any()])
    assert np.array_equal(trace.counts_FLE, expected.astype(np.int32))
    assert trace.meta["source"] == "vllm-windows" and trace.meta["row"] == ROW_MEANING
    assert not trace.prefill_known and trace.prefill_note() is not None
    EplbVllmPolicy.reset()


def test_vllm_plugin_writes_nothing_unless_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DUMP_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    EplbVllmPolicy.reset()
    EplbVllmPolicy.rebalance_experts(torch.from_numpy(windows(1, 1)[0]), 12, 1, 1, 4)
    assert list(tmp_path.iterdir()) == []
    EplbVllmPolicy.reset()


def test_window_log_is_bounded_and_checks_rows(tmp_path: Path) -> None:
    log = WindowLog(tmp_path / "w.safetensors", source="test", max_windows=2)
    rows = windows(2, 3)
    for row in rows:
        log.append(row)
    trace = load_trace(tmp_path / "w.safetensors")
    assert np.array_equal(trace.counts_FLE, np.stack(rows[1:]).astype(np.int32))  # the oldest dropped
    assert trace.meta["windows_dropped"] == 1
    with pytest.raises(ValueError, match="differs"):
        log.append(np.ones((2, 8)))
    with pytest.raises(ValueError, match=r"fractional|whole"):
        log.append(np.full((3, 8), 0.5))
    with pytest.raises(ValueError, match="max_windows"):
        WindowLog(tmp_path / "x.safetensors", source="test", max_windows=0)


def test_window_logs_never_raise_into_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("EPLB_TEST_DUMP", str(blocker))
    logs = WindowLogs("test", "EPLB_TEST_DUMP", logging.getLogger("eplb.test"))
    with caplog.at_level(logging.WARNING, logger="eplb.test"):
        assert logs.record(windows(3, 1)[0]) is None
    assert "load window not written" in caplog.text
    monkeypatch.setenv("EPLB_TEST_DUMP", str(tmp_path / "ok"))
    assert logs.record(windows(3, 1)[0]) == tmp_path / "ok" / "test_expert_load_3x8.safetensors"
    assert logs.record(windows(4, 1, (2, 4))[0]) == tmp_path / "ok" / "test_expert_load_2x4.safetensors"
