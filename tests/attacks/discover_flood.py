"""``kvsidecar bench discoverflood``: discovery under a flood of another user's files (#24).

Two figures, each from the real ``kvsidecar serve`` over a private tmpfs directory
holding N empty ``kvsidecar.*`` files owned by another uid (we must be root to chown):

- memory: the daemon's RSS (and peak) once it has looked at all N files, against the
  same daemon with none; bytes per refused file is the difference over N;
- CPU: the daemon's share of a core (user+system from /proc) in a quiet window, then
  while another uid creates and deletes a file every few milliseconds (the directory's
  mtime changes before every scan), and how long a new engine's segment created during
  that churn takes to be served.

It only uses flags every version has, so the same module measures an older checkout
(``PYTHONPATH`` pointing at it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from functools import partial
from typing import Any

from kvsidecar.bench.fleet import proc_stat, start_daemon, stop_daemon
from tests.attacks.hostile_writers import _kill, good_writer

MB = 1024 * 1024
SETTLE_S = 2.5  # > the daemon's _MTIME_SETTLE_NS
NOBODY = 65534
NEW = "kvsidecar.late{}.dp0.tp0.pp0"  # good_writer(tag=f"late{i}")

# Another uid keeping the directory changing: a create and a delete every `period`
# seconds, so every scan sees a new mtime (the attack, not a CPU burner of its own).
# With uid < 0 (not root) it creates symlinks instead: refused as cheaply.
CHURN = r"""
import os, sys, time
shm_dir, period, uid = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
if uid >= 0:
    os.setgid(uid); os.setuid(uid)
print("ready", flush=True)
i = 0
while True:
    path = os.path.join(shm_dir, f"kvsidecar.churn{i % 2}")
    if uid >= 0:
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
    else:
        os.symlink("/nonexistent", path)
    os.unlink(path)
    i += 1
    time.sleep(period)
"""


def make_foreign_files(shm_dir: str, start: int, stop: int, uid: int = NOBODY) -> None:
    """Empty ``kvsidecar.junk<i>`` files for i in [start, stop), created by a child running
    as uid (so none is ever ours, even for a moment: a file created by us and chowned
    after could be followed in between); with uid < 0 (not root) symlinks, refused as
    cheaply. shm_dir must be writable by uid."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if uid >= 0:
                os.setgid(uid)
                os.setuid(uid)
            for i in range(start, stop):
                path = os.path.join(shm_dir, f"kvsidecar.junk{i}")
                if uid < 0:
                    os.symlink("/nonexistent", path)
                else:
                    os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o644))
            code = 0
        finally:
            os._exit(code)
    if os.waitpid(pid, 0)[1] != 0:
        raise RuntimeError(f"could not create the files as uid {uid} in {shm_dir}")


def _metric(url: str, name: str, segment: str = "") -> float | None:
    """The value of one sample in /metrics (of that segment, if given), or None."""
    head, want = (name + "{", f'segment="{segment}"') if segment else (name + " ", "")
    with contextlib.suppress(OSError):
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(head) and want in line:
                    return float(line.rsplit(" ", 1)[1])
    return None


def _served(url: str, segment: str) -> bool:
    return _metric(url, "kvsidecar_source_up", segment) == 1


