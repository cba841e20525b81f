"""``kvsidecar bench soak``: a writer at 1 kHz, scrapes at 20 Hz, for 10 minutes.

Pass criteria (from the reliability issue): 0 scrape errors, daemon RSS growth
< 1 MB after warm-up, open fds flat; also the step counter never goes
backwards and advances by about 1,000 per second.
"""

from __future__ import annotations

import http.client
import time
from typing import Any

from kvsidecar.bench.fleet import fd_count, fleet, map_count, proc_stat

TARGET_RSS_GROWTH_MB = 1.0


def run(seconds: float = 600.0, warmup: float = 10.0) -> dict[str, Any]:
    errors = scrapes = 0
    backwards = 0
    first_step = last_step = None
    with fleet(ranks=1, pools=4, hz=1000.0) as f:
        pid = f["daemon_pid"]
        conn = http.client.HTTPConnection("127.0.0.1", f["port"], timeout=5)
        start = time.monotonic()
        baseline: tuple[int, int, int] | None = None
        series: list[tuple[float, float]] = []
        next_t = start
        while time.monotonic() - start < seconds + warmup:
            try:
                conn.request("GET", "/metrics", headers={"Accept-Encoding": "identity"})
                resp = conn.getresponse()
                body = resp.read()
                ok = resp.status == 200
            except (OSError, http.client.HTTPException):
                ok, body = False, b""
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", f["port"], timeout=5)
            scrapes += 1
            if not ok:
                errors += 1
            else:
                step = _steps(body)
                # Renders are cached per poll (4 Hz), so equal steps are expected;
                # a step going backwards would be a torn or mixed-up read.
                if last_step is not None and step is not None and step < last_step:
                    backwards += 1
                if step is not None:
                    first_step = step if first_step is None else first_step
                    last_step = step
            now = time.monotonic()
            if baseline is None and now - start >= warmup:
                baseline = (proc_stat(pid)[0], fd_count(pid), map_count(pid))
            if int(now - start) != int(now - start - 0.05):
                series.append((now - start, proc_stat(pid)[0] / 2**20))
            next_t += 0.05
            time.sleep(max(0.0, next_t - time.monotonic()))
        end = (proc_stat(pid)[0], fd_count(pid), map_count(pid))
        conn.close()
    assert baseline is not None
    growth_mb = (end[0] - baseline[0]) / 2**20
    return {
        "seconds": seconds,
        "warmup_seconds": warmup,
        "writer_hz": 1000,
        "scrape_hz": 20,
        "scrapes": scrapes,
        "errors": errors,
        "steps_backwards": backwards,
        "steps_advanced": (last_step or 0) - (first_step or 0),
        "rss_start_mb": baseline[0] / 2**20,
        "rss_end_mb": end[0] / 2**20,
        "rss_growth_mb": growth_mb,
        "fds_start": baseline[1],
        "fds_end": end[1],
        "maps_start": baseline[2],
        "maps_end": end[2],
        "rss_series": series,
        "met": errors == 0
        and backwards == 0
        and growth_mb < TARGET_RSS_GROWTH_MB
        and end[1] == baseline[1],
    }


def _steps(body: bytes) -> float | None:
    for line in body.split(b"\n"):
        if line.startswith(b"kvsidecar_engine_steps_total{"):
            return float(line.rsplit(b" ", 1)[1])
    return None
