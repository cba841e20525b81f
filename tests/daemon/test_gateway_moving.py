"""A gateway poll of a new step within the window of a probed check (issue 44 item 1): a
moving published sequence is a publishing writer, so the full check skips the probes of the
segment's writer and file (the path's ``stat``, the size ``fstat``, the liveness ``fcntl``)
while the target still holds the map that check probed, until that check's own window
ends (never extended by the checks without probes). Counted, not timed: the probes per
poll (main: one of each per new step). Then, for each probe skipped, the case it exists
for still reads as before: a writer that died after its last publish, a segment replaced
under a writer still publishing, a truncated file, a FAULTED state byte, a second live
segment claiming the rank. No wall clock decides: the gateway's clock is a counter the
test moves (the windows' ends), the engine's steps are published by hand."""

from __future__ import annotations

import os
import time
import types

import pytest

from kvsidecar.daemon import gateway as gw_mod
from kvsidecar.daemon.config import Discovery, Polling
from kvsidecar.daemon.gateway import FULL_CHECK_EVERY, Gateway
from kvsidecar.daemon.targets import TargetSet
from kvsidecar.protocol import _seqlock, layout
from kvsidecar.protocol import reader as reader_mod
from kvsidecar.protocol.reader import SegmentReader
from kvsidecar.protocol.writer import SegmentWriter
from tests.daemon import gateway_writer as gw

NAME = "kvsidecar.gw.dp0"


class Clock:
    """The gateway's `time`: monotonic() is the test's; the rest is the real module."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    fake = types.SimpleNamespace(monotonic=c.monotonic, monotonic_ns=time.monotonic_ns)
    monkeypatch.setattr(gw_mod, "time", fake)
    return c


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Calls of each probe: the path's stat, the liveness lock probe, and reads that
    fstat the file first (read_latest given a descriptor)."""
    counts = {"stat": 0, "liveness": 0, "fstat": 0}

    def counting(key, fn):
        def counted(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)

        return counted

    monkeypatch.setattr(SegmentReader, "replaced", counting("stat", SegmentReader.replaced))
    monkeypatch.setattr(
        SegmentReader, "writer_alive", counting("liveness", SegmentReader.writer_alive)
    )
    read_latest = _seqlock.read_latest

    def read(mm, retries=8, fd=-1):
        counts["fstat"] += fd >= 0
        return read_latest(mm, retries, fd)

    monkeypatch.setattr(
        reader_mod,
        "_seqlock",
        types.SimpleNamespace(
            **{k: getattr(_seqlock, k) for k in dir(_seqlock) if not k.startswith("__")}
            | {"read_latest": read}
        ),
    )
    return counts


@pytest.fixture
def shm(tmp_path) -> str:
    os.chmod(tmp_path, 0o750)
    return str(tmp_path)


def _setup(shm: str) -> tuple[SegmentWriter, TargetSet, Gateway]:
    writer = SegmentWriter(NAME, shm_dir=shm)
    writer.publish(gw.build("vllm", 0, "both", 1))
    targets = TargetSet(Discovery(shm), polling=Polling(poll_interval=0.25, stale_after=30))
    targets.poll_all()  # no background poller: the poll cycle (version) stays
    return writer, targets, Gateway(targets, stale_after=3600.0)


def _step(answer) -> int:
    status, _, _, extra = answer
    assert status == 200, answer
    return int(extra.split(b":")[1])


def test_new_steps_within_a_probed_window_make_no_probe(shm, clock, probes):
    """Fails on main: each poll of a new step stat'ed the path, fstat'ed the file and
    probed the writer's lock (20 of each for 20 steps). Now: none within the window of
    the probed check, one of each when it ends."""
    writer, targets, gateway = _setup(shm)
    try:
        assert _step(gateway.answer(0)) == 1  # the window's probed check
        for key in probes:
            probes[key] = 0
        for step in range(2, 22):
            writer.publish(gw.build("vllm", 0, "both", step))
            clock.now += FULL_CHECK_EVERY / 40  # all 20 within the window
            assert _step(gateway.answer(0)) == step  # every new step served at once
        assert gateway.full_checks == 21
        assert probes == {"stat": 0, "liveness": 0, "fstat": 0}
        clock.now += FULL_CHECK_EVERY  # the window's end: probed again, once
        writer.publish(gw.build("vllm", 0, "both", 22))
        assert _step(gateway.answer(0)) == 22
        assert probes == {"stat": 1, "liveness": 1, "fstat": 1}
    finally:
        targets.stop()
        writer.close()


