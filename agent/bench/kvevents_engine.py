"""The engine process of ``bench kvevents`` (the demo engine: our `KVBlockPool`).

``python -m kvsidecar.agent.bench.kvevents_engine SHM_DIR PUB_PORT REPLAY_PORT`` prints
one JSON line (pid, the engine thread's id, the KV-event segment), then serves commands
on stdin, one a line: ``MODE STEPS SEED``. It runs STEPS engine steps of a prefix-heavy
workload with evictions (4 requests a step over shared prefixes on a pool that fills up)
on a fresh pool, the same for every MODE given the same SEED, and answers one JSON line:
the engine thread's CPU, every thread's CPU (``/proc/self/task/*/schedstat``), the wall
time of the steps, the block-level changes (blocks stored + blocks removed + clears).

* ``none``: no events;
* ``kvsidecar``: the agent's recorder (agent/kv_events.py) into the KV-event segment
  the daemon publishes from;
* ``publisher``: events the way vLLM 0.32's own publisher does them, in this process:
  the msgspec events built on the engine thread, one `EventBatch` per step handed to a
  bounded queue with a blocking put, encoded and sent by a publisher thread that also
  serves replay (``vllm/distributed/kv_events.py``: ``ZmqEventPublisher``).

Around the steps the engine thread makes one ``getpgid`` call each side: markers for
``strace`` (the bench counts the system calls between them).
"""

from __future__ import annotations

import json
import os
import queue
import random
import sys
import threading
import time
from collections import deque

import msgspec
import zmq

from kvsidecar.agent.kv_events import KVEventsRecorder
from kvsidecar.agent.pool import KVBlockPool
from kvsidecar.protocol.kv_events_writer import MASK64, KVEventsWriter
from kvsidecar.streams.kv_events_wire import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
)

BLOCKS, BLOCK_SIZE = 1024, 16
REQUESTS_PER_STEP = 4
PREFIXES, PREFIX_BLOCKS = 48, 6
SEGMENT = "kvevents.bench.dp0.tp0.pp0"
MODES = ("none", "kvsidecar", "publisher")


class InEnginePublisher:
    """vLLM 0.32's ZmqEventPublisher, reduced to what it does per batch: a PUB (hwm
    100,000), a replay ROUTER, a bounded queue (100,000) with a blocking put, a buffer of
    10,000 batches, one thread that serves replay and sends."""

    def __init__(self, pub_port: int, replay_port: int) -> None:
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.set_hwm(100_000)
        self.pub.bind(f"tcp://127.0.0.1:{pub_port}")
        self.replay = self.ctx.socket(zmq.ROUTER)
        self.replay.bind(f"tcp://127.0.0.1:{replay_port}")
        self.queue: queue.Queue[EventBatch] = queue.Queue(maxsize=100_000)
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=10_000)
        self.seq = 0
        # vLLM's thread runs as long as the engine; here only through ``publisher``
        # rounds, so that it wakes nobody in the others (where vLLM's publisher is off).
        self.active = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kv-publisher", daemon=True)
        self.thread.start()

    def publish(self, batch: EventBatch) -> None:
        self.queue.put(batch)  # vLLM: a blocking put

    def _run(self) -> None:
        enc = msgspec.msgpack.Encoder()
        try:  # a name in /proc (threads show as "python" otherwise)
            with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
                f.write("kv-publisher")
        except OSError:
            pass
        while True:
            if not self.active.is_set():
                self.active.wait()
                # Requests left from a client of an earlier round (gone since): dropped,
                # so that no round pays for another's replays.
                while self.replay.poll(0):
                    self.replay.recv_multipart()
            if self.replay.poll(0):
                self._service_replay()
            try:
                batch = self.queue.get(timeout=0.1)
            except queue.Empty:
                continue
            payload = enc.encode(batch)
            seq = self.seq.to_bytes(8, "big")
            self.pub.send_multipart((b"", seq, payload), copy=False)
            self.buffer.append((self.seq, payload))
            self.seq += 1
            self.queue.task_done()

    def _service_replay(self) -> None:
        client, _, start_b = self.replay.recv_multipart()
        start = int.from_bytes(start_b, "big")
        for seq, payload in self.buffer:
            if seq >= start:
                self.replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self.replay.send_multipart((client, b"", END_SEQ, b""))


