"""The seam between a KV-cache pool and the publisher: anything with ``snapshot()``.

`PoolSource` is what the per-step publisher calls. Our own `KVBlockPool` satisfies it
directly; engine integrations (`kvsidecar.agent.engines`) adapt the allocators users run.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from kvsidecar.protocol.schema import KVCachePoolSnapshot


@runtime_checkable
class PoolSource(Protocol):
    """A pool the agent publishes every engine step.

    ``snapshot()`` is called on the engine thread once per step and must be cheap (O(1),
    no device sync). The returned record may be reused by the source: the publisher
    encodes it before the next call and does not keep it.
    """

    def snapshot(self) -> KVCachePoolSnapshot: ...
