"""The documents stay a reference: README.md, BENCHMARKS.md and docs/ARCHITECTURE.md within their line limits (so
that details move to docs/ and history to git), and every relative link in them and in docs/ reaches a file that
exists and, with an ``#anchor``, a heading of that file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LINE_LIMITS = {"README.md": 250, "BENCHMARKS.md": 600, "docs/ARCHITECTURE.md": 400}
DOCUMENTS = ["README.md", "BENCHMARKS.md", *sorted(str(path.relative_to(ROOT)) for path in (ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~)")
_INLINE_CODE = re.compile(r"`[^`\n]*`")
# [text](target) and ![alt](target), the text over lines too, the target up to a space (a title) or the ")"
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+[^)]*)?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")


def prose_lines(text: str) -> list[str]:
    """Every line, those of fenced code blocks (fences included) left empty: a "#" or a link in code is neither a
    heading nor a link."""
    lines, fenced = [], False
    for line in text.splitlines():
        fence = bool(_FENCE.match(line.strip()))
        lines.append("" if fenced or fence else line)
        fenced ^= fence
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (links and emphasis as shown), lowercased, every character but
    letters, digits, '-', '_' and spaces dropped, spaces turned to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "")
    return "".join(c for c in text.lower() if c.isalnum() or c in "-_ ").replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings; a repeated heading's anchor gains "-1", "-2", … as on GitHub."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose_lines(path.read_text()):
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(document: str, root: Path = ROOT) -> list[str]:
    """``path:line: target: why`` for each relative link of ``document`` that reaches no file or heading."""
    path = root / document
    text = "\n".join(_INLINE_CODE.sub("", line) for line in prose_lines(path.read_text()))  # code links are none
    broken = []
    for match in _LINK.finditer(text):
        target, number = match.group(1), text.count("\n", 0, match.start()) + 1
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{document}:{number}: {target}: no such file")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{document}:{number}: {target}: no heading #{anchor} in {linked.relative_to(root)}")
    return broken


@pytest.mark.parametrize("document", list(LINE_LIMITS))
def test_the_document_stays_within_its_line_limit(document):
    lines = len((ROOT / document).read_text().splitlines())
    assert lines <= LINE_LIMITS[document], (
        f"{document} has {lines} lines, over its limit of {LINE_LIMITS[document]}: move details to docs/ and "
        "superseded figures to git's history")


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_relative_link_reaches_a_file_and_heading(document):
    assert broken_links(document) == []


def test_anchors_follow_githubs_rules(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Memory model: predicted vs measured\n\n## Returned logits: `memopt::cce_with_logits`\n\n"
                    "## Breadth (zoo)\n\n```\n# not a heading\n```\n\n## Breadth (zoo)\n\n"
                    "### **WTA-CRS** against [recomputation](x.md), 0.70×\n")

    assert anchors(page) == {"memory-model-predicted-vs-measured", "returned-logits-memoptcce_with_logits",
                             "breadth-zoo", "breadth-zoo-1", "wta-crs-against-recomputation-070"}


def test_a_broken_link_is_named(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Here\n")
    (tmp_path / "README.md").write_text(
        "# Read me\n\n[ok](docs/a.md#here) [no file](docs/b.md) [no heading](docs/a.md#there) [web](https://example.com)\n"
        "[same page](#read-me) `[in code](nowhere.md)` [over\ntwo lines](docs/c.md)\n\n```\n[in a block](nowhere.md)\n```\n")

    assert broken_links("README.md", root=tmp_path) == ["README.md:3: docs/b.md: no such file",
                                                      "README.md:3: docs/a.md#there: no heading #there in docs/a.md",
                                                      "README.md:4: docs/c.md: no such file"]
