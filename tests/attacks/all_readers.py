"""The daemon's RSS with every reader kind at once (#43 item 8).

Beside the metrics side's worst accepted target (`worst_target`: every string at the
label limit in 4-byte characters, the most pools the default aggregate budget serves,
scraped as text, OpenMetrics and JSON), a KV-event segment of N blocks published by the
same daemon (``--kv-events.*``: the full state at start; S subscribers and R replay
clients asking for everything, none of which reads), the load stream
(``--load-push.endpoint``, a subscriber that never reads) and the gateway listener
(scraped). Reported at the end, in MiB: the daemon's VmRSS, VmHWM, RssAnon, RssShmem,
and the highest RssAnon sampled (`_AnonPeak`). Only flags every
version has: ``KVSIDECAR_BENCH_CHECKOUT`` at an older tree measures its daemon.

    python -c "from tests.attacks import all_readers as m; print(m.run(1_000_000))"
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import zmq

from kvsidecar.bench.fleet import free_port_run, start_daemon, stop_daemon
from tests.attacks import hostile_writers as hw
from tests.attacks import kv_events_memory as kvm
from tests.attacks import worst_target as wt
from tests.support.procs import wait_for

MB = 1024 * 1024


def _status(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        return {
            k: int(v.split()[0]) * 1024
            for k, v in (line.split(":", 1) for line in f)
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssShmem")
        }


class _AnonPeak(threading.Thread):
    """The highest RssAnon of a process, sampled every 20 ms: the memory its own cgroup
    is charged for (RssShmem, the KV-event table's pages mapped from /dev/shm, is charged
    to the engine that wrote them; VmHWM counts both)."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop = pid, 0, threading.Event()
        self.start()

    def run(self) -> None:
        while not self.stop.wait(0.02):
            try:
                self.peak = max(self.peak, _status(self.pid)["RssAnon"])
            except (OSError, KeyError):
                return


def listening(port: int) -> bool:
    """Something listens on the port (a connect from an ephemeral port equal to it would
    reach the socket itself: TCP's simultaneous open)."""
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", port)) != 0:
            return False
        return s.getsockname() != s.getpeername()


def _never_reads(ctx: zmq.Context, kind: int, endpoint: str) -> zmq.Socket:
    s = ctx.socket(kind)
    s.setsockopt(zmq.RCVHWM, 1)
    s.setsockopt(zmq.RCVBUF, 4096)
    if kind == zmq.SUB:
        s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(endpoint)
    return s


def run(
    blocks: int = 1_000_000,
    subscribers: int = 32,
    replays: int = 32,
    settle: float = 10.0,
    early: bool = False,
    segments: int = 1,
    flags: tuple[str, ...] = (),
    spare: int = 0,
) -> dict[str, Any]:
    """``early``: the subscribers connect before the daemon starts, so the full state at
    start is queued to them (up to PUB_QUEUE_MSGS messages each, the same bytes).
    ``segments``: the blocks split over that many KV-event segments (DP ranks 0..n-1, each
    published on its own ports: the subscribers and replay clients spread over them);
    ``flags``: more ``kvsidecar serve`` flags; ``spare``: slots each table has beyond its
    blocks (an agent's: a ring's worth, 65,536)."""
    shm_dir = tempfile.mkdtemp(prefix="kvsidecar-allreaders-", dir="/dev/shm")
    pools = wt.most_pools(4, wt.LABEL // 4)
    target = hw.raw_writer(
        shm_dir, "kvsidecar.worst.dp0.tp0.pp0", wt.payload(4, wt.LABEL // 4, pools), 512 * 1024
    )
    events = [
        kvm._writer(shm_dir, blocks // segments, f"kvevents.mem.dp{r}.tp0.pp0", r, spare)
        for r in range(segments)
    ]
    # Rank r publishes on port + r and replay + r: blocks of ports apart, below the
    # ephemeral range (early subscribers' reconnections draw from it: one of theirs on a
    # port the daemon then binds failed its start, exit 2, in 1 run of 3).
    port = free_port_run(202)
    replay, load, gateway = port + 100, port + 200, port + 201
    ctx = zmq.Context()
    socks: list[zmq.Socket] = []
    daemon = None
    try:
        if early:
            socks += [
                _never_reads(ctx, zmq.SUB, f"tcp://127.0.0.1:{port + i % segments}")
                for i in range(subscribers)
            ]
        daemon, url = start_daemon(
            shm_dir,
            "--kv-events.endpoint", f"tcp://127.0.0.1:{port}",
            "--kv-events.replay-endpoint", f"tcp://127.0.0.1:{replay}",
            "--load-push.endpoint", f"tcp://127.0.0.1:{load}",
            "--gateway.listen-address", f"127.0.0.1:{gateway}",
            *flags,
            wait_for_source=False, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        sampler = _AnonPeak(daemon.pid)
        published = 0
        for r in range(segments):  # a rank over --kv-events.memory-bytes never binds
            if wait_for(lambda r=r: listening(replay + r), timeout=20):
                kvm._wait_published(ctx, f"tcp://127.0.0.1:{replay + r}")
                published += 1
        socks.append(_never_reads(ctx, zmq.SUB, f"tcp://127.0.0.1:{load}"))
        if not early:
            socks += [
                _never_reads(ctx, zmq.SUB, f"tcp://127.0.0.1:{port + i % segments}")
                for i in range(subscribers)
            ]
        for i in range(replays):
            c = _never_reads(ctx, zmq.DEALER, f"tcp://127.0.0.1:{replay + i % segments}")
            c.send_multipart([b"", (0).to_bytes(8, "big")])
            socks.append(c)
        deadline = time.monotonic() + settle
        size = served = gateway_bytes = 0
        while time.monotonic() < deadline:
            size, served = wt._scrape_all(url, 1)
            try:  # 503 until the gateway has a rank to serve: the body costs the same
                with urllib.request.urlopen(f"http://127.0.0.1:{gateway}/metrics", timeout=30) as r:
                    gateway_bytes = len(r.read())
            except urllib.error.HTTPError as e:
                gateway_bytes = -e.code
        return {
            "blocks": blocks,
            "segments": segments,
            "spare": spare,
            "published": published,
            "subscribers": subscribers,
            "replay_clients": replays,
            "early_subscribers": early,
            "pools": pools,
            "served": served,
            "body_bytes": size,
            "gateway_bytes": gateway_bytes,
            **{k: round(v / MB, 1) for k, v in _status(daemon.pid).items()},
            "peak_anon_mb": round(sampler.peak / MB, 1),
        }
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()
        if daemon is not None:
            stop_daemon(daemon)
        hw._kill([target])
        for pid in events:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        shutil.rmtree(shm_dir, ignore_errors=True)
