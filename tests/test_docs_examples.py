"""Every ```python and ```bash example in README.md and docs/*.md runs as written, on the CPU.

Each Markdown file's blocks run in order in a fresh workspace (a copy of ``examples/``, the working
directory as the repository root would be), so a later block may read what an earlier one wrote;
Python blocks run each in a fresh interpreter, so none leans on names from another. Everything an
example writes must land under ``out/``; nothing else in the workspace may change. A block that
cannot run here (a GPU, a real server, a download) carries the line ``# docs-example: skip (why)``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COPIED = ("examples",)
"""Repository folders an example may read, copied into the workspace."""
BLOCK = re.compile(r"^```(python|bash)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
SKIP = re.compile(r"^\s*# docs-example: skip \((?P<why>[^)]+)\)", re.M)
BLOCK_TIMEOUT_S = 120
"""A block running longer is not an example (mark it skip, or make it smaller)."""


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int
    lang: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"

    @property
    def skip_reason(self) -> str | None:
        found = SKIP.search(self.code)
        return found["why"] if found else None


def blocks(doc: Path) -> list[Block]:
    text = doc.read_text()
    return [Block(doc, text.count("\n", 0, m.start()) + 1, m[1], m[2]) for m in BLOCK.finditer(text)]


def workspace_env(bin_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["MPLBACKEND"] = "Agg"
    # One thread per example: CI machines are small and shared, and torch's CPU kernels on these
    # tiny shapes only contend (a grouped GEMM took 16 ms a call with 2 threads on 2 busy cores).
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def make_bin(tmp_path: Path) -> Path:
    """``python`` and ``eplb`` on PATH as this interpreter and this checkout, whatever is installed."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, command in (("python", f'"{sys.executable}"'), ("eplb", f'"{sys.executable}" -m eplb')):
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec {command} "$@"\n')
        shim.chmod(0o755)
    return bin_dir


def snapshot(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in folder.rglob("*")
        if p.is_file() and p.relative_to(folder).parts[0] != "out"
    }


def run_block(block: Block, cwd: Path, env: dict[str, str], scripts: Path) -> None:
    if block.lang == "python":
        script = scripts / f"block_{block.line}.py"
        script.write_text(block.code)
        argv = [sys.executable, str(script)]
    else:
        argv = ["bash", "-euo", "pipefail", "-c", block.code]
    try:
        done = subprocess.run(
            argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"{block.where}: still running after {BLOCK_TIMEOUT_S} s: mark it skip or make it smaller"
        )
    if done.returncode != 0:
        pytest.fail(
            f"{block.where}: the {block.lang} example exits {done.returncode}\n--- code\n{block.code}"
            f"--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}"
        )


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_examples_run_as_written(doc: Path, tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    for name in COPIED:
        shutil.copytree(ROOT / name, ws / name, ignore=shutil.ignore_patterns("__pycache__"))
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    env = workspace_env(make_bin(tmp_path))
    before = snapshot(ws)
    for block in blocks(doc):
        if block.skip_reason is None:
            run_block(block, ws, env, scripts)
    after = snapshot(ws)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"{doc.name}: examples wrote outside out/: {changed}"


def test_every_doc_has_examples_and_few_skips() -> None:
    found = [b for doc in DOCS for b in blocks(doc)]
    skipped = [b for b in found if b.skip_reason is not None]
    assert len(found) >= 30 and {b.lang for b in found} == {"python", "bash"}
    # Skips are for what CI cannot have (a GPU, an engine, a server, a download, minutes).
    assert len(skipped) <= len(found) // 2, [b.where for b in skipped]
    for block in skipped:
        assert block.code.lstrip().startswith("# docs-example: skip ("), f"{block.where}: marker on top"
        assert len(block.skip_reason or "") >= 10, f"{block.where}: say why it is skipped"


def test_the_marker_is_honoured_and_failures_name_the_block(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "```bash\n# docs-example: skip (needs a GPU)\nexit 3\n```\n\ntext\n\n```python\nraise SystemExit(4)\n```\n"
    )
    skipped, failing = blocks(doc)
    assert skipped.skip_reason == "needs a GPU" and failing.skip_reason is None and failing.line == 8
    env = workspace_env(make_bin(tmp_path))
    with pytest.raises(pytest.fail.Exception, match=r"doc.md:8: the python example exits 4"):
        run_block(Block(ROOT / "doc.md", failing.line, failing.lang, failing.code), tmp_path, env, tmp_path)


def test_quoted_figures_are_those_of_their_run() -> None:
    # docs/simulate.md's tables and the numbers around them come from benchmarks.docs_figures.
    from benchmarks.docs_figures import rendered_document

    now, rendered = rendered_document()
    assert now == rendered, (
        "docs/simulate.md differs from its run: python -m benchmarks.docs_figures --render"
    )
