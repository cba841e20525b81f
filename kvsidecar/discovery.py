"""Finding segments in the shm directory (shared by the daemon and the CLI)."""

from __future__ import annotations

import fnmatch
import os

from kvsidecar.protocol.names import InvalidName, validate_name


def list_segments(shm_dir: str, prefix: str = "", pattern: str | None = None) -> list[str]:
    """Names in shm_dir that could be segments (valid names with the prefix/glob), sorted.

    Dot-files are skipped, so writers' temporary ``.<name>.tmp`` files are never
    picked up half-made. Symlinks, FIFOs and the like are listed too: the reader
    refuses them (``O_NOFOLLOW``, ``S_ISREG``) with a message instead of the daemon
    ignoring them silently.
    """
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    out = []
    for name in names:
        if name.startswith(".") or not name.startswith(prefix):
            continue
        if pattern is not None and not fnmatch.fnmatchcase(name, pattern):
            continue
        try:
            validate_name(name)
        except InvalidName:
            continue
        out.append(name)
    return sorted(out)
