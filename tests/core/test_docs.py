"""The docs stand alone: every link and repository path in them resolves inside the repository,
nothing links out, the README stays short, and docs/architecture.md's layer table is the one
tests/core/test_layers.py enforces."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests._jobs import REPO
from tests.core.test_layers import ALLOWED

README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, *DOCS]
README_MAX_LINES = 250

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
"""A markdown link's target."""

REPO_PATH = re.compile(r"`((?:tests|tether|bench|examples|docs)/[\w./-]+)`")
"""A backticked path into the repository; checked where it names a file (`tests/core/x.py`) or a
folder (`tether/events/`)."""

ISSUE = re.compile(r"issue\s+#?\d+", re.IGNORECASE)


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "--", *patterns], cwd=REPO, capture_output=True, text=True, check=True
    )
    return [REPO / name for name in out.stdout.splitlines() if (REPO / name).is_file()]


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = _without_code(page.read_text())
    return {_anchor(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def _without_code(text: str) -> str:
    """The page without its fenced code blocks (shell lines and Python are not links)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def _rel(page: Path) -> str:
    return str(page.relative_to(REPO))


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_link_resolves_inside_the_repository(page: Path) -> None:
    bad = []
    for target in LINK.findall(_without_code(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):
            bad.append(f"{target}: a link out of the repository")
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.is_relative_to(REPO):
            bad.append(f"{target}: escapes the repository")
        elif not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {_rel(dest)}")
    assert not bad, f"{_rel(page)}:\n" + "\n".join(bad)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_repository_path_named_exists(page: Path) -> None:
    missing = [
        path
        for path in REPO_PATH.findall(page.read_text())
        if "*" not in path and not (REPO / path.rstrip("/")).exists()
    ]
    assert not missing, f"{_rel(page)} names paths that do not exist: {missing}"


def test_no_markdown_links_out_or_escapes_the_repository() -> None:
    bad = []
    for page in _tracked("*.md"):
        text = page.read_text()
        for m in re.finditer(r"https?://|\]\(\.\./|`\.\./", text):
            line = text.count("\n", 0, m.start()) + 1
            bad.append(f"{_rel(page)}:{line}: {m.group(0)}")
    assert not bad, "\n".join(bad)


def test_no_issue_numbers_in_code_tests_or_docs() -> None:
    files = _tracked("*.py", "*.md", "*.toml", "Makefile", "**/Makefile")
    assert files, "git ls-files found nothing"
    bad = [
        f"{_rel(f)}:{n}: {line.strip()}"
        for f in files
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1)
        if ISSUE.search(line)
    ]
    assert not bad, "\n".join(bad)


def test_the_readme_is_short() -> None:
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


def test_the_architecture_page_has_the_layer_table_of_test_layers() -> None:
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text[text.index("\n## Layers") :]
    section = section[: section.find("\n## ", 1)]
    table: dict[str, set[str]] = {}
    for row in re.findall(r"^\| `([\w_]+)` \| (.*) \|$", section, re.M):
        part, cell = row
        table[part] = set(re.findall(r"`([\w_]+)`", cell))
        assert cell == "nothing of tether" or table[part], part
    assert table == ALLOWED, "docs/architecture.md's layer table differs from test_layers.ALLOWED"
