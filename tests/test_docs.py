"""The documents: the user guide builds strictly (MkDocs), and the README's and bench/'s relative links resolve.

`mkdocs build --strict` with mkdocs.yml's `validation` settings fails on a link to a missing page, a missing
anchor, a page left out of the nav and a nav entry without a page. The README and bench/ are read on GitHub, not
built, so their relative links are checked here directly.
"""
from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO

# [text](target) and ![alt](target); a target ends at whitespace or ')'. Code spans and fenced blocks are removed
# first, so a literal "[x](y)" in an example is not read as a link.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")

needs_mkdocs = pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None,
                                  reason="mkdocs is not installed (pip install -e '.[dev]' installs it)")


def relative_links(md: Path) -> list[tuple[str, Path]]:
    """(link as written, the file it points to) for every relative link of a Markdown file."""
    text = CODE_SPAN.sub("", FENCE.sub("", md.read_text(encoding="utf-8")))
    out = []
    for target in LINK.findall(text):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (https:, mailto:) or an anchor of the same file
        path = target.split("#", 1)[0]
        out.append((target, (md.parent / path).resolve()))
    return out


def broken_links(files) -> list[str]:
    return [f"{md.relative_to(REPO)}: {target}" for md in files for target, dest in relative_links(md)
            if not dest.exists()]


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], capture_output=True, text=True, timeout=300)


@needs_mkdocs
def test_the_user_guide_builds_strictly(tmp_path):
    r = _build(REPO / "mkdocs.yml", tmp_path / "site")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert (tmp_path / "site" / "results" / "index.html").exists()


@needs_mkdocs
@pytest.mark.parametrize("plant, says", [
    ("[gone](no-such-page.md)", "no-such-page.md"),
    ("[gone](results.md#no-such-section)", "no-such-section"),
    ("![gone](img/no-such-plot.png)", "no-such-plot.png"),
])
def test_a_broken_link_fails_the_build(tmp_path, plant, says):
    """The strict build is a real check: a copy of the guide with one broken link planted fails, naming it."""
    copy = tmp_path / "repo"
    shutil.copytree(REPO / "docs", copy / "docs")
    shutil.copy2(REPO / "mkdocs.yml", copy / "mkdocs.yml")
    page = copy / "docs" / "index.md"
    page.write_text(page.read_text(encoding="utf-8") + f"\n{plant}\n", encoding="utf-8")
    r = _build(copy / "mkdocs.yml", tmp_path / "site")
    assert r.returncode != 0 and says in r.stdout + r.stderr


@needs_mkdocs
def test_a_page_missing_from_the_nav_fails_the_build(tmp_path):
    copy = tmp_path / "repo"
    shutil.copytree(REPO / "docs", copy / "docs")
    shutil.copy2(REPO / "mkdocs.yml", copy / "mkdocs.yml")
    (copy / "docs" / "orphan.md").write_text("# Orphan\n", encoding="utf-8")
    r = _build(copy / "mkdocs.yml", tmp_path / "site")
    assert r.returncode != 0 and "orphan.md" in r.stdout + r.stderr


def test_readme_and_bench_links_point_to_files():
    files = [REPO / "README.md", *sorted((REPO / "bench").rglob("*.md"))]
    assert broken_links(files) == []


def test_the_link_check_finds_a_broken_link(tmp_path):
    md = tmp_path / "x.md"
    (tmp_path / "there.md").write_text("", encoding="utf-8")
    md.write_text("[ok](there.md) [ok](there.md#a) [web](https://example.org) [gone](missing/file.md)\n"
                  "`[not a link](nowhere.md)`\n```\n[nor this](nowhere.md)\n```\n", encoding="utf-8")
    assert [t for t, dest in relative_links(md) if not dest.exists()] == ["missing/file.md"]


def test_every_guide_page_is_written_for_users():
    """No page of the guide, the README or bench/README.md speaks of how the project was worked on."""
    files = [REPO / "README.md", REPO / "bench" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    hits = [f"{f.relative_to(REPO)}: {m.group(0)}" for f in files
            for m in re.finditer(r"\bsessions?\b", f.read_text(encoding="utf-8"), re.I)]
    assert hits == []
