"""Placement policies and dispatch modes: the one list of each, and the protocols planners follow.

Config flags, the solver, the manager, the simulator and the engine adapters all read their names
here (``policy_names()``, ``dispatch_mode_names()``). Importing this package loads nothing heavy:
a policy's code is imported only when :func:`get_policy` first asks for it. What a policy object
must do is the solver's business (``eplb.solver.Policy``); this package only names and loads them.
"""

from __future__ import annotations

from eplb.policy.base import LoadHistory, PlanLike, Planner, Proposal
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