def test_a_writer_dead_after_its_last_publish_reads_dead_a_window_after_that_step(shm, clock):
    """The liveness probe skipped: a step published, then the writer gone (its lock
    released, no CLOSED mark: a crash). The light check of that step may serve it (main
    probed it alive then); its word never moves again, so a window after that step the
    rank reads dead, as on main (whose full check of the step started the same window)."""
    writer, targets, gateway = _setup(shm)
    try:
        assert _step(gateway.answer(0)) == 1
        clock.now += FULL_CHECK_EVERY * 0.6
        writer.publish(gw.build("vllm", 0, "both", 2))
        writer._forget_in_child()  # the process's crash: lock gone, state byte READY
        status, body, _, extra = gateway.answer(0)  # main: probed alive (or dead)
        assert b"dead" in body if status == 503 else extra == b"Kvsidecar-Step: 2\r\n"
        clock.now += FULL_CHECK_EVERY * 1.01  # a window after the step's check
        status, body, _, _ = gateway.answer(0)
        assert status == 503 and b"dead" in body, body
        assert gateway.last_outcome[0][0] == "not_up"
    finally:
        targets.stop()
        writer.close()


def test_a_segment_replaced_under_a_publishing_writer_is_served_when_the_window_ends(shm, clock):
    """The path's stat skipped: a new segment renamed over the name while the old writer
    (on its now unlinked file) keeps publishing, so its word keeps moving. Past the probed
    check's window the new segment is served, not the old writer's steps."""
    writer, targets, gateway = _setup(shm)
    successor = SegmentWriter("kvsidecar.gw.next", shm_dir=shm)
    try:
        successor.publish(gw.build("vllm", 0, "both", 1000))
        assert _step(gateway.answer(0)) == 1
        os.rename(os.path.join(shm, "kvsidecar.gw.next"), os.path.join(shm, NAME))
        for step in (2, 3):  # the old writer goes on, its word moving
            clock.now += FULL_CHECK_EVERY * 0.4
            writer.publish(gw.build("vllm", 0, "both", step))
            assert _step(gateway.answer(0)) in (step, 1000)
        clock.now += FULL_CHECK_EVERY * 0.4  # past the probed window
        writer.publish(gw.build("vllm", 0, "both", 4))
        assert _step(gateway.answer(0)) == 1000
    finally:
        targets.stop()
        successor._forget_in_child()
        writer.close()


def test_a_file_truncated_under_a_light_check_reads_corrupt_not_a_crash(shm, clock):
    """The size fstat skipped: the file cut below its slots after a new step. The guarded
    copy reads the lost pages as truncated (no SIGBUS in the daemon), answered 503."""
    writer, targets, gateway = _setup(shm)
    try:
        assert _step(gateway.answer(0)) == 1
        writer.publish(gw.build("vllm", 0, "both", 2))
        os.truncate(os.path.join(shm, NAME), layout.HEADER_LEN)
        clock.now += FULL_CHECK_EVERY / 10
        status, body, _, _ = gateway.answer(0)
        assert status == 503 and b"truncated" in body, body
    finally:
        targets.stop()
        writer._forget_in_child()  # its pages are gone: never touch them again


def test_a_faulted_state_byte_is_seen_at_once_by_a_light_check(shm, clock):
    """A state byte other than READY takes the probed path: FAULTED after a new step is
    answered 503 at that poll, within the window."""
    writer, targets, gateway = _setup(shm)
    try:
        assert _step(gateway.answer(0)) == 1
        writer.publish(gw.build("vllm", 0, "both", 2))
        writer.mark_faulted()
        clock.now += FULL_CHECK_EVERY / 10
        status, body, _, _ = gateway.answer(0)
        assert status == 503 and b"fatal error" in body, body
    finally:
        targets.stop()
        writer.close()


def test_a_second_live_segment_makes_the_rank_ambiguous_at_the_next_cycle(shm, clock):
    """Ambiguity is decided per poll cycle: a second live segment claiming the rank makes
    it 503 at the cycle that finds it, whatever the first one's moving word."""
    writer, targets, gateway = _setup(shm)
    other = SegmentWriter("kvsidecar.gw.other", shm_dir=shm)
    try:
        assert _step(gateway.answer(0)) == 1
        other.publish(gw.build("vllm", 0, "both", 500))
        writer.publish(gw.build("vllm", 0, "both", 2))
        targets.discover()  # its directory scan finds the second segment
        targets.poll_all()  # the next poll cycle
        clock.now += FULL_CHECK_EVERY / 10
        status, body, _, _ = gateway.answer(0)
        assert status == 503 and b"all claim dp_rank 0" in body, body
    finally:
        targets.stop()
        other.close()
        writer.close()
