"""``kvsidecar bench aggregate``: daemon RSS against N maximal conforming targets
(issue 24 item 2).

Each target is a real writer process publishing `hostile_writers.worst_in_budget`:
within every default budget (48 pools, every label 256 characters). For
N = 1, 2, 4, ... the real ``kvsidecar serve`` runs over them and is scraped a few
times; reported per N: peak RSS (VmHWM), the last scrape's time and size, and how
many targets were served (``kvsidecar_source_up 1``) or shed. Only flags every
version has, so ``PYTHONPATH=<old checkout>`` measures the old daemon too.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import urllib.request
from typing import Any

from tests.attacks import hostile_writers as hw

MB = 1024 * 1024
POINTS = (1, 2, 4, 8, 16, 32)
QUICK_POINTS = (1, 8)


def one_point(n: int, scrapes: int = 3) -> dict[str, Any]:
    shm_dir = tempfile.mkdtemp(prefix="kvsidecar-aggregate-", dir="/dev/shm")
    payload = hw.worst_in_budget()
    pids = [
        hw.raw_writer(shm_dir, f"kvsidecar.max{i}.dp0.tp0.pp0", payload, 64 * 1024)
        for i in range(n)
    ]
    try:
        time.sleep(0.5)
        with hw._daemon(shm_dir) as (daemon, url):
            time.sleep(1.5)  # every target discovered and polled
            last = (0, 0, 0.0)
            for _ in range(scrapes):
                last = hw._scrape(url, timeout=60.0)
            status, size, seconds = last
            served = 0
            if status == 200:
                with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
                    body = r.read()
                served = sum(
                    line.endswith(b" 1.0") or line.endswith(b" 1")
                    for line in body.splitlines()
                    if line.startswith(b"kvsidecar_source_up{")
                )
            return {
                "targets": n,
                "peak_rss_mb": round(hw._peak_rss(daemon.pid) / MB, 1),
                "scrape_status": status,
                "scrape_ms": round(seconds * 1000, 1),
                "body_bytes": size,
                "served": served,
            }
    finally:
        hw._kill(pids)
        shutil.rmtree(shm_dir, ignore_errors=True)


def run(*, quick: bool = False) -> dict[str, Any]:
    points = QUICK_POINTS if quick else POINTS
    return {"payload_bytes": len(hw.worst_in_budget()), "points": [one_point(n) for n in points]}
