"""Every test is in exactly one of the two sets CI runs, and every name in tests/suite.py marks a test.

``python -m pytest`` (the default set: pyproject's ``addopts`` deselect ``slow``) and ``python -m
pytest -m slow`` (the rest) are collected here as CI runs them, in subprocesses, with a probe
(tests.helpers.suite_probe) that also records every test found before selection: the two sets are
disjoint and together the whole suite, and the suite is every ``test_*.py`` file on disk, so no
``-k``, ``--deselect``, ``--ignore`` or marker expression in the configuration can drop a test
from both. A name in the slow lists that marks no test (a file or test renamed, a fixture gone, an
entry already covered by its file's) fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests import suite
from tests.helpers.suite_probe import PROBE_ENV

ROOT = Path(__file__).resolve().parents[1]
SETS = {"default": (), "slow": ("-m", "slow")}
"""Each set's pytest arguments after ``python -m pytest`` (README, .ci/run)."""


def _collect(tmp: Path, name: str, args: tuple[str, ...]) -> dict[str, Any]:
    out = tmp / f"{name}.json"
    argv = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "tests.helpers.suite_probe", *args]
    # CI's environment: no options of this run's caller (PYTEST_ADDOPTS) in the collections
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    done = subprocess.run(
        argv, cwd=ROOT, env={**env, PROBE_ENV: str(out)}, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, (
        f"{' '.join(argv)} exits {done.returncode}\n{done.stdout[-3000:]}{done.stderr}"
    )
    probe: dict[str, Any] = json.loads(out.read_text())
    return probe


@pytest.fixture(scope="module")
def probes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Both collections at once (each is mostly imports, one core apiece)."""
    tmp = tmp_path_factory.mktemp("suite")
    with ThreadPoolExecutor(len(SETS)) as pool:
        runs = {name: pool.submit(_collect, tmp, name, args) for name, args in SETS.items()}
        return {name: run.result() for name, run in runs.items()}


def test_the_default_and_slow_sets_split_the_whole_suite(probes: dict[str, dict[str, Any]]) -> None:
    default, slow = probes["default"], probes["slow"]
    everything = default["collected"]
    assert slow["collected"] == everything
    assert len(set(everything)) == len(everything)
    in_default, in_slow = set(default["selected"]), set(slow["selected"])
    assert in_default and in_slow
    assert not in_default & in_slow, sorted(in_default & in_slow)[:20]
    left_out = set(everything) - in_default - in_slow
    assert not left_out, f"{len(left_out)} tests in neither set: {sorted(left_out)[:20]}"
    assert in_default | in_slow == set(everything)


def test_the_suite_is_every_test_file_on_disk(probes: dict[str, dict[str, Any]]) -> None:
    on_disk = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")}
    collected = {nodeid.partition("::")[0] for nodeid in probes["default"]["collected"]}
    assert collected == on_disk, (sorted(on_disk - collected), sorted(collected - on_disk))


def test_every_name_in_the_slow_lists_marks_a_test(probes: dict[str, dict[str, Any]]) -> None:
    used = set(probes["default"]["listed"].values())
    names = {*suite.SLOW_FILES, *suite.SLOW_TESTS, *(f"fixture {f}" for f in suite.SLOW_FIXTURES)}
    assert names - used == set(), f"stale or redundant in tests/suite.py: {sorted(names - used)}"
    # what the lists mark is in the slow set
    assert set(probes["default"]["listed"]) <= set(probes["slow"]["selected"])


def test_slow_reason_matches_files_tests_patterns_parametrisations_and_fixtures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(suite, "SLOW_FILES", {"tests/test_a.py": "why"})
    monkeypatch.setattr(
        suite,
        "SLOW_TESTS",
        {"tests/test_b.py::test_x": "why", "tests/test_b.py::test_y[1]": "w", "tests/test_d.py::*[4r*]": "w"},
    )
    monkeypatch.setattr(suite, "SLOW_FIXTURES", {"big": "why"})
    cases = {
        ("tests/test_a.py::test_q[3]", ()): "tests/test_a.py",
        ("tests/test_b.py::test_x", ()): "tests/test_b.py::test_x",
        ("tests/test_b.py::test_x[2-a]", ()): "tests/test_b.py::test_x",
        ("tests/test_b.py::test_xy", ()): None,
        ("tests/test_b.py::test_y[1]", ()): "tests/test_b.py::test_y[1]",
        ("tests/test_b.py::test_y[10]", ()): None,
        ("tests/test_c.py::test_z", ("tmp_path", "big")): "fixture big",
        ("tests/test_c.py::test_z", ("tmp_path",)): None,
        ("tests/test_a.pyx::test_q", ()): None,
        ("tests/test_d.py::test_p[4ranks]", ()): "tests/test_d.py::*[4r*]",
        ("tests/test_d.py::test_p[2ranks]", ()): None,
        ("tests/test_d.py::test_p", ()): None,
        ("tests/test_e.py::test_p[4ranks]", ()): None,
    }
    for (nodeid, fixtures), reason in cases.items():
        assert suite.slow_reason(nodeid, fixtures) == reason, nodeid
