"""A real engine-like process for KV-event tests: our KVBlockPool with its prefix cache
recorded into a KV-event segment (agent/kv_events.py), driven by lines on stdin.

    python -m tests.support.kv_pool_writer NAME SHM_DIR RING_CAP SEED

Prints "ready <incarnation>", then answers each command with one line:
``run N`` (N requests over a few shared prefixes: hits, new blocks, evictions) -> "ok";
``set`` -> the JSON list of the pool's cached block hashes as the wire carries them
(unsigned 64-bit); ``reset`` -> "ok <reset_prefix_cache()'s result>"; ``quit``.
"""

from __future__ import annotations

import json
import random
import sys

from kvsidecar.agent.kv_events import KVEventsRecorder
from kvsidecar.agent.pool import KVBlockPool
from kvsidecar.protocol.kv_events_writer import MASK64, KVEventsWriter

BLOCKS, BLOCK_SIZE = 48, 4
PREFIXES = [[p * 10 + i for i in range(8)] for p in range(6)]


def main() -> None:
    name, shm_dir, ring_cap, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    pool = KVBlockPool(BLOCKS, BLOCK_SIZE, num_layers=1, kv_heads=1, head_dim=2, device="cpu")
    writer = KVEventsWriter(
        name, n_slots=pool.kv_event_slots, block_size=BLOCK_SIZE, shm_dir=shm_dir, ring_cap=ring_cap
    )
    pool.attach_kv_events(KVEventsRecorder(writer))
    rng = random.Random(seed)
    n = 0
    print("ready", writer.incarnation, flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "run":
            for _ in range(int(cmd[1])):
                n += 1
                prompt = rng.choice(PREFIXES) + [
                    rng.randrange(1000) for _ in range(rng.randrange(9))
                ]
                if pool.allocate_prompt(f"r{n}", prompt) is not None:
                    pool.append_slots(f"r{n}", 4, [rng.randrange(1000) for _ in range(4)])
                    pool.finish(f"r{n}")
            print("ok", flush=True)
        elif cmd[0] == "set":
            print(json.dumps(sorted(h & MASK64 for h in pool._hash_to_block)), flush=True)
        elif cmd[0] == "reset":
            print("ok", pool.reset_prefix_cache(), flush=True)
        elif cmd[0] == "quit":
            writer.close()
            return


if __name__ == "__main__":
    main()
