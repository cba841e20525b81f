"""A real writer process standing in for one engine rank, with predictable values.

Run as ``python -m tests.support.rank_writer NAME SHM_DIR DP_RANK POOLS PERIOD``. Values
are functions of dp_rank and pool index (so tests can check exact numbers)
plus the step counter, which moves. This is the real SegmentWriter in its own
process; only the numbers are scripted.
"""

from __future__ import annotations

import signal
import sys
import time

from kvsidecar.protocol.schema import KVCachePoolSnapshot, RuntimeSnapshot, Snapshot
from kvsidecar.protocol.writer import SegmentWriter


def expected_pool(dp: int, i: int) -> dict[str, int]:
    return {
        "total_blocks": 1000 * (i + 1),
        "allocated_blocks": 100 * (dp + 1) + i,
        "reserved_blocks": i,
        "available_blocks": 1000 * (i + 1) - 100 * (dp + 1),
        "cached_blocks": 7 + i,
        "deferred_free_blocks": 10 * (dp + 1) + i,
        "deferred_free_requests": dp + 1,
        "tokens_used": 1500 * (dp + 1) + i,
        "evictions_total": 5 * (dp + 1),
    }


def build(name: str, dp: int, pools: int, step: int, engine: str = "fake") -> Snapshot:
    return Snapshot(
        runtime=RuntimeSnapshot(
            engine=engine,
            model_name="tiny-model",
            role="prefill",
            dp_rank=dp,
            dp_size=2,
            initialized=True,
            step=step,
            requests_running=4 + dp,
            requests_waiting=dp,
            requests_deferred_free=dp + 3,
            requests_deferred_free_distinct=dp + 3,
            device_total_bytes=8 << 30,
            device_free_bytes=2 << 30,
        ),
        pools=[
            KVCachePoolSnapshot(
                pool_name=f"pool{i}",
                group_id=i,
                num_layers=4,
                block_size_tokens=16,
                block_size_bytes=4096,
                **expected_pool(dp, i),
            )
            for i in range(pools)
        ],
    )


def main() -> None:
    name, shm_dir, dp, pools, period = (
        sys.argv[1],
        sys.argv[2],
        int(sys.argv[3]),
        int(sys.argv[4]),
        float(sys.argv[5]),
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with SegmentWriter(name, shm_dir=shm_dir) as w:
        step = 1
        w.publish(build(name, dp, pools, step))
        print("ready", w.incarnation, flush=True)
        while True:
            step += 1
            w.publish(build(name, dp, pools, step))
            time.sleep(period)


if __name__ == "__main__":
    main()
