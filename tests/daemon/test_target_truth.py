"""A target record tells the truth about a writer that is not up (issue 41 items 3, 4).

Item 3: every record not `up` names why (`error_kind`), null only while up
(segment-format.md section 8), on real writer processes: one SIGKILLed, one SIGSTOPped (it
stops publishing and heartbeating, its lock still held), one that marked its segment CLOSED
and exited. Seen through the daemon's `/api/v1/snapshots` and `kvsidecar dump --json`.

Item 4: `dump` and `ls` are one look at a segment: a heartbeat an hour old reads an hour
old there, not capped just past `--stale-after` as serve's first sight is (section 6).
"""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import time

from kvsidecar.daemon.config import Discovery, Polling
from kvsidecar.daemon.targets import TargetSet
from kvsidecar.protocol import layout
from kvsidecar.protocol.writer import SegmentWriter
from tests.support.procs import start_daemon, wait_for
from tests.support.protocol_helpers import sample_snapshot
from tests.support.scrape import fetch
from tests.support.writers import _fork, fork_writer, stop
from tests.test_operator_cli import cli

UP, KILLED, STOPPED, CLOSED = (f"kvsidecar.truth.{w}.dp0" for w in ("up", "kill", "stop", "close"))
WANT = {
    UP: ("up", None),
    KILLED: ("dead", "writer_dead"),
    STOPPED: ("stale", "stale"),
    CLOSED: ("dead", "closed"),
}
STALE_AFTER = "1"


def _closing_writer(shm_dir: str) -> int:
    """A writer that marks its segment CLOSED and exits before its unlink: the file stays
    (section 6: closed cleanly whether or not the file is still there)."""

    def main(ready) -> None:
        w = SegmentWriter(CLOSED, shm_dir=shm_dir)
        w.publish(sample_snapshot(3))
        fd = os.open(w.path, os.O_RDWR)
        os.pwrite(fd, bytes([layout.STATE_CLOSED]), layout.OFF_STATE)
        os.close(fd)
        ready()
        os._exit(0)

    pid = _fork(main, "closing writer")
    os.waitpid(pid, 0)
    return pid


def _by_name(records: list[dict]) -> dict[str, tuple[str, str | None]]:
    return {r["segment"]: (r["state"], r["error_kind"]) for r in records}


def test_every_state_but_up_names_its_error_kind(shm_dir: str) -> None:
    pids = {name: fork_writer(name, shm_dir) for name in (UP, KILLED, STOPPED)}
    _closing_writer(shm_dir)
    daemon = None
    try:
        stop(pids[KILLED])  # SIGKILL: the file stays, nobody holds the lock
        os.kill(pids[STOPPED], signal.SIGSTOP)  # hung: lock held, no publish, no heartbeat
        daemon, url = start_daemon(shm_dir, "--poll-interval", "0.05", "--stale-after", STALE_AFTER)
        records: list[dict] = []

        def settled() -> bool:
            nonlocal records
            records = json.loads(fetch(url + "/api/v1/snapshots")[2])["targets"]
            return _by_name(records).get(STOPPED, ("",))[0] == "stale"

        assert wait_for(settled), records
        assert _by_name(records) == WANT, records
        # The rule itself: null exactly while up, on every record.
        assert all((r["state"] == "up") == (r["error_kind"] is None) for r in records), records
        # dump --json prints the same record; its writer stays stopped, so still stale.
        r = cli("dump", "--shm-dir", shm_dir, "--json", "--stale-after", STALE_AFTER)
        assert r.returncode == 0, r.stderr
        dumped = json.loads(r.stdout)["targets"]
        assert _by_name(dumped) == WANT, dumped
        assert all((d["state"] == "up") == (d["error_kind"] is None) for d in dumped), dumped
    finally:
        if daemon is not None:
            daemon.kill()
            daemon.wait(10)
        os.kill(pids[STOPPED], signal.SIGCONT)
        for pid in pids.values():
            stop(pid)


