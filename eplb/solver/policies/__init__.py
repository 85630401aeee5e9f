"""The built-in placement policies that the registry (eplb.policy.registry) names.

- ``protocol``: :class:`~eplb.solver.policies.protocol.Policy`, what ``solve`` asks of a
  policy, and :func:`~eplb.solver.policies.protocol.load_policy`, the typed registry access;
- ``deepseek``: DeepSeek's EPLB (global and hierarchical) and its two policy objects;
- ``scipy_policy``: the ``scipy`` policy (forecast-driven packing, swap search and MILP, budgeted
  migration-aware plans). Not ``scipy.py``: a module of that name would read as SciPy itself in
  tracebacks and shadow it wherever this folder lands on ``sys.path``.

The registry loads a policy object by its ``module:attribute`` string, so importing it is what
loads its algorithm's modules.
"""
