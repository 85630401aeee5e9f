"""eplb: expert-parallel load balancing for serving Mixture-of-Experts LLMs.

The package root imports nothing heavy; import submodules for the parts you need
(``eplb.placement``, ``eplb.traces``, ``eplb.workloads``, ``eplb.config``...).
"""

from __future__ import annotations

__version__ = "0.1.0"
