"""What a scrape costs a real engine server's processes: shared by ``bench cost --vllm`` and
``--sglang``.

The server (its whole process tree) answers the same fixed requests every round, under none,
kvsidecar's /metrics at 20 and 50 Hz (the agent publishes in every condition, so the delta is
the scrapes alone), the burner control at 50 Hz (`rounds.Burner`: the CPU a kvsidecar scrape
costs its observers, measured in a warm-up, burnt by two processes that touch nothing of the
engine) and the engine's own /metrics at 20 and 50 Hz. Counters and pairing as in
`kvsidecar.bench.cost`. With a `HealthProber`, every round also records the latency of the
server's health checks, so the same interleaved rounds give both figures.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import shutil
import subprocess
import tempfile
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvsidecar.bench import fleet, health_probe, proccount, vllm
from kvsidecar.bench.rounds import Burner, Scraper, counted_round, interleaved_rounds, summarize

CLIENTS = 4

# What an engine supplies: (tmp dir, segment dir, port, model dir) -> (command, environment),
# and (port, prompt, max tokens) -> one request of the fixed workload.
Launch = Callable[[str, str, int, str], tuple[list[str], dict[str, str]]]
Request = Callable[[int, list[int], int], urllib.request.Request]


def conditions(own: str) -> tuple[str, ...]:
    """The conditions for an engine whose own /metrics condition is called ``own``."""
    return ("none", "kvsidecar@20", "kvsidecar@50", "burner@50", f"{own}@20", f"{own}@50")


@dataclasses.dataclass
class Server:
    """A started engine server: its launcher process, port, segment directory, workload."""

    proc: subprocess.Popen
    port: int
    shm: str
    tmp: str
    own: str  # the engine's name in its own conditions: "vllm", "sglang"
    work: Callable[[], None]  # one round's fixed requests


def observer_cost(scraper: Scraper, daemon_pid: int, work: Any) -> dict[str, float]:
    """CPU ms per answered scrape of the scraper and of the daemon over one ``work()``."""
    pids = {"scraper_ms": scraper.proc.pid, "daemon_ms": daemon_pid}
    before = {k: proccount.counters(p)["cpu_ms"] for k, p in pids.items()}
    done = scraper.answered
    scraper.resume()
    work()
    scraper.pause()
    n = max(1, scraper.answered - done)
    out = {k: (proccount.counters(p)["cpu_ms"] - before[k]) / n for k, p in pids.items()}
    out["scrapes"] = float(n)
    return out


def _probed(work: Callable[[], None], prober: health_probe.HealthProber, into: dict) -> Any:
    """``work`` with the prober running through it; its samples land in ``into``."""

    def run() -> None:
        prober.start()
        try:
            work()
        finally:
            into.update(prober.stop())

    return run


def measure(server: Server, rounds: int, probe_health: bool = False) -> dict[str, Any]:
    """Interleaved rounds of every condition over ``server``; the daemon and scrapers are
    started and stopped here, the server is the caller's."""
    conds = conditions(server.own)
    daemon = prober = None
    scrapers: dict[str, Scraper] = {}
    health_rounds: list[dict[str, dict]] = []
    try:
        daemon, kurl = fleet.start_daemon(server.shm, timeout=60)
        kport = int(kurl.rsplit(":", 1)[1])
        for cond in conds[1:]:
            target, _, hz = cond.partition("@")
            if target != "burner":
                port = kport if target == "kvsidecar" else server.port
                scrapers[cond] = Scraper(port, "/metrics", float(hz), server.tmp)
        own_body = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics").read()
        server.work()  # warm-up: compile, caches
        # A second warm-up under kvsidecar@50 measures what one scrape costs its observers
        # (scraper, daemon), which the burner control then burns at the same rate.
        observers = observer_cost(scrapers["kvsidecar@50"], daemon.pid, server.work)
        scrapers["burner@50"] = Burner(
            50.0, observers["scraper_ms"], observers["daemon_ms"], server.tmp
        )
        if probe_health:
            prober = health_probe.HealthProber(server.port)

        def one(cond: str) -> dict[str, float]:
            work = server.work
            if prober is not None:
                if not health_rounds or len(health_rounds[-1]) == len(conds):
                    health_rounds.append({})  # a new round: each runs every condition once
                work = _probed(work, prober, health_rounds[-1].setdefault(cond, {}))
            return counted_round(server.proc.pid, work, scrapers.get(cond))

        per_round = interleaved_rounds(rounds, conds, one)
    finally:
        for s in scrapers.values():
            s.close()
        if prober is not None:
            prober.close()
        if daemon is not None:
            fleet.stop_daemon(daemon)
    out: dict[str, Any] = {
        "rounds": rounds,
        f"{server.own}_metrics_bytes": len(own_body),
        "observer_cpu_ms_per_scrape": observers,
        "conditions": summarize(per_round, conds),
    }
    if health_rounds:
        out["health"] = health_probe.summarize(health_rounds, conds)
    return out


def run(
    own: str,
    launch: Launch,
    request: Request,
    expect: bytes,
    quick: bool = False,
    probe_health: bool = False,
    start_timeout: float = 240.0,
    requests: int = 16,
) -> dict[str, Any]:
    """Start engine ``own``'s server (`BENCH_MODEL`, dummy weights), `measure` it under the
    fixed workload (``requests`` x prompts of 64 tokens, ``max_tokens``, 4 at a time), stop it."""
    rounds, requests, max_tokens = (2, 8, 16) if quick else (8, requests, 32)
    tmp = tempfile.mkdtemp(prefix=f"kvsidecar-cost-{own}-")
    shm = os.path.join(tmp, "shm")
    os.makedirs(shm)
    port = fleet.free_port()
    model = vllm.write_model(Path(tmp) / "bench-model", **vllm.BENCH_MODEL)
    cmd, env = launch(tmp, shm, port, model)
    # Waiting OpenMP threads sleep instead of spinning, so CPU time counts work: spinning
    # would bill the server for any wall time another process's CPU use added to a round.
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    server = vllm.start_server(cmd, env, Path(tmp) / "server.log", timeout=start_timeout)
    try:
        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool:
            work = vllm.fixed_requests(
                lambda p: request(port, p, max_tokens), requests, pool, expect, timeout=120
            )
            out = measure(Server(server, port, shm, tmp, own, work), rounds, probe_health)
    finally:
        vllm.stop_server(server, timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        **out,
        "requests": requests,
        "max_tokens": max_tokens,
        "clients": CLIENTS,
        "omp_wait_policy": env["OMP_WAIT_POLICY"],
    }
