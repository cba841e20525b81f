"""``kvsidecar bench otlp``: what the OTLP push costs the daemon, side by side in one run.

Three ``kvsidecar serve`` processes follow the same fleet of segments (8 ranks x 4 pools
at 100 Hz): one without the push, one pushing to a dead collector (a closed loopback
port: every export fails), one pushing to a live loopback sink (answers 200, decodes
nothing). All three are measured over the same windows, so host load hits them alike;
CPU time and RSS come from /proc. Reported: medians over the windows of each daemon's
CPU per push interval and of its RSS, and the push's share (push minus no push, paired
per window).

``--hostile`` (a checkout only: the collector is in tests/attacks/): one daemon per hostile
collector answer (a 300 MB body, a gzip bomb, an answer trickled a byte every 0.5 s), each
until 3 answers were offered: its peak RSS (VmHWM) and the batches that failed.
"""

from __future__ import annotations

import contextlib
import http.server
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

from kvsidecar.bench import checkout
from kvsidecar.bench.fleet import fleet, free_port, proc_stat, start_daemon, stop_daemon

INTERVAL_S = 1.0  # short, to measure many pushes; the default is 15 s
CASES = ("none", "dead", "live")


@contextlib.contextmanager
def _sink() -> Iterator[int]:
    """A live OTLP/HTTP collector stand-in on loopback: reads each body, answers 200."""

    class H(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a: Any) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield srv.server_address[1]
    finally:
        srv.shutdown()


def _push_args(port: int) -> list[str]:
    endpoint = f"http://127.0.0.1:{port}/v1/metrics"
    return ["--otlp.endpoint", endpoint, "--otlp.interval", str(INTERVAL_S)]


def run(quick: bool = False) -> dict[str, Any]:
    try:
        import opentelemetry.exporter.otlp.proto.http  # noqa: F401  (the daemons need it)
    except ImportError:
        return {"skipped": "needs the OTLP extra: pip install 'kvsidecar[otlp]'"}
    window_s, windows = (2.0, 5) if quick else (10.0, 12)
    cpu: dict[str, list[float]] = {c: [] for c in CASES}  # ms per interval, per window
    rss: dict[str, list[float]] = {c: [] for c in CASES}  # MiB at each window's end
    with fleet(ranks=8, pools=4, hz=100.0) as f, _sink() as live_port:
        args = {"dead": _push_args(free_port()), "live": _push_args(live_port)}
        procs = {c: start_daemon(f["shm_dir"], *a)[0] for c, a in args.items()}
        pids = {"none": f["daemon_pid"], **{c: p.pid for c, p in procs.items()}}
        try:
            time.sleep(2 * INTERVAL_S)  # past start-up and the first pushes
            last = {c: proc_stat(pid) for c, pid in pids.items()}
            for _ in range(windows):
                t0 = time.monotonic()
                time.sleep(window_s)
                elapsed = time.monotonic() - t0
                for c, pid in pids.items():
                    now = proc_stat(pid)
                    cpu[c].append((now[1] - last[c][1]) / elapsed * INTERVAL_S * 1e3)
                    rss[c].append(now[0] / 2**20)
                    last[c] = now
        finally:
            for p in procs.values():
                stop_daemon(p)
    med = {c: {"cpu_ms_per_interval": _med(cpu[c]), "rss_mib": _med(rss[c])} for c in CASES}
    push = {
        c: {
            "cpu_ms_per_interval": _med([a - b for a, b in zip(cpu[c], cpu["none"])]),
            "rss_mib": _med([a - b for a, b in zip(rss[c], rss["none"])]),
        }
        for c in ("dead", "live")
    }
    return {
        "ranks": 8,
        "pools_per_rank": 4,
        "interval_s": INTERVAL_S,
        "window_s": window_s,
        "windows": windows,
        "median": med,
        "push_share": push,  # push minus no push, paired per window
        "samples": {"cpu_ms_per_interval": cpu, "rss_mib": rss},
    }


def _med(values: list[float]) -> float:
    return round(statistics.median(values), 2) if values else float("nan")


HEADERS = ["daemon", "CPU ms/interval", "push CPU ms/interval", "RSS MiB", "push RSS MiB"]


def rows(r: dict[str, Any]) -> list[list[Any]]:
    out = []
    for c in CASES:
        share = r["push_share"].get(c, {"cpu_ms_per_interval": "-", "rss_mib": "-"})
        label = {"none": "no push", "dead": "dead collector", "live": "live collector"}[c]
        out.append(
            [
                label,
                r["median"][c]["cpu_ms_per_interval"],
                share["cpu_ms_per_interval"],
                r["median"][c]["rss_mib"],
                share["rss_mib"],
            ]
        )
    return out


HOSTILE = ("big", "bomb", "trickle")
HOSTILE_TIMEOUT_MS = 2000  # OTEL_EXPORTER_OTLP_TIMEOUT for the trickler: 2 s, not 10


def _peak_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        line = next(ln for ln in f if ln.startswith("VmHWM:"))
    return round(int(line.split()[1]) / 1024, 1)


def hostile(answers: int = 3, wait_s: float = 120.0) -> dict[str, Any]:
    """Each hostile answer against its own daemon following 8 ranks x 4 pools."""
    import os

    attacks = checkout.load("hostile_collector")
    out: dict[str, Any] = {}
    with fleet(ranks=8, pools=4, hz=100.0) as f:
        out["no push"] = {"peak_rss_mib": _peak_mib(f["daemon_pid"])}
        for mode in HOSTILE:
            collector = attacks.HostileCollector(mode)
            env = {**os.environ, "OTEL_EXPORTER_OTLP_TIMEOUT": str(HOSTILE_TIMEOUT_MS)}
            proc, url = start_daemon(
                f["shm_dir"], "--otlp.endpoint", collector.url, "--otlp.interval", "0.5", env=env
            )
            try:
                deadline = time.monotonic() + wait_s
                while collector.requests < answers and time.monotonic() < deadline:
                    time.sleep(0.2)
                failed = _send_failed(url)
                out[mode] = {
                    "answers_offered": collector.requests,
                    "peak_rss_mib": _peak_mib(proc.pid),
                    "batches_failed": failed,
                }
            finally:
                stop_daemon(proc)
                collector.close()
    return out


def _send_failed(url: str) -> float:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "kvsidecar_otlp_dropped_batches_total" and s.labels == {
                "reason": "send_failed"
            }:
                return s.value
    return float("nan")


HOSTILE_HEADERS = ["collector", "answers offered", "daemon peak RSS MiB", "batches failed"]


def hostile_rows(r: dict[str, Any]) -> list[list[Any]]:
    return [
        [mode, v.get("answers_offered", "-"), v["peak_rss_mib"], v.get("batches_failed", "-")]
        for mode, v in r.items()
    ]
