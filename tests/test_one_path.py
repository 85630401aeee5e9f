"""Every rebalance takes one path: the Decider's (eplb.policy.decision), read off the source.

Outside the decision module no module of ``eplb/`` calls a planner (a callee named ``planner``,
``*_planner``, ``elastic``, a planner's ``__call__``, the result of ``replace(...)`` or of a
``.planner(...)``: the Decider prepares and calls planners), calls ``solve`` (but the solver's own
recursion, ``SolverPlanner``'s calls and the DeepSeek drop-in, named below), calls ``judge`` (but
``solve``, which computes its plans' facts) or builds a ``Verdict``; and ``SolveOptions`` is built
only in its own module (``SolveOptions.from_config``; the bare defaults ``SolveOptions()`` build
nothing from anyone's settings). A call of a function the module itself defines at its top level
(SGLang adapter's ``_planner`` cache) is that function, not a planner.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DECISION = "eplb/policy/decision.py"
SOLVE_CALLERS = {
    ("eplb/solver/solve.py", "solve"),  # the degraded plan's survivors' plan
    ("eplb/solver/planner.py", "SolverPlanner.__call__"),
    ("eplb/solver/planner.py", "SolverPlanner.plan_fresh"),
    ("eplb/solver/dropin.py", "rebalance_experts"),  # DeepSeek's entry point, no decision
}
JUDGE_CALLERS = {"eplb/solver/solve.py"}
OPTIONS_MODULE = "eplb/solver/types.py"
FIELD_CHECKERS = {"eplb/integrations/engine_env.py"}
"""Modules that only validate the user's string-keyed fields at start-up (``from_mapping``)."""
PLANNER_NAME = re.compile(r"^(_?planner|\w+_planner|elastic)$")
FACTORIES = {"make_planner", "default_planner"}
"""Functions that build a planner (called by name: they plan nothing)."""


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


