"""``kvsidecar bench observer``: what being observed costs an engine loop, four ways.

An engine loop of fixed work (Python scheduling over a real `KVBlockPool` plus a
torch matmul) is timed step by step under four conditions, interleaved in
rounds so host noise hits each alike:

* ``none``: no observer at all;
* ``kvsidecar``: the agent publishes every step; the daemon runs in another
  process and a real HTTP client (a third process) scrapes it at 20 Hz;
* ``prometheus_client``: an in-process exporter (vLLM/SGLang/ATOM style) with the
  same series, gauges set every step, scraped at 20 Hz over HTTP;
* ``locked_snapshot``: kvcached style: each step mutates the allocator under a
  lock, and a thread takes that lock 20 times a second to build a snapshot of
  every field, querying device memory twice per pool while holding it (as
  kvcached's ``available_size()`` does with cudaMemGetInfo; /proc/meminfo here).

Outside its rounds each observer is frozen (SIGSTOP for processes, an Event for
threads), so it cannot leak cost into the other conditions.

Two core layouts, measured in one run: **pinned** (the engine loop on core 0, every
observer — daemon, scrapers, the exporter's and poller's threads — on the others, as in a
deployment where the sidecar has its own CPU) and **shared** (no pinning: on a 2-core host
the observers compete with the engine for its cores, the honest worst case). Ratios are
per round against the same round's ``none`` and carry a bootstrap 95 % interval over
rounds (`kvsidecar.bench.stats`); the target is met only when its upper bound is <= 1.05.
An in-process observer pinned elsewhere still shares the engine's GIL: pinning separates
CPU time, not the interpreter lock, which is the point of the comparison.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import torch

from kvsidecar.agent.agent import KVSidecarAgent
from kvsidecar.agent.pool import KVBlockPool, host_memory
from kvsidecar.bench import stats
from kvsidecar.bench.fleet import free_port, start_daemon
from kvsidecar.bench.report import percentile
from kvsidecar.protocol.schema import KVCachePoolSnapshot, RuntimeSnapshot

CONDITIONS = ("none", "kvsidecar", "prometheus_client", "locked_snapshot")
SCRAPE_HZ = 20.0
TARGET_RATIO = 1.05
LAYOUTS = ("pinned", "shared")

_SCRAPER = r"""
import sys, time, urllib.request
url, hz = sys.argv[1], float(sys.argv[2])
next_t = time.monotonic()
while True:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            r.read()
    except OSError:
        pass
    next_t += 1 / hz
    time.sleep(max(0.0, next_t - time.monotonic()))
