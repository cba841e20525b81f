"""The in-engine agent: torch KV block allocator and per-step publisher.

Installed as ``kvsidecar.agent`` (the repository's ``agent/`` folder), never as a
bare top-level ``agent`` package. The names below import torch on first use
only (PEP 562), so torch-free tools (the demo launcher) can live in subpackages.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "KVBlockPool": "kvsidecar.agent.pool",
    "KVSidecarAgent": "kvsidecar.agent.agent",
    "KvcachedDictAdapter": "kvsidecar.agent.engines.kvcached",
    "PoolSource": "kvsidecar.agent.adapters",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvsidecar.agent' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
