"""A subscriber that reads SGLang's LoadStat stream as llm-d-router PR #2067 does, written
from its ``zmq-state-extractor`` (engine ``sglang``, ``extractor/zmqmetrics``) and
``zmq-metrics-data-source``: subscribe to every topic, take each message's LAST frame as
the payload, decode it as a generic msgpack array, require at least 5 elements, element 0
the string "LoadStat", elements 1-4 integers (a float, bool or string is an error), ignore
the rest (attn_dp_rank may be null; appended fields are tolerated). Running = [1],
waiting = [2], and only when max_total_num_tokens [4] > 0: capacity = [4],
KV usage = [3] / [4]. Here the frames are kept too, to check the framing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec
import zmq


class DecodeError(Exception):
    pass


@dataclass
class Reading:
    running: int
    waiting: int
    usage: float | None
    capacity: int | None
    topic: bytes
    seq: int
    raw: list
    payload: bytes
    at_ns: int  # CLOCK_MONOTONIC when received


def _as_int(v: object) -> int:
    # Go's msgpack decodes an integer as an int kind; bool, float and str are not.
    if type(v) is not int:
        raise DecodeError(f"expected integer, got {type(v).__name__}")
    return v


def extract(payload: bytes) -> tuple[int, int, float | None, int | None, list]:
    if not payload:
        raise DecodeError("empty payload")
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise DecodeError(f"invalid msgpack: {e}") from None
    if not isinstance(raw, list):
        raise DecodeError("not an array")
    if len(raw) < 5:
        raise DecodeError(f"expected at least 5 fields, got {len(raw)}")
    if raw[0] != "LoadStat":
        raise DecodeError(f"unexpected tag {raw[0]!r}")
    running, waiting, tokens, capacity = (_as_int(raw[i]) for i in range(1, 5))
    if capacity > 0:
        return running, waiting, tokens / capacity, capacity, raw
    return running, waiting, None, None, raw


class Subscriber:
    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.readings: list[Reading] = []
        self.errors: list[str] = []

    def poll(self, timeout: float) -> list[Reading]:
        """Receive for up to `timeout` s (returning early after the first message)."""
        got = []
        if self.sub.poll(int(timeout * 1000)):
            while self.sub.poll(0):
                frames = self.sub.recv_multipart()
                now = time.monotonic_ns()
                try:
                    running, waiting, usage, capacity, raw = extract(frames[-1])
                except DecodeError as e:
                    self.errors.append(str(e))
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True) if len(frames) == 3 else -1
                r = Reading(running, waiting, usage, capacity, frames[0], seq, raw, frames[-1], now)
                got.append(r)
        self.readings.extend(got)
        return got

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()
