"""``bench cost --vllm``: what a scrape costs the real vLLM server's processes.

The server (API server, EngineCore, and whatever they spawn: its process tree) answers
the same fixed completions every round (fixed prompts, ``max_tokens``, ``ignore_eos``,
4 at a time), under none, kvsidecar's /metrics at 20 and 50 Hz (the plugin publishes
in every condition, so the delta is the scrapes alone), the burner control at 50 Hz
(`cost.Burner`: the CPU a kvsidecar scrape costs its observers, measured in a warm-up,
burnt by two processes that touch nothing of the engine) and vLLM's own /metrics at 20
and 50 Hz. Counters and pairing as in `kvsidecar.bench.cost`.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from kvsidecar import settings
from kvsidecar.bench import cost, fleet, proccount, vllm

CLIENTS = 4


def observer_cost(scraper: cost.Scraper, daemon_pid: int, work: Any) -> dict[str, float]:
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


def run(quick: bool = False) -> dict[str, Any]:
    python = vllm.vllm_python()
    if python is None:
        return {"skipped": "no vLLM environment (build it: bash .ci/engine-env vllm)"}
    rounds, requests, max_tokens = (2, 8, 16) if quick else (8, 16, 32)
    tmp = tempfile.mkdtemp(prefix="kvsidecar-cost-vllm-")
    env = vllm.engine_env(cache_root=os.path.join(tmp, "vllm-cache"))
    shm = os.path.join(tmp, "shm")
    os.makedirs(shm)
    env[settings.SHM_DIR.name] = shm
    # Waiting OpenMP threads sleep instead of spinning, so CPU time counts work: spinning
    # would bill the server for any wall time another process's CPU use added to a round.
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    port = fleet.free_port()
    model = vllm.write_model(Path(tmp) / "bench-model", **vllm.BENCH_MODEL)
    cmd = vllm.server_command(python, model, port, num_gpu_blocks=512)
    server = vllm.start_server(cmd, env, Path(tmp) / "server.log")
    daemon = None
    scrapers: dict[str, cost.Scraper] = {}
    try:
        daemon, kurl = fleet.start_daemon(shm, timeout=60)
        kport = int(kurl.rsplit(":", 1)[1])
        for cond in cost.VLLM_CONDITIONS[1:]:
            target, _, hz = cond.partition("@")
            if target != "burner":
                scrapers[cond] = cost.Scraper(port if target == "vllm" else kport, "/metrics",
                                              float(hz), tmp)  # fmt: skip
        vllm_body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read()
        pool = concurrent.futures.ThreadPoolExecutor(CLIENTS)

        work = vllm.fixed_completions(port, requests, max_tokens, pool, timeout=120)

        work()  # warm-up: compile, caches
        # A second warm-up under kvsidecar@50 measures what one scrape costs its observers
        # (scraper, daemon), which the burner control then burns at the same rate.
        observers = observer_cost(scrapers["kvsidecar@50"], daemon.pid, work)
        scrapers["burner@50"] = cost.Burner(
            50.0, observers["scraper_ms"], observers["daemon_ms"], tmp
        )
        per_round = cost.interleaved_rounds(
            rounds,
            cost.VLLM_CONDITIONS,
            lambda cond: cost.counted_round(server.pid, work, scrapers.get(cond)),
        )
        pool.shutdown()
    finally:
        for s in scrapers.values():
            s.close()
        if daemon is not None:
            fleet.stop_daemon(daemon)
        vllm.stop_server(server)
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "rounds": rounds,
        "requests": requests,
        "max_tokens": max_tokens,
        "clients": CLIENTS,
        "vllm_metrics_bytes": len(vllm_body),
        "omp_wait_policy": env["OMP_WAIT_POLICY"],
        "observer_cpu_ms_per_scrape": observers,
        "conditions": cost.summarize(per_round, cost.VLLM_CONDITIONS),
    }