class _Finder(ast.NodeVisitor):
    """The forbidden calls of one module, as ``(function, line, what)``."""

    def __init__(self, module: str, tree: ast.Module) -> None:
        self.module = module
        self.own = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        self.scope: list[str] = []
        self.found: list[tuple[str, int, str]] = []

    def _scoped(self, node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _scoped

    def _flag(self, node: ast.Call, what: str) -> None:
        self.found.append((".".join(self.scope), node.lineno, what))

    def _calls_a_planner(self, func: ast.expr, name: str | None) -> bool:
        """A planner's ``__call__``, or a callee named as planners are (not a factory, not a
        function of this module)."""
        if isinstance(func, ast.Attribute) and func.attr == "__call__":
            return bool(PLANNER_NAME.match(_name(func.value) or ""))
        if name is None or name in FACTORIES or not PLANNER_NAME.match(name):
            return False
        return not (isinstance(func, ast.Name) and name in self.own)

    def visit_Call(self, node: ast.Call) -> None:
        self.generic_visit(node)
        func, where = node.func, ".".join(self.scope)
        name = _name(func)
        if self.module != DECISION:
            if isinstance(func, ast.Call) and _name(func.func) in ("replace", "planner"):
                self._flag(node, "calls a planner it built")
            elif isinstance(func, ast.Attribute) and func.attr == "planner":
                self._flag(node, "prepares a planner (the Decider's step)")
            elif self._calls_a_planner(func, name):
                self._flag(node, "calls a planner")
            if name == "judge" and self.module not in JUDGE_CALLERS:
                self._flag(node, "calls the judge")
            if name == "Verdict":
                self._flag(node, "builds a Verdict")
        of_solver = isinstance(func, ast.Name) or _name(getattr(func, "value", func)) in ("eplb", "solver")
        if name == "solve" and of_solver and (self.module, where) not in SOLVE_CALLERS:
            self._flag(node, "calls solve")
        if self.module != OPTIONS_MODULE:
            if name == "SolveOptions" and (node.args or node.keywords):
                self._flag(node, "builds SolveOptions")
            if name == "from_mapping" and self.module not in FIELD_CHECKERS:
                self._flag(node, "builds SolveOptions from a mapping")


def forbidden(module: str, source: str) -> list[tuple[str, int, str]]:
    """The one-path violations of ``module`` (a path like ``eplb/x/y.py``) whose text is ``source``."""
    tree = ast.parse(source)
    finder = _Finder(module, tree)
    finder.visit(tree)
    return finder.found


@pytest.mark.parametrize(
    ("module", "source", "what"),
    [
        ("eplb/x.py", "def f(planner, w, c):\n    return planner(w, c)", "calls a planner"),
        ("eplb/x.py", "def f(self, w, c):\n    return self._planner(w, c)", "calls a planner"),
        ("eplb/x.py", "def f(state, w, c):\n    return state.elastic(w, c)", "calls a planner"),
        ("eplb/x.py", "def f(base_planner, w):\n    return base_planner.__call__(w)", "calls a planner"),
        (
            "eplb/x.py",
            "def f(base, o, w, c):\n    return replace(base, options=o)(w, c)",
            "calls a planner it built",
        ),
        (
            "eplb/x.py",
            "def f(d, p, w, c):\n    return d.planner(p, counted_pass=1)(w, c)",
            "prepares a planner (the Decider's step)|calls a planner it built",
        ),
        (
            "eplb/x.py",
            "def f(d, p):\n    return d.planner(p, counted_pass=1)",
            "prepares a planner (the Decider's step)",
        ),
        ("eplb/x.py", "def f(w, t):\n    return solve(w, t, None)", "calls solve"),
        ("eplb/x.py", "import eplb\ndef f(w, t):\n    return eplb.solve(w, t)", "calls solve"),
        ("eplb/solver/planner.py", "def other(w, t):\n    return solve(w, t)", "calls solve"),
        ("eplb/x.py", "def f(facts):\n    return judge(facts)", "calls the judge"),
        ("eplb/x.py", "def f():\n    return Verdict(True, 'x')", "builds a Verdict"),
        ("eplb/solver/solve.py", "def f():\n    return Verdict(True, 'x')", "builds a Verdict"),
        ("eplb/x.py", "def f():\n    return SolveOptions(seed=1)", "builds SolveOptions"),
        (
            "eplb/x.py",
            "def f(m):\n    return SolveOptions.from_mapping(m)",
            "builds SolveOptions from a mapping",
        ),
    ],
)
def test_the_checker_finds_each_way_off_the_path(module: str, source: str, what: str) -> None:
    assert [found[2] for found in forbidden(module, source)] == what.split("|")


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("eplb/x.py", "def _planner(name):\n    return name\ndef f():\n    return _planner('auto')"),
        ("eplb/x.py", "def f(config):\n    return make_planner(config)"),
        ("eplb/x.py", "def f(config):\n    return SolveOptions.from_config(config, seed=1)"),
        ("eplb/x.py", "def f():\n    return SolveOptions()"),
        ("eplb/x.py", "def f(lp, ids):\n    return lp.solve(ids)"),
        (DECISION, "def f(planner, w, c):\n    return judge(Facts(proposed=Verdict(*planner(w, c))))"),
        ("eplb/solver/solve.py", "def f(facts):\n    return judge(facts)"),
        (
            "eplb/solver/planner.py",
            "class SolverPlanner:\n    def __call__(self, w, t):\n        return solve(w, t)",
        ),
        (OPTIONS_MODULE, "def f():\n    return SolveOptions(seed=1)"),
    ],
)
def test_the_checker_lets_the_path_and_the_factories_be(module: str, source: str) -> None:
    assert forbidden(module, source) == []


def test_every_rebalance_goes_through_the_decider() -> None:
    problems = []
    for path in sorted((ROOT / "eplb").rglob("*.py")):
        module = path.relative_to(ROOT).as_posix()
        for where, line, what in forbidden(module, path.read_text()):
            problems.append(f"{module}:{line} ({where or 'module'}): {what}")
    assert not problems, "off the Decider's path (eplb.policy.decision):\n" + "\n".join(problems)
