"""Benchmarks (run by hand or on the device machine; never part of the test suite's timing)."""
