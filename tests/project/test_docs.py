"""Every reference in the code and the docs can be followed from a checkout, and docs tables stay
readable.

* the design document is ``docs/DESIGN.md``, linked from the README and docs/ARCHITECTURE.md; no
  text names a design document anywhere else, nor a numbered section of one;
* a reference ``docs/NAME.md`` names a file of the checkout, and ``docs/NAME.md, "Title"`` (or
  ``docs/NAME.md "Title"``, the title possibly wrapped over lines) a heading of that file;
* a relative Markdown link resolves to a path inside the checkout;
* no Markdown table cell is longer than :data:`MAX_CELL` characters: prose belongs under a table.

The checkers are plain functions over text, so the tests below also hold them against examples of
what each one must refuse.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "DESIGN.md"
MAX_CELL = 300

#: file kinds whose text is read for references; folders never read (environments, caches, VCS)
TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".cfg", ".ini", ".yml", ".yaml", ".sh"}
SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".hypothesis",
             "build", "dist", "node_modules"}

_DOC_REF = re.compile(r"(?<![\w/.-])docs/([\w-]+\.md)")
_ANY_DESIGN = re.compile(r"[\w./-]*DESIGN\.md")
_TITLE = re.compile(r',?\s*\\?"([A-Za-z][^"\\\n]{0,99})\\?"')
_NUMBERED = re.compile(r",?\s*(section\s*\d|sec\.\s*\d|§)", re.IGNORECASE)
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^\s*(```|~~~)")


def text_files(root: Path = ROOT) -> list[Path]:
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        out += [Path(folder) / f for f in sorted(files) if Path(f).suffix in TEXT_SUFFIXES]
    return out


def strip_fences(text: str) -> str:
    """The text with every fenced code block blanked (line numbers kept)."""
    out, inside = [], False
    for line in text.split("\n"):
        if _FENCE.match(line):
            inside = not inside
            out.append("")
            continue
        out.append("" if inside else line)
    return "\n".join(out)


def headings(markdown: str) -> set[str]:
    """Titles of a Markdown document's headings, without ``#``, emphasis or code marks."""
    return {re.sub(r"[`*]", "", line.lstrip("#").strip())
            for line in strip_fences(markdown).split("\n") if line.startswith("#")}


def _after(text: str, end: int, code: bool) -> str:
    """What follows a reference, with line breaks (and, in code, comment marks) folded to spaces."""
    window = text[end:end + 240]
    fold = r"\s*\n\s*(?:#+ ?)?" if code else r"\s*\n\s*"
    return re.sub(fold, " ", window)


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def reference_problems(text: str, name: str, docs: dict[str, set[str]], code: bool = False,
                       in_docs: bool = False) -> list[str]:
    """Problems with the document references of one file's ``text``: ``docs`` maps the checkout's
    ``docs/*.md`` names to their headings; ``in_docs``: the file itself is in docs/ (a link
    ``[DESIGN.md](DESIGN.md)`` is its sibling there)."""
    problems = []
    for m in _ANY_DESIGN.finditer(text):
        token, at = m.group(0), m.start()
        as_link = text[at - 2:at] == "](" or (text[at - 1:at] == "[" and text[m.end():m.end() + 2] == "](")
        sibling_link = in_docs and token == "DESIGN.md" and as_link
        if token != "docs/DESIGN.md" and not sibling_link:
            problems.append(f"{name}:{_line(text, at)}: {token!r} is not the checkout's docs/DESIGN.md")
        if _NUMBERED.match(_after(text, m.end(), code)):
            problems.append(f"{name}:{_line(text, at)}: a numbered section of {token}: name its heading instead")
    for m in _DOC_REF.finditer(text):
        doc = m.group(1)
        where = f"{name}:{_line(text, m.start())}"
        if doc not in docs:
            problems.append(f"{where}: docs/{doc} is not in the checkout")
            continue
        t = _TITLE.match(_after(text, m.end(), code))
        if t:
            title = " ".join(t.group(1).split())
            if title not in docs[doc]:
                problems.append(f"{where}: docs/{doc} has no heading {title!r}")
    return problems


def link_problems(markdown: str, path: Path, root: Path = ROOT) -> list[str]:
    """Relative Markdown links (outside code) that do not resolve to a path inside ``root``."""
    problems = []
    text = re.sub(r"`[^`\n]*`", "", strip_fences(markdown))
    for m in _LINK.finditer(text):
        target = m.group(1).split("#")[0]
        if not target or re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue
        resolved = (path.parent / target).resolve()
        if not resolved.is_relative_to(root.resolve()) or not resolved.exists():
            problems.append(f"{path.name}:{_line(text, m.start())}: link {m.group(1)!r} does not resolve "
                            "inside the checkout")
    return problems


def long_cells(markdown: str, name: str, limit: int = MAX_CELL) -> list[str]:
    """Table cells (``|``-separated, escaped ``\\|`` kept) longer than ``limit`` characters."""
    out = []
    for no, line in enumerate(strip_fences(markdown).split("\n"), 1):
        row = line.strip()
        if not row.startswith("|"):
            continue
        for cell in re.split(r"(?<!\\)\|", row.strip("|")):
            cell = cell.strip()
            if len(cell) > limit:
                out.append(f"{name}:{no}: a cell of {len(cell)} characters (at most {limit}): {cell[:60]}...")
    return out


def _docs() -> dict[str, set[str]]:
    return {p.name: headings(p.read_text()) for p in sorted((ROOT / "docs").glob("*.md"))}


