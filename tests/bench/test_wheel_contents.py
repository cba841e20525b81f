"""The wheel (hence the images, which install it) carries the product and nothing of the
checkout: no attack tool (tests/attacks/), no test module, no checkout-only file (issue 35
item 3). Built from a fresh copy of the tree: a stale build/lib would re-add moved files."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO as _REPO

# Build products and local state, never part of a build's input.
IGNORED = (".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", "*.so", ".*_cache")
IGNORED += (".hypothesis", ".engine-envs", "bench-results", "gpu-wheels")
REPO = Path(_REPO)
PACKAGES = (
    "kvsidecar",
    "kvsidecar.protocol",
    "kvsidecar.cli",
    "kvsidecar.daemon",
    "kvsidecar.web",
    "kvsidecar.otlp",
    "kvsidecar.bench",
    "kvsidecar.agent",
    "kvsidecar.agent.demo",
    "kvsidecar.agent.bench",
    "kvsidecar.agent.engines",
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(*IGNORED))
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check"]
    r = subprocess.run(
        [*pip, "--no-deps", "--no-build-isolation", "--wheel-dir", str(tmp / "out"), str(src)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (built,) = (tmp / "out").glob("kvsidecar-*.whl")
    with zipfile.ZipFile(built) as z:
        return [n for n in z.namelist() if not n.endswith("/")]


def _sources() -> set[str]:
    """Every product module as the wheel names it (agent/ ships as kvsidecar.agent)."""
    out = {
        f"kvsidecar/{p.relative_to(REPO / 'kvsidecar')}" for p in (REPO / "kvsidecar").rglob("*.py")
    }
    out |= {
        f"kvsidecar/agent/{p.relative_to(REPO / 'agent')}" for p in (REPO / "agent").rglob("*.py")
    }
    return out


def test_the_wheel_carries_the_product_and_no_checkout_file(wheel: list[str]) -> None:
    outside = [n for n in wheel if not n.startswith(("kvsidecar/", "kvsidecar-"))]
    assert outside == [], outside  # no tests/, docs/, deploy/, Makefile, .ci/
    attacks = sorted(p.stem for p in (REPO / "tests" / "attacks").glob("*.py"))
    assert "hostile_writers" in attacks and "discover_flood" in attacks, attacks
    shipped = {Path(n).stem for n in wheel if n.startswith("kvsidecar/bench/")}
    assert shipped & set(attacks) == {"__init__"}, sorted(shipped & set(attacks))
    assert {n for n in wheel if n.endswith(".py")} == _sources()
    for package in PACKAGES:
        assert f"{package.replace('.', '/')}/__init__.py" in wheel, package
    assert "kvsidecar/bench/checkout.py" in wheel and "kvsidecar/bench/rounds.py" in wheel
    assert any(n.startswith("kvsidecar/protocol/_seqlock.") and n.endswith(".so") for n in wheel)


def test_no_product_module_imports_the_checkout() -> None:
    """The wheel has no tests package: the product reaches tests/attacks/ only through
    kvsidecar/bench/checkout.py, by name, where a checkout is present."""
    found = []
    for path in sorted((REPO / "kvsidecar").rglob("*.py")) + sorted((REPO / "agent").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            found += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] == "tests"]
    assert found == []


def test_the_images_install_the_wheel_built_from_the_product_only() -> None:
    for name in ("Containerfile", "Containerfile.vllm"):
        text = (REPO / "deploy" / name).read_text()
        copies = [line.split()[1:-1] for line in text.splitlines() if line.startswith("COPY ")]
        sources = {s for c in copies for s in c if not s.startswith("--")}
        assert not any(s.startswith("tests") or s == "." for s in sources), (name, sources)
        assert "pip wheel" in text and "--find-links /wheels kvsidecar" in text, name