"""

POOL_FIELDS = [
    f
    for f in KVCachePoolSnapshot.__struct_fields__
    if f not in ("pool_name", "pool_type", "integration")
]
RUNTIME_FIELDS = [
    f
    for f in RuntimeSnapshot.__struct_fields__
    if f not in ("schema_version", "engine", "engine_version", "model_name", "role", "device")
]


class Engine:
    """Fixed work per step: admit/decode/finish requests on a real pool + one matmul."""

    def __init__(self, matmul: int, pools: int = 4, device: str = "cpu") -> None:
        self.pools = [
            KVBlockPool(
                4096,
                16,
                num_layers=1,
                kv_heads=1,
                head_dim=1,
                num_kv_buffers=1,
                device=device,
                pool_name=f"pool{i}",
            )
            for i in range(pools)
        ]
        self.lock = threading.Lock()  # only taken in the locked_snapshot condition
        self.use_lock = False
        self.a = torch.randn(matmul, matmul, device=device)
        self.b = torch.randn(matmul, matmul, device=device)
        self.sync = torch.cuda.synchronize if self.a.is_cuda else (lambda: None)
        self.rng = random.Random(0)
        self.running: list[str] = []
        self.n = 0

    def _schedule(self) -> None:
        # Python scheduling work, like an engine's: admit, append, finish.
        self.n += 1
        rid = f"r{self.n}"
        prompt = [self.rng.randrange(50) for _ in range(48)]
        for p in self.pools:
            p.allocate_prompt(rid, prompt)
        self.running.append(rid)
        for r in self.running:
            for p in self.pools:
                p.append_slots(r, 1)
        if len(self.running) > 32:
            old = self.running.pop(0)
            for p in self.pools:
                p.finish(old)
        _ = sorted(self.running, key=len)  # some plain Python, as a scheduler does

    def step(self) -> None:
        if self.use_lock:
            with self.lock:
                self._schedule()
        else:
            self._schedule()
        torch.mm(self.a, self.b)
        self.sync()  # a step ends when its kernel has (a no-op on CPU)


def _locked_snapshot(engine: Engine) -> dict[str, Any]:
    # kvcached: every field read under the manager lock, and available_size() queries
    # device memory (cudaMemGetInfo, twice per pool per snapshot) while holding it. On a
    # CPU host the memory query is /proc/meminfo, the same figure our agent samples.
    with engine.lock:
        out = {}
        for p in engine.pools:
            host_memory()
            host_memory()
            out[p.stats.pool_name] = {f: getattr(p.stats, f) for f in POOL_FIELDS}
        return out


def _poller(engine: Engine, active: threading.Event, stop: threading.Event) -> None:
    while not stop.is_set():
        if not active.wait(0.1):
            continue
        _locked_snapshot(engine)
        time.sleep(1 / SCRAPE_HZ)


class CoreLayout:
    """Puts the engine thread on one core and everything observing it on the others."""

    def __init__(self, children: list[int]) -> None:
        self.all = sorted(os.sched_getaffinity(0))
        self.children = children
        self.main_tid = threading.get_native_id()

    @property
    def can_pin(self) -> bool:
        return len(self.all) >= 2

    def apply(self, layout: str) -> None:
        if layout == "pinned":
            engine, observers = {self.all[0]}, set(self.all[1:])
        else:
            engine = observers = set(self.all)
        # Linux affinity is per thread: set every thread of this process and the children.
        for tid in _tasks(os.getpid()):
            _set_affinity(tid, engine if tid == self.main_tid else observers)
        for pid in self.children:
            for tid in _tasks(pid):
                _set_affinity(tid, observers)


def _tasks(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def _set_affinity(tid: int, cores: set[int]) -> None:
    try:
        os.sched_setaffinity(tid, cores)
    except OSError:
        pass  # the thread ended meanwhile


class InProcessExporter:
    """prometheus_client in the engine process: same series, set every step."""

    def __init__(self, engine: Engine) -> None:
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        self.registry = CollectorRegistry()
        labels = ["engine", "model_name", "dp_rank", "pool"]
        self.pool_gauges = {
            f: Gauge(f"engine_kv_pool_{f}", f, labels, registry=self.registry) for f in POOL_FIELDS
        }
        self.rt_gauges = {
            f: Gauge(f"engine_runtime_{f}", f, labels[:3], registry=self.registry)
            for f in RUNTIME_FIELDS
        }
        self.port = free_port()
        start_http_server(self.port, addr="127.0.0.1", registry=self.registry)
        self.engine = engine
        self.children = {
            p.stats.pool_name: {
                f: g.labels("bench", "m", "0", p.stats.pool_name)
                for f, g in self.pool_gauges.items()
            }
            for p in engine.pools
        }
        self.rt_children = {f: g.labels("bench", "m", "0") for f, g in self.rt_gauges.items()}

    def update(self, step: int) -> None:
        for p in self.engine.pools:
            children = self.children[p.stats.pool_name]
            for f in POOL_FIELDS:
                v = getattr(p.stats, f)
                if v is not None:
                    children[f].set(v)
        self.rt_children["step"].set(step)
        self.rt_children["requests_running"].set(len(self.engine.running))


def _scraper(url: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _SCRAPER, url, str(SCRAPE_HZ)])
    proc.send_signal(signal.SIGSTOP)
    return proc


def run(
    quick: bool = False, matmul: int = 192, layouts: tuple[str, ...] = LAYOUTS
) -> dict[str, Any]:
    torch.set_num_threads(1)
    rounds = 4 if quick else 12
    steps_per_round = 400 if quick else 1500
    engine = Engine(matmul)
    shm_dir = tempfile.mkdtemp(prefix="kvsidecar-observer-", dir="/dev/shm")
    agent = KVSidecarAgent("bench", "m", shm_dir=shm_dir, device="cpu")
    for p in engine.pools:
        agent.register_pool(p)
    exporter = InProcessExporter(engine)
    agent.step()  # publish once so the daemon has a source when it comes up
    daemon, daemon_url = start_daemon(shm_dir)
    scrapers = {
        "kvsidecar": _scraper(f"{daemon_url}/metrics"),
        "prometheus_client": _scraper(f"http://127.0.0.1:{exporter.port}/metrics"),
    }
    poll_active, stop = threading.Event(), threading.Event()
    poller = threading.Thread(target=_poller, args=(engine, poll_active, stop), daemon=True)
    poller.start()
    cores = CoreLayout([daemon.pid, *(p.pid for p in scrapers.values())])
    layouts = tuple(lay for lay in layouts if lay != "pinned" or cores.can_pin)
    # per layout, per round: condition -> step times of that round
    per_round: dict[str, list[dict[str, list[float]]]] = {lay: [] for lay in layouts}
    order = list(CONDITIONS)
    rng = random.Random(1)
    try:
        daemon.send_signal(signal.SIGSTOP)
        for _ in range(200):
            engine.step()  # warm-up
        for _ in range(rounds):
            for layout in layouts:  # layouts interleaved too: both see the same host drift
                cores.apply(layout)
                rng.shuffle(order)
                this_round = {}
                for cond in order:
                    this_round[cond] = _round(
                        cond,
                        steps_per_round,
                        engine,
                        agent,
                        exporter,
                        daemon,
                        scrapers,
                        poll_active,
                    )
                per_round[layout].append(this_round)
    finally:
        stop.set()
        cores.apply("shared")
        for proc in (daemon, *scrapers.values()):
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()
        agent.close()
        os.rmdir(shm_dir)
    result: dict[str, Any] = {
        "matmul": matmul,
        "rounds": rounds,
        "steps_per_round": steps_per_round,
        "scrape_hz": SCRAPE_HZ,
        "cores": cores.all,
        "target_p99_ratio": TARGET_RATIO,
        "layouts": {lay: _summarize(per_round[lay]) for lay in layouts},
    }
    # The headline: kvsidecar with its own core, when the host has one to give.
    head = result["layouts"]["pinned" if "pinned" in layouts else "shared"]
    result["met"] = head["conditions"]["kvsidecar"]["p99_vs_none"]["met"]
    return result


def _summarize(rounds: list[dict[str, list[float]]]) -> dict[str, Any]:
    pooled = {c: [x for r in rounds for x in r[c]] for c in CONDITIONS}
    base_p50, base_p99 = percentile(pooled["none"], 50), percentile(pooled["none"], 99)
    out: dict[str, Any] = {"conditions": {}}
    for cond in CONDITIONS:
        s = pooled[cond]
        entry: dict[str, Any] = {
            "n": len(s),
            "p50_ms": percentile(s, 50) * 1e3,
            "p99_ms": percentile(s, 99) * 1e3,
            "max_ms": max(s) * 1e3,
            "p50_ratio": percentile(s, 50) / base_p50,
            "p99_ratio": percentile(s, 99) / base_p99,
        }
        if cond != "none":
            entry["p99_vs_none"] = stats.compare(rounds, cond, "none", target=TARGET_RATIO)
            entry["p50_vs_none"] = stats.compare(rounds, cond, "none", statistic=stats.p50)
        out["conditions"][cond] = entry
    return out


def _round(
    cond: str,
    steps: int,
    engine: Engine,
    agent: KVSidecarAgent,
    exporter: InProcessExporter,
    daemon: subprocess.Popen,
    scrapers: dict[str, subprocess.Popen],
    poll_active: threading.Event,
) -> list[float]:
    if cond == "kvsidecar":
        daemon.send_signal(signal.SIGCONT)
        scrapers[cond].send_signal(signal.SIGCONT)
    elif cond == "prometheus_client":
        scrapers[cond].send_signal(signal.SIGCONT)
    elif cond == "locked_snapshot":
        engine.use_lock = True
        poll_active.set()
    time.sleep(0.2)  # let the observer reach its steady state
    clock = time.perf_counter
    out = [0.0] * steps
    for i in range(steps):
        t0 = clock()
        engine.step()
        if cond == "kvsidecar":
            agent.step(len(engine.running), 0)
        elif cond == "prometheus_client":
            exporter.update(i)
        out[i] = clock() - t0
    if cond == "kvsidecar":
        scrapers[cond].send_signal(signal.SIGSTOP)
        daemon.send_signal(signal.SIGSTOP)
    elif cond == "prometheus_client":
        scrapers[cond].send_signal(signal.SIGSTOP)
    elif cond == "locked_snapshot":
        poll_active.clear()
        engine.use_lock = False
    return out
