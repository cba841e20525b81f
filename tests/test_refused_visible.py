"""Refused files are visible where operators look (issue #23, item 2): a segment from a
newer major version is counted with reason ``version`` (not ``unreadable``), named in
``kvsidecar ls`` with its versions and in /api/v1/snapshots, and never in a label value
(issue 31 item 3: the name is chosen by whoever created the file)."""

from __future__ import annotations

import json
import os

from kvsidecar.daemon.config import Discovery, Polling
from kvsidecar.daemon.targets import TargetSet
from kvsidecar.protocol import layout
from kvsidecar.protocol.writer import SegmentWriter
from tests.support.procs import start_daemon, wait_for
from tests.support.protocol_helpers import sample_snapshot
from tests.support.scrape import fetch, value
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
                by_reason = "kvsidecar_refused_segments_by_reason"
                return value(text, by_reason, reason="version") == 1

            assert wait_for(seen, timeout=10), text
            assert value(text, "kvsidecar_segment_refusals_total", reason="version") == 1
            assert value(text, "kvsidecar_segment_refusals_total", reason="unreadable") is None
            assert NEW not in text, "a file name is never a label value"
            refused = json.loads(fetch(url + "/api/v1/snapshots")[2])["refused"]
            assert refused["total"] == 1
            [row] = refused["files"]
            assert (row["file"], row["reason"]) == (NEW, "version"), row
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


def test_refused_names_are_bounded_and_a_version_refusal_comes_first(shm_dir: str) -> None:
    w = SegmentWriter(OLD, shm_dir=shm_dir)
    try:
        w.publish(sample_snapshot(3))
        for i in range(6):  # sort before NEW by name
            os.mkfifo(os.path.join(shm_dir, f"kvsidecar.a{i}"))
        _newer_major_copy(shm_dir, OLD, NEW)
        ts = TargetSet(Discovery(shm_dir, prefix="kvsidecar.", max_targets=4))
        ts.poll_all()
        assert ts.refused_count == 7
        assert ts.refused_by_reason() == {"not_regular": 6, "version": 1}
        got = [(n, r) for n, r, _ in ts.refused_files(4)]
        assert got == [(NEW, "version")] + [(f"kvsidecar.a{i}", "not_regular") for i in range(3)]
        ts.stop()
    finally:
        w.close()


def test_ls_exit_code_unchanged_for_an_empty_directory(shm_dir: str) -> None:
    r = cli("ls", "--shm-dir", shm_dir)
    assert r.returncode == 1 and "no segments" in r.stderr


def _section8() -> str:
    from tests.conftest import REPO

    with open(os.path.join(REPO, "docs", "segment-format.md")) as f:
        doc = f.read()
    return " ".join(doc.split("## 8.", 1)[1].split())


def test_a_refused_file_named_in_dump_and_serve_is_what_section_8_says(shm_dir: str) -> None:
    """Issue 30 item 7: section 8 said `kvsidecar dump NAME` shows a newer-version file as
    a target in state refused; it exits 1 with "no segments matching" after a stderr line
    naming the refusal, and only `serve --segment NAME` makes it a refused target."""
    import json

    w = SegmentWriter(OLD, shm_dir=shm_dir)
    try:
        w.publish(sample_snapshot(3))
        _newer_major_copy(shm_dir, OLD, NEW)
        r = cli("dump", "--shm-dir", shm_dir, NEW)
        assert r.returncode == 1 and r.stdout == "", r
        assert f"kvsidecar: refused {NEW}: " in r.stderr and "matching" in r.stderr, r.stderr
        ts = TargetSet(Discovery(shm_dir, names=(NEW,)), polling=Polling(stale_after=3600))
        try:
            ts.poll_all()
            view = ts.targets[NEW].view
            assert (view.state, view.error_kind) == ("refused", "version_mismatch")
        finally:
            ts.stop()
        # error_kind is in dump's JSON (and /api/v1/snapshots: the same record): null while
        # up, the class's kind otherwise.
        r = cli("dump", "--shm-dir", shm_dir, "--json", OLD)
        (record,) = json.loads(r.stdout)["targets"]
        assert (record["state"], record["error_kind"]) == ("up", None), record
        with open(os.path.join(shm_dir, OLD), "r+b") as f:
            f.write(b"NOTASEG!")  # bad magic under the live writer
        r = cli("dump", "--shm-dir", shm_dir, "--json", OLD)
        (record,) = json.loads(r.stdout)["targets"]
        assert (record["state"], record["error_kind"]) == ("corrupt", "corrupt"), record
    finally:
        w.close()
    section8 = _section8()
    assert "`kvsidecar dump NAME`) it is a target in state `refused`" not in section8
    for rule in (
        "Named in `serve --segment NAME`, a file is a target whatever it holds: refused, it "
        "is in state `refused` with the one-line message.",
        "so it prints `kvsidecar: refused NAME: <why>` on stderr and, with no other match, "
        "exits 1 (no segments matching)",
        "it is in the target's record of `/api/v1/snapshots` and of `kvsidecar dump --json`",
    ):
        assert rule in section8, rule


def test_section_8_names_every_refusal_reason_as_the_daemon_counts_it() -> None:
    """Issue 30 item 7: the list said a version mismatch counts as `unreadable` (it is
    `version`) and left out `admission`."""
    from kvsidecar.daemon.refusals import REFUSAL_REASONS

    paragraph = _section8().split("**A refused file.**", 1)[1].split("**", 1)[0]
    missing = [r for r in REFUSAL_REASONS if f"`{r}`" not in paragraph]
    assert not missing, missing
    assert "`version` = the reader said `version_mismatch`" in paragraph
    assert "`unreadable` = the reader said `refused`," in paragraph
