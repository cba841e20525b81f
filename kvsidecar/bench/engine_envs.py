"""Which checkout an engine environment runs.

An engine environment (`.ci/engine-env NAME`) is shared by every clone on the host, keyed by
its lock, and holds an editable install of whichever checkout last ran `.ci/engine-env`.
Tests or benchmarks run from another checkout would silently exercise that other code (or
fail obscurely once it is deleted), so they check first and name the fix.
"""

from __future__ import annotations

import json
import urllib.parse
from pathlib import Path


def installed_checkout(python: Path) -> Path | None:
    """The directory kvsidecar is installed from in `python`'s environment (PEP 610's
    direct_url.json), or None when it is not an editable install there."""
    env = python.parent.parent
    for record in env.glob("lib/python*/site-packages/kvsidecar-*.dist-info/direct_url.json"):
        try:
            url = json.loads(record.read_text())["url"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        parsed = urllib.parse.urlparse(url)
        return Path(urllib.parse.unquote(parsed.path)) if parsed.scheme == "file" else None
    return None


def wrong_checkout(name: str, python: Path, checkout: Path) -> str | None:
    """A one-line problem-and-fix message when `name`'s environment does not run `checkout`."""
    installed = installed_checkout(python)
    if installed is not None and installed.resolve() == checkout.resolve():
        return None
    return (
        f"the {name} environment ({python}) runs kvsidecar from {installed or 'nowhere'}, "
        f"not from this checkout ({checkout}): run `bash .ci/engine-env {name}` here"
    )