def _markdown_files() -> list[Path]:
    return [p for p in text_files() if p.suffix == ".md"]


# ------------------------------------------------------------------------------ the checkout


def test_design_document_is_in_the_checkout_and_linked():
    assert DESIGN.is_file()
    titles = headings(DESIGN.read_text())
    for section in ("Architecture", "Contracts", "Cost model", "Published systems", "Zeppelin", "FlexSP",
                    "Hydraulis", "CommFuse", "Baselines", "Sources"):
        assert section in titles, f"docs/DESIGN.md has no section {section!r}"
    assert "(docs/DESIGN.md)" in (ROOT / "README.md").read_text()
    assert "(DESIGN.md)" in (ROOT / "docs" / "ARCHITECTURE.md").read_text()


def test_every_document_reference_points_into_the_checkout():
    docs = _docs()
    this = Path(__file__).resolve()
    problems = []
    for path in text_files():
        if path.resolve() == this:
            continue
        rel = path.relative_to(ROOT)
        problems += reference_problems(path.read_text(errors="replace"), str(rel), docs,
                                       code=path.suffix != ".md", in_docs=rel.parts[0] == "docs")
    assert not problems, "\n".join(problems)


def test_markdown_links_resolve_inside_the_checkout():
    problems = []
    for path in _markdown_files():
        problems += link_problems(path.read_text(), path)
    assert not problems, "\n".join(problems)


def test_markdown_table_cells_are_short():
    problems = []
    for path in _markdown_files():
        problems += long_cells(path.read_text(), str(path.relative_to(ROOT)))
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------ the checkers

DOCS = {"DESIGN.md": {"Cost model", "One truth"}, "RUNTIME.md": {"Memory model"}}


@pytest.mark.parametrize("text", [
    'priced as the model says (docs/DESIGN.md, "Cost model")',
    'see docs/DESIGN.md "One truth" and docs/RUNTIME.md, "Memory model"',
    '"""Two statistics (docs/DESIGN.md, "One\ntruth"):',
    '# the bound (docs/DESIGN.md, "One\n    # truth")',
    '"the preset profiles (docs/DESIGN.md, \\"Cost model\\"), not measured"',
    'open("docs/RUNTIME.md", "w")',
    "the design: docs/DESIGN.md",
])
def test_references_that_pass(text):
    assert reference_problems(text, "f.py", DOCS, code=True) == []


@pytest.mark.parametrize(("text", "problem"), [
    ("the analytic cost model (DESIGN.md section 4)",
     "f.py:1: 'DESIGN.md' is not the checkout's docs/DESIGN.md"),
    ("the cost model (docs/DESIGN.md section 4)",
     "f.py:1: a numbered section of docs/DESIGN.md: name its heading instead"),
    ("the cost model (docs/DESIGN.md §4)",
     "f.py:1: a numbered section of docs/DESIGN.md: name its heading instead"),
    ("kept with shared material:\n../shared/DESIGN.md",
     "f.py:2: '../shared/DESIGN.md' is not the checkout's docs/DESIGN.md"),
    ("/srv/project/DESIGN.md", "f.py:1: '/srv/project/DESIGN.md' is not the checkout's docs/DESIGN.md"),
    ('(docs/DESIGN.md, "Cost modle")', "f.py:1: docs/DESIGN.md has no heading 'Cost modle'"),
    ('(docs/DESIGN.md, "One\n    # lie")', "f.py:1: docs/DESIGN.md has no heading 'One lie'"),
    ("see docs/NOTES.md", "f.py:1: docs/NOTES.md is not in the checkout"),
])
def test_references_that_fail(text, problem):
    assert problem in reference_problems(text, "f.py", DOCS, code=True)


def test_a_sibling_link_inside_docs_is_the_design_document():
    assert reference_problems("the design: [DESIGN.md](DESIGN.md)", "d.md", DOCS, in_docs=True) == []
    assert reference_problems("the design: [DESIGN.md](DESIGN.md)", "README.md", DOCS) != []
    assert reference_problems("the model (DESIGN.md, \"Cost model\")", "d.md", DOCS, in_docs=True) == [
        "d.md:1: 'DESIGN.md' is not the checkout's docs/DESIGN.md"]


def test_headings_skip_code_blocks():
    assert headings("# Title\n```\n# not a heading\n```\n## `Cost` model\n") == {"Title", "Cost model"}


def test_links_outside_the_checkout_fail(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "A.md").write_text("x")
    page = tmp_path / "docs" / "B.md"
    text = ("[a](A.md) [web](https://example.org/x.md) [top](#cost-model) `[code](nowhere.md)`\n"
            "[gone](C.md) [up](../../outside.md)\n")
    assert link_problems(text, page, root=tmp_path) == [
        "B.md:2: link 'C.md' does not resolve inside the checkout",
        "B.md:2: link '../../outside.md' does not resolve inside the checkout",
    ]


def test_long_cells_are_found_and_escaped_bars_kept():
    row = "| a | " + "x" * 301 + " |"
    assert long_cells("| h | h |\n|---|---|\n" + row + "\n", "t.md") == [
        f"t.md:3: a cell of 301 characters (at most {MAX_CELL}): {'x' * 60}..."]
    escaped = "| a | " + "y \\| " * 70 + " |"  # one cell of 349 characters: `\|` does not split it
    assert len(long_cells(escaped, "t.md")) == 1
    assert long_cells("```\n| " + "z" * 400 + " |\n```\n", "t.md") == []
