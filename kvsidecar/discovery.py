"""Finding segments in the shm directory (shared by the daemon and the CLI)."""

from __future__ import annotations

import fnmatch
import os

from kvsidecar.protocol.names import InvalidName, validate_name


def scan_segments(shm_dir: str, prefix: str = "", pattern: str | None = None) -> dict[str, int]:
    """{name: inode} of the entries in shm_dir that could be segments (valid names with
    the prefix/glob). Raises OSError if the directory cannot be listed: "cannot look"
    must never read as "no segments" (that would forget every live target).

    Dot-files are skipped, so writers' temporary ``.<name>.tmp`` files are never
    picked up half-made. Symlinks, FIFOs and the like are listed too: the caller
    refuses them with a reason instead of ignoring them silently. The inode comes
    from readdir (no stat), so a caller can tell a replaced file from an unchanged one
    for free.
    """
    out: dict[str, int] = {}
    with os.scandir(shm_dir) as entries:
        for entry in entries:
            name = entry.name
            if name.startswith(".") or not name.startswith(prefix):
                continue
            if pattern is not None and not fnmatch.fnmatchcase(name, pattern):
                continue
            try:
                validate_name(name)
            except InvalidName:
                continue
            out[name] = entry.inode()
    return out


def list_segments(shm_dir: str, prefix: str = "", pattern: str | None = None) -> list[str]:
    """Sorted names of `scan_segments`; [] if the directory cannot be listed."""
    try:
        return sorted(scan_segments(shm_dir, prefix, pattern))
    except OSError:
        return []
