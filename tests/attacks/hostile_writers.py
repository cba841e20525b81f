"""``kvsidecar bench hostile``: the daemon against hostile writers and neighbours (#12).

Each scenario runs the real ``kvsidecar serve`` over a private tmpfs directory and
measures what the issue measured: daemon RSS and scrape latency under the worst
payload, CPU and log lines under a foreign-file flood, RSS under label churn,
distinct series minted by transient files, log lines under fd exhaustion.

It only uses flags every version has, so the same script measures the code before
and after the fix (run it with ``PYTHONPATH`` pointing at an older checkout).
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import msgspec

from kvsidecar.bench.fleet import proc_stat, start_daemon
from kvsidecar.bench.publish import realistic_snapshot
from kvsidecar.bench.report import percentile
from kvsidecar.protocol.schema import RuntimeSnapshot
from kvsidecar.protocol.writer import SegmentWriter

MB = 1024 * 1024
FOREIGN_UID = 4321


def _child(main: Callable[[], None]) -> int:
    """Fork a writer (or churner) child; it never returns."""
    pid = os.fork()
    if pid == 0:
        try:
            main()
        finally:
            os._exit(0)
    return pid


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def good_writer(shm_dir: str, ranks: int = 4, tag: str = "good") -> int:
    def main() -> None:
        writers = [
            SegmentWriter(f"kvsidecar.{tag}.dp{d}.tp0.pp0", shm_dir=shm_dir) for d in range(ranks)
        ]
        snap = realistic_snapshot(4)
        while True:
            snap.runtime.step += 1
            for w in writers:
                w.publish(snap)
            time.sleep(0.01)

    return _child(main)


def raw_writer(shm_dir: str, name: str, payload: bytes, slot: int = 16 * 1024) -> int:
    def main() -> None:
        w = SegmentWriter(name, shm_dir=shm_dir, slot_capacity=slot)
        w.publish_bytes(payload)
        while True:
            time.sleep(0.05)
            w.heartbeat()

    return _child(main)


def pool_flood(pools: int, model_name: str = "m") -> bytes:
    runtime = msgspec.msgpack.encode(RuntimeSnapshot(engine="evil", model_name=model_name))
    header = (
        b"\xdc" + pools.to_bytes(2, "big") if pools < 65536 else b"\xdd" + pools.to_bytes(4, "big")
    )
    return b"\x92" + runtime + header + b"\x90" * pools


def worst_in_budget(pools: int = 48) -> bytes:
    """What passes every default budget, the aggregate one alone included: 48 pools, every
    label value 256 ASCII characters (64 such pools alone exceed --max-exposition-bytes and
    are shed since issue 31; `worst_target.payload` sets every string and every number)."""
    snap = realistic_snapshot(pools)
    r = snap.runtime
    r.engine, r.model_name, r.role = "e" * 256, "m" * 256, "r" * 256
    r.engine_version, r.device = "v" * 256, "d" * 256
    for i, p in enumerate(snap.pools):
        p.pool_name = f"{i:03d}" + "p" * 253
        p.group_id = i
    return msgspec.msgpack.encode(snap)


def _scrape(url: str, timeout: float = 30.0) -> tuple[int, int, float]:
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=timeout) as r:
            body = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        body, status = b"", e.code
    except OSError:
        body, status = b"", 0
    return status, len(body), time.perf_counter() - t0


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


@contextlib.contextmanager
def _daemon(
    shm_dir: str, *args: str, log: str | None = None, **popen: Any
) -> Iterator[tuple[Any, str]]:
    err = open(log or os.devnull, "w")
    daemon, url = start_daemon(
        shm_dir, "--log-level", "info", *args, wait_for_source=False, stderr=err, **popen
    )
    try:
        yield daemon, url
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(10)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        err.close()


def _scrapes(url: str, seconds: float, good_marker: bytes = b"") -> dict[str, Any]:
    times, codes, sizes = [], [], []
    good = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        status, size, dt = _scrape(url)
        times.append(dt)
        codes.append(status)
        sizes.append(size)
        if good_marker:
            try:
                with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
                    good += good_marker in r.read()
            except OSError:
                pass
    return {
        "scrapes": len(times),
        "ok": sum(c == 200 for c in codes),
        "p50_ms": round(percentile(times, 50) * 1000, 2),
        "p99_ms": round(percentile(times, 99) * 1000, 2),
        "body_bytes": max(sizes) if sizes else 0,
    }


def payload_scenario(quick: bool) -> dict[str, Any]:
    seconds = 5.0 if quick else 20.0
    variants: list[tuple[str, bytes, int]] = [
        ("16,000 empty pools (16 KiB slot)", pool_flood(16_000), 16 * 1024),
        ("4 KiB model_name + 12,000 pools", pool_flood(12_000, "m" * 4096), 16 * 1024),
        ("worst within default budgets (64 KiB slot)", worst_in_budget(), 64 * 1024),
    ]
    if _has_budgets():  # an older daemon would decode 1,000,000 records: not run there
        variants.append(("1,000,000 empty pools (1 MiB slot)", pool_flood(1_000_000), 1 * MB))
    out: dict[str, Any] = {"variants": []}
    for title, payload, slot in variants:
        shm_dir = tempfile.mkdtemp(prefix="kvsidecar-hostile-", dir="/dev/shm")
        pids = [good_writer(shm_dir)]
        try:
            time.sleep(0.5)
            with _daemon(shm_dir) as (daemon, url):
                time.sleep(1.0)
                rss0 = proc_stat(daemon.pid)[0]
                before = _scrapes(url, seconds / 2)
                pids.append(raw_writer(shm_dir, "kvsidecar.evil.dp0.tp0.pp0", payload, slot))
                time.sleep(1.0)
                after = _scrapes(url, seconds, b'segment="kvsidecar.good.dp0.tp0.pp0"')
                out["variants"].append(
                    {
                        "variant": title,
                        "payload_bytes": len(payload),
                        "rss_before_mb": round(rss0 / MB, 1),
                        "peak_rss_mb": round(_peak_rss(daemon.pid) / MB, 1),
                        "good_only": before,
                        "with_hostile": after,
                    }
                )
        finally:
            _kill(pids)
            shutil.rmtree(shm_dir, ignore_errors=True)
    return out


def _has_budgets() -> bool:
    r = subprocess.run(
        [sys.executable, "-m", "kvsidecar", "serve", "--help"], capture_output=True, text=True
    )
    return "--max-pools-per-rank" in r.stdout


def _log_lines(path: str, *needles: str) -> int:
    with open(path) as f:
        return sum(1 for line in f if any(n in line for n in needles))


def flood_scenario(quick: bool, files: int = 50_000) -> dict[str, Any]:
    """Foreign-owned empty kvsidecar.* files, at the daemon's default intervals."""
    if os.getuid() != 0:
        return {"skipped": "needs root to create foreign-owned files"}
    seconds = 10.0 if quick else 30.0
    shm_dir = tempfile.mkdtemp(prefix="kvsidecar-hostile-", dir="/dev/shm")
    log = shm_dir + ".log"
    pids = [good_writer(shm_dir, ranks=1)]
    try:
        for i in range(files):
            path = os.path.join(shm_dir, f"kvsidecar.junk{i}")
            os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
            os.chown(path, FOREIGN_UID, FOREIGN_UID)
        with _daemon(shm_dir, log=log) as (daemon, url):
            time.sleep(5.0)  # first scans
            _, cpu0 = proc_stat(daemon.pid)
            t0 = time.monotonic()
            polls = []
            while time.monotonic() - t0 < seconds:
                time.sleep(1.0)
                with contextlib.suppress(OSError):
                    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
                        for line in r.read().decode().splitlines():
                            if line.startswith("kvsidecar_poll_duration_seconds "):
                                polls.append(float(line.split()[1]))
            _, cpu1 = proc_stat(daemon.pid)
            elapsed = time.monotonic() - t0
            rss = proc_stat(daemon.pid)[0]
        return {
            "files": files,
            "cores": round((cpu1 - cpu0) / elapsed, 4),
            "poll_max_s": round(max(polls), 4) if polls else None,
            "log_lines_about_files": _log_lines(log, "junk"),
            "rss_mb": round(rss / MB, 1),
        }
    finally:
        _kill(pids)
        shutil.rmtree(shm_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(log)


def churn_scenario(quick: bool) -> dict[str, Any]:
    """A writer whose 2 KB model_name changes on every publish (100 Hz), scrapes at 10 Hz."""
    seconds = 15.0 if quick else 60.0
    shm_dir = tempfile.mkdtemp(prefix="kvsidecar-hostile-", dir="/dev/shm")

    def main() -> None:
        w = SegmentWriter("kvsidecar.churn.dp0.tp0.pp0", shm_dir=shm_dir)
        snap = realistic_snapshot(4)
        i = 0
        while True:
            i += 1
            snap.runtime.model_name = f"{i:08d}" + "m" * 2040
            w.publish(snap)
            time.sleep(0.01)

    pids = [_child(main)]
    try:
        with _daemon(shm_dir) as (daemon, url):
            time.sleep(1.0)
            rss0 = proc_stat(daemon.pid)[0]
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                _scrape(url)
                time.sleep(0.1)
            rss1 = proc_stat(daemon.pid)[0]
        return {
            "seconds": seconds,
            "rss_start_mb": round(rss0 / MB, 1),
            "rss_end_mb": round(rss1 / MB, 1),
        }
    finally:
        _kill(pids)
        shutil.rmtree(shm_dir, ignore_errors=True)


# Another local user's churn: 50 short-lived kvsidecar.* files alive at a time.
CHURN = r"""
import os, sys, time
shm_dir, seconds, uid = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
if uid >= 0:
    os.setgid(uid); os.setuid(uid)
deadline, i = time.monotonic() + seconds, 0
while time.monotonic() < deadline:
    # 50 files alive at a time, each for about a millisecond.
    os.close(os.open(os.path.join(shm_dir, f"kvsidecar.t{i}"), os.O_CREAT | os.O_WRONLY, 0o644))
    if i >= 50:
        os.unlink(os.path.join(shm_dir, f"kvsidecar.t{i - 50}"))
    i += 1
for j in range(max(0, i - 50), i):
    os.unlink(os.path.join(shm_dir, f"kvsidecar.t{j}"))
print(i)
"""


def transient_scenario(quick: bool) -> dict[str, Any]:
    """Another local user churning short-lived kvsidecar.* files; distinct segment labels."""
    seconds = 5.0 if quick else 20.0
    shm_dir = tempfile.mkdtemp(prefix="kvsidecar-hostile-", dir="/dev/shm")
    uid = 65534 if os.getuid() == 0 else -1
    os.chmod(shm_dir, 0o1777)
    pids = [good_writer(shm_dir, ranks=1)]
    try:
        with _daemon(shm_dir) as (_, url):
            time.sleep(1.0)
            churn = subprocess.Popen(
                [sys.executable, "-c", CHURN, shm_dir, str(seconds), str(uid)],
                stdout=subprocess.PIPE,
            )
            seen: set[str] = set()
            while churn.poll() is None:
                with contextlib.suppress(OSError):
                    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
                        for line in r.read().decode().splitlines():
                            if line.startswith("kvsidecar_source_up{"):
                                seen.add(line.split('segment="', 1)[1].split('"', 1)[0])
            files = int(churn.stdout.read() or 0)
        return {"seconds": seconds, "files_churned": files, "distinct_segments": len(seen)}
    finally:
        _kill(pids)
        shutil.rmtree(shm_dir, ignore_errors=True)


def fds_scenario(quick: bool) -> dict[str, Any]:
    """No descriptor left for the daemon: log lines and whether targets stayed."""
    seconds = 5.0 if quick else 20.0
    shm_dir = tempfile.mkdtemp(prefix="kvsidecar-hostile-", dir="/dev/shm")
    log = shm_dir + ".log"
    pids = [good_writer(shm_dir, ranks=2)]
    try:
        with _daemon(shm_dir, log=log) as (daemon, url):
            time.sleep(1.5)
            lines0 = _log_lines(log, "")
            used = {int(n) for n in os.listdir(f"/proc/{daemon.pid}/fd")}
            lowest = next(i for i in range(len(used) + 1) if i not in used)
            soft, hard = resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE)
            resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (lowest, hard))
            time.sleep(seconds)
            resource.prlimit(daemon.pid, resource.RLIMIT_NOFILE, (soft, hard))
            lines = _log_lines(log, "") - lines0
            forgotten = _log_lines(log, "forgetting")
            time.sleep(1.5)
            with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
                up = r.read().decode().count("kvsidecar_source_up{")
        return {"seconds": seconds, "log_lines": lines, "forgotten": forgotten, "targets_after": up}
    finally:
        _kill(pids)
        shutil.rmtree(shm_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(log)


SCENARIOS = {
    "payload": payload_scenario,
    "flood": flood_scenario,
    "churn": churn_scenario,
    "transient": transient_scenario,
    "fds": fds_scenario,
}


def run(quick: bool = False, only: tuple[str, ...] = ()) -> dict[str, Any]:
    return {name: fn(quick) for name, fn in SCENARIOS.items() if not only or name in only}
