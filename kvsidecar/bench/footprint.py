"""``kvsidecar bench footprint``: the daemon's RSS and CPU with 8 segments at 4 Hz poll.

The daemon runs as its own process with its default poll interval (0.25 s = 4 Hz)
over 8 writer segments (runtime + 4 pools each, published at 100 Hz); a
Prometheus-like scraper hits /metrics every 15 s. RSS and CPU come from /proc.
"""

from __future__ import annotations

import time
import urllib.request
from typing import Any

from kvsidecar.bench.fleet import fd_count, fleet, proc_stat
from kvsidecar.protocol import layout

TARGET_RSS_MB = 40.0
TARGET_CPU_PCT = 1.0


def run(quick: bool = False) -> dict[str, Any]:
    seconds = 5.0 if quick else 60.0
    with fleet(ranks=8, pools=4, hz=100.0) as f:
        pid = f["daemon_pid"]
        time.sleep(1.0)  # past start-up
        rss0, cpu0 = proc_stat(pid)
        t0 = time.monotonic()
        next_scrape = t0
        peak = rss0
        while time.monotonic() - t0 < seconds:
            if time.monotonic() >= next_scrape:
                with urllib.request.urlopen(f["url"] + "/metrics") as r:
                    r.read()
                next_scrape += 15.0
            time.sleep(0.5)
            peak = max(peak, proc_stat(pid)[0])
        rss1, cpu1 = proc_stat(pid)
        elapsed = time.monotonic() - t0
        fds = fd_count(pid)
        import os

        seg = os.path.join(f["shm_dir"], "kvsidecar.bench.dp0.tp0.pp0")
        seg_bytes = os.stat(seg).st_size
    cpu_pct = (cpu1 - cpu0) / elapsed * 100
    return {
        "segments": 8,
        "pools_per_segment": 4,
        "poll_hz": 4,
        "seconds": elapsed,
        "rss_mb": rss1 / 2**20,
        "peak_rss_mb": peak / 2**20,
        "cpu_pct_of_core": cpu_pct,
        "open_fds": fds,
        "segment_bytes_per_rank": seg_bytes,
        "default_slot_capacity": layout.DEFAULT_SLOT_CAPACITY,
        "targets": {"rss_mb": TARGET_RSS_MB, "cpu_pct": TARGET_CPU_PCT},
        "met": rss1 / 2**20 <= TARGET_RSS_MB and cpu_pct <= TARGET_CPU_PCT,
    }
