"""Hostile neighbours in the shm directory (#12 items 3, 5, 6), against a real daemon.

Other local users can create, churn and flood files in a shared /dev/shm, and the
daemon's own file descriptors or permissions can fail it. The daemon must keep
serving what it knows, mint no series for what it refuses, and say so once.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from kvsidecar.bench.fleet import proc_stat
from tests.attacks.hostile_writers import CHURN
from tests.support.procs import start_daemon, wait_for
from tests.support.scrape import fetch, samples, value
from tests.support.writers import fork_writer, stop

GOOD = "kvsidecar.good.dp0.tp0.pp0"
NOBODY = 65534
ROOT = os.getuid() == 0
FAST = ("--poll-interval", "0.05", "--rediscover-interval", "0.05", "--log-level", "info")


def metrics(url: str) -> str:
    return fetch(url + "/metrics")[2]


def _log(path: str) -> list[str]:
    with open(path) as f:
        return f.read().splitlines()


@pytest.fixture
def logfile():
    fd, path = tempfile.mkstemp(prefix="kvsidecar-daemon-", suffix=".log")
    os.close(fd)
    yield path
    os.unlink(path)


def _start(shm_dir: str, logfile: str, *extra: str, **popen) -> tuple[subprocess.Popen, str]:
    with open(logfile, "w") as err:
        return start_daemon(shm_dir, *FAST, *extra, stderr=err, **popen)


def _shutdown(daemon: subprocess.Popen | None) -> None:
    if daemon is None:  # it never started: nothing to stop
        return
    daemon.send_signal(signal.SIGTERM)
    try:
        daemon.wait(10)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()


def test_transient_files_mint_no_series(shm_dir: str, logfile: str) -> None:
    """Short-lived kvsidecar.* files (created and unlinked at once) by another local user:
    none becomes a segment label (there were 24,739 in 20 s), and they are counted."""
    uid = NOBODY if ROOT else -1
    if ROOT:
        os.chmod(shm_dir, 0o1777)  # a shared directory, like /dev/shm itself
    good = fork_writer(GOOD, shm_dir)
    daemon = None
    try:
        # A new target with no good reading stays hidden for one rediscover interval (1 s).
        daemon, url = _start(shm_dir, logfile, "--rediscover-interval", "1")
        assert wait_for(lambda: value(metrics(url), "kvsidecar_source_up", segment=GOOD) == 1)
        churn = subprocess.Popen(
            [sys.executable, "-c", CHURN, shm_dir, "6", str(uid)], stdout=subprocess.PIPE
        )
        seen: set[str] = set()
        while churn.poll() is None:
            text = metrics(url)
            seen |= {lab["segment"] for _, lab, _ in samples(text) if "segment" in lab}
        assert int(churn.stdout.read()) > 100  # the churn really ran
        text = metrics(url)
        seen |= {lab["segment"] for _, lab, _ in samples(text) if "segment" in lab}
        assert seen == {GOOD}, sorted(seen)[:10]
        refusals = [v for n, lab, v in samples(text) if n == "kvsidecar_segment_refusals_total"]
        assert sum(refusals) >= 1  # the files the daemon saw were counted, not followed
        assert value(text, "kvsidecar_source_up", segment=GOOD) == 1
    finally:
        _shutdown(daemon)
        stop(good)


def test_followed_targets_are_capped_and_refusals_counted(shm_dir: str, logfile: str) -> None:
    good = fork_writer(GOOD, shm_dir)
    daemon, pids = None, []
    try:
        daemon, url = _start(shm_dir, logfile, "--max-targets", "3")
        assert wait_for(lambda: value(metrics(url), "kvsidecar_source_up", segment=GOOD) == 1)
        pids = [fork_writer(f"kvsidecar.more.dp{i}.tp0.pp0", shm_dir) for i in range(4)]

        def capped() -> bool:
            text = metrics(url)
            capped = value(text, "kvsidecar_segment_refusals_total", reason="max_targets")
            return value(text, "kvsidecar_sources") == 3 and capped == 2

        assert wait_for(capped)
        time.sleep(0.5)  # many more scans: each capped file is counted once, not per scan
        text = metrics(url)
        assert value(text, "kvsidecar_segment_refusals_total", reason="max_targets") == 2
        assert value(text, "kvsidecar_source_up", segment=GOOD) == 1  # first come, kept
        # A followed writer exits cleanly: its slot goes to a capped one.
        stop(pids[0], signal.SIGTERM)

        def refilled() -> bool:
            text = metrics(url)
            followed = {lab["segment"] for n, lab, _ in samples(text) if n == "kvsidecar_source_up"}
            return len(followed) == 3 and "kvsidecar.more.dp0.tp0.pp0" not in followed

        assert wait_for(refilled)
        text = metrics(url)
        assert value(text, "kvsidecar_segment_refusals_total", reason="max_targets") == 2
    finally:
        _shutdown(daemon)
        for p in [good, *pids]:
            stop(p)


def _drop_dac_capabilities() -> None:
    """preexec_fn: root without CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH obeys directory modes."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # PR_CAPBSET_DROP (24) of CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_unreadable_directory_keeps_known_targets(shm_dir: str, logfile: str) -> None:
    """listdir fails (EACCES): known targets are still served, the error is reported by a
    gauge, a counter, the JSON API and one log line, and everything recovers."""
    popen = {"preexec_fn": _drop_dac_capabilities} if ROOT else {}
    good = fork_writer(GOOD, shm_dir)
    daemon = None
    try:
        daemon, url = _start(shm_dir, logfile, **popen)
        assert wait_for(lambda: value(metrics(url), "kvsidecar_source_up", segment=GOOD) == 1)
        os.chmod(shm_dir, 0o300)  # search but not read: segments open by name, no listing
        time.sleep(1.0)  # ~20 failed scans
        text = metrics(url)
        assert value(text, "kvsidecar_source_up", segment=GOOD) == 1  # still served
        assert value(text, "kvsidecar_discovery_up") == 0
        assert value(text, "kvsidecar_discovery_errors_total", cause="EACCES") >= 10
        assert "cannot list" in fetch(url + "/api/v1/snapshots")[2]
        assert fetch(url + "/-/ready")[0] == 200  # readiness gates the Pod: no flapping
        os.chmod(shm_dir, 0o700)
        assert wait_for(lambda: value(metrics(url), "kvsidecar_discovery_up") == 1)
        assert value(metrics(url), "kvsidecar_source_up", segment=GOOD) == 1
    finally:
        os.chmod(shm_dir, 0o700)
        _shutdown(daemon)
        stop(good)
    lines = [line for line in _log(logfile) if "cannot list" in line]
    assert len(lines) == 1, lines  # once per cause, not once per scan
    assert not [line for line in _log(logfile) if "forgetting" in line]


