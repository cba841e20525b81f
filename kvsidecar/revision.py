"""The source revision this kvsidecar was built from, for ``--version`` and
``kvsidecar_build_info{revision}``.

A built image or wheel carries it in ``kvsidecar/REVISION`` (deploy/Containerfile writes
its ``REVISION`` build argument there); a checkout asks git; otherwise ``unknown``.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

_HERE = Path(__file__).resolve().parent


@functools.cache
def revision() -> str:
    try:
        text = (_HERE / "REVISION").read_text().strip()
        if text and text != "unknown":
            return text
    except OSError:
        pass
    if (_HERE.parent / ".git").exists():  # a checkout (an editable install included)
        try:
            r = subprocess.run(
                ["git", "-C", str(_HERE.parent), "rev-parse", "--short=12", "HEAD"],
                capture_output=True,
                text=True,
                timeout=5,
            )
            if r.returncode == 0 and r.stdout.strip():
                return r.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return "unknown"
