"""Every Containerfile has its <Containerfile>.dockerignore, and it keeps out every local
build product .gitignore names (issue 33 item 4: Containerfile.vllm sent .venv and .git)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CONTAINERFILES = sorted(p for p in DEPLOY.glob("Containerfile*") if p.suffix != ".dockerignore")


def _patterns(path: Path) -> set[str]:
    return {
        ln.strip().rstrip("/")
        for ln in path.read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    }


def test_there_are_containerfiles() -> None:
    assert {p.name for p in CONTAINERFILES} >= {"Containerfile", "Containerfile.vllm"}


@pytest.mark.parametrize("containerfile", CONTAINERFILES, ids=lambda p: p.name)
def test_each_containerfile_has_an_ignore_file(containerfile: Path) -> None:
    ignore = containerfile.with_name(containerfile.name + ".dockerignore")
    assert ignore.is_file(), f"{ignore.name} missing: the whole clone would be build context"
    patterns = _patterns(ignore)
    assert {".git", ".venv", ".engine-envs"} <= patterns
    # Every local product .gitignore names, too (kvsidecar/REVISION and BUILD_DATE are the
    # build's input).
    for entry in _patterns(ROOT / ".gitignore") - {"kvsidecar/REVISION", "kvsidecar/BUILD_DATE"}:
        anywhere = "/" not in entry and ("*" in entry or entry == "__pycache__")
        wanted = f"**/{entry}" if anywhere else entry
        assert wanted in patterns or entry in patterns, f"{ignore.name} lacks {entry}"