def _wait(predicate: Any, timeout: float) -> float | None:
    """Seconds until predicate() held, or None after timeout."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if predicate():
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


@contextlib.contextmanager
def _shm_dir() -> Iterator[str]:
    shm_dir = tempfile.mkdtemp(prefix="kvsidecar-discoverflood-", dir="/dev/shm")
    os.chmod(shm_dir, 0o1777)  # the other uid may create files, not delete ours (sticky)
    try:
        yield shm_dir
    finally:
        shutil.rmtree(shm_dir, ignore_errors=True)


def _daemon_rss(shm_dir: str, files: int, settle: float) -> tuple[int, int, float | None]:
    """(RSS, peak RSS) of a fresh daemon once it counts `files` refused files, and the
    seconds that took (None: it never did within 120 s)."""
    daemon, url = start_daemon(shm_dir, wait_for_source=True, stderr=subprocess.DEVNULL)
    try:
        took = _wait(lambda: (_metric(url, "kvsidecar_refused_segments") or 0) >= files, 120)
        time.sleep(settle)  # a few more scans: what it keeps, not what one scan allocates
        rss = proc_stat(daemon.pid)[0]
        return rss, _peak_rss(daemon.pid), took
    finally:
        stop_daemon(daemon)


def memory_scenario(quick: bool) -> dict[str, Any]:
    """RSS of a fresh daemon at N foreign files, N = 0 and each step of `counts`."""
    counts = (20_000,) if quick else (50_000, 100_000, 200_000)
    settle = 0.5 if quick else 3.0
    rows = []
    with _shm_dir() as shm_dir:
        pids = [good_writer(shm_dir, ranks=1)]
        try:
            base, base_peak, _ = _daemon_rss(shm_dir, 0, settle)
            made, last = 0, base
            for n in counts:
                make_foreign_files(shm_dir, made, n)
                rss, peak, took = _daemon_rss(shm_dir, n, settle)
                rows.append(
                    {
                        "files": n,
                        "rss_mb": round(rss / MB, 1),
                        "peak_rss_mb": round(peak / MB, 1),
                        "bytes_per_file": round((rss - base) / n),
                        # What each file beyond the previous row's cost: flat once capped.
                        "bytes_per_added_file": round((rss - last) / (n - made)),
                        "counted_after_s": None if took is None else round(took, 2),
                    }
                )
                made, last = n, rss
        finally:
            _kill(pids)
    return {
        "rss_0_files_mb": round(base / MB, 1),
        "peak_0_files_mb": round(base_peak / MB, 1),
        "rows": rows,
    }


def cpu_share(pid: int, seconds: float) -> float:
    """The process's CPU (user+system) over the next `seconds`, in cores."""
    _, cpu0 = proc_stat(pid)
    t0 = time.monotonic()
    time.sleep(seconds)
    _, cpu1 = proc_stat(pid)
    return (cpu1 - cpu0) / (time.monotonic() - t0)


def start_churn(shm_dir: str, period: float = 0.005, uid: int = NOBODY) -> subprocess.Popen:
    """Another uid creating and deleting a file every `period` s, until killed."""
    proc = subprocess.Popen(
        [sys.executable, "-c", CHURN, shm_dir, str(period), str(uid)], stdout=subprocess.PIPE
    )
    if proc.stdout is None or not proc.stdout.readline().startswith(b"ready"):
        proc.kill()
        raise RuntimeError("the churn process did not start")
    return proc


def churn_scenario(quick: bool) -> dict[str, Any]:
    """Daemon cores, quiet and under churn, beside N foreign files; a new engine's delay."""
    files = 20_000 if quick else 200_000
    window, settle = (3.0, 1.0) if quick else (20.0, 2.0)
    engines = 1 if quick else 5
    with _shm_dir() as shm_dir:
        make_foreign_files(shm_dir, 0, files)
        pids = [good_writer(shm_dir, ranks=1)]
        # Past tmpfs' coarse mtime: the first listing can trust that the directory is
        # unchanged, so the quiet window is quiet (no listing until the flood changes it).
        time.sleep(SETTLE_S)
        churn = None
        daemon, url = start_daemon(shm_dir, wait_for_source=True, stderr=subprocess.DEVNULL)
        try:
            _wait(lambda: (_metric(url, "kvsidecar_refused_segments") or 0) >= files, 120)
            time.sleep(settle)  # past the first scans
            quiet = cpu_share(daemon.pid, window)
            churn = start_churn(shm_dir)
            time.sleep(settle)
            churning = cpu_share(daemon.pid, window)
            # New engines (our uid) start during the churn, one after the other at odd
            # offsets from the paced listings: how long until each is served.
            found = []
            for i in range(engines):
                pids.append(good_writer(shm_dir, ranks=1, tag=f"late{i}"))
                served = partial(_served, url, NEW.format(i))
                found.append(_wait(served, 120))
                time.sleep(1.7 if i + 1 < engines else 0.0)
            rss = proc_stat(daemon.pid)[0]
        finally:
            if churn is not None:
                churn.kill()
                churn.wait()
            stop_daemon(daemon)
            _kill(pids)
    return {
        "files": files,
        "window_s": window,
        "cores_quiet": round(quiet, 4),
        "cores_churn": round(churning, 4),
        "new_engines_served_after_s": [None if f is None else round(f, 2) for f in found],
        "rss_mb": round(rss / MB, 1),
    }


def run(quick: bool = False) -> dict[str, Any]:
    if os.getuid() != 0:
        return {"skipped": "needs root to create files owned by another uid"}
    return {"memory": memory_scenario(quick), "churn": churn_scenario(quick)}
