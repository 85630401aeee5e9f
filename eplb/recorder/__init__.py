"""The expert distribution recorder: per-pass load from the remap kernel into a bounded window.

Modes ``stat`` (window [W, L, P]), ``per_pass`` and ``per_token``, SGLang's prefill-only counter
agreed across ranks, and dumps in this project's format or SGLang's.
"""

from __future__ import annotations

from eplb.recorder.recorder import ExpertDistributionRecorder, RecorderConfig

__all__ = ["ExpertDistributionRecorder", "RecorderConfig"]
