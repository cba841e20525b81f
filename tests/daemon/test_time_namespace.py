"""Liveness survives a writer in another time namespace (issue 24 item 5). The writer runs
under ``unshare --time --monotonic=OFFSET``: its CLOCK_MONOTONIC, which it stamps into the
heartbeat, is offset from the daemon's. On cb621d7 staleness compared that stamp with
the daemon's clock: a writer ahead, once hung, stayed up forever; a live writer behind
read stale forever. Now only progress (a changed heartbeat or sequence), timed on the
daemon's clock, counts. Real processes, a real time namespace; ~10 s."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from kvsidecar.daemon import gateway_body as gb
from kvsidecar.daemon.app import view_record
from kvsidecar.daemon.collector import SnapshotCollector
from kvsidecar.daemon.config import Discovery, Polling
from kvsidecar.daemon.exposition import render_text
from kvsidecar.daemon.gateway import Gateway
from kvsidecar.daemon.target import TargetView
from kvsidecar.daemon.targets import TargetSet
from tests.support.scrape import samples

NAME = "kvsidecar.ns.dp0.tp0.pp0"
WRITER = """
import sys, time
from kvsidecar.protocol.writer import SegmentWriter
from tests.support.protocol_helpers import sample_snapshot
DEFERRED = 2.0
w = SegmentWriter(sys.argv[1], shm_dir=sys.argv[2])
step = 0
while True:
    step += 1
    snap = sample_snapshot(step)
    # A request deferred DEFERRED s ago, on this namespace's clock.
    snap.pools[0].oldest_deferred_free_mono_ns = time.monotonic_ns() - int(DEFERRED * 1e9)
    w.publish(snap)
    time.sleep(0.05)
"""


AGE = "kvsidecar_source_snapshot_age_seconds"
DEFERRED_AGE = "kvsidecar_kv_pool_oldest_deferred_free_age_seconds"


def _text(view: TargetView) -> str:
    return render_text(SnapshotCollector(lambda: [view]).collect()).decode()


def uptime() -> float:
    with open("/proc/uptime") as f:
        return float(f.read().split()[0])


def namespaced_writer(shm_dir: str, offset: int) -> subprocess.Popen:
    cmd = ["unshare", "--time", f"--monotonic={offset}", "--fork", "--kill-child"]
    return subprocess.Popen([*cmd, sys.executable, "-c", WRITER, NAME, shm_dir])


def time_namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = ["unshare", "--time", "--monotonic=1000", "--fork", "true"]
    return subprocess.run(probe, capture_output=True).returncode == 0


pytestmark = pytest.mark.skipif(
    not time_namespaces_work(), reason="needs unshare --time (CAP_SYS_ADMIN, Linux >= 5.6)"
)


def poll_until(ts: TargetSet, state: str, seconds: float) -> str:
    deadline = time.monotonic() + seconds
    got = ""
    while time.monotonic() < deadline:
        ts.poll_all()
        got = ts.targets[NAME].view.state if NAME in ts.targets else ""
        if got == state:
            return got
        time.sleep(0.1)
    return got


@pytest.mark.parametrize("offset", ["behind", "ahead"])
def test_liveness_by_progress_whatever_the_writer_clock(shm_dir: str, offset: str) -> None:
    # Behind: half the host's uptime (CLOCK_MONOTONIC must stay >= 0); ahead: a day.
    shift = -int(uptime() / 2) if offset == "behind" else 86_400
    if offset == "behind" and shift > -60:
        pytest.skip("host up for under 2 minutes: no room for a clock behind ours")
    writer = namespaced_writer(shm_dir, shift)
    try:
        ts = TargetSet(
            Discovery(shm_dir, prefix="kvsidecar.", rediscover_interval=0.0),
            polling=Polling(stale_after=1.0),
        )
        # A live writer is up (on cb621d7, one behind read stale forever).
        assert poll_until(ts, "up", 15.0) == "up"
        # Its exported age is on our clock too (issue 31 item 11: on bca725e a live writer
        # behind read its clock offset, thousands of seconds). Up means progress seen
        # within stale_after, so the age cannot be more.
        view = ts.targets[NAME].view
        assert view.up and 0 <= view.age_seconds() <= ts.stale_after, view.age_seconds()
        assert 0 <= view_record(view)["age_seconds"] <= ts.stale_after
        text = _text(view)
        ages = [v for n, _, v in samples(text) if n == AGE]
        assert len(ages) == 1 and 0 <= ages[0] <= ts.stale_after, ages
        # A pool's deferral stamp too: about 2 s, never the clock offset (on bca725e,
        # 1000s of s behind; a writer ahead read 0). Bounded by the shift, not by time.
        pool0 = [
            v for n, lab, v in samples(text) if (n, lab.get("pool")) == (DEFERRED_AGE, "pool0")
        ]
        assert len(pool0) == 1 and 1.0 <= pool0[0] < abs(shift) / 2, pool0
        # The gateway's held-KV age as well (issue 41 item 8a: it read the daemon's clock
        # alone, so the offset itself behind and 0 ahead).
        status, body, _, _ = Gateway(ts).answer(0)
        assert status == 200, body
        held = [v for n, _, v in samples(body.decode()) if n == gb.HELD_AGE]
        assert len(held) == 1 and 1.0 <= held[0] < abs(shift) / 2, held
        # Hung (SIGSTOP the whole namespace's processes): stale within stale_after plus a
        # poll or two (on cb621d7, one ahead stayed up forever). Generous for a loaded host.
        _stop_all(writer)
        assert poll_until(ts, "stale", 10.0) == "stale"
    finally:
        _kill_all(writer)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(k) for k in f.read().split()]
    except OSError:
        return []
    return [k for kid in kids for k in (kid, *_children(kid))]


def _stop_all(proc: subprocess.Popen) -> None:
    for pid in _children(proc.pid):
        os.kill(pid, signal.SIGSTOP)


def _kill_all(proc: subprocess.Popen) -> None:
    for pid in _children(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.kill()
    proc.wait(10)
