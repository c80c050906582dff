"""The README's map stays current (no Ray, no engine): its Layout table has a row for every module
of minirl/, and names none that is gone; every docs/ or bench/ link in the README and in docs/
resolves to a file."""

import re
from pathlib import Path

from minirl.config import REPO_ROOT

README = REPO_ROOT / "README.md"


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_the_layout_table_lists_every_module():
    rows = [line for line in _section(README.read_text(), "Layout").splitlines() if line.startswith("| `minirl/")]
    listed = {re.match(r"\| `(minirl/[^`]+)`", row).group(1) for row in rows}
    modules = {p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "minirl").rglob("*.py")
               if p.name != "__init__.py"}
    assert len(modules) > 30  # the walk found the package
    assert not modules - listed, f"modules without a row in README's Layout table: {sorted(modules - listed)}"
    assert not listed - modules, f"rows in README's Layout table for modules that do not exist: {sorted(listed - modules)}"


def test_every_docs_link_resolves():
    pages = [README, REPO_ROOT / "bench" / "README.md", *(REPO_ROOT / "docs").glob("*.md")]
    checked = 0
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            path = (page.parent / target).resolve()
            assert path.exists(), f"{page.relative_to(REPO_ROOT)} links to {target}, which does not exist"
            checked += 1
    assert checked >= 10  # the README links its docs pages


def test_the_readme_keeps_its_overview_sections():
    text = README.read_text()
    for heading in ("Quick start", "Layering", "Layout", "Where things go", "Deviations from upstream", "Performance"):
        assert f"\n## {heading}\n" in text, heading
