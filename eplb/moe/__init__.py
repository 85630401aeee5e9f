"""The MoE GPU path: expert-parallel layers whose routed experts live in fixed physical-slot buffers.

Modules: ``experts`` (grouped-GEMM FFN over local slots), ``exchange`` (all-to-all dispatch and
combine), ``layer`` (one EP MoE layer), ``model`` (a small MoE stack and its weights), ``reference``
(dense single-process oracle), ``spawn`` (local multi-rank launcher with timeouts).
Importing this package imports torch.
"""
