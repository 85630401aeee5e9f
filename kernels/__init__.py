"""Device code (Triton kernels), installed as ``eplb.kernels``.

Importing this package imports nothing heavy; each kernel module imports Triton itself, and the
public entry points in ``eplb`` choose a backend lazily from a registry.
"""

from __future__ import annotations
