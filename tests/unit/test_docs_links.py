"""Every relative link and ``#anchor`` in README.md, CHANGELOG.md, docs/*.md and the lab notes
(docs/notes/*.md) resolves: the file (or folder) exists, and an anchor names a heading of the page
it points to, slugged the way GitHub does."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *DOCS, *sorted((ROOT / "docs" / "notes").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+).+?\1", re.DOTALL)
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.MULTILINE)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks (their lines could look like links or headings)."""
    return _FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: the text of its links, lowercased, punctuation (all but ``-``
    and ``_``) removed, spaces turned into ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings; a repeated slug gets ``-1``, ``-2``, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for heading in _HEADING.findall(_prose(text)):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(text: str) -> list[str]:
    """The targets of a page's inline links and images, outside code."""
    return _LINK.findall(_CODE_SPAN.sub("", _prose(text)))


def broken_links(page: Path) -> list[str]:
    """Each relative link of ``page`` that does not resolve, with why."""
    problems = []
    for target in links(page.read_text()):
        if _SCHEME.match(target) or target.startswith("/"):
            continue  # a URL or an absolute path: not ours to check
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            problems.append(f"{target}: no file {resolved}")
        elif anchor:
            if resolved.suffix != ".md" or resolved.is_dir():
                problems.append(f"{target}: an anchor into {resolved.name}, which is not a Markdown page")
            elif anchor not in anchors(resolved.read_text()):
                problems.append(f"{target}: no heading with anchor #{anchor} in {resolved.name}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    assert not broken_links(page), "\n".join(broken_links(page))


def test_the_docs_pages_are_linked_from_the_readme():
    readme = set(links((ROOT / "README.md").read_text()))
    missing = [page.name for page in DOCS if f"docs/{page.name}" not in readme]
    assert not missing, f"README.md links no docs page of {missing}"


def test_slugs_are_githubs():
    assert slug("Planning ahead: `deepspeed-knap bench ahead`") == "planning-ahead-deepspeed-knap-bench-ahead"
    assert slug("FLUX.2 [dev] on 4 nodes x 8 H100") == "flux2-dev-on-4-nodes-x-8-h100"
    assert slug("Training: `examples/train_dit.py`") == "training-examplestrain_ditpy"
    assert slug('The `"knapformer"` block') == "the-knapformer-block"
    assert slug("See [the docs](docs/x.md) here") == "see-the-docs-here"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n## A\n") == {"a", "a-1", "a-2"}


def test_the_checker_finds_a_broken_file_and_a_broken_anchor(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A section: `code`\n")
    (tmp_path / "page.md").write_text(
        "# Page\n\n"
        "[fine](other.md) [fine](other.md#a-section-code) [fine](#page) [web](https://example.com/x#y)\n"
        "![missing image](img/none.png) [gone](missing.md) [bad anchor](other.md#no-such-section)\n"
        "[bad local anchor](#nowhere) `[in code](not-checked.md)`\n\n"
        "```\n[in a code block](not-checked-either.md)\n```\n"
    )
    problems = broken_links(tmp_path / "page.md")
    assert [problem.split(":")[0] for problem in problems] == [
        "img/none.png",
        "missing.md",
        "other.md#no-such-section",
        "#nowhere",
    ], problems
    assert broken_links(tmp_path / "other.md") == []
