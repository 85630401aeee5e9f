"""Package discovery: every ``eplb`` subpackage, and ``kernels/`` shipped as ``eplb.kernels``.

Metadata lives in pyproject.toml; only the package list needs code (``kernels/`` must never
install as a top-level ``kernels`` module, which belongs to another PyPI project).
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["eplb", "eplb.*"]), "eplb.kernels"],
    package_dir={"eplb.kernels": "kernels"},
)
