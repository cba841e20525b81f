"""The source revision and build date this kvsidecar was built from, for ``--version``
(``revision`` also for ``kvsidecar_build_info{revision}``).

A built image or wheel carries them in ``kvsidecar/REVISION`` and ``kvsidecar/BUILD_DATE``
(`make dist` writes both; deploy/Containerfile its ``REVISION`` and ``BUILD_DATE`` build
arguments); a checkout asks git; otherwise ``unknown``. The build date is the commit's
date, as Prometheus's exporters print it (``20261205-08:15:00``, UTC), not the time of the
build: two builds of one commit say the same.
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

_HERE = Path(__file__).resolve().parent

# `git log` format of the commit date, in UTC whatever the host's zone.
DATE_FORMAT = "%Y%m%d-%H:%M:%S"


def _built_or_git(name: str, git_args: list[str]) -> str:
    """The content of kvsidecar/`name` (a build wrote it), else git's answer in a checkout
    (an editable install included), else ``unknown``."""
    try:
        text = (_HERE / name).read_text().strip()
        if text and text != "unknown":
            return text
    except OSError:
        pass
    if (_HERE.parent / ".git").exists():
        try:
            r = subprocess.run(
                ["git", "-C", str(_HERE.parent), *git_args],
                capture_output=True,
                text=True,
                timeout=5,
                env={**os.environ, "TZ": "UTC"},
            )
            if r.returncode == 0 and r.stdout.strip():
                return r.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return "unknown"


@functools.cache
def revision() -> str:
    return _built_or_git("REVISION", ["rev-parse", "--short=12", "HEAD"])


@functools.cache
def build_date() -> str:
    return _built_or_git(
        "BUILD_DATE", ["log", "-1", f"--date=format-local:{DATE_FORMAT}", "--format=%cd"]
    )
