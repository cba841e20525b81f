"""Fuzzing the reader: random and mutated segments always give a typed result, fast."""

from __future__ import annotations

import os
import random
import struct
import time

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsidecar.protocol import layout
from kvsidecar.protocol.reader import ReadError, Reading, SegmentReader
from kvsidecar.protocol.schema import Snapshot, decode_snapshot, encode_snapshot
from kvsidecar.protocol.writer import SegmentWriter
from tests.support.protocol_helpers import sample_snapshot

CASES = int(os.environ.get("KVSIDECAR_FUZZ_CASES", "10000"))  # `make fuzz`: 100,000
CORPUS = os.path.join(os.path.dirname(__file__), "corpus")
SAVE_CORPUS = os.environ.get("KVSIDECAR_FUZZ_SAVE_CORPUS")  # a dir: keep one case per outcome

# Fields worth aiming at: every header offset with a value that is absurd for it.
_TARGETS = [
    (layout.OFF_MAJOR, "<H"),
    (layout.OFF_MINOR, "<H"),
    (layout.OFF_HEADER_LEN, "<H"),
    (layout.OFF_STATE, "<B"),
    (layout.OFF_N_SLOTS, "<B"),
    (layout.OFF_TOTAL_SIZE, "<Q"),
    (layout.OFF_DIR_OFF, "<I"),
    (layout.OFF_DIR_LEN, "<I"),
    (layout.OFF_PUBLISHED_SEQ, "<Q"),
    (layout.OFF_SLOT_OFF, "<I"),
    (layout.OFF_SLOT_STRIDE, "<I"),
    (layout.OFF_SLOT_CAPACITY, "<I"),
    (layout.OFF_DIR_CRC, "<I"),
]
_ABSURD = [0, 1, 7, 255, 256, 4095, 4096, 65535, 2**31 - 1, 2**32 - 1, 2**63, 2**64 - 1]


def _valid_segment(shm_dir: str) -> bytes:
    with SegmentWriter("kvsidecar.fuzz.seed", shm_dir=shm_dir) as w:
        w.publish(sample_snapshot(7))
        w.publish(sample_snapshot(8))
        with open(w.path, "rb") as f:
            return f.read()


def _mutate(rng: random.Random, seed: bytes) -> bytes:
    data = bytearray(seed)
    kind = rng.randrange(8)
    if kind == 0:  # truncate anywhere
        return bytes(data[: rng.randrange(len(data))])
    if kind == 1:  # flip random bits
        for _ in range(rng.randint(1, 16)):
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
    elif kind == 2:  # absurd value in a header field
        off, fmt = rng.choice(_TARGETS)
        value = rng.choice(_ABSURD) % (256 ** struct.calcsize(fmt))
        struct.pack_into(fmt, data, off, value)
    elif kind == 3:  # bad magic
        data[rng.randrange(8)] ^= 0xFF
    elif kind == 4:  # garbage slot payload / slot header
        h = layout.Header(bytes(data[: layout.HEADER_LEN]))
        slot = h.slot_off + (h.published_seq & 1) * h.slot_stride
        n = rng.randint(1, 64)
        start = slot + rng.randrange(64)
        data[start : start + n] = rng.randbytes(n)
    elif kind == 5:  # completely random bytes of a plausible size
        return rng.randbytes(rng.choice([0, 1, 100, 4096, len(seed)]))
    elif kind == 6:  # random bytes with a valid magic
        data = bytearray(rng.randbytes(len(seed)))
        data[:8] = layout.MAGIC
    else:  # extend: file bigger than the header says
        data += rng.randbytes(rng.choice([1, 4096]))
    return bytes(data)


def _read(shm_dir: str, name: str, content: bytes) -> Reading | ReadError:
    path = os.path.join(shm_dir, name)
    with open(path, "wb") as f:
        f.write(content)
    try:
        with SegmentReader(name, shm_dir=shm_dir) as reader:
            error = reader.attach()
            return error if error is not None else reader.read()
    finally:
        os.unlink(path)


def test_fuzz_mutated_segments(shm_dir: str) -> None:
    seed = _valid_segment(shm_dir)
    assert isinstance(_read(shm_dir, "kvsidecar.fuzz.ok", seed), Reading)
    rng = random.Random(1234)
    kinds: dict[str, int] = {}
    slowest = 0.0
    for i in range(CASES):
        content = _mutate(rng, seed)
        t0 = time.perf_counter()
        result = _read(shm_dir, f"kvsidecar.fuzz.{i % 8}", content)
        slowest = max(slowest, time.perf_counter() - t0)
        assert isinstance(result, (Reading, ReadError)), type(result)
        if isinstance(result, ReadError):
            assert "\n" not in str(result) and str(result)  # one clear line
        key = "ok" if isinstance(result, Reading) else result.kind
        kinds[key] = kinds.get(key, 0) + 1
        if SAVE_CORPUS:
            _save(content, result)
    print(f"\nfuzz: {CASES} cases, outcomes {kinds}, slowest {slowest * 1e3:.2f} ms")
    assert slowest < 1.0  # no hangs
    assert kinds.get("corrupt", 0) > CASES // 10  # the mutations really hit the checks


_saved: set[str] = set()


def _outcome(result: Reading | ReadError) -> str:
    """Outcome class: kind plus the message with its numbers and paths stripped."""
    if isinstance(result, Reading):
        return "ok"
    words = [w for w in str(result).split() if not any(c.isdigit() or c == "/" for c in w)]
    return f"{result.kind}: {' '.join(words)[:80]}"


def _save(content: bytes, result: Reading | ReadError) -> None:
    outcome = _outcome(result)
    if outcome in _saved:
        return
    _saved.add(outcome)
    os.makedirs(SAVE_CORPUS, exist_ok=True)
    kind = "ok" if isinstance(result, Reading) else result.kind
    path = os.path.join(SAVE_CORPUS, f"{kind}-{len(_saved):03d}.bin")
    with open(path, "wb") as f:
        f.write(content)


def test_corpus_regressions(shm_dir: str) -> None:
    """Interesting cases kept from fuzz runs: each still gives the outcome it gave then."""
    files = sorted(os.listdir(CORPUS))
    assert len(files) >= 10
    for name in files:
        with open(os.path.join(CORPUS, name), "rb") as f:
            content = f.read()
        result = _read(shm_dir, "kvsidecar.corpus", content)
        expected = name.rsplit("-", 1)[0]
        got = "ok" if isinstance(result, Reading) else result.kind
        assert got == expected, (name, str(result))


def test_payload_mutations_decode_or_fail_typed() -> None:
    """Mutated valid payloads: a typed decode error or a valid Snapshot, never anything else."""
    rng = random.Random(99)
    seeds = [encode_snapshot(sample_snapshot(k, pools=k % 5)) for k in range(1, 20)]
    outcomes = {"ok": 0, "error": 0}
    for _ in range(CASES):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 8)):
            op = rng.randrange(3)
            i = rng.randrange(len(data))
            if op == 0:
                data[i] = rng.randrange(256)
            elif op == 1:
                del data[i : i + rng.randint(1, 16)]
            else:
                data[i:i] = rng.randbytes(rng.randint(1, 16))
        try:
            snap = decode_snapshot(bytes(data))
        except (msgspec.DecodeError, msgspec.ValidationError):
            outcomes["error"] += 1
        else:
            assert isinstance(snap, Snapshot)
            outcomes["ok"] += 1
    assert outcomes["error"] > CASES // 2


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=2048))
def test_payload_decoder_never_crashes(data: bytes) -> None:
    try:
        decode_snapshot(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
