"""The library's structure rules (docs/design.md, "Import direction"): they hold as tests, not as grep
commands someone has to remember to run."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from .conftest import REPO

LIB = REPO / "drafttrain"
MAX_FUNCTION_LINES = 80


def _modules():
    return sorted(p for p in LIB.rglob("*.py") if "__pycache__" not in p.parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, absolute module)`` of every import in ``path``, relative imports resolved; ``from x import y``
    also yields ``x.y`` (a submodule imported by name)."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


def test_no_library_function_is_over_80_lines():
    long = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, long


def test_hydra_is_imported_by_the_cli_only():
    found = [f"{p.relative_to(REPO)}:{line} {m}" for p in _modules() if p != LIB / "cli.py"
             for line, m in _imports(p) if m == "hydra" or m.startswith("hydra.")]
    assert not found, found


@pytest.mark.parametrize("area", ["eval.py", "bench.py", "capture", "decoding", "export"])
def test_decoding_side_does_not_import_training(area):
    paths = [LIB / area] if area.endswith(".py") else sorted((LIB / area).rglob("*.py"))
    found = [f"{p.relative_to(REPO)}:{line} {m}" for p in paths for line, m in _imports(p)
             if m == "drafttrain.training" or m.startswith("drafttrain.training.")]
    assert not found, found


def test_drafters_import_neither_peft_nor_losses():
    found = [f"{p.relative_to(REPO)}:{line} {m}" for p in sorted((LIB / "drafters").glob("*.py"))
             for line, m in _imports(p) if m.split(".")[0] == "peft" or m == "drafttrain.losses"]
    assert not found, found


def test_the_import_reader_resolves_relative_imports(tmp_path):
    """The checks above read imports correctly (so an empty result means something)."""
    mods = dict((m, line) for line, m in _imports(LIB / "training" / "loop.py"))
    assert "drafttrain.training.checkpoint" in mods and "drafttrain.data.select" in mods
    assert any(m.startswith("drafttrain.training") for _, m in _imports(LIB / "artifacts.py"))
