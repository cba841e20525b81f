"""A publisher process for the KV-event budget test: its anonymous RSS around a full state.

``python -m tests.streams.kv_state_rss SHM_DIR BLOCKS``: fills a KV-event segment of
BLOCKS blocks (16 token ids each, chains of 64), binds a `RankPublisher`'s PUB and prints
its endpoint, then publishes empty batches until a line comes on stdin (the test's
subscribers have each taken one: their subscriptions are in). Then it publishes the full
state (a new writer incarnation's) and prints one line: RssAnon before and after, and
the bytes of the state's batches.
"""

from __future__ import annotations

import gc
import select
import sys

import zmq

from kvsidecar.daemon.config import KVEventsOptions
from kvsidecar.protocol.kv_events_writer import KVEventsWriter
from kvsidecar.streams import kv_events_zmq as kz
from tests.support.kv_chains import store_chains

NAME = "kvevents.rss.dp0.tp0.pp0"


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def main(shm_dir: str, blocks: int) -> None:
    w = KVEventsWriter(NAME, n_slots=blocks, block_size=16, shm_dir=shm_dir)
    store_chains(w, blocks)
    ctx = zmq.Context()
    pub = kz.RankPublisher(
        NAME, shm_dir, KVEventsOptions("tcp://127.0.0.1:0", memory_bytes=1 << 40), ctx
    )
    pub._bind(0)
    print(pub.endpoint, flush=True)
    while not select.select([sys.stdin], [], [], 0.05)[0]:
        pub._publish([], heartbeat=True)
    sys.stdin.readline()
    sent: list[int] = []
    remember = pub._remember
    pub._remember = lambda seq, payload: (sent.append(len(payload)), remember(seq, payload))  # type: ignore[method-assign,func-returns-value]
    gc.collect()
    before = rss_anon()
    pub.poll_once()  # attaches: the full state, published
    gc.collect()
    print(before, rss_anon(), sum(sent), pub.stats["events"], flush=True)
    sys.stdin.readline()  # the test is done with the subscribers
    pub._close()
    w.close()
    ctx.term()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
