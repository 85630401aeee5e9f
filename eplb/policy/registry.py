"""The registry of placement policies: names, aliases, and lazy loading by ``module:attribute``.

One table (:data:`POLICIES`) is the list of algorithm names that ``--eplb-algorithm``, ``SolveOptions``,
the simulator and the engine adapters accept. Entries name their implementation as a string, so
this module imports nothing: SciPy is loaded the first time the ``scipy`` policy is asked for.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class PolicyEntry:
    """One registered placement algorithm."""

    name: str
    """The name users pass (``--eplb-algorithm NAME``)."""
    target: str
    """``module:attribute`` of the policy object (an ``eplb.solver.Policy``); an alias names no target."""
    summary: str
    """One line for ``--help`` and docs."""
    alias_of: str | None = None
    """Another entry's name when this one is an alias (``auto`` stands for ``scipy``)."""


POLICIES: dict[str, PolicyEntry] = {
    entry.name: entry
    for entry in (
        PolicyEntry(
            name="auto",
            target="",
            alias_of="scipy",
            summary="eplb's default: the scipy policy",
        ),
        PolicyEntry(
            name="deepseek",
            target="eplb.solver.policies.deepseek:DEEPSEEK",
            summary="DeepSeek's EPLB, global: replicate the hottest experts, pack heaviest-first",
        ),
        PolicyEntry(
            name="deepseek_hierarchical",
            target="eplb.solver.policies.deepseek:DEEPSEEK_HIERARCHICAL",
            summary="DeepSeek's EPLB, hierarchical: expert groups onto nodes, then replicas onto GPUs",
        ),
        PolicyEntry(
            name="scipy",
            target="eplb.solver.policies.scipy_policy:SCIPY",
            summary="forecast, swap search and MILP packing, incremental plans that move few experts",
        ),
    )
}
"""name -> entry; insertion order is the order shown to users."""

_LOADED: dict[str, Any] = {}


def policy_names() -> tuple[str, ...]:
    """Every accepted algorithm name, aliases included."""
    return tuple(POLICIES)


def resolve_policy_name(name: str) -> str:
    """The concrete policy ``name`` stands for (follows aliases); ValueError for an unknown name."""
    check_policy_name(name)
    entry = POLICIES[name]
    return entry.alias_of if entry.alias_of is not None else name


def check_policy_name(name: str, flag: str = "algorithm") -> None:
    """ValueError naming ``flag`` and the choices unless ``name`` is registered."""
    if name not in POLICIES:
        raise ValueError(f"{flag}: unknown algorithm {name!r}; choose from {policy_names()}")


def get_policy(name: str) -> Any:
    """The policy object of ``name`` (alias resolved), imported on first use.

    Typed loosely on purpose: the registry must not import the solver that defines the protocol
    (``eplb.solver.Policy``); ``eplb.solver.policies.protocol.load_policy`` is the typed access.
    """
    concrete = resolve_policy_name(name)
    policy = _LOADED.get(concrete)
    if policy is None:
        module_name, _, attribute = POLICIES[concrete].target.partition(":")
        policy = getattr(importlib.import_module(module_name), attribute)
        _LOADED[concrete] = policy
    return policy


def register_policy(entry: PolicyEntry, *, replace: bool = False) -> None:
    """Add a policy (plugins); an existing name needs ``replace=True``."""
    if entry.name in POLICIES and not replace:
        raise ValueError(f"policy {entry.name!r} is already registered")
    if entry.alias_of is not None and entry.alias_of not in POLICIES:
        raise ValueError(f"alias {entry.name!r} names an unknown policy {entry.alias_of!r}")
    POLICIES[entry.name] = entry
    _LOADED.pop(entry.name, None)
