"""gzip for responses: the Accept-Encoding check and a one-entry cache of the last body."""

from __future__ import annotations

import gzip

__all__ = ["accepts_gzip", "gzip_cached"]

_gzip_last: tuple[bytes, bytes] = (b"", gzip.compress(b"", mtime=0))


def gzip_cached(body: bytes) -> bytes:
    """Compress, reusing the last result for the same body object.

    The daemon renders /metrics once per poll and hands every scrape the same
    bytes object; compressing 200 KB costs ~3 ms, so repeat scrapes reuse it.
    """
    global _gzip_last
    last_body, last_gz = _gzip_last
    if body is last_body:
        return last_gz
    gz = gzip.compress(body, compresslevel=6, mtime=0)
    _gzip_last = (body, gz)  # one tuple store: atomic for concurrent handler threads
    return gz


def accepts_gzip(accept_encoding: str) -> bool:
    for item in accept_encoding.split(","):
        coding, _, params = item.strip().partition(";")
        if coding.strip().lower() not in ("gzip", "x-gzip"):
            continue
        q = 1.0
        for param in params.split(";"):
            name, _, value = param.strip().partition("=")
            if name.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        return q > 0
    return False
