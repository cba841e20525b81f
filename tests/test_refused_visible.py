"""Refused files are visible where operators look (issue #23, item 2): a segment from a
newer major version gets a health series with reason ``version`` (not ``unreadable``),
``kvsidecar ls`` lists it with its versions, and the series stay bounded."""

from __future__ import annotations

import os

from kvsidecar.daemon.targets import TargetSet
from kvsidecar.protocol import layout
from kvsidecar.protocol.writer import SegmentWriter
from tests.daemon.scrape import fetch, value
from tests.procs import start_daemon, wait_for
from tests.protocol_helpers import sample_snapshot
from tests.test_operator_cli import cli

NEW = "kvsidecar.new.dp0.tp0.pp0"
OLD = "kvsidecar.old.dp0.tp0.pp0"


def _newer_major_copy(shm_dir: str, src: str, name: str) -> None:
    """A copy of a real segment that says layout major+1: what a newer agent writes."""
    with open(os.path.join(shm_dir, src), "rb") as f:
        data = bytearray(f.read())
    data[layout.OFF_MAJOR : layout.OFF_MAJOR + 2] = (layout.LAYOUT_MAJOR + 1).to_bytes(2, "little")
    with open(os.path.join(shm_dir, name), "wb") as f:
        f.write(data)


def test_newer_major_has_a_version_series_and_an_ls_row(shm_dir: str) -> None:
    w = SegmentWriter(OLD, shm_dir=shm_dir)
    try:
        w.publish(sample_snapshot(3))
        _newer_major_copy(shm_dir, OLD, NEW)
        daemon, url = start_daemon(shm_dir, "--poll-interval", "0.05")
        try:
            text = ""

            def seen() -> bool:
                nonlocal text
                text = fetch(url + "/metrics")[2]
                return value(text, "kvsidecar_refused_file", file=NEW, reason="version") == 1

            assert wait_for(seen, timeout=10), text
            assert value(text, "kvsidecar_segment_refusals_total", reason="version") == 1
            assert value(text, "kvsidecar_segment_refusals_total", reason="unreadable") is None
            assert value(text, "kvsidecar_refused_file", file=OLD, reason="version") is None
        finally:
            daemon.kill()
            daemon.wait(10)
        r = cli("ls", "--shm-dir", shm_dir)
        rows = [ln for ln in r.stdout.splitlines() if ln.startswith(NEW)]
        assert len(rows) == 1, r.stdout
        assert " refused " in rows[0] and f"v{layout.LAYOUT_MAJOR + 1}." in rows[0], rows[0]
        # Said once, not once on stdout and again on stderr.
        assert NEW not in r.stderr, r.stderr
    finally:
        w.close()


def test_ls_lists_refused_files_even_with_no_segment_followed(shm_dir: str) -> None:
    os.mkfifo(os.path.join(shm_dir, "kvsidecar.fifo"))
    r = cli("ls", "--shm-dir", shm_dir)
    assert r.returncode == 1
    assert "kvsidecar.fifo" in r.stdout and "refused" in r.stdout, (r.stdout, r.stderr)


def test_refused_series_are_bounded_by_max_targets(shm_dir: str) -> None:
    for i in range(6):
        os.mkfifo(os.path.join(shm_dir, f"kvsidecar.f{i}"))
    ts = TargetSet(shm_dir, prefix="kvsidecar.", max_targets=4)
    ts.poll_all()
    assert ts.refused_count == 6
    got = ts.refused_files(ts.max_targets)
    assert got == [(f"kvsidecar.f{i}", "not_regular") for i in range(4)]
    ts.stop()


def test_ls_exit_code_unchanged_for_an_empty_directory(shm_dir: str) -> None:
    r = cli("ls", "--shm-dir", shm_dir)
    assert r.returncode == 1 and "no segments" in r.stderr
