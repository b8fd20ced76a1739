"""Every relative link of the documentation resolves: README.md, docs/ and benchmarks/'s pages link to
files the repository ships (tracked by git, not merely present in this checkout) and, for a
`#fragment` into a Markdown page, to one of its headings. Links inside code (fenced blocks, `spans`)
and HTML comments are not links. And no page cites texts that users do not have."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path
from urllib.parse import unquote

import pytest

from benchmarks.results import heading_anchors

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", "docs/**/*.md", "benchmarks/README.md", "benchmarks/RESULTS.md"]
# texts the project's authors read that users do not have: a page says what they say, or nothing
UNSHIPPED = ("background text", "/work/shared", "paged-kv-memory.txt", "kv-out-of-blocks.txt",
             "preemption-swap-recompute.txt", "when-kv-capacity-runs-out.txt")

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_LINK = re.compile(r"<(?:img|a|source)\b[^>]*?\b(?:src|href|srcset)=\"([^\"]+)\"", re.IGNORECASE)


def pages(root: Path = ROOT) -> list[Path]:
    return sorted({p for pattern in PAGES for p in root.glob(pattern)})


def prose(markdown: str) -> str:
    """The page without what is not prose: fenced code blocks, inline code spans, HTML comments
    (each replaced by as many newlines, so that line numbers stay right)."""
    def blank(match: re.Match) -> str:
        return "\n" * match.group(0).count("\n")

    text = re.sub(r"<!--.*?-->", blank, markdown, flags=re.DOTALL)
    text = re.sub(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", blank, text, flags=re.DOTALL | re.MULTILINE)
    return re.sub(r"(`+)(?:(?!\1)(?:[^\n]|\n(?![ \t]*\n)))+?\1", blank, text)   # a span may wrap, not span a paragraph


def links(markdown: str) -> list[tuple[int, str]]:
    """(line number, target) of every link and image of the page's prose."""
    text = prose(markdown)
    found = []
    for pattern in (LINK, HTML_LINK):
        for match in pattern.finditer(text):
            found.append((text.count("\n", 0, match.start()) + 1, match.group(1)))
    return sorted(found)


def shipped(root: Path) -> set[str] | None:
    """The files git tracks (and their folders), or None outside a git checkout."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    files = {name for name in out.decode().split("\0") if name}
    return files | {parent.as_posix() for name in files for parent in Path(name).parents if parent != Path(".")}


def broken_links(root: Path) -> list[str]:
    """'page:line: target (why)' for every relative link that does not resolve."""
    tracked = shipped(root)
    problems = []
    for page in pages(root):
        for line, target in links(page.read_text()):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):        # https:, mailto:: not ours to check
                continue
            path_part, _, fragment = target.partition("#")
            path = (page.parent / unquote(path_part)).resolve() if path_part else page
            where = f"{page.relative_to(root)}:{line}: {target}"
            if not path.is_relative_to(root) or not path.exists():
                problems.append(f"{where} (no such file)")
                continue
            name = path.relative_to(root).as_posix()
            if tracked is not None and path != root and name not in tracked:
                problems.append(f"{where} (not shipped: git does not track it)")
                continue
            if fragment and path.suffix == ".md":
                text = path.read_text()
                explicit = re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text)
                if unquote(fragment) not in heading_anchors(text) + explicit:
                    problems.append(f"{where} (no heading #{fragment} in {name})")
    return problems


def test_every_relative_link_resolves():
    assert pages() and ROOT / "docs" / "README.md" in pages()
    assert broken_links(ROOT) == []


def test_no_page_cites_texts_users_do_not_have():
    found = [f"{page.relative_to(ROOT)}: {name}" for page in pages() for name in UNSHIPPED
             if name in page.read_text().lower()]
    assert found == []


def test_the_checker_finds_a_broken_link(tmp_path):
    """A planted page: its good links pass, each bad one is named with its line and why."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## What if, on a run's traffic\n")
    (tmp_path / "docs" / "img.svg").write_text("<svg/>")
    (tmp_path / "README.md").write_text(
        "# Title\n"
        "[ok](docs/a.md) [ok](docs/a.md#what-if-on-a-runs-traffic) ![ok](docs/img.svg) [ok](#title)\n"
        "[web](https://example.com) `[code](missing.md)` <!-- [commented](missing.md) -->\n"
        "```\n[fenced](missing.md)\n```\n"
        "[gone](docs/missing.md)\n"
        "[bad anchor](docs/a.md#nowhere)\n"
        '<img src="docs/none.png" alt="x">\n')
    assert broken_links(tmp_path) == [
        "README.md:7: docs/missing.md (no such file)",
        "README.md:8: docs/a.md#nowhere (no heading #nowhere in docs/a.md)",
        "README.md:9: docs/none.png (no such file)",
    ]


@pytest.mark.skipif(shipped(ROOT) is None, reason="not a git checkout")
def test_an_untracked_file_is_not_shipped(tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "README.md").write_text("[run](traces/runs/latest/meta.json)\n")
    (tmp_path / "traces" / "runs" / "latest").mkdir(parents=True)
    (tmp_path / "traces" / "runs" / "latest" / "meta.json").write_text("{}")
    subprocess.run(["git", "add", "README.md"], cwd=tmp_path, check=True)
    assert broken_links(tmp_path) == ["README.md:1: traces/runs/latest/meta.json (not shipped: git does not track it)"]


def test_every_docs_page_the_code_names_exists():
    """Help texts, docstrings and comments send readers to docs/*.md: those pages exist (a page renamed
    or folded into another leaves them pointing nowhere)."""
    named = {}
    for folder in ("kvtrace", "engine", "analyses", "benchmarks", "scripts"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".sql", ".sh") and "__pycache__" not in path.parts:
                for page in re.findall(r"\bdocs/[\w-]+\.md\b", path.read_text()):
                    named.setdefault(page, path.relative_to(ROOT).as_posix())
    assert "docs/trace-format.md" in named
    assert {page: where for page, where in named.items() if not (ROOT / page).is_file()} == {}
