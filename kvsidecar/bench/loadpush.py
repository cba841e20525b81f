"""``kvsidecar bench loadpush``: the load push against a picker polling at 50 ms.

One writer process steps an engine-like segment at a fixed rate (a decode step every 20 ms,
and every 5 ms), a new waiting count at every step, and stamps each publish on
CLOCK_MONOTONIC (one clock for every process of the host). One ``kvsidecar serve`` with
``--load-push.endpoint`` and ``--gateway.listen-address``; in turn:

* ``push``: a SUB on the load push (what llm-d-router PR #2067's ``zmq-metrics-data-source``
  does), no poller;
* ``poll 50 ms``: a picker polling the gateway every 50 ms (llm-d-router's default and
  minimum ``--refresh-metrics-interval``) on a kept-alive connection, no subscriber;
* ``push, idle``: the writer does not step (its agent's idle heartbeat only);
* ``serve alone, idle``: the same, on a daemon without ``--load-push.endpoint`` (its CPU is
  the baseline the push adds to). The polls run on that daemon too: each daemon CPU figure
  is one reader's.

Per condition: messages (or polls) a second; for each step, the delay from its publish to
the first message or poll answer that shows it or a later step (a later one supersedes it:
a picker routing on it is that fresh), median and p99; the share of steps whose own values
were ever received; the daemon's CPU (user + system, all its threads) a second.
"""

from __future__ import annotations

import http.client
import multiprocessing as mp
import re
import tempfile
import time
from typing import Any

from kvsidecar.bench import fleet, report

HEADERS = [
    "condition",
    "steps/s",
    "messages/s",
    "delay p50 ms",
    "delay p99 ms",
    "steps seen %",
    "daemon CPU %",
]
NAME = "kvsidecar.kvsidecar-demo.dp0.tp0.pp0"
POLL_S = 0.05
_WAITING = re.compile(rb"^vllm:num_requests_waiting\{[^}]*\} (\S+)$", re.M)


def _writer(shm_dir: str, period: float, seconds: float, ready: Any, conn: Any) -> None:
    """Step every `period` s for `seconds` (0: not at all, the idle heartbeat only); send
    back [(waiting, CLOCK_MONOTONIC ns of its publish)]."""
    from kvsidecar.agent.heartbeat import IdleHeartbeat
    from kvsidecar.protocol.schema import KVCachePoolSnapshot, RuntimeSnapshot, Snapshot
    from kvsidecar.protocol.writer import SegmentWriter

    def snapshot(step: int) -> Snapshot:
        return Snapshot(
            runtime=RuntimeSnapshot(
                engine="kvsidecar-demo",
                initialized=True,
                step=step,
                requests_running=step % 4,
                requests_waiting=step,
            ),
            pools=[
                KVCachePoolSnapshot(
                    block_size_tokens=16,
                    total_blocks=1000,
                    allocated_blocks=step % 1000,
                    available_blocks=1000 - step % 1000,
                )
            ],
        )

    stamps: list[tuple[int, int]] = []
    with SegmentWriter(NAME, shm_dir=shm_dir) as w:
        beat = IdleHeartbeat(w, 1.0)
        w.publish(snapshot(0))
        ready.set()
        time.sleep(0.5)  # the daemon attaches and the reader connects
        end = time.monotonic() + seconds
        step, nxt = 0, time.monotonic()
        while time.monotonic() < end:
            if period <= 0:
                time.sleep(0.05)
                continue
            step += 1
            beat.last_step_ns = time.perf_counter_ns()
            w.publish(snapshot(step))
            stamps.append((step, time.monotonic_ns()))
            nxt += period
            time.sleep(max(0.0, nxt - time.monotonic()))
        beat.stop()
    conn.send(stamps)
    conn.close()


def _subscribe(endpoint: str, until: float) -> list[tuple[int, int]]:
    import msgspec
    import zmq

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    got = []
    try:
        while time.monotonic() < until:
            if sub.poll(50):
                frames = sub.recv_multipart()
                got.append((msgspec.msgpack.decode(frames[-1])[2], time.monotonic_ns()))
    finally:
        sub.close(linger=0)
        ctx.term()
    return got


