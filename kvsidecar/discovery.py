"""Finding segments in the shm directory (shared by the daemon and the CLI)."""

from __future__ import annotations

import fnmatch
import os
import stat

from kvsidecar.protocol.names import InvalidName, validate_name


def list_segments(
    shm_dir: str, prefix: str = "", pattern: str | None = None, *, regular_only: bool = True
) -> list[str]:
    """Names of entries in shm_dir that look like segments, sorted.

    Uses lstat (never follows symlinks) and skips dot-files, so writers'
    temporary ``.<name>.tmp`` files are never picked up half-made. With
    ``regular_only=False`` symlinks, FIFOs and the like are listed too, so the
    daemon can refuse them with a message instead of ignoring them silently.
    """
    try:
        entries = list(os.scandir(shm_dir))
    except OSError:
        return []
    names = []
    for entry in entries:
        name = entry.name
        if name.startswith(".") or not name.startswith(prefix):
            continue
        if pattern is not None and not fnmatch.fnmatchcase(name, pattern):
            continue
        try:
            validate_name(name)
            mode = entry.stat(follow_symlinks=False).st_mode
        except (InvalidName, OSError):
            continue
        if stat.S_ISREG(mode) or not regular_only or pattern == name:
            names.append(name)
    return sorted(names)
