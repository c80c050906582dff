"""The README stays a door (no Ray, no engine): under its size budget, one current figure per
performance cell, its Layering list the same floors as tests/unit/test_layering.py, every module with a
docstring (the module map's home now), and every docs/ or bench/ link in the README and docs/ resolving."""

import ast
import re

from test_layering import FLOORS

from minirl.config import REPO_ROOT

README = REPO_ROOT / "README.md"
BUDGET_BYTES = 20_000


def _section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_the_readme_stays_under_its_budget():
    size = len(README.read_bytes())
    assert size <= BUDGET_BYTES, \
        f"README.md is {size} bytes, over its {BUDGET_BYTES}: move detail to docs/ or bench/history/"


def test_every_performance_cell_holds_one_current_figure():
    rows = [line for line in _section(README.read_text(), "Performance").splitlines()
            if line.startswith("| ") and not line.startswith(("| claim", "|---"))]
    assert len(rows) >= 10
    for row in rows:
        figure = row.split(" | ")[1]
        assert "Before" not in figure and len(re.findall(r"20\d\d-\d\d-\d\d", figure)) <= 1, (
            f"a Performance cell holds history (dated files take it: bench/history/): {figure}")
        assert len(figure) <= 160, f"a Performance cell is over 160 characters: {figure}"


def test_the_layering_list_matches_the_layering_test():
    listed = {}
    for line in _section(README.read_text(), "Layering").split("\n\n")[2].split("\n"):
        if m := re.match(r"(\d)\. ", line):
            floor = int(m.group(1))
        for name in re.findall(r"`([a-z_]+(?:/[a-z_]+)*)(?:\.py|/)`", line):  # `wire.py`, `algo/`, `gym/failures.py`
            listed["minirl." + name.replace("/", ".")] = floor
    expected = {k: v for k, v in FLOORS.items() if k != "minirl"}
    assert listed == expected, ("README's Layering list and tests/unit/test_layering.py's FLOORS differ: "
                                f"{set(listed.items()) ^ set(expected.items())}")


def test_every_module_opens_with_a_docstring():
    missing = [p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "minirl").rglob("*.py")
               if p.name != "__init__.py" and not ast.get_docstring(ast.parse(p.read_text()))]
    assert not missing, f"modules without a docstring saying their job and invariant: {missing}"


def test_every_docs_link_resolves():
    pages = [README, REPO_ROOT / "bench" / "README.md", *(REPO_ROOT / "docs").glob("*.md"),
             *(REPO_ROOT / "bench" / "history").glob("*.md")]
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
    for heading in ("Quick start", "A first run, and how to read it", "The main switches", "Layering",
                    "Deviations from upstream", "Performance", "Reference"):
        assert f"\n## {heading}\n" in text, heading
