"""Why a rebalance ended as it did, as one of a fixed set of causes: the only rebalance label values.

The manager explains each rebalance in free text ("balancedness 0.6123 above threshold 0.6",
"hot-swap of layers [3] failed and was rolled back: chunk 0 wait: TimeoutError: ..."): numbers
and layer lists that would make every rebalance a new Prometheus series. Metrics label a rebalance
by ``outcome`` and a ``cause`` from :data:`REBALANCE_CAUSES` only; :func:`rebalance_cause` maps the
free text onto a cause, here and nowhere else. The text itself goes to the manager's log.
"""

from __future__ import annotations

import re
from typing import Literal, get_args

RebalanceOutcome = Literal["applied", "skipped", "failed"]
RebalanceCause = Literal[
    "applied",
    "skipped_empty",
    "skipped_threshold",
    "skipped_unchanged",
    "skipped_gain",
    "skipped_budget",
    "skipped_other",
    "failed_planner",
    "failed_watchdog",
    "failed_shape",
    "failed_memory",
    "failed_timeout",
    "failed_checksum",
    "failed_peer",
    "failed_other",
]

REBALANCE_OUTCOMES: tuple[RebalanceOutcome, ...] = get_args(RebalanceOutcome)
REBALANCE_CAUSES: tuple[RebalanceCause, ...] = get_args(RebalanceCause)

CAUSE_HELP: dict[RebalanceCause, str] = {
    "applied": "the plan was applied",
    "skipped_empty": "the window held no load",
    "skipped_threshold": "balancedness was above the rebalancing threshold; nothing was solved",
    "skipped_unchanged": "the plan equals the live placement",
    "skipped_gain": "the time the plan was predicted to save did not pay for its transfer (or its gain was below min_gain)",
    "skipped_budget": "the plan moves more than the move budget allows",
    "skipped_other": "skipped for a reason not listed (a custom planner's)",
    "failed_planner": "the planner raised",
    "failed_watchdog": "the rebalance was in flight longer than the watchdog's bound and was ended",
    "failed_shape": "the plan or the slot buffers did not fit the model's shapes",
    "failed_memory": "a rank could not allocate the swap's staging buffer",
    "failed_timeout": "transfers did not finish within the hot-swap timeout",
    "failed_checksum": "a received expert's checksum did not match the sender's",
    "failed_peer": "another rank failed or disagreed on the swap",
    "failed_other": "failed for a reason not listed",
}
"""One line per cause, for the docs."""

# Per outcome, the first cause whose pattern matches the reason wins: the more specific come first
# (a timeout on this rank is reported, rather than "another rank failed" that follows from it).
_PATTERNS: dict[str, tuple[tuple[RebalanceCause, re.Pattern[str]], ...]] = {
    "skipped": (
        ("skipped_empty", re.compile(r"no load|empty window")),
        ("skipped_threshold", re.compile(r"threshold")),
        ("skipped_unchanged", re.compile(r"equals the current placement|nothing to move|no change")),
        ("skipped_budget", re.compile(r"\bover max_|budget|max_moved|max_bytes")),
        ("skipped_gain", re.compile(r"gain|does not pay")),
    ),
    "failed": (
        ("failed_planner", re.compile(r"^planner failed")),
        ("failed_watchdog", re.compile(r"watchdog")),
        ("failed_shape", re.compile(r"shape|slots, expected|must both be \[L, P\]|spans \d+ GPUs but")),
        ("failed_memory", re.compile(r"out of memory|OutOfMemoryError|MemoryError|could not allocate")),
        ("failed_timeout", re.compile(r"Timeout|timed out|not done after")),
        ("failed_checksum", re.compile(r"checksum")),
        ("failed_peer", re.compile(r"another rank|on some rank|ranks disagree|peer")),
    ),
}


def rebalance_cause(outcome: str, reason: str) -> RebalanceCause:
    """The cause a rebalance of ``outcome`` explained by ``reason`` is counted under."""
    if outcome == "applied":
        return "applied"
    patterns = _PATTERNS.get(outcome)
    if patterns is None:
        raise ValueError(f"rebalance outcome must be one of {REBALANCE_OUTCOMES}, got {outcome!r}")
    text = str(reason)
    for cause, pattern in patterns:
        if pattern.search(text):
            return cause
    return "skipped_other" if outcome == "skipped" else "failed_other"


def causes_of(outcome: str) -> tuple[RebalanceCause, ...]:
    """The causes a rebalance of ``outcome`` may have."""
    if outcome not in REBALANCE_OUTCOMES:
        raise ValueError(f"rebalance outcome must be one of {REBALANCE_OUTCOMES}, got {outcome!r}")
    return tuple(c for c in REBALANCE_CAUSES if c == outcome or c.startswith(outcome + "_"))


def check_cause(outcome: str, cause: str) -> RebalanceCause:
    """``cause`` if a rebalance of ``outcome`` may have it; ValueError otherwise."""
    allowed = causes_of(outcome)
    for known in allowed:
        if known == cause:
            return known
    raise ValueError(f"a rebalance {outcome!r} has a cause among {allowed}, got {cause!r}")
