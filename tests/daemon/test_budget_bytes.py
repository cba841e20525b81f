"""Budgets in bytes that bound memory (issue 31 items 1 and 9).

On bca725e the label check and the exposition estimate counted characters: 256 emoji per
label were 1 KiB each, a 9-12 MB body against a 3 MiB budget and 444-499 MB RSS; the
aggregate budget kept the smallest targets and always one, so one target alone could
exceed it, and 72 slightly smaller junk targets of the engine's uid shed the engine.
Real segments and a real `TargetSet`; the RSS figure is `kvsidecar bench worsttarget`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import msgspec
import pytest

from kvsidecar.bench.publish import realistic_snapshot
from kvsidecar.daemon import budget
from kvsidecar.daemon.collector import SnapshotCollector
from kvsidecar.daemon.config import Discovery, Polling
from kvsidecar.daemon.exposition import render_text
from kvsidecar.daemon.target import NameThrottle, TargetView
from kvsidecar.daemon.targets import TargetSet
from kvsidecar.protocol.reader import Reading
from kvsidecar.protocol.schema import KVCachePoolSnapshot, RuntimeSnapshot, Snapshot
from kvsidecar.protocol.writer import SegmentWriter
from tests.attacks.worst_target import CHARS, payload

SLOT = 512 * 1024


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_label_length_counts_utf8_bytes(width: int) -> None:
    text = CHARS[width] * (budget.DEFAULT_MAX_LABEL_LENGTH // width + 1)  # one char too many
    for snap in (
        Snapshot(runtime=RuntimeSnapshot(model_name=text), pools=[]),
        Snapshot(runtime=RuntimeSnapshot(), pools=[KVCachePoolSnapshot(pool_name=text)]),
    ):
        with pytest.raises(budget.OverBudget) as e:
            budget.check(snap, budget.Budget())
        assert e.value.limit == "label_length" and "bytes" in str(e.value)
    fits = CHARS[width] * (budget.DEFAULT_MAX_LABEL_LENGTH // width)
    budget.check(Snapshot(runtime=RuntimeSnapshot(model_name=fits), pools=[]), budget.Budget())


def _body(snap: Snapshot, name: str) -> bytes:
    now = time.monotonic_ns()
    reading = Reading(snap, 2, 1, 1, now, 0, 0, 1, 1, 1)
    view = TargetView(name=name, state="up", last=reading)
    return render_text(SnapshotCollector(lambda: [view]).collect())


@pytest.mark.parametrize(("width", "pools"), [(0, 48), (1, 8), (2, 48), (3, 16), (4, 64)])
def test_exposition_estimate_is_not_below_the_body_in_bytes(width: int, pools: int) -> None:
    # bca725e: 4-byte labels, 64 pools: an estimate of 1.4 MB for a 3.8 MB body; labels of
    # double quotes (width 0), escaped to twice their bytes: 2.9 MB for 5.4 MB.
    name = "kvsidecar.worst.dp0.tp0.pp0"
    snap = msgspec.msgpack.decode(payload(width, 256 // max(width, 1), pools), type=Snapshot)
    body = len(_body(snap, name))
    bare = len(_body(Snapshot(runtime=RuntimeSnapshot(), pools=[]), "x"))  # daemon-free part
    assert budget.exposition_estimate(snap, name) >= body - bare, (width, pools, body)


@pytest.fixture
def writers(shm_dir: str) -> Iterator[dict[str, SegmentWriter]]:
    made: dict[str, SegmentWriter] = {}
    yield made
    for w in made.values():
        w.close()


def _publish(writers: dict, shm_dir: str, name: str, snap: Snapshot) -> None:
    if name not in writers:
        writers[name] = SegmentWriter(name, shm_dir=shm_dir, slot_capacity=SLOT)
    writers[name].publish(snap)


def _states(ts: TargetSet) -> dict[str, str]:
    return {v.name: v.state for v in ts.views()}


def _targets(shm_dir: str, limit: int) -> TargetSet:
    budget_ = budget.Budget(max_exposition_bytes=limit)
    return TargetSet(
        Discovery(shm_dir, rediscover_interval=0), polling=Polling(stale_after=3600), budget=budget_
    )


def test_a_target_alone_over_the_aggregate_is_shed(shm_dir: str, writers: dict) -> None:
    # bca725e kept "always at least one": one target took the daemon to 444-499 MB.
    big = msgspec.msgpack.decode(payload(1, 256, 48), type=Snapshot)
    _publish(writers, shm_dir, "kvsidecar.big.dp0.tp0.pp0", big)
    limit = budget.exposition_estimate(big, "kvsidecar.big.dp0.tp0.pp0") // 2
    ts = _targets(shm_dir, limit)
    try:
        for _ in range(3):
            ts.poll_all()
        view = ts.views()[0]
        assert view.state == "refused" and "--max-exposition-bytes" in view.error, view
        assert view.last is None, "a shed target exports none of its values"
    finally:
        ts.stop()


def _engine(pools: int, tag: str) -> Snapshot:
    snap = realistic_snapshot(pools)
    snap.runtime.model_name = tag
    return snap


def test_newcomers_never_shed_a_serving_target(shm_dir: str, writers: dict) -> None:
    # bca725e kept the smallest: 72 junk targets a little smaller shed the real engine.
    engine = "kvsidecar.engine.dp0.tp0.pp0"
    _publish(writers, shm_dir, engine, _engine(8, "real"))
    cost = budget.exposition_estimate(_engine(8, "real"), engine)
    ts = _targets(shm_dir, 3 * cost)
    try:
        ts.poll_all()
        ts.poll_all()
        assert _states(ts) == {engine: "up"}
        for i in range(12):  # each a little smaller than the engine, the same uid
            _publish(writers, shm_dir, f"kvsidecar.junk{i:02d}.dp0.tp0.pp0", _engine(7, "junk"))
        for _ in range(4):
            ts.poll_all()
        states = _states(ts)
        assert states[engine] == "up", states
        assert list(states.values()).count("up") == 3, "what fits beside it is served"
        assert list(states.values()).count("refused") == 10, states
    finally:
        ts.stop()


def test_shed_warning_is_throttled_per_target(
    shm_dir: str, writers: dict, caplog: pytest.LogCaptureFixture
) -> None:
    # bca725e: 35 "shed:" lines in 20 s for one target flapping across the budget.
    first, flapping = "kvsidecar.a.dp0.tp0.pp0", "kvsidecar.b.dp0.tp0.pp0"
    _publish(writers, shm_dir, first, _engine(4, "a"))
    _publish(writers, shm_dir, flapping, _engine(1, "b"))
    limit = budget.exposition_estimate(_engine(4, "a"), first) * 3 // 2
    ts = _targets(shm_dir, limit)
    try:
        ts.poll_all()
        ts.poll_all()
        caplog.set_level(logging.WARNING, logger="kvsidecar.daemon")
        start, rounds = time.monotonic(), 40
        for i in range(rounds):  # over the budget beside `first` every other poll
            _publish(writers, shm_dir, flapping, _engine(8 if i % 2 == 0 else 1, "b"))
            ts.poll_all()
        elapsed = time.monotonic() - start
    finally:
        ts.stop()
    shed = [r for r in caplog.records if "shed:" in r.getMessage()]
    # A burst, then one per interval of what the loop took (however slow the host).
    bound = NameThrottle.BURST + 1 + int(elapsed / NameThrottle().interval)
    assert 1 <= len(shed) <= bound, (len(shed), bound)


@pytest.mark.parametrize("width", [1, 4])
def test_renders_hold_about_twice_the_body_whatever_the_characters(
    shm_dir: str, writers: dict, width: int
) -> None:
    """bca725e joined the whole body into one Python string before encoding it: 4 bytes a
    character once a label held an emoji, a render peak of 4.2x the body (6.5x RSS per
    exposition byte in `bench worsttarget`). Rendered family by family now: ~2x, and the
    OpenMetrics bytes are exactly prometheus_client's."""
    import tracemalloc

    from prometheus_client.openmetrics.exposition import generate_latest

    from kvsidecar.daemon.app import Daemon

    name = "kvsidecar.worst.dp0.tp0.pp0"
    snap = msgspec.msgpack.decode(payload(width, 256 // width, 52), type=Snapshot)
    _publish(writers, shm_dir, name, snap)
    ts = _targets(shm_dir, 16 * 2**20)
    daemon = Daemon(ts, exporter_metrics=False)
    try:
        ts.poll_all()
        assert ts.views()[0].up
        for render in (daemon._render_text, daemon._render_openmetrics):
            render()  # caches warm (the label cache, prometheus_client's)
            tracemalloc.start()
            try:
                body = render()
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert len(body) > 2**20 and peak < 3 * len(body), (render.__name__, peak, len(body))
        families = list(daemon.registry.collect())

        class Families:
            def collect(self) -> list:
                return families

        daemon.registry = Families()  # type: ignore[assignment]
        assert daemon._render_openmetrics() == generate_latest(Families())
    finally:
        ts.stop()
