"""Health-check latency of an engine's HTTP server while something else scrapes it.

The symptom of sglang #28157: SGLang renders its ``/metrics`` (prometheus_client's
multiprocess collector) inside the API server's event loop, the same loop that answers
``/health``, so a scrape delays the health checks that P/D bootstrap and load balancers rely
on. The prober measures that directly: in its own process (so its GIL and sockets share
nothing with the benchmark's clients), one thread fetches ``/health`` at a fixed rate over a
new connection each time (as kubelet probes do), another fetches ``/health_generate`` back to
back (SGLang's check that runs one token through the scheduler; it answers after at least
1 s, its own poll interval; in SGLang 0.5.23 plain ``/health`` is the same check unless
``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0``, which `cost_sglang` sets so that ``/health``
times the event loop alone). A round starts with ``go`` on its stdin and ends with ``stop``,
upon which it prints that round's latencies as one JSON line: no sample straddles two rounds,
and a round is never stopped in the middle of a request (a SIGSTOP would bill the pause to
the request in flight).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from kvsidecar.bench import stats

PATHS = ("/health", "/health_generate")

_PROBER = r"""
import http.client, json, select, sys, threading, time
port, hz = int(sys.argv[1]), float(sys.argv[2])

def fetch(path, timeout):
    t0 = time.perf_counter()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        conn.request("GET", path); r = conn.getresponse(); r.read(); conn.close()
        ok = r.status == 200
    except (OSError, http.client.HTTPException):
        ok = False
    return (time.perf_counter() - t0) * 1000, ok

def generate_loop(stop, out):
    while not stop.is_set():
        ms, ok = fetch("/health_generate", 30)
        if not stop.is_set():
            out["/health_generate" if ok else "failed"].append(ms if ok else "/health_generate")

for line in sys.stdin:
    if line.strip() != "go":
        continue
    out = {"/health": [], "/health_generate": [], "failed": []}
    stop = threading.Event()
    gen = threading.Thread(target=generate_loop, args=(stop, out))
    gen.start()
    nxt = time.monotonic()
    while True:
        ms, ok = fetch("/health", 10)
        out["/health" if ok else "failed"].append(ms if ok else "/health")
        nxt = max(nxt + 1 / hz, time.monotonic())
        if select.select([sys.stdin], [], [], max(0.0, nxt - time.monotonic()))[0]:
            sys.stdin.readline()  # "stop"
            break
    stop.set()
    gen.join()
    print(json.dumps(out), flush=True)
"""


class HealthProber:
    """The prober process for one server port; `round_` wraps one round of work."""

    def __init__(self, port: int, hz: float = 20.0) -> None:
        self.hz = hz
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _PROBER, str(port), str(hz)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def start(self) -> None:
        self.proc.stdin.write("go\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def stop(self) -> dict[str, list[float]]:
        self.proc.stdin.write("stop\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"health prober exited (code {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(40)  # a /health_generate in flight finishes first
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _pooled(rounds: Sequence[Mapping[str, Any]], cond: str, path: str) -> list[float]:
    return [ms for r in rounds for ms in r[cond][path]]


def summarize(
    rounds: Sequence[Mapping[str, Mapping[str, list[float]]]], conditions: Sequence[str]
) -> dict[str, Any]:
    """Per path and condition: per-round median and p99 (mean over rounds, bootstrap 95 %
    interval), the pooled median/p99, and the paired per-round ratio to ``none``'s (its
    geometric mean and interval: `stats.compare`)."""
    out: dict[str, Any] = {}
    for path in PATHS:
        per: dict[str, Any] = {}
        samples = [{c: r[c][path] for c in conditions} for r in rounds]
        usable = [s for s in samples if all(s.values())]  # rounds where every cell has data
        for cond in conditions:
            pooled = _pooled(rounds, cond, path)
            cells = [s[cond] for s in usable]
            per[cond] = {
                "samples": len(pooled),
                "failed": sum(r[cond]["failed"].count(path) for r in rounds),
                "pooled_p50_ms": statistics.median(pooled) if pooled else float("nan"),
                "pooled_p99_ms": stats.p99(pooled) if pooled else float("nan"),
                "p50_ms": stats.mean_interval([stats.p50(c) for c in cells]),
                "p99_ms": stats.mean_interval([stats.p99(c) for c in cells]),
            }
            if cond != "none" and usable:
                per[cond]["p50_ratio"] = stats.compare(usable, cond, "none", statistic=stats.p50)
                per[cond]["p99_ratio"] = stats.compare(usable, cond, "none", statistic=stats.p99)
        out[path] = per
    return out


HEADERS = [
    "path",
    "condition",
    "samples (failed)",
    "p50 ms: mean of round medians [95% CI]",
    "p99 ms: mean of round p99s [95% CI]",
    "p50 vs none: geomean of round ratios [95% CI]",
    "p99 vs none [95% CI]",
]


def _mean(m: Mapping[str, Any], fmt: str = "{:.2f}") -> str:
    lo, hi = m["ci95"]
    return f"{fmt.format(m['mean'])} [{fmt.format(lo)}, {fmt.format(hi)}]"


def _ratio(m: Mapping[str, Any] | None) -> str:
    if not m:
        return "-"
    lo, hi = m["ci95"]
    return f"{m['geomean']:.2f} [{lo:.2f}, {hi:.2f}]"


def rows(health: Mapping[str, Any]) -> list[list[Any]]:
    out = []
    for path, per in health.items():
        for cond, v in per.items():
            out.append(
                [
                    path,
                    cond,
                    f"{v['samples']} ({v['failed']})",
                    _mean(v["p50_ms"]),
                    _mean(v["p99_ms"]),
                    _ratio(v.get("p50_ratio")),
                    _ratio(v.get("p99_ratio")),
                ]
            )
    return out
