"""Process supervision shared by the demo launcher and its engines (torch-free).

One way to ask Linux for a signal when the parent dies (``PR_SET_PDEATHSIG``), so a
SIGKILLed launcher leaves no orphaned engines or daemon behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def parent_death_signal(sig: int = signal.SIGTERM) -> Callable[[int], None]:
    """Return ``arm(parent_pid)``, which asks for `sig` when the parent dies (no-op off
    Linux). libc is resolved here, not in ``arm``: ``arm`` may run between fork and exec
    (a ``preexec_fn``), where loading a library is not safe."""
    prctl = None
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            prctl = ctypes.CDLL(None, use_errno=True).prctl

    def arm(parent: int) -> None:
        if prctl is None:
            return
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), sig)

    return arm
