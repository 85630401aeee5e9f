"""A pytest plugin that records one collection's tests before and after selection (tests/test_suite.py).

Loaded with ``-p tests.helpers.suite_probe`` into a ``--collect-only`` run in a subprocess, it writes
JSON to the file named by ``$EPLB_SUITE_PROBE``: ``collected``, every test the run found, before
any hook deselects one (``-m``, ``-k``, ``--deselect``); ``selected``, what the run would execute;
``listed``, for each collected test that tests/suite.py's lists make slow, the entry that does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Generator
from pathlib import Path

import pytest

from tests.suite import slow_reason

PROBE_ENV = "EPLB_SUITE_PROBE"
"""The variable naming the JSON file the probe writes."""

_collected: list[pytest.Item] = []


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> Generator[None, None, None]:
    """Outermost around every other implementation, so it sees the items before any is deselected."""
    _collected[:] = items
    return (yield)


def pytest_collection_finish(session: pytest.Session) -> None:
    listed = {item.nodeid: slow_reason(item.nodeid, getattr(item, "fixturenames", ())) for item in _collected}
    out = {
        "collected": [item.nodeid for item in _collected],
        "selected": [item.nodeid for item in session.items],
        "listed": {nodeid: reason for nodeid, reason in listed.items() if reason is not None},
    }
    Path(os.environ[PROBE_ENV]).write_text(json.dumps(out))
