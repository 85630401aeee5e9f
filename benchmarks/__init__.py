"""Benchmarks, run by hand or on the device machine as ``python -m benchmarks.NAME`` from the repo root.

Never part of the test suite's timing. Every benchmark times and writes its result file with
``benchmarks.harness``; ``benchmarks.peers`` is the one loader of peer code (SGLang from PyPI).
"""
