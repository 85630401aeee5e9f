"""Placement policies and dispatch modes: the one list of each, and the protocols planners follow.

Config flags, the solver, the manager, the simulator and the engine adapters all read their names
here (``policy_names()``, ``dispatch_mode_names()``). Importing this package loads nothing heavy:
a policy's code is imported only when :func:`get_policy` first asks for it.
"""

from __future__ import annotations

from eplb.policy.base import LoadHistory, PlanLike, Planner, Policy, Proposal
from eplb.policy.dispatch import DISPATCH_MODES, DispatchMode, dispatch_mode, dispatch_mode_names
from eplb.policy.registry import (
    POLICIES,
    PolicyEntry,
    check_policy_name,
    get_policy,
    policy_names,
    register_policy,
    resolve_policy_name,
)

__all__ = [
    "DISPATCH_MODES",
    "POLICIES",
    "DispatchMode",
    "LoadHistory",
    "PlanLike",
    "Planner",
    "Policy",
    "PolicyEntry",
    "Proposal",
    "check_policy_name",
    "dispatch_mode",
    "dispatch_mode_names",
    "get_policy",
    "policy_names",
    "register_policy",
    "resolve_policy_name",
]
