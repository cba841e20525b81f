"""Engine-supplied strings made safe to print on a terminal or in a log (shared by the
CLI, the log formatter and the daemon's messages)."""

from __future__ import annotations

import re

# C0 controls (but not tab), DEL and C1 controls: an engine string carrying ESC or CR
# could rewrite the operator's terminal (clear it, fake a line, set the title).
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")


def printable(text: object, style: str = "backslash") -> str:
    """``text`` with every control character shown as an escape, for anything that prints
    an engine-supplied string to a terminal or a log: ``\\x1b``, ``\\r`` (style
    ``backslash``) or ``<0x1b>`` (style ``angle``, for formats with no backslash escapes)."""
    s = str(text)
    if not _CONTROL.search(s):
        return s
    if style == "angle":
        return _CONTROL.sub(lambda m: f"<{ord(m.group()):#04x}>", s)
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], s)
