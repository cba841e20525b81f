"""Finding segments in the shm directory (shared by the daemon and the CLI)."""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterator

from kvsidecar import settings
from kvsidecar.printable import printable
from kvsidecar.protocol.names import DEFAULT_SHM_DIR, InvalidName, validate_name


def iter_segments(
    shm_dir: str, prefix: str = "", pattern: str | None = None
) -> Iterator[tuple[str, int]]:
    """(name, inode) of each entry in shm_dir that could be a segment (a valid name with
    the prefix/glob), as readdir returns them: nothing is kept per entry, so a caller
    can look at a directory of any size in bounded memory. Raises OSError if the
    directory cannot be listed: "cannot look" must never read as "no segments" (that
    would forget every live target).

    Dot-files are skipped, so writers' temporary ``.<name>.tmp`` files are never
    picked up half-made. Symlinks, FIFOs and the like are listed too: the caller
    refuses them with a reason instead of ignoring them silently. The inode comes
    from readdir (no stat), so a caller can tell a replaced file from an unchanged one
    for free.
    """
    with os.scandir(shm_dir) as entries:
        for entry in entries:
            if segment_name(entry.name, prefix, pattern):
                yield entry.name, entry.inode()


def segment_name(name: str, prefix: str = "", pattern: str | None = None) -> bool:
    """Whether a directory entry's name could be a segment's (see `iter_segments`)."""
    # Cheapest tests first: most names in a shared directory are not ours.
    if not name.startswith(prefix) or name.startswith("."):
        return False
    if pattern is not None and not fnmatch.fnmatchcase(name, pattern):
        return False
    try:
        validate_name(name)
    except InvalidName:
        return False
    return True


def scan_segments(shm_dir: str, prefix: str = "", pattern: str | None = None) -> dict[str, int]:
    """{name: inode} of `iter_segments`; raises OSError as it does."""
    return dict(iter_segments(shm_dir, prefix, pattern))


def list_segments(shm_dir: str, prefix: str = "", pattern: str | None = None) -> list[str]:
    """Sorted names of `scan_segments`; [] if the directory cannot be listed."""
    try:
        return sorted(scan_segments(shm_dir, prefix, pattern))
    except OSError:
        return []


def dir_problem(shm_dir: str) -> str | None:
    """Why the segment directory is unusable, naming the option, or None. A missing
    directory is an error (otherwise the command would report 'no segments', which sends
    you looking elsewhere).

    The default directory is the exception: the agent creates it (private, 0750) when the
    first engine starts, so its absence means "no segment yet", not a wrong option."""
    if shm_dir == DEFAULT_SHM_DIR and not os.path.lexists(shm_dir):
        return None
    if os.path.isdir(shm_dir):
        return None
    what = "does not exist" if not os.path.exists(shm_dir) else "is not a directory"
    return (
        f"--shm-dir {printable(shm_dir)} {what}: create it or point "
        f"--shm-dir/{settings.SHM_DIR.name} at the agent's segment directory"
    )
