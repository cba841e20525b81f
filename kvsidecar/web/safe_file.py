"""Reading a configuration file that someone else may have swapped: a FIFO blocked the
whole HTTP server on open (probes included), and ``/dev/zero`` read until MemoryError.
Here only a regular file of bounded size is read, and nothing blocks."""

from __future__ import annotations

import os
import stat

__all__ = ["MAX_CONFIG_BYTES", "read_regular"]

MAX_CONFIG_BYTES = 1024 * 1024  # far above any web config or certificate chain


def read_regular(path: str, limit: int = MAX_CONFIG_BYTES) -> bytes:
    """The bytes of ``path``; `OSError` (with a message saying why) unless it is a regular
    file of at most ``limit`` bytes. Symlinks are followed (Kubernetes' ``..data``)."""
    # O_NONBLOCK: opening a FIFO without a writer returns at once instead of waiting.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"not a regular file ({_kind(st.st_mode)}): point it at a file")
        if st.st_size > limit:
            raise OSError(f"{st.st_size} bytes, more than {limit}: not a config file")
        chunks, total = [], 0
        while chunk := os.read(fd, 65536):
            total += len(chunk)
            if total > limit:  # grew while we read
                raise OSError(f"more than {limit} bytes: not a config file")
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a file"
