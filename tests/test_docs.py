"""Documentation that makes claims about tests: every test it names exists."""

from __future__ import annotations

import os
import re
from pathlib import Path

from tests.conftest import REPO


def _all_test_source() -> str:
    out = []
    for dirpath, _, files in os.walk(os.path.join(REPO, "tests")):
        for name in files:
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name)) as f:
                    out.append(f.read())
    return "\n".join(out)


def test_reliability_table_names_real_tests() -> None:
    with open(os.path.join(REPO, "docs", "reliability.md")) as f:
        doc = f.read()
    source = _all_test_source()
    files = set(re.findall(r"`(tests/[\w/]+\.py)", doc))
    # Test function names (module names like test_e2e are covered by the file check).
    names = {
        n
        for n in re.findall(r"\b(test_\w+)\b(?!\.py)", doc)
        if not any(p.endswith(f"/{n}.py") for p in files)
    }
    assert len(files) >= 8 and len(names) >= 25
    for path in files:
        assert os.path.exists(os.path.join(REPO, path)), path
    missing = sorted(n for n in names if f"def {n}(" not in source)
    assert not missing, missing


def _layout_table() -> str:
    with open(os.path.join(REPO, "README.md")) as f:
        readme = f.read()
    start = readme.index("## Layout")
    return readme[
        start : readme.index("\n## ", start + 1) if "\n## " in readme[start + 1 :] else None
    ]


def test_readme_layout_table_matches_the_tree() -> None:
    """Every package and top-level module of kvsidecar/ is in the table, and every path
    the table's first column names exists: a move that forgets the README fails here."""
    table = _layout_table()
    first_column = [row.split("|")[1] for row in table.splitlines() if row.startswith("| `")]

    def paths_in(cell: str) -> list[str]:  # `kvsidecar.agent` is a module name, not a path
        return [p for p in re.findall(r"`([^`]+)`", cell) if "/" in p or p.endswith(".py")]

    named = [p for cell in first_column for p in paths_in(cell)]
    for cell in first_column:
        # "`kvsidecar/discovery.py`, `logsetup.py`": bare names live beside the first path.
        paths = paths_in(cell)
        base = os.path.dirname(paths[0].rstrip("/"))
        for p in paths:
            full = p if "/" in p else os.path.join(base, p)
            assert os.path.exists(os.path.join(REPO, full)), f"README layout names {p}: missing"
    package = os.path.join(REPO, "kvsidecar")
    for entry in sorted(os.listdir(package)):
        if entry.startswith(("_", ".")) or entry.endswith(".so"):
            continue
        is_pkg = os.path.isdir(os.path.join(package, entry))
        if is_pkg and not os.path.exists(os.path.join(package, entry, "__init__.py")):
            continue
        want = f"kvsidecar/{entry}/" if is_pkg else entry
        assert any(n == want or n.endswith("/" + entry) for n in named), (
            f"kvsidecar/{entry} is not in the README's layout table"
        )


def test_no_table_row_or_bullet_is_left_over_from_a_merge() -> None:
    """A table row repeated in one document, or a bullet list glued to a table's last row,
    is what a merge leaves (docs/vllm.md had both under "Stopping vLLM")."""
    problems = []
    root = Path(REPO)
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        lines = path.read_text().splitlines()
        seen: dict[str, int] = {}
        for i, line in enumerate(lines, 1):
            header = i < len(lines) and set(lines[i]) <= set("|-: ") and "-" in lines[i]
            if line.startswith("|") and not set(line) <= set("|-: ") and not header:
                if line in seen:
                    problems.append(f"{path.name}:{i} repeats line {seen[line]}")
                seen.setdefault(line, i)
            if line.startswith(("* ", "- ")) and i > 1 and lines[i - 2].startswith("|"):
                problems.append(f"{path.name}:{i} a bullet right after a table row")
    assert not problems, problems


def heading_anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def doc_anchors(text: str) -> set[str]:
    """The anchors of a document's headings (not of `#` lines inside code blocks)."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return {heading_anchor(h) for h in re.findall(r"^#+ (.+)$", prose, re.M)}


def test_every_anchor_link_resolves() -> None:
    """`[..](#x)` and `[..](other.md#x)` in README.md and docs/ name a heading that exists
    (issue 45 item 4: the alert runbooks are linked by anchor; one link of benchmarks.md
    pointed at a heading renamed since)."""
    docs = {p.name: p.read_text() for p in Path(REPO, "docs").glob("*.md")}
    docs["README.md"] = Path(REPO, "README.md").read_text()
    anchors = {name: doc_anchors(text) for name, text in docs.items()}
    links = [
        (name, target, frag)
        for name, text in docs.items()
        for target, frag in re.findall(r"\]\(([\w./-]*\.md|)#([\w-]+)\)", text)
    ]
    assert len(links) > 20, links
    broken = [
        (name, target, frag)
        for name, target, frag in links
        if frag not in anchors.get(Path(target).name if target else name, set())
    ]
    assert not broken, broken
