"""vLLM's hook points: the private methods the plugin wraps, the parameters it expects of
them, and the one log line that disables the plugin when this vLLM lacks one or changed it.

The hooks touch private vLLM methods (vLLM says the scheduler interface is not public).
`TESTED_VERSIONS` were checked (docs/vllm.md, "Supported versions"); on another version the
plugin still tries, and if a hook point is missing or its signature differs from
`HOOK_SIGNATURES` it disables itself with one log line naming the version and the hook point.

Here too: the plugin's logger and its log-once, shared by the whole package (so the
``"hook"`` line is said once, whichever module finds the problem).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterable
from typing import Any

from kvsidecar.agent.engines._patching import LogOnce

# Under "vllm." so vLLM's own logging configuration (handlers, format, level) shows it.
log = logging.getLogger("vllm.kvsidecar")
_log_once = LogOnce(log)
_logged = _log_once.logged  # the keys logged already

TESTED_VERSIONS = ("0.32.0", "0.33.0")

# Hook points, checked before anything is patched: (owner, attribute).
SCHEDULER_HOOKS = ("update_from_output", "_free_request", "_free_blocks", "finish_requests")
BLOCK_POOL_HOOKS = (
    "get_new_blocks",
    "free_blocks",
    "touch",
    "unpin_blocks",
    "_insert_block_hash",
    "_remove_cached_block_hashes",
    "reset_prefix_cache",
    "free_block_queue",
    "num_gpu_blocks",
    "blocks",
)
MANAGER_HOOKS = ("record_prefix_cache_stats", "allocate_slots", "coordinator", "block_pool")

# The parameters (after self) of every wrapped method, as in TESTED_VERSIONS. A hook point
# whose signature differs is treated like a missing one: our wrappers pass arguments through
# by position and read them by meaning, so a changed signature would miscount silently.
HOOK_SIGNATURES: dict[str, dict[str, tuple[str, ...]]] = {
    "Scheduler": {
        "update_from_output": ("scheduler_output", "model_runner_output"),
        "_free_request": ("request", "delay_free_blocks"),
        "_free_blocks": ("request",),
        "finish_requests": ("request_ids", "finished_status"),
        "reset_prefix_cache": ("reset_running_requests", "reset_connector"),
        "shutdown": (),
        "get_request_counts": (),
    },
    "BlockPool": {
        "get_new_blocks": ("num_blocks",),
        "free_blocks": ("ordered_blocks",),
        "touch": ("blocks",),
        "unpin_blocks": ("blocks", "on_reuse"),
        "_insert_block_hash": ("block_hash_with_group_id", "block", "num_tokens"),
        "_remove_cached_block_hashes": ("block",),
        "reset_prefix_cache": (),
    },
    "KVCacheManager": {
        "record_prefix_cache_stats": ("request", "num_hits"),
        "prefix_cache_lookup_enabled": ("request",),
    },
}


def vllm_version() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception:
        return "unknown"


def _missing(obj: Any, names: Iterable[str]) -> str | None:
    for name in names:
        if not hasattr(obj, name):
            return f"{type(obj).__name__ if not isinstance(obj, type) else obj.__name__}.{name}"
    return None


def _params(fn: Any) -> tuple[str, ...] | None:
    try:
        names = tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return names[1:] if names[:1] == ("self",) else names


def _defined_params(cls: type, name: str) -> tuple[str, ...] | None:
    # A subclass's (*args, **kwargs) override (a custom --scheduler-cls) passes through:
    # the method it forwards to is the one whose signature counts.
    fn = getattr(cls, name, None)
    for klass in cls.__mro__:
        if name in vars(klass):
            fn = vars(klass)[name]
            params = inspect.signature(fn).parameters if callable(fn) else {}
            kinds = {p.kind for n, p in params.items() if n != "self"}
            if kinds != {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}:
                break
    return _params(fn)


def signature_mismatch(cls: type, table: str) -> str | None:
    """The first wrapped method of `cls` whose parameters differ from the tested ones, as
    ``Owner.method(found) instead of (expected)``; None when all match."""
    for name, want in HOOK_SIGNATURES[table].items():
        found = _defined_params(cls, name)
        if found != want:
            got = "?" if found is None else ", ".join(found)
            return f"{table}.{name}({got}) instead of ({', '.join(want)})"
    return None


def _hook_problem(version: str, missing: str | None, changed: str | None) -> bool:
    """Log the one line that disables the plugin; True when there is a problem."""
    if missing is not None:
        what = f"hook point {missing} is missing"
    elif changed is not None:
        what = f"hook point signature changed: {changed}"
    else:
        return False
    _log_once(
        "hook",
        "kvsidecar disabled for vLLM %s: %s (tested: %s)",
        version,
        what,
        ", ".join(TESTED_VERSIONS),
    )
    return True
