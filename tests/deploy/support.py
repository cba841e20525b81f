"""Shared paths, tool lookup and CLI-contract helpers for the deployment-artifact tests."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
DEPLOY = REPO / "deploy"


def find_tool(name: str) -> str | None:
    """A tool from PATH or from the running interpreter's bin directory."""
    local = Path(sys.executable).parent / name
    if local.exists():
        return str(local)
    return shutil.which(name)


def require_tool(name: str, hint: str) -> str:
    path = find_tool(name)
    if path is None:
        pytest.skip(f"{name} is not installed ({hint})")
    return path


def run(cmd, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


# `kvsidecar serve` flags of the CLI contract; each has a KVSIDECAR_* twin.
# The test prefers the real click command when it can import it.
SERVE_FLAGS = [
    "--shm-dir",
    "--prefix",
    "--segment",
    "--poll-interval",
    "--stale-after",
    "--web.listen-address",
    "--web.config.file",
    "--web.telemetry-path",
    "--web.max-requests",
    "--allow-uid",
    "--log.level",
    "--log.format",
]


def serve_env_twins() -> tuple[set[str], bool]:
    """(env variable names of `kvsidecar serve`, whether they came from the code)."""
    try:
        from kvsidecar.cli.main import main
    except ImportError:
        return {env_twin(f) for f in SERVE_FLAGS}, False
    serve = main.commands.get("serve")
    if serve is None:
        return {env_twin(f) for f in SERVE_FLAGS}, False
    names = set()
    for param in serve.params:
        flag = max(param.opts, key=len)
        if flag in ("--help", "--version", "--help-man"):
            continue
        assert param.envvar == env_twin(flag), (
            f"{flag}: env twin {param.envvar}, expected {env_twin(flag)}"
        )
        names.add(param.envvar)
    return names, True


def env_twin(flag: str) -> str:
    return "KVSIDECAR_" + re.sub(r"[.-]", "_", flag.lstrip("-")).upper()
