"""Launch a compiled Triton kernel by a caller-chosen key, skipping ``JITFunction.run`` per call.

``kernel[grid](*args)`` runs ``JITFunction.run`` on every call: it binds the arguments, derives
how each one specialises the kernel, builds a cache key that includes ``str(options)``, evaluates
the launch metadata and calls the (empty) hook chains before it reaches the compiled kernel's
launcher. For the remap kernel's 31 arguments that took 62-71 µs of host time per call on the
H200's host (docs/benchmarks.md, "Remap + record").

:class:`DirectLaunchCache` lets the caller name the specialisation: a hashable key that must
determine everything Triton specialises on for this kernel (constexpr values, ``num_warps``,
which pointer arguments are 16-byte aligned, which specialised integers equal 1 or are multiples
of 16; argument dtypes are fixed by the caller's validation). The first call with a key goes
through ``kernel[grid]`` as always (it compiles or finds the kernel, launches it, and returns the
``CompiledKernel``, which the caller hands to :meth:`DirectLaunchCache.keep` with the
compile-time arguments); later calls with that key pass the runtime arguments, pointers as
plain ints, to ``CompiledKernel.run`` (the backend's launcher: it then neither calls
``data_ptr()`` nor asks the driver about each pointer). Triton 3.6 and 3.9 launch with the same
call: ``run(gx, gy, gz, stream, function, packed_metadata, launch_metadata, enter_hook,
exit_hook, *args)``, constexpr arguments included.

Used only where it is known to work: compiled CUDA kernels (not the interpreter, where
``kernel[grid]`` returns no compiled kernel; not ROCm, whose specialisation has further cases),
a ``CompiledKernel`` with ``run``, ``function`` and ``packed_metadata``, and no launch hooks
installed (profilers such as Proton add them; they then see every launch through the normal
path). Callers check :meth:`DirectLaunchCache.usable` and otherwise launch with ``kernel[grid]``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch


class DirectLaunch:
    """One compiled specialisation: its launcher, function handle, packed metadata, constexpr values."""

    __slots__ = ("constexprs", "function", "metadata", "run")

    def __init__(self, compiled: Any, constexprs: tuple[Any, ...]) -> None:
        self.run: Callable[..., Any] = compiled.run  # property: loads the module on first access
        self.function: Any = compiled.function
        self.metadata: Any = compiled.packed_metadata
        self.constexprs = constexprs

    def __call__(self, grid: int, stream: int, runtime_args: tuple[Any, ...]) -> None:
        """Launch ``grid`` programs on ``stream`` (a raw handle): runtime arguments, then the constexprs.

        The launcher parses every argument of the kernel's signature (it skips constexprs itself).
        """
        self.run(
            grid,
            1,
            1,
            stream,
            self.function,
            self.metadata,
            None,
            None,
            None,
            *runtime_args,
            *self.constexprs,
        )


class DirectLaunchCache:
    """Compiled specialisations of one ``@triton.jit`` kernel by caller key (see module docstring)."""

    def __init__(self, enabled: bool, device_and_stream: Callable[[], tuple[int, int]] | None = None) -> None:
        """``enabled``: :func:`direct_launch_supported` of the kernel. ``device_and_stream``: returns the
        current device index and its raw stream (default: Triton's driver, as ``kernel[grid]`` does)."""
        self._entries: dict[Hashable, DirectLaunch] = {}
        self._enabled = enabled
        self._runtime_knobs: Any = None
        self._device_and_stream = device_and_stream

    def usable(self) -> bool:
        """Whether a direct launch may be tried now (enabled, and no launch hooks are installed)."""
        if not self._enabled:
            return False
        knobs = self._runtime_knobs
        return knobs is None or (_hook_idle(knobs.launch_enter_hook) and _hook_idle(knobs.launch_exit_hook))

    def get(self, key: Hashable) -> DirectLaunch | None:
        return self._entries.get(key)

    def device_and_stream(self) -> tuple[int, int]:
        """The current device index and its current raw stream, as ``kernel[grid]`` would use them."""
        if self._device_and_stream is None:
            from triton.runtime import driver

            current_stream = driver.active.get_current_stream
            # torch.cuda.current_device() (Triton's choice) minus its lazy-init check: CUDA is
            # initialised by now, a kernel[grid] launch preceded every direct one.
            current_device = getattr(torch._C, "_cuda_getDevice", None) or driver.active.get_current_device
            self._device_and_stream = lambda: (d := current_device(), current_stream(d))
        return self._device_and_stream()

    def keep(self, key: Hashable, compiled: Any, constexprs: tuple[Any, ...]) -> None:
        """Remember what ``kernel[grid](...)`` returned for ``key`` (a CompiledKernel, or None)."""
        entry = _direct_launch(compiled, constexprs)
        if entry is None:
            self._enabled = False  # this Triton (or the interpreter) offers no launcher to call
            return
        if self._runtime_knobs is None:
            try:
                from triton import knobs  # Triton >= 3.4: launch hooks live in triton.knobs.runtime
            except ImportError:
                self._enabled = False
                return
            self._runtime_knobs = knobs.runtime
        if self.usable():
            self._entries[key] = entry

    def disable(self) -> None:
        """Stop using direct launches in this process (after a launcher refused its arguments)."""
        self._enabled = False
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


def direct_launch_supported(jit_fn: Any) -> bool:
    """Whether ``jit_fn`` can be launched directly: compiled (not interpreted) and not on ROCm."""
    from triton.runtime.jit import JITFunction

    return getattr(torch.version, "hip", None) is None and isinstance(jit_fn, JITFunction)


def _hook_idle(hook: Any) -> bool:
    # Triton 3.6+: a HookChain whose list of calls is empty; older: None.
    return hook is None or getattr(hook, "calls", None) == []


def _direct_launch(compiled: Any, constexprs: tuple[Any, ...]) -> DirectLaunch | None:
    # Triton 3.x: launch_metadata marks the run(grid, stream, function, metadata, ...) convention.
    if compiled is None or not hasattr(compiled, "launch_metadata"):
        return None
    try:
        return DirectLaunch(compiled, constexprs)
    except AttributeError:
        return None


__all__ = ["DirectLaunch", "DirectLaunchCache", "direct_launch_supported"]
