"""Which tests are slow: the one list ``python -m pytest`` leaves out and ``python -m pytest -m slow`` runs.

The default run (pyproject's ``addopts``: ``-m "not slow"``) checks every module's behaviour in a
few minutes on 2 cores; the slow set is the rest, and CI runs both (.ci/run). A test is slow when
its file is in ``SLOW_FILES``, its node id is in ``SLOW_TESTS`` (a name without ``[params]`` takes
every parametrisation), it uses a fixture in ``SLOW_FIXTURES``, or it carries ``@pytest.mark.slow``
itself. tests/conftest.py marks the first three at collection; tests/test_suite.py checks that every
test is in exactly one set and that every name here still marks some test.
"""

from __future__ import annotations

from collections.abc import Iterable

SLOW_FIXTURES: dict[str, str] = {
    "engine_site": "installs vLLM's and SGLang's wheels from PyPI (a minute, once) and runs them in subprocesses",
}
"""Fixture name -> why every test that uses it is slow."""

SLOW_FILES: dict[str, str] = {}
"""Test file (from the repository root) -> why all of it is slow."""

SLOW_TESTS: dict[str, str] = {}
"""Test node id, with or without its ``[params]`` -> why it is slow."""


def slow_reason(nodeid: str, fixturenames: Iterable[str]) -> str | None:
    """The entry of the lists above that makes a test slow, or None (its own marker may still do)."""
    file = nodeid.partition("::")[0]
    if file in SLOW_FILES:
        return file
    if nodeid in SLOW_TESTS:
        return nodeid
    unparametrised = nodeid.partition("[")[0]
    if unparametrised in SLOW_TESTS:
        return unparametrised
    return next((f"fixture {f}" for f in fixturenames if f in SLOW_FIXTURES), None)
