"""Engine integrations: one module per engine, each the only importer of its engine.

The table maps an engine name to the ``module:attr`` of its integration, so that
naming an engine imports nothing until it is used (vLLM's platform and connector
registries do the same). An integration module keeps its pure mapping (engine
state -> `KVCachePoolSnapshot`) apart from its hooks into the engine.
"""

from __future__ import annotations

import importlib
from typing import Any

ENGINES: dict[str, str] = {
    "atom": "kvsidecar.agent.engines.atom_hook:install",
    "kvcached": "kvsidecar.agent.engines.kvcached:KvcachedDictAdapter",
    "sglang": "kvsidecar.agent.engines.sglang:SGLangPoolSource",
    "vllm": "kvsidecar.agent.engines.vllm:register",
}


def load(engine: str) -> Any:
    """The integration object registered for `engine` (imports its module now)."""
    module, _, attr = ENGINES[engine].partition(":")
    return getattr(importlib.import_module(module), attr)
