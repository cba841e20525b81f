"""kvsidecar is installed only from what the operator builds or pins (issue #23, item 1).

We publish to no index, and the name `kvsidecar` is free on the public one: a line that
installs it by name runs whatever someone registers there. Every `pip install` in the docs,
the deploy files (comments included: they are copied) and the manifests' commands must
install a local path or wheel, or run with --no-index or --require-hashes.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml

from .support import DEPLOY, REPO

SOURCES = [
    REPO / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
    *sorted(p for p in DEPLOY.rglob("*") if p.is_file()),
]
# A package named on a pip command line: a bare name, optionally with extras or a version.
_BY_NAME = re.compile(r"[A-Za-z][\w.-]*(\[[\w,]+\])?([=<>!~]=?[\w.*]+)?")


def by_name(command: str) -> list[str]:
    """The packages `pip install ...` in command would resolve from an index."""
    m = re.search(r"\bpip3?\s+install\s+(.*)", command)
    if m is None:
        return []
    # The command ends at the end of an inline code span or of a shell list.
    rest = re.split(r"`|&&|;|\|\|", m.group(1))[0]
    try:
        words = shlex.split(rest, comments=True)
    except ValueError:
        words = rest.split()
    if "--no-index" in words or "--require-hashes" in words:
        return []
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
            continue
        if w in ("-r", "-c", "-e", "--target", "-t", "--find-links", "-f", "--prefix"):
            skip = True  # the next word is a path
            continue
        if w.startswith("-") or "/" in w or w in (".", "'.[agent]'", ".[agent]"):
            continue
        if w.startswith(".") or w.endswith(".whl"):
            continue
        if _BY_NAME.fullmatch(w):
            out.append(w)
    return out


def yaml_commands(path: Path) -> list[str]:
    """Every container command + args of a manifest, as one line each."""
    out = []
    for doc in yaml.safe_load_all(path.read_text()):
        stack = [doc]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                if "image" in node and ("command" in node or "args" in node):
                    words = [*node.get("command", []), *node.get("args", [])]
                    out.append(shlex.join(map(str, words)))
                stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)
    return out


def test_nothing_installs_kvsidecar_by_name() -> None:
    found = []
    for path in SOURCES:
        if path.suffix in (".png", ".json"):
            continue
        lines = path.read_text().splitlines()
        if path.suffix in (".yaml", ".yml") and "kubernetes" in path.parts:
            lines += yaml_commands(path)
        for line in lines:
            for name in by_name(line):
                found.append(f"{path.relative_to(REPO)}: {name!r} in {line.strip()!r}")
    assert not found, "installed by name from an index:\n" + "\n".join(found)


def test_checker_catches_a_name() -> None:
    assert by_name("python3 -m pip install --no-cache-dir --no-deps --target /x kvsidecar==0.1.0")
    assert by_name("#   RUN pip install --no-deps kvsidecar") == ["kvsidecar"]
    assert by_name("pip install 'kvsidecar[vllm]'") == ["kvsidecar[vllm]"]
    assert not by_name("/opt/vllm/bin/pip install dist/kvsidecar-0.1.0-*.whl")
    assert not by_name("pip install --no-index --find-links /wheels kvsidecar")
    assert not by_name("pip install -c constraints.txt '.[agent]'")


def test_the_vllm_example_runs_an_image_we_build() -> None:
    path = DEPLOY / "kubernetes" / "vllm-example.yaml"
    assert not [c for c in yaml_commands(path) if "pip" in c]
    text = path.read_text()
    assert "deploy/Containerfile.vllm" in text and (DEPLOY / "Containerfile.vllm").exists()


def test_license_matches_the_declared_one() -> None:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0", "SPDX string form (the table form is deprecated)"
    assert project["license-files"] == ["LICENSE"]
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
