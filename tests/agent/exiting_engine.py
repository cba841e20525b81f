"""An engine that steps, closes its agent and exits at once: ``python -m
tests.agent.exiting_engine SHM_DIR``. Its exit status must be 0 (see test_heartbeat_thread)."""

from __future__ import annotations

import sys

from kvsidecar.agent.agent import KVSidecarAgent
from kvsidecar.agent.pool import KVBlockPool


def main(shm_dir: str) -> None:
    pool = KVBlockPool(64, 16, num_layers=2, kv_heads=2, head_dim=8, device="cpu")
    # A heartbeat due all the time: its thread is awake whenever the engine stops.
    agent = KVSidecarAgent("t", "m", shm_dir=shm_dir, device="cpu", heartbeat_interval=0.001)
    agent.register_pool(pool)
    pool.allocate_prompt("req", list(range(40)))
    for _ in range(10):
        agent.step()
    agent.close()  # then the interpreter finalizes, freeing the pool's tensors


if __name__ == "__main__":
    main(sys.argv[1])
