"""The daemon's RSS with the KV-event publisher at a large table, subscribers and replay
clients that never read (#43 item 8).

A writer process fills a KV-event segment with N cached blocks (16 token ids each, one
BlockStored each) and keeps its heartbeat; the real ``kvsidecar serve --kv-events.*``
publishes it; S subscribers connect to the PUB and R replay clients ask for everything
(start 0: older than the buffer, so the full state), and none of them reads. Reported:
the daemon's RSS and peak (VmHWM) before the clients and after them. Only flags every
version has: ``KVSIDECAR_BENCH_CHECKOUT`` at an older tree measures its daemon.

    python -c "from tests.attacks import kv_events_memory as m; print(m.run(100_000))"
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Any

import zmq

from kvsidecar.bench.fleet import free_port, proc_stat, start_daemon, stop_daemon
from kvsidecar.protocol.kv_events_writer import KVEventsWriter
from tests.support.kv_chains import store_chains

MB = 1024 * 1024
NAME = "kvevents.mem.dp0.tp0.pp0"


def _writer(shm_dir: str, blocks: int, name: str = NAME, dp_rank: int = 0, spare: int = 0) -> int:
    """A child that stores `blocks` blocks in a table of `blocks + spare` slots (an
    agent's: what its engine can cache plus a ring's worth), says so on a pipe, then
    keeps the segment."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            seg = KVEventsWriter(
                name, n_slots=blocks + spare, block_size=16, shm_dir=shm_dir, dp_rank=dp_rank
            )
            store_chains(seg, blocks)
            os.write(w, b"ok")
            while True:
                time.sleep(0.1)
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 2) == b"ok"
    os.close(r)
    return pid


def _wait_published(ctx: zmq.Context, endpoint: str, timeout: float = 300.0) -> None:
    """Until a replay from 0 answers a batch: the first full state was published (a
    client that reads it whole, so what it took is freed before the measure)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        c = ctx.socket(zmq.DEALER)
        try:
            c.connect(endpoint)
            c.send_multipart([b"", (0).to_bytes(8, "big")])
            got = 0
            while c.poll(30_000):
                frames = c.recv_multipart()
                if frames[2] == (-1).to_bytes(8, "big", signed=True):
                    break
                got += 1
            if got:
                return
        finally:
            c.close(linger=0)
        time.sleep(0.5)
    raise RuntimeError(f"no full state from {endpoint} in {timeout} s")


def _peak(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def run(
    blocks: int = 100_000, subscribers: int = 32, replays: int = 32, settle: float = 10.0
) -> dict[str, Any]:
    shm_dir = tempfile.mkdtemp(prefix="kvsidecar-kvmem-", dir="/dev/shm")
    port, replay = free_port(), free_port()
    writer = _writer(shm_dir, blocks)
    ctx = zmq.Context()
    socks = []
    daemon = None
    try:
        daemon, _ = start_daemon(
            shm_dir,
            "--kv-events.endpoint", f"tcp://127.0.0.1:{port}",
            "--kv-events.replay-endpoint", f"tcp://127.0.0.1:{replay}",
            wait_for_source=False, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        _wait_published(ctx, f"tcp://127.0.0.1:{replay}")
        time.sleep(1.0)
        rss0, peak0 = proc_stat(daemon.pid)[0], _peak(daemon.pid)
        for _ in range(subscribers):
            s = ctx.socket(zmq.SUB)
            s.setsockopt(zmq.RCVHWM, 1)
            s.setsockopt(zmq.RCVBUF, 4096)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(f"tcp://127.0.0.1:{port}")
            socks.append(s)
        for _ in range(replays):
            c = ctx.socket(zmq.DEALER)
            c.setsockopt(zmq.RCVHWM, 1)
            c.setsockopt(zmq.RCVBUF, 4096)
            c.connect(f"tcp://127.0.0.1:{replay}")
            c.send_multipart([b"", (0).to_bytes(8, "big")])
            socks.append(c)
        time.sleep(settle)
        return {
            "blocks": blocks,
            "subscribers": subscribers,
            "replay_clients": replays,
            "rss_mb": round(rss0 / MB, 1),
            "peak_mb": round(peak0 / MB, 1),
            "rss_with_clients_mb": round(proc_stat(daemon.pid)[0] / MB, 1),
            "peak_with_clients_mb": round(_peak(daemon.pid) / MB, 1),
        }
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()
        if daemon is not None:
            stop_daemon(daemon)
        os.kill(writer, signal.SIGKILL)
        os.waitpid(writer, 0)
        shutil.rmtree(shm_dir, ignore_errors=True)
