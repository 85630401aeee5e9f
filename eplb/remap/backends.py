"""The remap backends by name: a lazy registry, so importing it loads no Triton.

Backends (``backend=`` of eplb.remap.api.remap_and_record): ``triton`` (CUDA and ROCm; CPU under
TRITON_INTERPRET=1), ``torch`` (reference, any device), ``aiter`` (ROCm with amd-aiter installed),
``auto`` (triton on a GPU, else torch). Each takes one :class:`eplb.remap.call.RemapCall`; ``lp`` has
a function of its own in each backend. The registry lives apart from the public function so that
eplb.remap.prepared (which the public function's per-call cache builds) can resolve backends too.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable

import torch

from eplb.remap.call import RemapCall

RemapBackend = Callable[[RemapCall], None]
"""A backend: writes ``call.out_TK`` and adds the call's counts (semantics: eplb.remap.api)."""


# name -> "module:function"; imported on first use only.
_BACKENDS: dict[str, str] = {
    "torch": "eplb.remap.torch_backend:remap_record_torch",
    "triton": "eplb.kernels.remap_record:remap_record_triton",
    "aiter": "eplb.remap.aiter_backend:remap_record_aiter",
}
# The same for mode "lp" (aiter: the Triton kernels, which run on ROCm as they are).
_LP_BACKENDS: dict[str, str] = {
    "torch": "eplb.remap.lp:remap_record_lp_torch",
    "triton": "eplb.kernels.remap_lp_launch:remap_record_lp_triton",
    "aiter": "eplb.kernels.remap_lp_launch:remap_record_lp_triton",
}


def available_backends() -> list[str]:
    """Backend names usable in this process (aiter only on ROCm with amd-aiter importable)."""
    names = ["torch"]
    if importlib.util.find_spec("triton") is not None:
        names.append("triton")
    if _aiter_usable():
        names.append("aiter")
    return names


def _aiter_usable() -> bool:
    if getattr(torch.version, "hip", None) is None:
        return False
    return importlib.util.find_spec("aiter") is not None


_RESOLVED: dict[tuple[str, ...], RemapBackend] = {}
# The same by torch.device, for the per-call lookup (device.type costs more than hashing the device).
_BY_DEVICE: dict[tuple[str, torch.device, bool], RemapBackend] = {}


def get_backend(name: str, device: torch.device, mode: str = "static") -> RemapBackend:
    """Resolve a backend name (``auto`` included) for tensors on ``device`` (cached: once per pair).

    ``mode="lp"`` gives the backend's ``lp`` function; every other mode shares one function.
    """
    key: tuple[str, ...] = (name, device.type) if mode != "lp" else (name, device.type, "lp")
    fn = _RESOLVED.get(key)
    if fn is None:
        fn = _RESOLVED[key] = _resolve_backend(name, device, mode == "lp")
    return fn


def _resolve_backend(name: str, device: torch.device, lp: bool = False) -> RemapBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" and importlib.util.find_spec("triton") else "torch"
    if name not in _BACKENDS:
        raise ValueError(f"unknown remap backend {name!r}; choose from {('auto', *_BACKENDS)}")
    if name == "aiter" and not _aiter_usable():
        raise RuntimeError(
            "remap backend 'aiter' needs a ROCm build of torch and the amd-aiter package "
            "(pip install 'eplb[rocm]'); use backend='triton' or 'torch' here"
        )
    module_name, func_name = (_LP_BACKENDS if lp else _BACKENDS)[name].split(":")
    fn: RemapBackend = getattr(importlib.import_module(module_name), func_name)
    return fn


__all__ = ["RemapBackend", "available_backends", "get_backend"]
