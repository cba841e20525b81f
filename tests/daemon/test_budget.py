"""Per-target budgets (#12 item 1): an over-budget segment is refused, the others are served.

Hostile payloads are real, CRC-correct publishes into real segments (forked
writers or a writer in this process); the headline case runs `kvsidecar serve`.
"""

from __future__ import annotations

import os
import signal
import tracemalloc

import msgspec
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse

from kvsidecar.daemon.collector import SnapshotCollector
from kvsidecar.daemon.config import Discovery
from kvsidecar.daemon.exposition import render_text
from kvsidecar.daemon.target import REFUSED, UP
from kvsidecar.daemon.targets import TargetSet
from kvsidecar.protocol.schema import RuntimeSnapshot
from kvsidecar.protocol.writer import SegmentWriter
from tests.support.procs import start_daemon, wait_for
from tests.support.protocol_helpers import sample_snapshot
from tests.support.scrape import fetch, samples, value
from tests.support.writers import fork_raw_writer, fork_writer, stop

# Imported inside the tests that need them, so the end-to-end test also runs (and fails)
# against a daemon that predates budgets.

GOOD = "kvsidecar.good.dp0.tp0.pp0"
EVIL = "kvsidecar.evil.dp0.tp0.pp0"


def pool_flood(pools: int, model_name: str = "evil-model") -> bytes:
    """A valid payload: one runtime and `pools` empty pool arrays (1 byte each)."""
    runtime = msgspec.msgpack.encode(
        RuntimeSnapshot(engine="evil", model_name=model_name, step=1, initialized=True)
    )
    return b"\x92" + runtime + b"\xdc" + pools.to_bytes(2, "big") + b"\x90" * pools


def peak_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def test_pool_flood_is_refused_and_other_targets_are_served(shm_dir: str) -> None:
    payload = pool_flood(16_000)
    assert len(payload) < 16 * 1024  # fits the agent's default slot
    good = fork_writer(GOOD, shm_dir)
    evil = fork_raw_writer(EVIL, shm_dir, payload)
    daemon = None
    try:
        daemon, url = start_daemon(
            shm_dir, "--poll-interval", "0.05", "--rediscover-interval", "0.05"
        )
        refused = lambda: (  # noqa: E731
            value(fetch(url + "/metrics")[2], "kvsidecar_source_state", segment=EVIL, state=REFUSED)
            == 1
        )
        assert wait_for(refused, timeout=20)
        status, _, text = fetch(url + "/metrics")
        assert status == 200
        assert len(text) < 200_000, len(text)  # was 44 MB: 240,000 series
        labels = {"segment": EVIL, "limit": "pools"}
        assert value(text, "kvsidecar_source_budget_refusals_total", **labels) >= 1
        assert value(text, "kvsidecar_source_up", segment=EVIL) == 0
        assert value(text, "kvsidecar_kv_pool_total_blocks", segment=EVIL) is None
        # The healthy engine is served as usual.
        assert value(text, "kvsidecar_source_up", segment=GOOD) == 1
        assert value(text, "kvsidecar_kv_pool_total_blocks", segment=GOOD, pool="pool0") == 1000
        om = fetch(url + "/metrics", {"Accept": "application/openmetrics-text"})[2]
        assert len(list(om_parse(om))) > 10
        snapshots = fetch(url + "/api/v1/snapshots")[2]
        assert "over budget: 16000 pools per rank > --max-pools-per-rank 64" in snapshots
        # Generous: the figure itself (~30 MB) is measured by `kvsidecar bench hostile`.
        assert peak_rss_bytes(daemon.pid) < 128 * 1024 * 1024
    finally:
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            daemon.wait(10)
        stop(good)
        stop(evil)


def test_bounded_decoder_builds_no_pool_records() -> None:
    from kvsidecar.daemon.budget import BoundedSnapshotDecoder, OverBudget

    payload = pool_flood(60_000)
    decoder = BoundedSnapshotDecoder(64)
    tracemalloc.start()
    try:
        try:
            decoder.decode(payload)
        except OverBudget as e:
            assert e.limit == "pools" and "60000 pools" in str(e)
        else:
            raise AssertionError("not refused")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, peak  # a full decode builds 60,000 records (~30 MB)
    # Within budget, it decodes like the plain decoder.
    assert len(BoundedSnapshotDecoder(60_000).decode(payload).pools) == 60_000


def _one_target(shm_dir: str, budget) -> TargetSet:
    ts = TargetSet(Discovery(shm_dir, prefix="kvsidecar."), budget=budget)
    ts.poll_all()
    return ts


