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


@pytest.mark.parametrize("area", ["artifacts.py", "evaluation", "capture", "decoding", "export", "drafters"])
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
    assert "drafttrain.training.method" in dict((m, n) for n, m in _imports(LIB / "training" / "checkpoint.py"))


# ------------------------------------------------------------------------------------------ import graph
def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _dynamic_modules(tree: ast.AST, package: str, known: set[str]) -> list[str]:
    """Modules a file imports by name (``importlib.import_module``: a method table such as training/method.py's
    ``METHODS``): every string constant of a file that calls it and names a drafttrain module, absolute or
    relative to the file's package."""
    calls = any(isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", None)) == "import_module"
                for n in ast.walk(tree))
    if not calls:
        return []
    names = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    return [m for v in names for m in (v, f"{package}.{v}") if m in known]


def import_graph(lib: Path = LIB, root: Path = REPO) -> dict[str, set[str]]:
    """module -> the drafttrain modules it imports: every ``import`` / ``from … import`` anywhere in the file
    (function-local ones included; relative ones resolved; ``from pkg import mod`` is an edge to ``pkg.mod``)
    and the modules it imports by name through ``importlib.import_module``."""
    files = {}
    for p in sorted(q for q in lib.rglob("*.py") if "__pycache__" not in q.parts):
        parts = p.relative_to(root).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        targets = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")
                    base = ".".join(up[: len(up) - node.level + 1] + ([node.module] if node.module else []))
                targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
        targets += _dynamic_modules(tree, package, set(files))
        edges = set()
        for t in targets:
            while t and t not in files:
                t = t.rpartition(".")[0]
            if t and t != mod and t != lib.name:  # the top package's __init__ imports nothing
                edges.add(t)
        graph[mod] = edges
    return graph


def unit_of(module: str) -> str:
    """A module's unit: its sub-package (drafttrain.data.chat -> data) or itself (drafttrain.io -> io)."""
    return module.split(".")[1] if "." in module else module


def unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for mod, targets in graph.items():
        out.setdefault(unit_of(mod), set()).update(unit_of(t) for t in targets if unit_of(t) != unit_of(mod))
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_between_modules():
    assert cycles(import_graph()) == []


def test_no_import_cycle_between_units():
    """Each sub-package and top-level module is one unit; the units import each other in one direction."""
    assert cycles(unit_graph(import_graph())) == []


def test_the_cycle_checks_see_local_relative_and_table_imports(tmp_path):
    """A planted cycle is found through a function-local relative import, a ``from pkg import module`` and a
    module named in an ``importlib.import_module`` table; the real graph holds the edges the checks rely on."""
    pkg = tmp_path / "drafttrain"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "b.py").write_text("import importlib\nTABLE = {'x': 'c'}\n"
                                      "def g(k):\n    return importlib.import_module(f'{__package__}.{TABLE[k]}')\n")
    (pkg / "sub" / "c.py").write_text("from .. import a\n")
    graph = import_graph(pkg, tmp_path)
    assert graph["drafttrain.a"] == {"drafttrain.sub.b"} and graph["drafttrain.sub.b"] == {"drafttrain.sub.c"}
    assert cycles(graph) == [["drafttrain.a", "drafttrain.sub.b", "drafttrain.sub.c"]]
    assert cycles(unit_graph(graph)) == [["a", "sub"]]
    (pkg / "sub" / "c.py").write_text("")
    assert cycles(import_graph(pkg, tmp_path)) == []
    real = import_graph()
    assert {"drafttrain.training.eagle3", "drafttrain.training.medusa"} <= real["drafttrain.training.method"]
    assert "drafttrain.drafters.eagle3" in real["drafttrain.artifacts"]


# ------------------------------------------------------------------------------------------ design map
def _design_map() -> str:
    text = (REPO / "docs" / "design.md").read_text()
    start = text.index("```\ntrain.py")
    return text[start: text.index("```", start + 3)]


def _map_entries(block: str) -> list[str]:
    """The paths the map's first column names (under ``drafttrain/``: two spaces, then the path)."""
    return [line.split()[0] for line in block.splitlines()
            if line.startswith("  ") and not line.startswith("   ") and line.split()[0].endswith((".py", "/"))]


def test_the_design_map_names_every_module_once():
    """docs/design.md's map of the code names every library module (a file, or its package ending in ``/`` when
    the package's modules are described together) exactly once, and nothing that does not exist."""
    entries = _map_entries(_design_map())
    dupes = sorted({e for e in entries if entries.count(e) > 1})
    assert not dupes, dupes
    named = set(entries)
    missing = []
    for path in _modules():
        rel = path.relative_to(LIB).as_posix()
        if path.name == "__init__.py" and path.stat().st_size < 200:
            continue  # an empty package marker
        if rel in named or any(rel.startswith(d) for d in named if d.endswith("/")):
            continue
        missing.append(rel)
    assert not missing, f"docs/design.md's map does not name: {missing}"
    stale = [e for e in named if not (LIB / e).exists() and e != "train.py"]
    assert not stale, f"docs/design.md's map names what does not exist: {stale}"
