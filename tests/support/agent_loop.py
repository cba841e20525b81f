"""An engine-like loop in its own process: a KVBlockPool, deferred P/D frees, agent.step().

``python -m tests.support.agent_loop SHM_DIR STEPS_PER_SEC`` runs until killed. Each step
admits a request sharing a prefix, finishes the oldest running one deferred on
the "pd" connector, and releases deferred requests after 20 steps, so the
deferred gauges rise and fall in a sawtooth.
"""

from __future__ import annotations

import collections
import signal
import sys
import time

from kvsidecar.agent.agent import KVSidecarAgent
from kvsidecar.agent.pool import KVBlockPool


def main() -> None:
    shm_dir, rate = sys.argv[1], float(sys.argv[2])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    agent = KVSidecarAgent("loop", "tiny", role="prefill", shm_dir=shm_dir, device="cpu")
    pool = KVBlockPool(512, 16, num_layers=2, kv_heads=2, head_dim=8, device="cpu")
    agent.register_pool(pool)
    running: collections.deque[str] = collections.deque()
    deferred: collections.deque[tuple[int, str]] = collections.deque()
    prefix = list(range(64))
    print("ready", agent.segment_name, flush=True)
    n = 0
    while True:
        n += 1
        rid = f"r{n}"
        if pool.allocate_prompt(rid, prefix + [1000 + n] * 20) is not None:
            running.append(rid)
        if len(running) > 4:
            old = running.popleft()
            pool.finish(old, connectors=("pd",))
            deferred.append((n, old))
        while deferred and (n - deferred[0][0] >= 20 or (n // 200) % 2 == 1):
            pool.release(deferred.popleft()[1], "pd")
        agent.step(len(running), 0)
        time.sleep(1 / rate)


if __name__ == "__main__":
    main()