def _lowest_free_fd(pid: int) -> int:
    used = {int(n) for n in os.listdir(f"/proc/{pid}/fd")}
    return next(i for i in range(len(used) + 1) if i not in used)


def test_fd_exhaustion_does_not_flap_targets(shm_dir: str, logfile: str) -> None:
    """With no descriptor left, scans fail: targets must not be forgotten and re-found
    (they flapped, writing ~30,000 log lines in 20 s)."""
    names = [GOOD, "kvsidecar.second.dp0.tp0.pp0"]
    pids = [fork_writer(n, shm_dir) for n in names]
    daemon = None
    try:
        daemon, url = _start(shm_dir, logfile)
        for n in names:
            assert wait_for(lambda n=n: value(metrics(url), "kvsidecar_source_up", segment=n) == 1)
        before = len(_log(logfile))
        soft, hard = resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE)
        resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (_lowest_free_fd(daemon.pid), hard))
        # The directory itself changed: only a listing can say what is there (an unchanged
        # one needs no descriptor: its inotify watch says nothing changed).
        os.chmod(shm_dir, 0o700)
        time.sleep(1.5)  # ~30 scans with no descriptor to list the directory with
        resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (soft, hard))
        time.sleep(0.5)  # descriptors back: a few good scans
        log = _log(logfile)[before:]
        assert not [line for line in log if "forgetting" in line or "found" in line], log[:10]
        assert len([line for line in log if "EMFILE" in line]) <= 2, log[:10]
        text = metrics(url)
        for n in names:
            assert value(text, "kvsidecar_source_up", segment=n) == 1
            assert value(text, "kvsidecar_source_writer_restarts_total", segment=n) == 0
        assert value(text, "kvsidecar_discovery_up") == 1
        assert value(text, "kvsidecar_discovery_errors_total", cause="EMFILE") >= 5
    finally:
        _shutdown(daemon)
        for p in pids:
            stop(p)


def test_foreign_file_flood_costs_no_cpu_and_one_log_line(shm_dir: str, logfile: str) -> None:
    """5,000 refused files (foreign-owned, or symlinks without root): each is counted once,
    looked at again only when it changes, and summarized in one log line."""
    good = fork_writer(GOOD, shm_dir)
    n = 5000
    for i in range(n):
        path = os.path.join(shm_dir, f"kvsidecar.junk{i}")
        if ROOT:
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
            os.chown(path, 4321, 4321)
        else:
            os.symlink("/nonexistent", path)
    reason = "foreign_owner" if ROOT else "symlink"
    daemon = None
    try:
        daemon, url = _start(shm_dir, logfile)
        assert wait_for(lambda: value(metrics(url), "kvsidecar_source_up", segment=GOOD) == 1)
        time.sleep(1.0)  # past the first scans
        _, cpu0 = proc_stat(daemon.pid)
        time.sleep(3.0)  # 60 scan intervals
        _, cpu1 = proc_stat(daemon.pid)
        # Re-opening 5,000 files every 50 ms saturates a core; an unchanged directory costs
        # one stat per scan. Generous bound for a shared 2-core host.
        assert cpu1 - cpu0 < 1.0, cpu1 - cpu0
        refusal_lines = [line for line in _log(logfile) if "junk" in line]
        assert len(refusal_lines) <= 2, (len(refusal_lines), refusal_lines[:3])
        text = metrics(url)
        assert value(text, "kvsidecar_segment_refusals_total", reason=reason) == n  # once each
        assert value(text, "kvsidecar_refused_segments") == n
        assert value(text, "kvsidecar_source_up", segment=GOOD) == 1
        assert value(text, "kvsidecar_source_up", segment="kvsidecar.junk1") is None
    finally:
        _shutdown(daemon)
        stop(good)
