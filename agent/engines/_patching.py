"""What the engine integrations share when they patch an engine from inside its process.

The mark that says a method (or a class) is patched already, so a second ``register()`` or
import hook changes nothing; a warning logged once per key, so a hook that fails on every
step says so once and never floods the engine's log; ``KVSIDECAR_DISABLE``, which leaves every
engine exactly as it was; and closing the segments of the engine processes a launcher stops
(engines stop theirs with SIGKILL, before they can close their own).

Used by `vllm`, `atom`, `atom_hook` and `sglang_plugin`; imports nothing of any engine. Each
integration keeps its own logger (``vllm.kvsidecar``, ``atom.kvsidecar``,
``sglang.kvsidecar``: the engine's logging configuration shows them) and its own `LogOnce`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Mapping
from typing import Any

from kvsidecar import settings

PATCH_MARK = "_kvsidecar_patched"


def is_patched(obj: Any) -> bool:
    """Whether `obj` (a wrapper we installed, or a class we patched) carries `PATCH_MARK`."""
    return bool(getattr(obj, PATCH_MARK, False))


def mark_patched(obj: Any, original: Any = None) -> None:
    """Put `PATCH_MARK` on `obj`; a wrapper also names the `original` it wraps."""
    setattr(obj, PATCH_MARK, True)
    if original is not None:
        obj.__wrapped__ = original


class LogOnce:
    """``log.warning(message, *args)`` the first time a key is seen, then nothing for it.

    ``logged`` holds the keys said already (a test may discard one to hear it again).
    """

    def __init__(self, log: logging.Logger) -> None:
        self.log = log
        self.logged: set[str] = set()

    def __call__(self, key: str, message: str, *args: object) -> None:
        if key not in self.logged:
            self.logged.add(key)
            self.log.warning(message, *args)


def disabled(env: Mapping[str, str] | None = None) -> bool:
    """``KVSIDECAR_DISABLE`` is set (in `env`, else this process's environment)."""
    return settings.DISABLE.enabled(os.environ if env is None else env)


def close_segments(pids: Collection[int], dead_only: bool) -> list[str]:
    """Close the segments that the processes `pids` write in this process's
    ``KVSIDECAR_SHM_DIR`` (only those of processes gone, with `dead_only`); their names."""
    from kvsidecar.protocol.writer import close_for_writers

    shm_dir = settings.SHM_DIR.get(os.environ) or settings.SHM_DIR.default
    return close_for_writers(shm_dir, pids, dead_only=dead_only) if pids else []
