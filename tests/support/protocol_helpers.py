"""Small builders shared by tests."""

from __future__ import annotations

from kvsidecar.protocol.schema import KVCachePoolSnapshot, RuntimeSnapshot, Snapshot


def sample_snapshot(step: int, pools: int = 4) -> Snapshot:
    return Snapshot(
        runtime=RuntimeSnapshot(engine="test", model_name="tiny", step=step, initialized=True),
        pools=[
            KVCachePoolSnapshot(pool_name=f"pool{i}", total_blocks=1000, allocated_blocks=step)
            for i in range(pools)
        ],
    )