def _poll(port: int, until: float) -> list[tuple[int, int]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    got = []
    nxt = time.monotonic()
    while time.monotonic() < until:
        conn.request("GET", "/metrics")
        body = conn.getresponse().read()
        m = _WAITING.search(body)
        if m is not None:
            got.append((int(float(m.group(1))), time.monotonic_ns()))
        nxt += POLL_S
        time.sleep(max(0.0, nxt - time.monotonic()))
    conn.close()
    return got


def _delays(stamps: list[tuple[int, int]], seen: list[tuple[int, int]]) -> list[float]:
    """Per step: ms from its publish to the first reading of it or a later step."""
    delays, j = [], 0
    for step, at in stamps:
        while j < len(seen) and seen[j][0] < step:
            j += 1
        if j == len(seen):
            break
        delays.append((seen[j][1] - at) / 1e6)
    return delays


def _condition(
    name: str, period: float, seconds: float, shm: str, endpoint: str, gateway: int, pid: int
) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    recv, send = ctx.Pipe(duplex=False)
    writer = ctx.Process(target=_writer, args=(shm, period, seconds, ready, send), daemon=True)
    writer.start()
    send.close()
    ready.wait(60)
    time.sleep(0.5)
    until = time.monotonic() + seconds
    cpu0 = fleet.proc_stat(pid)[1]
    t0 = time.monotonic()
    seen = _poll(gateway, until) if name.startswith("poll") else _subscribe(endpoint, until)
    elapsed = time.monotonic() - t0
    cpu = fleet.proc_stat(pid)[1] - cpu0
    stamps = recv.recv() if recv.poll(60) else []
    writer.join(30)
    delays = _delays(stamps, seen)
    values = {v for v, _ in seen}
    return {
        "condition": name,
        "steps_per_s": len(stamps) / elapsed,
        "messages_per_s": len(seen) / elapsed,
        "delay_p50_ms": report.percentile(delays, 50),
        "delay_p99_ms": report.percentile(delays, 99),
        "steps_seen_pct": 100.0 * sum(s in values for s, _ in stamps) / len(stamps)
        if stamps
        else float("nan"),
        "daemon_cpu_pct": 100.0 * cpu / elapsed,
    }


def run(quick: bool = False) -> dict[str, Any]:
    try:
        import zmq  # noqa: F401
    except ImportError:
        return {"skipped": "pyzmq is missing: pip install 'kvsidecar[kvevents]'", "rows": []}
    seconds = 2.0 if quick else 10.0
    periods = [0.02] if quick else [0.02, 0.005]
    # The push on a daemon with --load-push.endpoint; the polls and the idle baseline on
    # one without it, so each daemon CPU figure is that reader's alone.
    pushed = [("push", p) for p in periods] + [("push, idle", 0.0)]
    polled = [("poll 50 ms", p) for p in periods] + [("serve alone, idle", 0.0)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvs-loadpush-") as shm:
        push = fleet.free_port_run(2)
        gateway = push + 1
        endpoint = f"tcp://127.0.0.1:{push}"
        for pushing in (True, False):
            todo = pushed if pushing else polled
            args = ["--load-push.endpoint", endpoint] if pushing else []
            daemon, _url = fleet.start_daemon(
                shm,
                *args,
                "--gateway.listen-address", f"127.0.0.1:{gateway}",
                "--rediscover-interval", "0.1",
                wait_for_source=False,
            )  # fmt: skip
            try:
                for name, period in todo:
                    rows.append(
                        _condition(name, period, seconds, shm, endpoint, gateway, daemon.pid)
                    )
            finally:
                fleet.stop_daemon(daemon)
    return {"seconds": seconds, "host": report.host_description(), "rows": rows}


def rows(result: dict[str, Any]) -> list[list[Any]]:
    return [
        [
            r["condition"],
            round(r["steps_per_s"], 1),
            round(r["messages_per_s"], 1),
            round(r["delay_p50_ms"], 2),
            round(r["delay_p99_ms"], 2),
            round(r["steps_seen_pct"], 1),
            round(r["daemon_cpu_pct"], 2),
        ]
        for r in result["rows"]
    ]
