"""Every module's "Shape legend:" means by each letter what the glossary in docs/architecture.md does.

A legend is comma-separated ``X meaning`` items, possibly over several lines, ending at the end of
its paragraph (or at a ``;`` note). A meaning may carry a parenthesis that qualifies it ("G GPUs
(EP ranks)"); without its parentheses it must read as the glossary's meaning of that letter. A
module lists only the letters it uses.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GLOSSARY = ROOT / "docs" / "architecture.md"


def core(meaning: str) -> str:
    """``meaning`` without parentheses (nested ones too), lower case, spaces folded."""
    while True:
        stripped = re.sub(r"\([^()]*\)", "", meaning)
        if stripped == meaning:
            break
        meaning = stripped
    return " ".join(meaning.lower().split())


def split_items(text: str) -> list[str]:
    """``text`` split at the commas outside parentheses and backquotes."""
    items, depth, quoted, start = [], 0, False, 0
    for i, ch in enumerate(text):
        if ch == "`":
            quoted = not quoted
        elif not quoted and ch == "(":
            depth += 1
        elif not quoted and ch == ")":
            depth -= 1
        elif ch == "," and depth == 0 and not quoted:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def parse_legend(docstring: str) -> dict[str, str] | None:
    """letter -> meaning of the docstring's legend; None without one."""
    match = re.search(r"Shape legend:(.*?)(?:\n\s*\n|\Z)", docstring, re.S)
    if match is None:
        return None
    text = " ".join(match.group(1).split())
    # A note after a ";" outside parentheses ends the list.
    depth = 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == ";" and depth == 0:
            text = text[:i]
            break
    legend: dict[str, str] = {}
    for item in split_items(text.rstrip(".")):
        letter, _, meaning = item.partition(" ")
        assert meaning, f"legend item {item!r} has no meaning"
        assert letter not in legend, f"letter {letter} listed twice"
        legend[letter] = meaning
    return legend


def glossary() -> dict[str, str]:
    """letter -> meaning, from the table whose header is ``| letter | meaning | ...``."""
    rows: dict[str, str] = {}
    in_table = False
    for line in GLOSSARY.read_text().splitlines():
        cells = (
            [c.strip() for c in line.strip().strip("|").split("|")] if line.strip().startswith("|") else []
        )
        if cells[:2] == ["letter", "meaning"]:
            in_table = True
        elif in_table and not cells:
            break
        elif in_table and not set(cells[0]) <= set("-:"):
            letter = cells[0].strip("`")
            assert letter not in rows, f"glossary lists {letter} twice"
            rows[letter] = cells[1]
    return rows


def module_legends() -> dict[str, dict[str, str]]:
    out = {}
    for base in ("eplb", "kernels"):
        for path in sorted((ROOT / base).rglob("*.py")):
            docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
            legend = parse_legend(docstring)
            if legend is not None:
                out[str(path.relative_to(ROOT))] = legend
    return out


def test_the_parser() -> None:
    doc = (
        "Title.\n\nShape legend: L layers, G GPUs (EP ranks, here), x any leading\n"
        "dimensions, R max replicas (``P - E + 1``); TR x BW a tile, not a letter.\n\nBody."
    )
    assert parse_legend(doc) == {
        "L": "layers",
        "G": "GPUs (EP ranks, here)",
        "x": "any leading dimensions",
        "R": "max replicas (``P - E + 1``)",
    }
    assert parse_legend("No legend here.") is None
    assert core("GPUs (EP ranks (of one (node)))") == "gpus"
    assert core("Views (tensors)  per   slot") == "views per slot"


def test_the_glossary_has_one_meaning_per_letter() -> None:
    table = glossary()
    assert {"L", "E", "P", "G", "T", "F", "K", "Z", "N", "W"} <= set(table)
    assert table["T"] == "tokens" and table["F"] == "steps" and table["K"] == "top-k"
    assert table["Z"] == "scenarios" and table["N"] == "nodes"


def test_every_legend_agrees_with_the_glossary() -> None:
    table = {letter: core(meaning) for letter, meaning in glossary().items()}
    legends = module_legends()
    assert len(legends) > 50
    wrong = [
        f"{path}: {letter} {meaning!r} (glossary: {table.get(letter, 'not listed')!r})"
        for path, legend in legends.items()
        for letter, meaning in legend.items()
        if table.get(letter) != core(meaning)
    ]
    assert wrong == []
