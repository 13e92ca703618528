"""The corpus every machine has: the Python standard library sources of the running interpreter.

Files are split deterministically by a hash of their path relative to the stdlib root:
``target`` (trains the built-in target), ``draft`` (held out from the target: drafter training chats) and
``eval`` (held out from both: evaluation prompts).
"""
from __future__ import annotations

import ast
import hashlib
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

SPLITS = ("target", "draft", "eval")
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__", "lib2to3", "turtledemo"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relpath: str) -> str:
    bucket = int(hashlib.sha1(relpath.encode()).hexdigest()[:8], 16) % 100
    if bucket < 80:
        return "target"
    if bucket < 93:
        return "draft"
    return "eval"


def stdlib_files(split: str | None = None, root: Path | None = None) -> list[Path]:
    """Sorted ``.py`` files of the stdlib (tests, IDLE and site-packages excluded), optionally one split."""
    root = root or stdlib_root()
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if any(part in _EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        if split is None or split_of(rel.as_posix()) == split:
            out.append(p)
    return out


def read_source(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    return text.replace("\r\n", "\n")


@dataclass(frozen=True)
class CodeChat:
    """A code-completion chat: the user gives a function's signature (+ docstring), the assistant its body."""

    prefix: str
    completion: str
    source: str  # "relpath:lineno"

    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.prefix}, {"role": "assistant", "content": self.completion}]


def _function_chats(text: str, relpath: str, max_prefix_lines: int, max_completion_lines: int) -> list[CodeChat]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.split("\n")
    chats = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
            continue
        first = node.body[0]
        has_doc = (
            isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
        )
        body_start = node.body[1].lineno if has_doc and len(node.body) > 1 else first.lineno
        if has_doc and len(node.body) == 1:
            continue  # docstring only: nothing to complete
        end = node.end_lineno or body_start
        prefix_lines = lines[node.lineno - 1 : body_start - 1]
        body_lines = lines[body_start - 1 : end]
        if not prefix_lines or not body_lines or len(prefix_lines) > max_prefix_lines:
            continue
        body_lines = body_lines[:max_completion_lines]
        block = textwrap.dedent("\n".join(prefix_lines + body_lines)).split("\n")
        prefix = "\n".join(block[: len(prefix_lines)]).rstrip()
        completion = "\n".join(block[len(prefix_lines) :]).rstrip()
        if completion.strip():
            chats.append(CodeChat(prefix=prefix, completion=completion, source=f"{relpath}:{node.lineno}"))
    return chats


def code_chats(
    split: str, max_prefix_lines: int = 24, max_completion_lines: int = 24, root: Path | None = None
) -> list[CodeChat]:
    """All function-completion chats of a split, in a deterministic order."""
    root = root or stdlib_root()
    out: list[CodeChat] = []
    for p in stdlib_files(split, root):
        text = read_source(p)
        if text:
            out.extend(_function_chats(text, p.relative_to(root).as_posix(), max_prefix_lines, max_completion_lines))
    return out


def plain_texts(split: str, root: Path | None = None) -> list[str]:
    """Whole source files of a split (for plain language-model text)."""
    root = root or stdlib_root()
    return [t for t in (read_source(p) for p in stdlib_files(split, root)) if t]
