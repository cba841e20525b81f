"""A real writer process for the load-push tests, driven line by line on stdin.

``python -m tests.streams.load_writer NAME SHM_DIR ENGINE DP_RANK [ROLE]``; prints "ready" after
its first publish (running 0, waiting 0, allocated 0). Then each line ``R W A`` publishes
the next step with R running, W waiting and A allocated blocks (of `TOTAL`, block size
`BLOCK`) and prints the CLOCK_MONOTONIC ns of the publish; the agent's idle heartbeat
(0.5 s) keeps it fresh between steps, as an idle engine's agent does.
"""

from __future__ import annotations

import signal
import sys
import time

from kvsidecar.agent.heartbeat import IdleHeartbeat
from kvsidecar.protocol.schema import KVCachePoolSnapshot, RuntimeSnapshot, Snapshot
from kvsidecar.protocol.writer import SegmentWriter

TOTAL = 999
BLOCK = 16


def build(
    engine: str, dp: int, step: int, running: int, waiting: int, allocated: int, role: str
) -> Snapshot:
    return Snapshot(
        runtime=RuntimeSnapshot(
            engine=engine,
            role=role,
            model_name="m",
            dp_rank=dp,
            dp_size=2,
            initialized=True,
            step=step,
            requests_running=running,
            requests_waiting=waiting,
        ),
        pools=[
            KVCachePoolSnapshot(
                pool_name="block_pool",
                num_layers=2,
                block_size_tokens=BLOCK,
                block_size_bytes=4096,
                total_blocks=TOTAL,
                virtual_blocks=TOTAL + 1,
                null_block_reserved=True,
                allocated_blocks=allocated,
                available_blocks=TOTAL - allocated,
            )
        ],
    )


def main() -> None:
    name, shm_dir, engine, dp = sys.argv[1:5]
    role = sys.argv[5] if len(sys.argv) > 5 else "both"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with SegmentWriter(name, shm_dir=shm_dir) as w:
        beat = IdleHeartbeat(w, 0.5)
        step = 1
        w.publish(build(engine, int(dp), step, 0, 0, 0, role))
        print("ready", flush=True)
        for line in sys.stdin:
            running, waiting, allocated = (int(x) for x in line.split())
            step += 1
            beat.last_step_ns = time.perf_counter_ns()
            w.publish(build(engine, int(dp), step, running, waiting, allocated, role))
            print(time.monotonic_ns(), flush=True)
        beat.stop()


if __name__ == "__main__":
    main()
