"""The house's floors, read from the code's own imports (`ast`, every module).

protocol is the ground floor; web knows nothing of metrics, snapshots or the daemon; torch
is imported only under agent/. A move that breaks one of these fails here, by name.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def _offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in _imports(path):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


def test_web_knows_nothing_of_metrics_or_the_daemon() -> None:
    forbidden = ("kvsidecar.daemon", "kvsidecar.protocol", "kvsidecar.agent", "kvsidecar.cli")
    forbidden += ("prometheus_client", "msgspec", "torch")
    assert _offenders("kvsidecar/web", forbidden) == []


def test_protocol_is_the_ground_floor() -> None:
    forbidden = ("kvsidecar.daemon", "kvsidecar.web", "kvsidecar.cli", "kvsidecar.agent")
    forbidden += ("kvsidecar.bench", "prometheus_client", "torch")
    assert _offenders("kvsidecar/protocol", forbidden) == []


def test_the_daemon_and_the_shared_helpers_do_not_import_the_cli() -> None:
    """The CLI is the top floor: it wires the daemon, never the other way round (run.py
    took exit codes and the directory check from cli.options before issue 35)."""
    found = _offenders("kvsidecar/daemon", ("kvsidecar.cli",))
    for helper in ("discovery", "logsetup", "printable", "exit_codes", "settings"):
        found += [
            f"kvsidecar/{helper}.py imports {name}"
            for name in _imports(ROOT / "kvsidecar" / f"{helper}.py")
            if name == "kvsidecar.cli" or name.startswith("kvsidecar.cli.")
        ]
    assert found == []


def test_torch_is_imported_only_under_agent() -> None:
    assert _offenders("kvsidecar", ("torch",)) == []


def test_importing_the_web_server_loads_no_exporter_code() -> None:
    probe = (
        "import sys, kvsidecar.web.server, kvsidecar.web.config_file; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('prometheus_client', 'msgspec', 'torch') or m.startswith('kvsidecar.daemon')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"


def _normalized(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def test_every_declared_runtime_dependency_is_imported() -> None:
    """A dependency must earn its place (posix_ipc was declared and never imported)."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = list(project["dependencies"])
    for extra in ("agent", "vllm"):
        declared += project["optional-dependencies"][extra]
    names = {_normalized(re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0]) for d in declared}
    imported = set()
    for package in ("kvsidecar", "agent"):
        for path in (ROOT / package).rglob("*.py"):
            imported |= {name.split(".")[0] for name in _imports(path)}
    providers = importlib.metadata.packages_distributions()
    provided = {_normalized(d) for top in imported for d in providers.get(top, [top])}
    assert sorted(names - provided) == []
