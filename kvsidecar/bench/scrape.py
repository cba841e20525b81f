"""``kvsidecar bench scrape``: scrapes/s and latency of /metrics, 8 ranks x 4 pools.

Concurrent clients are threads with keep-alive connections in this process,
the daemon is its own process, the writers a third: all on the same host, so
the figures include client cost (a lower bound on what the daemon can serve).
Clients send ``Accept-Encoding: gzip`` like Prometheus (and, for comparison,
without it).

Two modes per client count: *saturated* (each client scrapes back to back:
the ceiling) and *paced* (the clients together offer exactly the target rate,
400 scrapes/s: the latency a fleet of gateways polling at that rate would
see, without the client queueing behind its own GIL).
"""

from __future__ import annotations

import http.client
import threading
import time
from typing import Any

from kvsidecar.bench.fleet import fleet
from kvsidecar.bench.report import percentile

TARGET_RPS = 400
TARGET_P99_MS = 10.0


def _client(
    port: int, deadline: float, latencies: list[float], errors: list[int], gzip: bool, period: float
) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"Accept-Encoding": "gzip"} if gzip else {}
    next_t = time.monotonic()
    while time.monotonic() < deadline:
        if period:
            next_t += period
            delay = next_t - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        t0 = time.perf_counter()
        try:
            conn.request("GET", "/metrics", headers=headers)
            resp = conn.getresponse()
            resp.read()
            ok = resp.status == 200
        except (OSError, http.client.HTTPException):
            ok = False
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        if ok:
            latencies.append(time.perf_counter() - t0)
        else:
            errors.append(1)
    conn.close()


def measure(
    port: int, clients: int, seconds: float, gzip: bool = True, rate: float = 0.0
) -> dict[str, Any]:
    """rate 0: saturate; else the clients together offer `rate` scrapes/s."""
    deadline = time.monotonic() + seconds
    lats: list[list[float]] = [[] for _ in range(clients)]
    errors: list[int] = []
    period = clients / rate if rate else 0.0
    threads = [
        threading.Thread(target=_client, args=(port, deadline, lats[i], errors, gzip, period))
        for i in range(clients)
    ]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - t0
    all_lats = [x for lst in lats for x in lst]
    return {
        "clients": clients,
        "mode": f"paced {rate:g}/s" if rate else "saturated",
        "gzip": gzip,
        "scrapes": len(all_lats),
        "errors": len(errors),
        "scrapes_per_s": len(all_lats) / elapsed,
        "p50_ms": percentile(all_lats, 50) * 1e3,
        "p99_ms": percentile(all_lats, 99) * 1e3,
        "max_ms": max(all_lats) * 1e3 if all_lats else float("nan"),
    }


def run(quick: bool = False) -> dict[str, Any]:
    seconds = 2.0 if quick else 10.0
    results = []
    with fleet(ranks=8, pools=4, hz=100.0) as f:
        import urllib.request

        with urllib.request.urlopen(f["url"] + "/metrics") as r:
            body = r.read()
        for rate in (0.0, float(TARGET_RPS)):
            for gzip in (True, False):
                for clients in (1, 4, 16):
                    results.append(measure(f["port"], clients, seconds, gzip, rate))
    return {
        "ranks": 8,
        "pools": 4,
        "seconds_per_run": seconds,
        "body_bytes": len(body),
        "series": body.count(b"\n") - body.count(b"\n#"),
        "runs": results,
        "targets": {"scrapes_per_s": TARGET_RPS, "p99_ms": TARGET_P99_MS},
    }


HEADERS = [
    "mode",
    "clients",
    "gzip",
    "scrapes",
    "errors",
    "scrapes/s",
    "p50 ms",
    "p99 ms",
    "max ms",
    "met",
]


def rows(result: dict[str, Any]) -> list[list[Any]]:
    out = []
    for r in result["runs"]:
        # Paced runs offer exactly the target rate: allow 2% for start-up and timer slack.
        met = r["scrapes_per_s"] >= TARGET_RPS * 0.98 and r["p99_ms"] < TARGET_P99_MS
        out.append(
            [
                r["mode"],
                r["clients"],
                r["gzip"],
                r["scrapes"],
                r["errors"],
                r["scrapes_per_s"],
                r["p50_ms"],
                r["p99_ms"],
                r["max_ms"],
                "yes" if met else "NO",
            ]
        )
    return out
