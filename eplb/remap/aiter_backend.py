"""The ``aiter`` remap backend: for ROCm engines that run their MoE through amd-aiter.

amd-aiter ships no remap+record operator, so this backend runs the project's Triton kernel
(``eplb.kernels.remap_record``) with launch settings for CDNA GPUs (64-wide wavefronts, so
fewer warps per program). It exists so an engine that selects its MoE ops by the name ``aiter``
can select this one the same way. It is registered only where amd-aiter imports on a ROCm build
of torch (:func:`eplb.remap.api.available_backends`); elsewhere asking for it fails with a message.
"""

from __future__ import annotations

import torch

from eplb.remap.call import RemapCall


def remap_record_aiter(call: RemapCall) -> None:
    """Same semantics as eplb.remap.torch_backend.remap_record_torch."""
    if getattr(torch.version, "hip", None) is None:
        raise RuntimeError("the aiter remap backend runs only on a ROCm build of torch")
    import aiter  # noqa: F401  (fails with ImportError where amd-aiter is missing)

    from eplb.kernels.remap_record import LaunchConfig, remap_record_triton

    block = 2048 if call.topk_ids_TK.numel() >= 2048 else 256
    # The map row's lookup stays a global load here: tl.gather was only measured on NVIDIA.
    config = LaunchConfig(
        block=block, num_warps=2 if block == 256 else 4, programs_per_sm=4, gather_map=False
    )
    remap_record_triton(call, config=config)
