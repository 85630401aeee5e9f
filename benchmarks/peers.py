"""Peer code for side-by-side runs, fetched from PyPI at run time and never committed.

``fetch_sglang()`` downloads the SGLang wheel (``pip download --no-deps``) into the git-ignored
``.peers/`` folder and unpacks only the EPLB files; ``load_sglang_deepseek()`` and
``load_sglang_fused_kernel()`` import them by file path, with the one SGLang import the fused
kernel needs replaced by a stub. On the device machine (no network), fetch here first
(``python -m benchmarks.peers``) and pass ``.peers`` in the device tool's ``carry``.

``fetch_vllm_test(name)`` unpacks one test file of vLLM's sdist (its wheel carries no ``tests/``,
and ``pip download --no-binary :all:`` stops at building the sdist's metadata, which needs
vLLM's build requirements): the sdist is located through PyPI's JSON simple index (PEP 691),
checked against the index's sha256 and kept under ``.peers/``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import subprocess
import sys
import tarfile
import types
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

SGLANG_VERSION = "0.5.23"
VLLM_VERSION = "0.33.0"
"""The vLLM release whose tests the hot-expert checks read (the engine tests' pin)."""
REPO_ROOT = Path(__file__).resolve().parent.parent
PEERS_DIR = REPO_ROOT / ".peers"
_WANTED = (
    "sglang/srt/eplb/eplb_algorithms/deepseek.py",
    "sglang/srt/eplb/eplb_map_record_fused.py",
    "sglang/srt/eplb/eplb_algorithms/elasticity_aware.py",
)


def sglang_dir(version: str = SGLANG_VERSION, root: Path = PEERS_DIR) -> Path:
    return root / f"sglang-{version}"


def fetch_sglang(version: str = SGLANG_VERSION, root: Path = PEERS_DIR) -> Path:
    """Make sure SGLang's EPLB files are unpacked under ``root``; return that folder."""
    dest = sglang_dir(version, root)
    if all((dest / name).is_file() for name in _WANTED):
        return dest
    wheels = root / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(f"sglang-{version}-*.whl"))
    if not found:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-q",
                f"sglang=={version}",
                "-d",
                str(wheels),
            ],
            check=True,
        )
        found = sorted(wheels.glob(f"sglang-{version}-*.whl"))
    if not found:
        raise RuntimeError(f"pip download did not produce an sglang {version} wheel in {wheels}")
    with zipfile.ZipFile(found[0]) as zf:
        for name in _WANTED:
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(zf.read(name))
    return dest


def _load_by_path(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_sglang_deepseek(version: str = SGLANG_VERSION, root: Path = PEERS_DIR) -> types.ModuleType:
    """SGLang's vendored DeepSeek EPLB (pure torch): ``rebalance_experts(weight, ...)``."""
    base = (
        sglang_dir(version, root)
        if (sglang_dir(version, root) / _WANTED[0]).is_file()
        else fetch_sglang(version, root)
    )
    return _load_by_path("_peer_sglang_deepseek", base / _WANTED[0])


def load_sglang_elasticity_aware(version: str = SGLANG_VERSION, root: Path = PEERS_DIR) -> Any:
    """SGLang's ``elasticity_aware.rebalance_experts`` (pure torch; eplb.simulate.sglang_peer loads it)."""
    from eplb.simulate.sglang_peer import load_elasticity_aware

    return load_elasticity_aware(fetch_sglang(version, root))


def load_sglang_fused_kernel(version: str = SGLANG_VERSION, root: Path = PEERS_DIR) -> types.ModuleType:
    """SGLang's fused map+record Triton kernel, its one SGLang import stubbed."""
    base = (
        sglang_dir(version, root)
        if (sglang_dir(version, root) / _WANTED[1]).is_file()
        else fetch_sglang(version, root)
    )
    stub_name = "sglang.srt.eplb.expert_location_dispatch"
    if stub_name not in sys.modules:
        stub = types.ModuleType(stub_name)

        class ExpertLocationDispatchInfo:  # only used as a type and for two attributes
            ep_dispatch_algorithm: str
            partial_logical_to_rank_dispatch_physical_map: object

        stub.ExpertLocationDispatchInfo = ExpertLocationDispatchInfo  # type: ignore[attr-defined]
        for parent in ("sglang", "sglang.srt", "sglang.srt.eplb"):
            sys.modules.setdefault(parent, types.ModuleType(parent))
        sys.modules[stub_name] = stub
    return _load_by_path("_peer_sglang_fused", base / _WANTED[1])


def fetch_vllm_test(
    name: str = "tests/distributed/test_eplb_algo.py", version: str = VLLM_VERSION, root: Path = PEERS_DIR
) -> Path:
    """Make sure vLLM's test file ``name`` (a path inside its sdist) is unpacked under ``root``;
    return its path. Raises OSError (no network) or RuntimeError (no such sdist or file)."""
    dest = root / f"vllm-{version}" / name
    if dest.is_file():
        return dest
    sdist = root / "sdists" / f"vllm-{version}.tar.gz"
    if not sdist.is_file():
        request = urllib.request.Request(
            "https://pypi.org/simple/vllm/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            index = json.load(response)
        files = [f for f in index["files"] if f["filename"] == sdist.name]
        if not files:
            raise RuntimeError(f"PyPI lists no {sdist.name}")
        with urllib.request.urlopen(files[0]["url"], timeout=300) as response:
            data = response.read()
        if hashlib.sha256(data).hexdigest() != files[0]["hashes"]["sha256"]:
            raise RuntimeError(f"{sdist.name}: sha256 differs from PyPI's")
        sdist.parent.mkdir(parents=True, exist_ok=True)
        partial = sdist.with_suffix(".part")
        partial.write_bytes(data)
        partial.rename(sdist)
    member = f"vllm-{version}/{name}"
    with tarfile.open(sdist) as tar:
        try:
            source = tar.extractfile(member)
        except KeyError:
            source = None
        if source is None:
            raise RuntimeError(f"{sdist.name} has no {name}")
        content = source.read()
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(content)
    return dest


if __name__ == "__main__":
    print(fetch_sglang())