def test_a_contended_read_of_an_up_target_keeps_it_up_with_no_error_kind(
    shm_dir: str,
) -> None:
    """A lapped read (contended) keeps the previous state (section 8): an up target stays
    up, so it names no error either (it said up with error_kind contended)."""
    with SegmentWriter(UP, shm_dir=shm_dir) as w:
        w.publish(sample_snapshot(1))
        ts = TargetSet(Discovery(shm_dir, names=(UP,)), polling=Polling(stale_after=3600))
        try:
            ts.poll_all()
            target = ts.targets[UP]
            assert target.view.state == "up"
            target.reader.retries = 0  # no attempt at all: the reader's verdict is contended
            view = target.poll()
            assert view.read_errors_total == {"contended": 1}, view
            assert (view.state, view.error_kind, view.error) == ("up", "", ""), view
        finally:
            ts.stop()


def _hung_segment(shm_dir: str, name: str) -> tuple[SegmentWriter, float]:
    """A real writer (its lock held: alive) whose heartbeat says it last beat up to 600 s
    ago (less on a host booted since: CLOCK_MONOTONIC counts from boot), and that age: an
    engine hung for minutes, as a reader first sees it."""
    now = time.monotonic_ns()
    hung_for = min(600.0, now / 1e9 - 5.0)
    # Far past serve's cap (--stale-after 5, so 6 s), so a capped age cannot pass for it.
    assert hung_for > 30, f"CLOCK_MONOTONIC is {now / 1e9:.0f} s: the host booted just now"
    w = SegmentWriter(name, shm_dir=shm_dir)
    w.publish(sample_snapshot(5))
    fd = os.open(w.path, os.O_RDWR)
    try:
        os.pwrite(fd, struct.pack("<Q", now - int(hung_for * 1e9)), layout.OFF_HEARTBEAT_MONO)
    finally:
        os.close(fd)
    return w, hung_for


def _ages(text: str, name: str) -> list[float]:
    """The AGE cells ("605.8s") of name's row in dump's or ls's table."""
    row = next(ln for ln in text.splitlines() if ln.startswith(name))
    return [float(a) for a in re.findall(r"\s(\d+\.\d)s\s", row)]


def test_dump_and_ls_report_a_hung_writers_true_age(shm_dir: str) -> None:
    name = "kvsidecar.hung.dp0"
    w, hung_for = _hung_segment(shm_dir, name)
    try:
        r = cli("dump", "--shm-dir", shm_dir, "--json")
        (record,) = json.loads(r.stdout)["targets"]
        assert record["age_seconds"] >= hung_for, record
        assert (record["state"], record["error_kind"]) == ("stale", "stale"), record
        said = float(re.search(r"not advanced for ([0-9.]+)s", record["error"]).group(1))
        assert said >= hung_for, record["error"]
        table = cli("dump", "--shm-dir", shm_dir)
        assert _ages(table.stdout, name) and min(_ages(table.stdout, name)) >= hung_for, table
        said = float(re.search(r"not advanced for ([0-9.]+)s", table.stdout).group(1))
        assert said >= hung_for, table.stdout
        listing = cli("ls", "--shm-dir", shm_dir)
        assert min(_ages(listing.stdout, name)) >= hung_for, listing.stdout
        # serve keeps its first-sight cap by design (section 6, time namespaces): stale at
        # once, its age counted on the daemon's clock from just past --stale-after.
        ts = TargetSet(Discovery(shm_dir, names=(name,)), polling=Polling(stale_after=5))
        try:
            ts.poll_all()
            view = ts.targets[name].view
            assert view.state == "stale" and view.age_seconds() < hung_for, view
        finally:
            ts.stop()
    finally:
        w.close()


def test_the_documents_state_both_rules() -> None:
    from tests.conftest import REPO

    with open(os.path.join(REPO, "docs", "segment-format.md")) as f:
        doc = " ".join(f.read().split())
    for rule in (
        "`dead`; `error_kind` `writer_dead`, or `closed` when the state byte is `CLOSED`",
        "`stale`; `error_kind` `stale`, or `publish_failing` when",
        "It is null while the target is `up`, and only then",
        "`kvsidecar ls`) has a single sample and uses `now - heartbeat_mono_ns` in full",
        "in `kvsidecar serve` capped just past `--stale-after`",
    ):
        assert rule in doc, rule
