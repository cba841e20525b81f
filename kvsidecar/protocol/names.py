"""Segment names and paths.

A segment is a file directly inside the shm directory (``/dev/shm/kvsidecar``
by default, a Kubernetes ``emptyDir`` elsewhere). Names are validated on both
sides so a name can never walk out of that directory or hide as a dot-file.

The default directory is private rather than ``/dev/shm`` itself: ``/dev/shm``
is world-writable, so any local user could pre-create a segment's name there.
The agent creates ``/dev/shm/kvsidecar`` (mode 0750: the engine's user writes,
its group, the daemon's, reads) and refuses it when another user owns it.
This constant is the one source of the default for writers and readers alike.
"""

from __future__ import annotations

import os
import re

DEFAULT_SHM_DIR = "/dev/shm/kvsidecar"
# Mode the agent gives the default directory when it creates it (group: the engine's, or
# KVSIDECAR_GROUP): others can neither list it nor create names in it.
DEFAULT_SHM_DIR_MODE = 0o750
DEFAULT_PREFIX = "kvsidecar."
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:@+-]{0,200}")


class InvalidName(ValueError):
    """A segment name that is not a plain file name."""


def validate_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or ".." in name:
        raise InvalidName(
            f"invalid segment name {name!r}: use letters, digits and _.:@+- only, "
            "no '/', no '..', not starting with '.'"
        )
    return name


def segment_path(name: str, shm_dir: str = DEFAULT_SHM_DIR) -> str:
    return os.path.join(shm_dir, validate_name(name))


def default_segment_name(
    engine: str, dp_rank: int = 0, tp_rank: int = 0, pp_rank: int = 0, *, tag: str = ""
) -> str:
    """``kvsidecar.<engine>[.<tag>].dp<d>.tp<t>.pp<p>``: one segment per rank."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", engine) or "engine"
    middle = f".{re.sub(r'[^A-Za-z0-9_-]', '_', tag)}" if tag else ""
    return f"{DEFAULT_PREFIX}{safe}{middle}.dp{dp_rank}.tp{tp_rank}.pp{pp_rank}"
