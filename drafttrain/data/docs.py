"""The second corpus every machine has: documentation prose shipped with Python.

Two sources, both part of every CPython install: the docstrings of the standard library's modules, classes
and functions (read with :mod:`ast`, never imported), and the language-reference topics behind ``help()``
(:mod:`pydoc_data.topics`). Prose, not code: it trains the ``docs`` built-in target
(``target=builtin-docs``) and gives its drafters chats in another domain than the code chats of
:mod:`drafttrain.data.stdlib`.

Documents are split deterministically by a salted hash of their file (a docstring) or topic name:
``target`` (trains the target), ``draft`` (drafter training chats) and ``eval`` (evaluation prompts), so a
module's docstrings never straddle two splits.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import re
import textwrap
from pathlib import Path

from . import stdlib
from .stdlib import CodeChat as DocChat  # same shape: a user prefix, the assistant's completion, a source

__all__ = ["DocChat", "doc_chats", "plain_texts", "split_of"]

_MIN_CHARS = 40  # shorter docstrings ("Return x.") carry no prose
_MAX_LINES = 16  # the assistant's answer: at most this many lines of one document


def split_of(name: str) -> str:
    """``target`` 70%, ``draft`` 20%, ``eval`` 10% (a wider draft split than the code corpus: docstrings are
    fewer than functions)."""
    bucket = int(hashlib.sha1(f"docs:{name}".encode()).hexdigest()[:8], 16) % 100
    return "target" if bucket < 70 else "draft" if bucket < 90 else "eval"


def _clean(text: str) -> str:
    lines = [ln.rstrip() for ln in textwrap.dedent(text).replace("\r\n", "\n").split("\n")]
    out = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
    return out


def _paragraphs(text: str) -> list[str]:
    return [p for p in (q.strip() for q in text.split("\n\n")) if p]


def _chunks(text: str, max_lines: int = _MAX_LINES) -> list[str]:
    """Whole paragraphs grouped into chunks of at most ``max_lines`` lines (a longer paragraph is cut)."""
    chunks, cur = [], []
    for para in _paragraphs(text):
        lines = para.split("\n")[:max_lines]
        if cur and sum(len(c.split("\n")) for c in cur) + len(lines) > max_lines:
            chunks.append("\n\n".join(cur))
            cur = []
        cur.append("\n".join(lines))
    if cur:
        chunks.append("\n\n".join(cur))
    return chunks


def _docstrings(path: Path, relpath: str) -> list[tuple[str, str, str]]:
    """(kind, qualified name, cleaned docstring) of a source file's module, classes and functions."""
    text = stdlib.read_source(path)
    if not text:
        return []
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    module = relpath[:-3].replace("/", ".").removesuffix(".__init__")
    out = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}.{child.name}"
                doc = ast.get_docstring(child, clean=True)
                if doc and len(doc) >= _MIN_CHARS and not child.name.startswith("_"):
                    out.append(("class" if isinstance(child, ast.ClassDef) else "function", name, _clean(doc)))
                if isinstance(child, ast.ClassDef):
                    visit(child, name)

    doc = ast.get_docstring(tree, clean=True)
    if doc and len(doc) >= _MIN_CHARS:
        out.append(("module", module, _clean(doc)))
    visit(tree, module)
    return out


_QUESTIONS = {
    "module": ("What is the `{name}` module for?", "Give an overview of the `{name}` module.",
               "Describe the Python module `{name}`."),
    "class": ("What is the class `{name}`?", "Describe the class `{name}`.", "Explain what `{name}` represents."),
    "function": ("What does `{name}` do?", "Document the function `{name}`.", "Explain `{name}`."),
    "topic": ("Explain {name} in Python.", "What does the Python reference say about {name}?",
              "Describe {name} in Python."),
}


def _question(kind: str, name: str, part: int) -> str:
    options = _QUESTIONS[kind]
    q = options[int(hashlib.sha1(name.encode()).hexdigest()[:4], 16) % len(options)].format(name=name)
    return q if part == 0 else f"{q} Continue from part {part + 1}."


@functools.lru_cache(maxsize=4)
def _all_documents(root: Path) -> tuple:
    """(split, kind, name, source, text) of every document under ``root``, in a deterministic order (parsing
    the stdlib takes seconds; it does not change while a process runs)."""
    out = []
    for p in stdlib.stdlib_files(None, root):
        rel = p.relative_to(root).as_posix()
        out.extend((split_of(rel), kind, name, rel, text) for kind, name, text in _docstrings(p, rel))
    try:
        from pydoc_data.topics import topics
    except ImportError:  # a Python built without its docs data: docstrings only
        topics = {}
    for key in sorted(topics):
        text = _clean(topics[key])
        if len(text) >= _MIN_CHARS:
            out.append((split_of(f"topic:{key}"), "topic", key.replace("-", " "), f"pydoc_data.topics:{key}", text))
    return tuple(out)


def _documents(split: str, root: Path | None):
    """(kind, name, source, text) of every document of a split."""
    return [doc[1:] for doc in _all_documents(root or stdlib.stdlib_root()) if doc[0] == split]


def doc_chats(split: str, root: Path | None = None) -> list[DocChat]:
    """Question-and-answer chats of a split: the user asks about a documented name or a reference topic, the
    assistant answers with the documentation, one chunk of whole paragraphs per chat (a long document gives
    several chats, the later ones asking to continue)."""
    out = []
    for kind, name, source, text in _documents(split, root):
        for part, chunk in enumerate(_chunks(text)[:4]):
            out.append(DocChat(prefix=_question(kind, name, part), completion=chunk, source=f"{source}#{name}/{part}"))
    return out


def plain_texts(split: str, root: Path | None = None) -> list[str]:
    """Each document's whole text, headed by its name (plain language-model text for the target)."""
    return [f"{name}\n\n{text}" for _kind, name, _src, text in _documents(split, root)]
