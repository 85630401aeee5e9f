"""Run inside a subprocess with vLLM or SGLang importable (tests.helpers.engines): load eplb through
the engine's own plugin loader under each given environment and write what the loader did as JSON.

``python -m tests.helpers.engine_settings vllm|sglang SCENARIOS.json OUT.json``: SCENARIOS is a list
of ``{"name": ..., "env": {...}}``; each is loaded in a fresh loader state with exactly those
``EPLB_*`` variables set, and the result is ``{"name": {"raised": type or None, "message": ...}}``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any


def _load(engine: str) -> None:
    if engine == "sglang":
        import sglang.srt.plugins as plugins

        plugins._plugins_loaded = False
        plugins.load_plugins()
    else:
        import vllm.plugins

        vllm.plugins.plugins_loaded = False
        vllm.plugins.load_general_plugins()


def main() -> int:
    engine, scenarios_path, out_path = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    results: dict[str, Any] = {}
    for scenario in json.loads(scenarios_path.read_text()):
        for key in [k for k in os.environ if k.startswith("EPLB_")]:
            del os.environ[key]
        os.environ.update(scenario["env"])
        try:
            _load(engine)
            results[scenario["name"]] = {"raised": None, "message": ""}
        except BaseException as exc:  # SGLang's loader lets only what is not an Exception through
            results[scenario["name"]] = {"raised": type(exc).__name__, "message": str(exc)}
    out_path.write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
