"""Where Triton kernel tests run on this machine, and the marker that says how.

A kernel test runs the compiled kernel on CUDA when there is a device, else the interpreted one
on the CPU (TRITON_INTERPRET=1, which tests/conftest.py sets before any kernel module loads). Its
tensors must live on :data:`KERNEL_DEVICE`: a compiled kernel cannot read CPU memory ("Pointer
argument cannot be accessed from Triton (cpu tensor?)"). :data:`on_kernel_device` marks such a
test ``gpu`` on a CUDA machine and ``interpreter`` elsewhere, so ``-m "gpu or interpreter"``
selects every kernel test on either machine and neither of conftest's skip rules drops it. Tests
that only make sense under the interpreter (stand-ins for compiled kernels, CPU tensors) carry
``interpreter`` themselves and are skipped on CUDA.
"""

from __future__ import annotations

import pytest
import torch

KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
"""The device kernel tests put their tensors on: CUDA when present, else the CPU (interpreter)."""

on_kernel_device = pytest.mark.gpu if KERNEL_DEVICE.type == "cuda" else pytest.mark.interpreter
"""Marks a test that runs a Triton kernel on :data:`KERNEL_DEVICE` (compiled or interpreted)."""

__all__ = ["KERNEL_DEVICE", "on_kernel_device"]
