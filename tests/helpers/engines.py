"""vLLM 0.33.0 and SGLang 0.5.23 from PyPI for the integration tests: installed once, run apart.

The engines' wheels go in with ``pip install --no-deps --target`` beside the packages their EPLB
and plugin modules import (``ENGINE_DEPS``: what importing ``vllm.plugins``,
``vllm.distributed.eplb.policy``, ``sglang.srt.plugins`` and ``sglang.srt.eplb.*`` needs, found
by importing them until nothing was missing; the rest of each engine's requirements, CUDA stacks
included, is never installed). They land in a cache folder keyed by the pins (``EPLB_ENGINES_DIR``
overrides where), so only the first run pays (about a minute). Engine code then runs in a
subprocess with that folder on PYTHONPATH: plugin loading and SGLang's hooks patch process-wide
state, and neither engine belongs in the test process. A failed download, install or import fails
the tests that need the engines; nothing is skipped (CI reaches PyPI).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
ENGINES = ("vllm==0.33.0", "sglang==0.5.23")
ENGINE_DEPS = (
    # vllm.config (imported by vllm.distributed.eplb.policy) and vllm.distributed
    "psutil==7.2.2",
    "pyzmq==27.3.0",
    "regex==2026.11.19",
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "typing-inspection==0.4.5",
    "annotated-types==0.8.0",
    "cbor2==6.3.0",
    "transformers==5.19.0",  # vLLM: >=5.16.1,<5.21; SGLang: ==5.19.0
    "tokenizers==0.23.3",
    "huggingface-hub==2.4.0",
    "httpx2==2.16.2",
    "httpcore2==2.16.2",
    "truststore==0.10.5",
    "h11==0.16.0",
    "idna==3.20",
    "aiohttp==3.14.5",
    "multidict==7.2.1",
    "attrs==26.1.0",
    "yarl==1.25.1",
    "propcache==0.5.4",
    "aiohappyeyeballs==2.7.1",
    "aiosignal==1.4.0",
    "frozenlist==1.8.0",
    "requests==2.34.2",
    "charset-normalizer==3.4.4",
    "urllib3==2.8.0",
    "certifi==2026.10.19.post1",
    "oss-harmony==0.0.11",
    "openai==3.57.0",
    "sniffio==1.3.1",
    "anyio==4.16.0",
    # SGLang's plugin, environment and EPLB modules (and what they share with the above)
    "orjson==3.13.0",
    "pybase64==1.5.1",
    "starlette==1.10.0",
    "msgspec==0.23.0",
    "ipython==9.18.1",
    "traitlets==5.16.1",
)
_MARKER = ".complete"


def engines_dir() -> Path:
    """The cache folder for this set of pins (``EPLB_ENGINES_DIR``, else the user cache)."""
    key = hashlib.sha256("\n".join((*ENGINES, *ENGINE_DEPS, sys.version)).encode()).hexdigest()[:12]
    base = os.environ.get("EPLB_ENGINES_DIR")
    root = (
        Path(base) if base else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "eplb-tests"
    )
    return root / f"engines-{key}"


def ensure_engines() -> Path:
    """Install the engines and their import-time packages once; return the folder for PYTHONPATH."""
    target = engines_dir()
    if (target / _MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="engines-", dir=target.parent))
    # Wheels fetched earlier for the benchmarks (.peers) or by hand (.whl) save the download.
    links = [
        arg
        for d in (ROOT / ".peers" / "wheels", ROOT / ".whl")
        if d.is_dir()
        for arg in ("--find-links", str(d))
    ]
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(staging), *links,
           *ENGINES, *ENGINE_DEPS]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(f"installing the engines failed ({' '.join(cmd)}):\n{done.stdout}\n{done.stderr}")
    (staging / _MARKER).write_text("\n".join((*ENGINES, *ENGINE_DEPS)) + "\n")
    if target.exists():  # another run finished first
        shutil.rmtree(staging, ignore_errors=True)
    else:
        staging.rename(target)
    return target


def run_engine_checks(site: Path, engine: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``tests/helpers/engine_checks.py ENGINE`` with the engines importable; return its JSON result."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("EPLB_", "VLLM_", "SGLANG_"))}
    full_env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)])
    full_env.update(env or {})
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "tests.helpers.engine_checks", engine, str(out)]
        done = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=900)
        if done.returncode != 0 or not out.is_file():
            raise AssertionError(
                f"{engine} checks failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}"
            )
        result: dict[str, Any] = json.loads(out.read_text())
    return result
