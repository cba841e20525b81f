"""A tiny vLLM KV connector that defers every finished request's free, like a P/D producer
whose decode peer has not pulled the KV yet, and releases it on command or after a delay.

Loaded by vLLM through ``kv_transfer_config`` (``kv_connector="HoldConnector"``,
``kv_connector_module_path="kvsidecar_hold_connector"``). Runs inside the vLLM env only.

* in-process tests (worker in the driver's process): the driver puts ids in `RELEASE`;
  the worker side reports them as sent on the next step.
* ``kv_connector_extra_config={"hold_s": S}``: every hold is released S seconds after it
  began (for the OpenAI server test, whose worker lives in another process).
"""

from __future__ import annotations

import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

RELEASE: set[str] = set()  # request ids the driver lets go (in-process tests)
HELD: dict[str, float] = {}  # worker side: request id -> when the hold began


class HoldConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {}
        self.hold_s = float(extra.get("hold_s", 0) or 0)
        self.hold = bool(extra.get("hold", True))  # False: a connector that never defers

    # -- scheduler side -----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def request_finished(self, request: Any, block_ids: list[int]):
        return self.hold, None  # keep the blocks: "the KV is being sent"

    # -- worker side ----------------------------------------------------------------------
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs):
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]):
        now = time.monotonic()
        for rid in finished_req_ids:
            HELD.setdefault(rid, now)
        done = {
            rid
            for rid, t0 in HELD.items()
            if rid in RELEASE or (self.hold_s > 0 and now - t0 >= self.hold_s)
        }
        for rid in done:
            del HELD[rid]
            RELEASE.discard(rid)
        return (done or None), None


class HoldConnectorHMA(HoldConnector, SupportsHMA):
    """The same for hybrid KV configs (several KV-cache groups): vLLM turns its hybrid
    manager off for a connector that does not declare HMA support."""

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]):
        return self.hold, None
