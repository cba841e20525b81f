"""``kvsidecar bench labels``: `segment` labels minted by short-lived trusted files (#24).

A churner of the daemon's own uid (a crash-looping script, a buggy engine) creates valid
segments under fresh names, each published once and unlinked 1.5-3 rediscover intervals
later, about 91 a second as in the audit; a real engine (a writer publishing at 100 Hz)
starts a quarter of the way in. The real ``kvsidecar serve`` is scraped back to back;
reported: the distinct `segment` label values seen, how long the engine took to be
served (`kvsidecar_source_up 1` under its name) from its first publish, and the daemon's
log lines (at info) naming a churned file.

Only default flags, so ``PYTHONPATH=<old checkout>`` measures the old daemon the same way.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

from kvsidecar import settings
from tests.attacks import hostile_writers as hw

ENGINE = "kvsidecar.good.dp0.tp0.pp0"  # hostile_writers.good_writer's first rank
_SEGMENT = re.compile(rb'segment="([^"]*)"')

# argv: shm_dir seconds every life_min life_max. Prints the number of files created.
CHURN = r"""
import random, sys, time
from kvsidecar.bench.publish import realistic_snapshot
from kvsidecar.protocol.writer import SegmentWriter
shm_dir, seconds, every, lo, hi = sys.argv[1], *map(float, sys.argv[2:6])
rng, snap, alive, i = random.Random(24), realistic_snapshot(1), [], 0
start = time.monotonic()
while (now := time.monotonic()) < start + seconds:
    if i <= (now - start) / every:
        w = SegmentWriter(f"kvsidecar.churn{i}.dp0.tp0.pp0", shm_dir=shm_dir)
        w.publish(snap)  # once: it dies younger than --stale-after, so it reads up
        alive.append((now + rng.uniform(lo, hi), w))
        i += 1
    for end, w in [a for a in alive if a[0] <= now]:
        w.close()
    alive = [a for a in alive if a[0] > now]
    time.sleep(every / 4)
for _, w in alive:
    w.close()
print(i)
"""


def start_churn(
    shm_dir: str, seconds: float, every: float, life: tuple[float, float]
) -> subprocess.Popen:
    args = [str(seconds), str(every), str(life[0]), str(life[1])]
    return subprocess.Popen(
        [sys.executable, "-c", CHURN, shm_dir, *args], stdout=subprocess.PIPE, text=True
    )


def labels_seen(url: str) -> tuple[set[str], bool]:
    """The `segment` label values of one scrape, and whether the engine is up in it."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        body = r.read()
    name = f'segment="{ENGINE}"'.encode()
    engine_up = any(
        line.startswith(b"kvsidecar_source_up{")
        and name in line
        and line.rsplit(b" ", 1)[1] in (b"1", b"1.0")
        for line in body.splitlines()
    )
    return {m.decode() for m in _SEGMENT.findall(body)}, engine_up


def run(quick: bool = False) -> dict[str, Any]:
    seconds = 5.0 if quick else 20.0
    interval = settings.REDISCOVER_INTERVAL.default
    shm_dir = tempfile.mkdtemp(prefix="kvsidecar-labels-", dir="/dev/shm")
    log = shm_dir + ".log"
    pids: list[int] = []
    try:
        with hw._daemon(shm_dir, log=log) as (_, url):
            churn = start_churn(shm_dir, seconds, 1 / 91, (1.5 * interval, 3 * interval))
            t0 = time.monotonic()
            seen: set[str] = set()
            started = served = None
            while churn.poll() is None:
                if started is None and time.monotonic() - t0 >= seconds / 4:
                    pids.append(hw.good_writer(shm_dir, ranks=1))
                    started = time.monotonic()
                with contextlib.suppress(OSError):
                    labels, engine_up = labels_seen(url)
                    seen |= labels
                    if engine_up and served is None and started is not None:
                        served = time.monotonic()
            files = int(churn.stdout.read() or 0) if churn.stdout else 0
            while served is None and started is not None and time.monotonic() - started < 60:
                with contextlib.suppress(OSError):
                    if labels_seen(url)[1]:
                        served = time.monotonic()
                time.sleep(0.05)
        return {
            "seconds": seconds,
            "files_churned": files,
            "distinct_segment_labels": len(seen - {ENGINE}),
            "engine_served": served is not None,
            "engine_admission_s": round(served - started, 2) if served and started else None,
            "log_lines": hw._log_lines(log, "kvsidecar.churn"),
        }
    finally:
        hw._kill(pids)
        shutil.rmtree(shm_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(log)


def main_rows(r: dict[str, Any]) -> list[list[Any]]:
    served = r["engine_admission_s"] if r["engine_served"] else "never"
    return [
        [r["seconds"], r["files_churned"], r["distinct_segment_labels"], served, r["log_lines"]]
    ]


HEADERS = ["seconds", "files churned", "distinct segment labels (churn)", "engine served after s"]
HEADERS += ["log lines naming them"]
