"""Run in the SGLang environment: an SGLang-identity rank for the gateway's doc test.

Real SGLang 0.5.23 memory classes on CPU (oracle.py's `Sim`: ``MHATokenToKVPool``,
``TokenToKVPoolAllocator``, ``RadixCache``) under our `SGLangPoolSource`, published by a
`KVSidecarAgent` whose engine is ``sglang``, with a few requests admitted so that the record
is SGLang's in every field. Prints ``ready`` once published, then steps every 0.1 s until
SIGTERM.

    python gateway_writer.py SHM_DIR SEGMENT_NAME
"""

from __future__ import annotations

import random
import signal
import sys
import time

from oracle import Sim

from kvsidecar.agent import KVSidecarAgent
from kvsidecar.agent.engines.sglang import SGLangPoolSource


def main() -> None:
    shm_dir, name = sys.argv[1:3]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    sim = Sim(1, 256, random.Random(41))
    for _ in range(4):
        sim.admit()
    source = SGLangPoolSource(sim.alloc, sim.tree, max_total_num_tokens=256)
    agent = KVSidecarAgent("sglang", "m", shm_dir=shm_dir, segment_name=name, device="cpu")
    agent.register_pool(source)
    try:
        agent.step(len(sim.reqs), 0)
        print("ready", flush=True)
        while True:
            time.sleep(0.1)
            agent.step(len(sim.reqs), 0)
    finally:
        agent.close()


if __name__ == "__main__":
    main()