class PublisherRecorder:
    """The pool's recorder interface, building vLLM's events on the engine thread."""

    def __init__(self, publisher: InEnginePublisher) -> None:
        self.publisher = publisher
        self.events: list[object] = []
        self.run: BlockStored | None = None
        self.changes = 0

    def stored(self, slot, block_hash, parent_hash, token_ids, *, first=True, group_idx=0):
        h = block_hash & MASK64
        self.changes += 1
        run = self.run
        if first or run is None:
            self.run = BlockStored(
                block_hashes=[h],
                parent_block_hash=None if parent_hash is None else parent_hash & MASK64,
                token_ids=list(token_ids),
                block_size=BLOCK_SIZE,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=[None],
                group_idx=group_idx,
            )
            self.events.append(self.run)
        else:
            run.block_hashes.append(h)
            run.token_ids.extend(token_ids)
            run.extra_keys.append(None)  # type: ignore[union-attr]

    def removed(self, slot, block_hash, *, group_idx=0):
        self.changes += 1
        self.run = None
        self.events.append(
            BlockRemoved(block_hashes=[block_hash & MASK64], medium="GPU", group_idx=group_idx)
        )

    def cleared(self):
        self.changes += 1
        self.run = None
        self.events.append(AllBlocksCleared())

    def step(self) -> None:
        """The engine step's end: vLLM's scheduler takes the events and publishes a batch."""
        self.run = None
        if self.events:
            self.publisher.publish(
                EventBatch(ts=time.time(), events=self.events, data_parallel_rank=0)
            )
            self.events = []


def thread_cpu_ns() -> dict[str, int]:
    """CPU ns of every live thread of this process, by ``name/tid``."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[f"{name}/{tid}"] = int(f.read().split()[0])
        except OSError:
            pass
    return out


def workload(pool: KVBlockPool, steps: int, seed: int, step_end) -> None:
    rng = random.Random(seed)
    prefixes = [[p * 7919 + i for i in range(PREFIX_BLOCKS * BLOCK_SIZE)] for p in range(PREFIXES)]
    n = 0
    for _ in range(steps):
        for _ in range(REQUESTS_PER_STEP):
            n += 1
            prompt = rng.choice(prefixes) + [
                rng.randrange(50_000) for _ in range(rng.randrange(64))
            ]
            if pool.allocate_prompt(f"r{n}", prompt) is not None:
                pool.append_slots(f"r{n}", 16, [rng.randrange(50_000) for _ in range(16)])
                pool.finish(f"r{n}")
        step_end()


def main() -> None:
    shm_dir, pub_port, replay_port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    probe = KVBlockPool(BLOCKS, BLOCK_SIZE, num_layers=1, kv_heads=1, head_dim=2, device="cpu")
    writer = KVEventsWriter(
        SEGMENT, n_slots=probe.kv_event_slots, block_size=BLOCK_SIZE, shm_dir=shm_dir
    )
    publisher = InEnginePublisher(pub_port, replay_port)
    print(
        json.dumps({"pid": os.getpid(), "tid": threading.get_native_id(), "segment": SEGMENT}),
        flush=True,
    )
    try:
        for line in sys.stdin:
            mode, steps, seed = line.split()
            pool = KVBlockPool(
                BLOCKS, BLOCK_SIZE, num_layers=1, kv_heads=1, head_dim=2, device="cpu"
            )
            rec = None
            step_end = _nothing
            if mode == "kvsidecar":
                writer.cleared()
                pool.attach_kv_events(KVEventsRecorder(writer))
            elif mode == "publisher":
                publisher.active.set()
                rec = PublisherRecorder(publisher)
                pool.attach_kv_events(rec)  # type: ignore[arg-type]
                step_end = rec.step
            head0 = writer.head
            threads0, main0 = thread_cpu_ns(), time.thread_time_ns()
            os.getpgid(0)  # marker
            t0 = time.perf_counter()
            workload(pool, int(steps), int(seed), step_end)
            wall = time.perf_counter() - t0
            os.getpgid(0)  # marker
            main1 = time.thread_time_ns()
            publisher.queue.join()  # what the publisher thread owes for these steps
            threads1 = thread_cpu_ns()
            publisher.active.clear()
            changes = rec.changes if rec else writer.head - head0 if mode == "kvsidecar" else 0
            answer = {
                "mode": mode,
                "steps": int(steps),
                "wall_s": wall,
                "changes": changes,
                "engine_thread_ns": main1 - main0,
                "threads_ns": {k: v - threads0.get(k, 0) for k, v in threads1.items()},
            }
            print(json.dumps(answer), flush=True)
    finally:
        writer.close()


def _nothing() -> None:
    pass


if __name__ == "__main__":
    main()
