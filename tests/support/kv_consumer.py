"""A KV-event consumer as a prefix-cache router runs one (llm-d-router's precise prefix-cache
producer): a SUB on the live stream and a DEALER for vLLM's replay protocol, applying the
events to the set of block hashes it believes cached.

It joins with a replay from 0 (the sidecar answers a start older than its buffer with the
full state), asks for a replay from last + 1 on a gap in the sequence, and for one from 0
when the sequence goes back (a restarted publisher).

``sabotage`` breaks it on purpose, so a test can show that its check catches a consumer
that loses an event: "drop_event" (after `arm()`, each BlockStored is applied only when
the next one arrives, so the latest is lost: the one whose blocks a settled engine most
surely still holds, where losing an earlier one goes unseen once its blocks are evicted),
"miss_removal" (every BlockRemoved after `arm()` is ignored), "ignore_clear"
(AllBlocksCleared is ignored) and "ignore_restart" (no replay when the sequence goes back).
"""

from __future__ import annotations

import time

import msgspec
import zmq

from kvsidecar.streams.kv_events_wire import END_SEQ, KVEventBatch

SABOTAGES = ("drop_event", "miss_removal", "ignore_clear", "ignore_restart")


class Consumer:
    def __init__(
        self, port: int, replay_port: int, *, topic: bytes = b"", sabotage: str | None = None
    ):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.sub.subscribe(topic)
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        self.sabotage = sabotage
        self.armed = False
        self.held: set[int] = set()
        self.withheld: list[int] = []  # drop_event: the latest BlockStored's hashes
        self.last: int | None = None
        self.counts = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
        self.replays = 0
        self._dec = msgspec.msgpack.Decoder(KVEventBatch)

    def arm(self) -> None:
        self.armed = True

    def join(self) -> None:
        self.replay(0)

    def replay(self, start: int) -> None:
        """vLLM's replay: (b"", start) -> (b"", topic, seq, payload)... then the end marker."""
        self.replays += 1
        self.dealer.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            if not self.dealer.poll(30_000):
                raise TimeoutError("no replay answer")
            frames = self.dealer.recv_multipart()
            _, _topic, seq_b, payload = frames
            if seq_b == END_SEQ:
                return
            seq = int.from_bytes(seq_b, "big")
            if self.last is None or seq >= start:
                self._apply(payload)
                self.last = seq if self.last is None else max(self.last, seq)

    def pump(self, seconds: float = 0.3) -> None:
        """Apply what arrives on the live stream for about ``seconds`` (quiet time)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if not self.sub.poll(20):
                continue
            _topic, seq_b, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_b, "big")
            if self.last is not None and seq <= self.last:
                if seq < self.last and self.sabotage != "ignore_restart":
                    self.last = None  # the publisher restarted: rebuild from its replay
                    self.replay(0)
                elif self.sabotage == "ignore_restart" and seq < self.last:
                    self._apply(payload)
                    self.last = seq
                continue
            if self.last is not None and seq > self.last + 1:
                self.replay(self.last + 1)  # a gap: ask for what was missed
                if seq <= (self.last or -1):
                    continue
            self._apply(payload)
            self.last = seq

    def _apply(self, payload: bytes) -> None:
        for e in self._dec.decode(payload).events:
            kind = type(e).__name__
            self.counts[kind] += 1
            if kind == "BlockStored":
                if self.armed and self.sabotage == "drop_event":
                    self.held.update(self.withheld)
                    self.withheld = list(e.block_hashes)
                    continue
                self.held.update(e.block_hashes)
            elif kind == "BlockRemoved":
                if self.armed and self.sabotage == "miss_removal":
                    continue
                self.held.difference_update(e.block_hashes)
            elif self.sabotage != "ignore_clear":
                self.held.clear()
                self.withheld = []

    def close(self) -> None:
        self.sub.close()
        self.dealer.close()
        self.ctx.term()