def test_long_label_value_is_refused_and_last_good_labels_kept(shm_dir: str) -> None:
    from kvsidecar.daemon.budget import Budget

    w = SegmentWriter(EVIL, shm_dir=shm_dir)
    other = SegmentWriter(GOOD, shm_dir=shm_dir)
    try:
        other.publish(sample_snapshot(1))
        w.publish(sample_snapshot(1))
        ts = _one_target(shm_dir, Budget(max_label_length=256))
        assert ts.targets[EVIL].view.state == UP
        huge = sample_snapshot(2)
        huge.runtime.model_name = "m" * 4096
        w.publish(huge)
        ts.poll_all()
        view = ts.targets[EVIL].view
        assert view.state == REFUSED and "model_name is 4096 bytes" in view.error
        assert view.budget_refusals_total == {"label_length": 1}
        # The over-budget snapshot is never kept: health series keep the last good labels.
        assert view.last is not None and view.last.snapshot.runtime.model_name == "tiny"
        assert ts.targets[GOOD].view.state == UP
        long_pool = sample_snapshot(3)
        long_pool.pools[1].pool_name = "p" * 300
        w.publish(long_pool)
        ts.poll_all()
        assert "pool_name is 300 bytes" in ts.targets[EVIL].view.error
        w.publish(sample_snapshot(4))  # back within budget: served again
        ts.poll_all()
        assert ts.targets[EVIL].view.state == UP
    finally:
        w.close()
        other.close()


def test_series_budget_is_an_upper_bound_of_what_is_exported(shm_dir: str) -> None:
    from kvsidecar.daemon.budget import Budget, series_estimate

    snap = sample_snapshot(1)
    n = series_estimate(snap)
    w = SegmentWriter(EVIL, shm_dir=shm_dir)
    try:
        w.publish(snap)
        ts = _one_target(shm_dir, Budget(max_series_per_target=n))
        assert ts.targets[EVIL].view.state == UP
        text = render_text(SnapshotCollector(ts.views).collect()).decode()
        exported = [s for s in samples(text) if s[1].get("segment") == EVIL]
        assert 0 < len(exported) <= n
        ts = _one_target(shm_dir, Budget(max_series_per_target=n - 1))
        view = ts.targets[EVIL].view
        assert view.state == REFUSED and view.budget_refusals_total["series"] >= 1
    finally:
        w.close()


def test_oversized_slot_is_refused_before_any_payload_is_read(shm_dir: str) -> None:
    from kvsidecar.daemon.budget import Budget

    snap = sample_snapshot(1)
    pid = fork_raw_writer(
        EVIL, shm_dir, msgspec.msgpack.encode(snap), slot_capacity=2 * 1024 * 1024
    )
    try:
        ts = _one_target(shm_dir, Budget())
        view = ts.targets[EVIL].view
        assert view.state == REFUSED
        assert view.budget_refusals_total["payload_bytes"] >= 1
        assert "--max-payload-bytes" in view.error and view.last is None
        ts = _one_target(shm_dir, Budget(max_payload_bytes=4 * 1024 * 1024))
        assert ts.targets[EVIL].view.state == UP
    finally:
        stop(pid)


def test_budget_flags_have_environment_twins(shm_dir: str) -> None:
    pid = fork_writer(GOOD, shm_dir)  # 4 pools
    env = {**os.environ, "KVSIDECAR_MAX_POOLS_PER_RANK": "2"}
    daemon = None
    try:
        daemon, url = start_daemon(shm_dir, "--poll-interval", "0.05", env=env)
        assert wait_for(
            lambda: (
                (
                    value(
                        fetch(url + "/metrics")[2],
                        "kvsidecar_source_budget_refusals_total",
                        segment=GOOD,
                        limit="pools",
                    )
                    or 0
                )
                >= 1
            )
        )
    finally:
        if daemon is not None:
            daemon.kill()
            daemon.wait()
        stop(pid)


def test_huge_directory_is_refused_before_it_is_decoded(
    shm_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The directory is decoded at attach: 100,000 field names would build 100,000
    objects (a 16 MiB segment could carry 16 million); it is refused as corrupt."""
    from kvsidecar.protocol import writer
    from kvsidecar.protocol.schema import Capabilities, current_capabilities

    # A hostile writer: ours refuses to create such a directory.
    monkeypatch.setattr(writer, "MAX_DIRECTORY_BYTES", 1 << 30)
    caps = current_capabilities()
    names = [*caps.pool_fields, *(f"{i:x}" for i in range(100_000))]  # distinct: see writer
    huge = Capabilities(**{**msgspec.structs.asdict(caps), "pool_fields": names})
    w = SegmentWriter(EVIL, shm_dir=shm_dir, capabilities=huge)
    try:
        w.publish(sample_snapshot(1))
        ts = TargetSet(Discovery(shm_dir, prefix="kvsidecar."))
        ts.poll_all()
        view = ts.targets[EVIL].view
        assert view.state == "corrupt" and "directory of" in view.error, view.error
    finally:
        w.close()
