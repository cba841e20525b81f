"""The interleaved rounds that `bench cost`, `cost_server` (vLLM, SGLang) and `bench gateway`
share: scraper and burner processes counted through a mapped file, one round's counters of
an engine's process tree, shuffled rounds, and the per-scrape summary against each
condition's baseline (mean and bootstrap 95 % interval, `stats.mean_interval`).
"""

from __future__ import annotations

import mmap
import os
import random
import signal
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from kvsidecar.bench import proccount, stats

SETTLE_S = 0.1  # after a round: an in-flight scrape finishes inside its own round

# Scrapes a URL at HZ over one keep-alive connection (as Prometheus does) and keeps the
# count of 200s in an 8-byte file it maps, so reading it costs the engine nothing. The
# benchmark SIGSTOPs it between its rounds.
_SCRAPER = r"""
import http.client, mmap, struct, sys, time
host, port, path, counter = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[5]
hz = float(sys.argv[4])
with open(counter, "r+b") as f:
    m = mmap.mmap(f.fileno(), 8)
ok, conn, nxt = 0, None, time.monotonic()
while True:
    try:
        conn = conn or http.client.HTTPConnection(host, port, timeout=5)
        conn.request("GET", path); r = conn.getresponse(); r.read()
        if r.status == 200:
            ok += 1
            struct.pack_into("Q", m, 0, ok)
        if r.getheader("connection", "").lower() == "close" or r.version == 10:
            conn.close(); conn = None
    except (OSError, http.client.HTTPException):
        if conn is not None:
            conn.close()
        conn = None
    nxt = max(nxt + 1 / hz, time.monotonic() - 1 / hz)
    time.sleep(max(0.0, nxt - time.monotonic()))
"""


class _Counted:
    """A process that counts what it did in an 8-byte file it maps (so reading the count
    costs nothing), stopped until resumed; the benchmark SIGSTOPs it between rounds."""

    def __init__(self, script: str, args: list[str], counter: str) -> None:
        with open(counter, "wb") as f:
            f.write(bytes(8))
        with open(counter, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 8)
        self.proc = subprocess.Popen([sys.executable, "-c", script, *args, counter])
        self.proc.send_signal(signal.SIGSTOP)

    @property
    def answered(self) -> int:
        return struct.unpack_from("Q", self._map, 0)[0]

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def close(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.proc.kill()
        self.proc.wait()


class Scraper(_Counted):
    """One scraper process for one (port, path, Hz)."""

    def __init__(self, port: int, path: str, hz: float, tmp: str) -> None:
        counter = os.path.join(tmp, f"scrapes-{port}-{hz:g}")
        super().__init__(_SCRAPER, ["127.0.0.1", str(port), path, str(hz)], counter)


# The control for the scraped rows: two processes that do what a scrape's two observers
# do (one wakes at HZ and burns what the scraper burns, the other is woken over a socket,
# burns what the daemon burns and answers) and touch nothing of the engine. What the
# engine's counters move under them is what sharing its cores costs, not the scrape path.
_BURNER = r"""
import mmap, os, socket, struct, sys, time
hz, a_ms, b_ms, counter = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
def burn(ms):
    end = time.thread_time() + ms / 1000
    while time.thread_time() < end:
        pass
left, right = socket.socketpair()
if os.fork() == 0:
    left.close()
    while right.recv(1):
        burn(b_ms); right.send(b"x")
    os._exit(0)
right.close()
with open(counter, "r+b") as f:
    m = mmap.mmap(f.fileno(), 8)
n, nxt = 0, time.monotonic()
while True:
    burn(a_ms); left.send(b"x"); left.recv(1)
    n += 1; struct.pack_into("Q", m, 0, n)
    nxt = max(nxt + 1 / hz, time.monotonic() - 1 / hz)
    time.sleep(max(0.0, nxt - time.monotonic()))
"""


class Burner(_Counted):
    """`_BURNER` at ``hz``: ``scraper_ms`` then ``daemon_ms`` of CPU per wake-up."""

    def __init__(self, hz: float, scraper_ms: float, daemon_ms: float, tmp: str) -> None:
        counter = os.path.join(tmp, f"burns-{hz:g}")
        args = [str(hz), f"{scraper_ms:.4f}", f"{daemon_ms:.4f}"]
        super().__init__(_BURNER, args, counter)


def counted_round(
    pid: int, work: Callable[[], int | None], scraper: Scraper | None
) -> dict[str, float]:
    """Counters of pid's tree over one round of ``work`` with ``scraper`` running;
    "scrapes" is what the scraper got answered (or what ``work`` says it served)."""
    before, root0 = proccount.tree_counters(pid), proccount.counters(pid)
    done0 = scraper.answered if scraper else 0
    if scraper:
        scraper.resume()
    served = work()
    if scraper:
        scraper.pause()
    time.sleep(SETTLE_S)
    after, root1 = proccount.tree_counters(pid), proccount.counters(pid)
    out = proccount.delta(after, before)
    out["root_cpu_ms"] = root1["cpu_ms"] - root0["cpu_ms"]  # the tree's first process alone
    out["syscalls"] = out["syscr"] + out["syscw"]
    out["ctxt"] = out["voluntary_ctxt"] + out["nonvoluntary_ctxt"]
    out["sockets"] = after["sockets"]
    out["processes"] = after["processes"]
    if served is None:
        served = scraper.answered - done0 if scraper else 0
    out["scrapes"] = float(served)
    return out


PER_SCRAPE = ("cpu_ms", "root_cpu_ms", "syscalls", "ctxt", "voluntary_ctxt", "rchar", "wchar")


def baseline(cond: str) -> str:
    """What a condition is paired with: the same observer unscraped (``X@0``: what it
    costs per step, publish or gauge updates), so the delta is the scrapes alone."""
    target, _, hz = cond.partition("@")
    return f"{target}@0" if hz and hz != "0" and target != "locked_snapshot" else "none"


def summarize(rounds: list[dict[str, dict[str, float]]], conditions: tuple[str, ...]) -> dict:
    """Per condition, paired with its baseline in the same round: deltas per scrape
    answered (per round for the unscraped ``X@0``), mean + 95 % CI."""
    out: dict[str, Any] = {}
    for cond in conditions:
        rows = [r[cond] for r in rounds]
        entry: dict[str, Any] = {
            "baseline": baseline(cond) if baseline(cond) in conditions else "none",
            "scrapes_per_round": statistics.fmean(x["scrapes"] for x in rows),
            "sockets": max(x["sockets"] for x in rows),
            "processes": max(x["processes"] for x in rows),
            "absolute": {k: statistics.fmean(x[k] for x in rows) for k in PER_SCRAPE},
        }
        if cond != "none":
            base, scraped = entry["baseline"], entry["scrapes_per_round"] > 0
            for k in PER_SCRAPE:
                per = [
                    (r[cond][k] - r[base][k]) / (r[cond]["scrapes"] if scraped else 1)
                    for r in rounds
                    if r[cond]["scrapes"] > 0 or not scraped
                ]
                entry[f"{k}_{'per_scrape' if scraped else 'per_round'}"] = stats.mean_interval(per)
        out[cond] = entry
    return out


def interleaved_rounds(
    rounds: int, conditions: tuple[str, ...], one: Callable[[str], dict[str, float]]
) -> list[dict[str, dict[str, float]]]:
    order, rng, out = list(conditions), random.Random(1), []
    for _ in range(rounds):
        rng.shuffle(order)  # interleaved, shuffled: host drift hits every condition alike
        out.append({cond: one(cond) for cond in order})
    return out
