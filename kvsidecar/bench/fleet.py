"""A fleet of ranks for benchmarks: one process publishing N segments, plus the daemon.

The writer process is the real SegmentWriter publishing realistic snapshots
(runtime + pools) at a fixed rate; the daemon is the real ``kvsidecar serve``
subprocess. Used by ``bench scrape``, ``bench footprint`` and ``bench soak``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable, Iterator
from typing import Any

from kvsidecar import settings
from kvsidecar.bench.publish import realistic_snapshot
from kvsidecar.protocol.writer import SegmentWriter


def writer_main(shm_dir: str, ranks: int, pools: int, hz: float, ready: Any, stop: Any) -> None:
    writers, snaps = [], []
    for dp in range(ranks):
        snap = realistic_snapshot(pools)
        snap.runtime.dp_rank, snap.runtime.dp_size = dp, ranks
        writers.append(SegmentWriter(f"kvsidecar.bench.dp{dp}.tp0.pp0", shm_dir=shm_dir))
        snaps.append(snap)
    ready.set()
    period = 1.0 / hz
    next_t = time.monotonic()
    while not stop.is_set():
        for w, s in zip(writers, snaps):
            s.runtime.step += 1
            s.pools[0].allocated_blocks = 80_000 + s.runtime.step % 1000
            w.publish(s)
        next_t += period
        time.sleep(max(0.0, next_t - time.monotonic()))
    for w in writers:
        w.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(count: int = 1, taken: Iterable[int] = ()) -> int:
    """The first of ``count`` consecutive free loopback ports, none in ``taken``, all below
    the kernel's ephemeral range: `free_port` and every outgoing connection draw from that
    range, so a port picked there for a later bind (a gateway's rank ports, base + dp_rank)
    may by then be another daemon's listener or someone's connection."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        hi = min(int(f.read().split()[0]), 32768)
    avoid, rng = set(taken), random.Random()
    while True:
        base = rng.randrange(20000, hi - count)
        run = range(base, base + count)
        if avoid.intersection(run):
            continue
        try:
            for port in run:
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base


@contextlib.contextmanager
def fleet(
    ranks: int = 8, pools: int = 4, hz: float = 100.0, checkout: str | None = None
) -> Iterator[dict[str, Any]]:
    """Yield {"url", "daemon_pid", "writer_pid", "shm_dir"} while writers and daemon run
    (the daemon of ``checkout``'s code if given: see `start_daemon`)."""
    shm_dir = tempfile.mkdtemp(prefix="kvsidecar-fleet-", dir="/dev/shm")
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    writer = ctx.Process(target=writer_main, args=(shm_dir, ranks, pools, hz, ready, stop))
    writer.start()
    daemon = None
    try:
        if not ready.wait(60):
            raise RuntimeError("benchmark writers did not start")
        daemon, url = start_daemon(shm_dir, checkout=checkout)
        port = int(url.rsplit(":", 1)[1])
        yield {
            "url": url,
            "port": port,
            "daemon_pid": daemon.pid,
            "writer_pid": writer.pid,
            "shm_dir": shm_dir,
        }
    finally:
        if daemon is not None:
            stop_daemon(daemon)
        stop.set()
        writer.join(10)
        if writer.is_alive():
            writer.kill()
        shutil.rmtree(shm_dir, ignore_errors=True)


def start_daemon(
    shm_dir: str,
    *args: str,
    wait_for_source: bool = True,
    timeout: float = 30.0,
    context: ssl.SSLContext | None = None,
    checkout: str | None = None,
    **popen: Any,
) -> tuple[subprocess.Popen, str]:
    """Start ``kvsidecar serve`` on a free loopback port; return it and its base URL once
    it serves a scrape with at least one source (or, without ``wait_for_source``, once
    ``/-/healthy`` answers; over https with ``context``). stderr is inherited (an unread
    pipe could fill and block it) unless ``popen`` says otherwise (e.g. ``stderr=file``,
    ``user=uid``). With ``checkout`` (a source tree, e.g. a git worktree of an older
    commit with its extension built in place), that tree's daemon runs instead, for
    side-by-side runs of two versions."""
    port = free_port()
    daemon = subprocess.Popen(
        [
            *daemon_command(checkout),
            "serve",
            "--shm-dir",
            shm_dir,
            "--web.listen-address",
            f"127.0.0.1:{port}",
            "--log-level",
            "warning",
            *args,
        ],
        stdout=subprocess.DEVNULL,
        **popen,
    )
    url = f"{'https' if context else 'http'}://127.0.0.1:{port}"
    path, marker = ("/metrics", b"kvsidecar_source_up{") if wait_for_source else ("/-/healthy", b"")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url + path, timeout=2, context=context) as r:
                if r.status == 200 and marker in r.read():
                    return daemon, url
        except OSError:
            pass
        if time.monotonic() > deadline or daemon.poll() is not None:
            daemon.kill()
            raise RuntimeError(f"daemon did not come up (exit code {daemon.wait()})")
        time.sleep(0.05)


# -I: this environment's editable install would otherwise win over the other tree's path.
_RUN_FROM = (
    "import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); "
    "runpy.run_module('kvsidecar', run_name='__main__', alter_sys=True)"
)


def daemon_command(checkout: str | None = None) -> list[str]:
    """argv that runs ``kvsidecar``'s CLI from this install, or from ``checkout``'s tree
    (by default $KVSIDECAR_BENCH_CHECKOUT: every bench's daemon from an older tree, for
    the side-by-side tables of docs/reliability.md)."""
    checkout = checkout or os.environ.get(settings.BENCH_CHECKOUT.name) or None
    if checkout is None:
        return [sys.executable, "-m", "kvsidecar"]
    if not os.path.isfile(os.path.join(checkout, "kvsidecar", "__main__.py")):
        raise ValueError(f"{checkout}: not a kvsidecar source tree (no kvsidecar/__main__.py)")
    return [sys.executable, "-I", "-c", _RUN_FROM, os.path.abspath(checkout)]


def stop_daemon(daemon: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout``; reaps it."""
    daemon.send_signal(signal.SIGTERM)
    try:
        daemon.wait(timeout)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()


def proc_stat(pid: int) -> tuple[int, float]:
    """(RSS bytes, CPU seconds user+system) of a process, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return rss, (int(fields[11]) + int(fields[12])) / ticks


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def map_count(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return sum(1 for _ in f)
