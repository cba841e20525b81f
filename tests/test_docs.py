"""Documentation that makes claims about tests: every test it names exists."""

from __future__ import annotations

import os
import re

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
