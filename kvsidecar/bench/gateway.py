"""``kvsidecar bench gateway``: what an endpoint picker's polls cost, engine vs sidecar.

An endpoint picker polls every engine endpoint every 50 ms per picker replica: 20 replicas
make 400 polls a second per engine (GIE #189). Side by side in one run, in interleaved,
shuffled rounds while the engine works (`bench cost`'s machinery): the engine's own
/metrics and kvsidecar's gateway endpoint, each polled at 20/s and at 400/s by a poller
process holding 20 kept-alive connections (one per picker replica, round robin). Counted
per poll answered, against the same round's unpolled baseline: the engine processes' CPU,
read/write syscalls and context switches (/proc, `proccount`), the daemon's CPU, the body's
bytes, and for the gateway the freshness (the step it says it served, Kvsidecar-Step,
against the step the segment held just before the request was sent).

* demo engine (default): `bench cost`'s engine process, publishing through the agent in the
  gateway conditions and setting its in-process prometheus_client gauges (its own /metrics)
  in the engine ones;
* ``--vllm``: the real vLLM server answering a fixed set of completions in every round,
  the plugin publishing in every condition;
* the gateway path under attack on the main port: `frontmix` (TLS RSA-4096: pipelining,
  slow readers, a ClientHello replay) and `scrapeflood` (40 keep-alive scrapers), with a
  picker polling the gateway at 20/s: answered share, p50, p99;
* the gateway port itself flooded (`flooded`), from addresses other than the picker's
  (127.0.0.2 and up): `idleflood` (connections opened as fast as they are taken, never a
  byte sent) and `pipeline` (16 clients each pipelining 64 polls at a time); a picker on 4
  kept-alive connections from 127.0.0.1 at 20/s (1 s timeout, a redial after a failure, as
  Go's transport): answered share, p50, p99, and the daemon's share of a core.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from kvsidecar.bench import checkout, cost, fleet, proccount, stats
from kvsidecar.bench.rounds import Scraper, counted_round, interleaved_rounds
from kvsidecar.bench.rounds import summarize as summarize_rounds

PICKERS = 20  # picker replicas: one kept-alive connection each
RATES = (20, 400)  # polls per second: one replica at 20 Hz; 20 replicas
FRESH_TARGET = 0.99
CORE_TARGET_PCT = 2.0
DAEMON_MS_TARGET = 0.05
BODY_TARGET = 1024

# The picker process: PICKERS kept-alive connections polled round robin at HZ in total (as
# fast as answers come when the server cannot keep up). Counts in a file it maps, so the
# benchmark reads them without a syscall into the engine: answered, fresh, checked, bytes.
# With a segment path it reads the segment's step before each request (freshness).
_PICKER = r"""
import http.client, mmap, struct, sys, time
port, path, hz, n, counter, segment = sys.argv[1:7]
port, hz, n = int(port), float(hz), int(n)
reader = None
if segment != "-":
    from kvsidecar.protocol.reader import SegmentReader
    reader = SegmentReader(path=segment)
    if reader.attach() is not None:
        reader = None
with open(counter, "r+b") as f:
    m = mmap.mmap(f.fileno(), 32)
conns = [None] * n
ok = fresh = checked = nbytes = 0
i, nxt = 0, time.monotonic()
while True:
    before = None
    if reader is not None:
        r = reader.read()
        before = None if isinstance(r, Exception) else r.snapshot.runtime.step
    try:
        conns[i] = conns[i] or http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conns[i].request("GET", path)
        resp = conns[i].getresponse()
        body = resp.read()
        if resp.status == 200:
            ok += 1
            nbytes += len(body)
            served = resp.getheader("Kvsidecar-Step")
            if before is not None and served is not None:
                checked += 1
                fresh += int(served) >= before
            struct.pack_into("QQQQ", m, 0, ok, fresh, checked, nbytes)
    except (OSError, http.client.HTTPException):
        if conns[i] is not None:
            conns[i].close()
        conns[i] = None
    i = (i + 1) % n
    nxt = max(nxt + 1 / hz, time.monotonic() - 1 / hz)
    time.sleep(max(0.0, nxt - time.monotonic()))
"""


class Picker(Scraper):
    """A picker process for one (port, Hz), stopped (SIGSTOP) until resumed; pause, resume
    and close as `rounds.Scraper`'s."""

    def __init__(self, port: int, hz: float, tmp: str, segment: str | None = None) -> None:
        self.counter = os.path.join(tmp, f"picker-{port}-{hz:g}")
        with open(self.counter, "wb") as f:
            f.write(bytes(32))
        args = [str(port), "/metrics", str(hz), str(PICKERS), self.counter, segment or "-"]
        self.proc = subprocess.Popen([sys.executable, "-c", _PICKER, *args])
        self.proc.send_signal(signal.SIGSTOP)

    def counts(self) -> tuple[int, int, int, int]:
        with open(self.counter, "rb") as f:
            raw = f.read(32)
        return tuple(int.from_bytes(raw[k : k + 8], "little") for k in range(0, 32, 8))  # type: ignore[return-value]

    @property
    def answered(self) -> int:
        return self.counts()[0]


def counted(
    engine_pid: int, daemon_pid: int, work: Callable[[], Any], picker: Picker | None
) -> dict[str, float]:
    """One round: the engine tree's counters (`rounds.counted_round`), the daemon's CPU, and
    what the picker got (polls answered, fresh of checked, bytes)."""
    d0 = proccount.counters(daemon_pid)["cpu_ms"]
    c0 = picker.counts() if picker else (0, 0, 0, 0)
    t0 = time.monotonic()
    out = counted_round(engine_pid, lambda: _work_none(work), picker)  # type: ignore[arg-type]
    out["seconds"] = time.monotonic() - t0
    c1 = picker.counts() if picker else (0, 0, 0, 0)
    out["daemon_cpu_ms"] = proccount.counters(daemon_pid)["cpu_ms"] - d0
    out["scrapes"], fresh, checked, nbytes = (float(b - a) for a, b in zip(c0, c1))
    out["fresh"], out["checked"] = fresh, checked
    out["bytes_per_poll"] = nbytes / out["scrapes"] if out["scrapes"] else 0.0
    return out


def _work_none(work: Callable[[], Any]) -> None:
    work()  # the picker's own count is what was served: counted_round must not use work's


def summarize(rounds: list[dict[str, dict[str, float]]], conditions: tuple[str, ...]) -> dict:
    """`rounds.summarize` per condition plus the daemon's CPU per poll (against the same
    round's baseline), polls per second, bytes per poll and freshness."""
    out = summarize_rounds(rounds, conditions)
    for cond in conditions:
        base = out[cond]["baseline"]
        polled = [r[cond] for r in rounds if r[cond]["scrapes"] > 0]
        if cond == "none" or not polled:
            continue
        out[cond]["daemon_cpu_ms_per_poll"] = stats.mean_interval(
            [(r[cond]["daemon_cpu_ms"] - r[base]["daemon_cpu_ms"]) / r[cond]["scrapes"]
             for r in rounds if r[cond]["scrapes"] > 0]
        )  # fmt: skip
        out[cond]["polls_per_s"] = statistics.fmean(x["scrapes"] / x["seconds"] for x in polled)
        out[cond]["bytes_per_poll"] = statistics.fmean(x["bytes_per_poll"] for x in polled)
        checked = sum(x["checked"] for x in polled)
        out[cond]["fresh_fraction"] = sum(x["fresh"] for x in polled) / checked if checked else None
    return out


DEMO_CONDITIONS = (
    "none",
    "kvsidecar@0",
    "kvsidecar@20",
    "kvsidecar@400",
    "prometheus_client@0",
    "prometheus_client@20",
    "prometheus_client@400",
)
VLLM_CONDITIONS = ("none", "kvsidecar@20", "kvsidecar@400", "vllm@20", "vllm@400")


def _gateway_daemon(
    shm: str, *extra: str, context: Any = None
) -> tuple[subprocess.Popen, int, int]:
    gport = fleet.free_port()
    daemon, url = fleet.start_daemon(
        shm, "--gateway.listen-address", f"127.0.0.1:{gport}", *extra, timeout=60, context=context
    )
    return daemon, int(url.rsplit(":", 1)[1]), gport


def bench_demo(rounds: int, steps: int) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="kvsidecar-gw-", dir="/dev/shm")
    shm = os.path.join(tmp, "shm")
    os.mkdir(shm)
    engine = daemon = None
    pickers: dict[str, Picker] = {}
    try:
        engine = cost.EngineProc(shm, exporter=True)
        daemon, _, gport = _gateway_daemon(shm)
        eport = engine.hello["exporter_port"]
        segment = os.path.join(shm, engine.hello["segment"])
        for cond in DEMO_CONDITIONS:
            target, _, hz = cond.partition("@")
            if hz and hz != "0":
                gateway = target == "kvsidecar"
                port = gport if gateway else eport
                pickers[cond] = Picker(port, float(hz), tmp, segment if gateway else None)

        def one(cond: str) -> dict[str, float]:
            target, _, hz = cond.partition("@")
            return counted(
                engine.pid,
                daemon.pid,
                lambda: engine.run(target, steps, float(hz or 20)),
                pickers.get(cond),
            )

        per_round = interleaved_rounds(rounds, DEMO_CONDITIONS, one)
    finally:
        for p in pickers.values():
            p.close()
        if daemon is not None:
            fleet.stop_daemon(daemon)
        if engine is not None:
            engine.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "engine": "demo",
        "rounds": rounds,
        "steps_per_round": steps,
        "conditions": summarize(per_round, DEMO_CONDITIONS),
    }


def bench_vllm(rounds: int, requests: int, max_tokens: int) -> dict[str, Any]:
    import concurrent.futures
    from pathlib import Path

    from kvsidecar import settings
    from kvsidecar.bench import vllm

    python = vllm.vllm_python()
    if python is None:
        return {"skipped": "no vLLM environment (build it: bash .ci/engine-env vllm)"}
    tmp = tempfile.mkdtemp(prefix="kvsidecar-gw-vllm-")
    env = vllm.engine_env(cache_root=os.path.join(tmp, "vllm-cache"))
    shm = os.path.join(tmp, "shm")
    os.makedirs(shm)
    env[settings.SHM_DIR.name] = shm
    env["OMP_WAIT_POLICY"] = "PASSIVE"  # CPU time counts work, not spinning (bench cost)
    port = fleet.free_port()
    model = vllm.write_model(Path(tmp) / "bench-model", **vllm.BENCH_MODEL)
    server = vllm.start_server(
        vllm.server_command(python, model, port, num_gpu_blocks=512), env, Path(tmp) / "log"
    )
    daemon = None
    pickers: dict[str, Picker] = {}
    pool = concurrent.futures.ThreadPoolExecutor(cost_clients := 4)
    try:
        daemon, _, gport = _gateway_daemon(shm)
        segment = os.path.join(shm, sorted(os.listdir(shm))[0])
        for cond in VLLM_CONDITIONS[1:]:
            target, _, hz = cond.partition("@")
            gateway = target == "kvsidecar"
            pickers[cond] = Picker(
                gport if gateway else port, float(hz), tmp, segment if gateway else None
            )
        engine_bytes = len(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read())

        work = vllm.fixed_completions(port, requests, max_tokens, pool, timeout=300)

        work()  # warm-up
        per_round = interleaved_rounds(
            rounds,
            VLLM_CONDITIONS,
            lambda cond: counted(server.pid, daemon.pid, work, pickers.get(cond)),
        )
    finally:
        pool.shutdown()
        for p in pickers.values():
            p.close()
        if daemon is not None:
            fleet.stop_daemon(daemon)
        vllm.stop_server(server)
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "engine": "vllm",
        "rounds": rounds,
        "requests": requests,
        "max_tokens": max_tokens,
        "clients": cost_clients,
        "engine_metrics_bytes": engine_bytes,
        "conditions": summarize(per_round, VLLM_CONDITIONS),
    }


# -- the gateway path while the main port is attacked ----------------------------------------


@contextlib.contextmanager
def _writer_and_daemon(
    *extra: str, context: Any = None
) -> Iterator[tuple[subprocess.Popen, int, int, str]]:
    shm = tempfile.mkdtemp(prefix="kvsidecar-gw-front-", dir="/dev/shm")
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    writer = ctx.Process(target=fleet.writer_main, args=(shm, 1, 4, 100.0, ready, stop))
    writer.start()
    daemon = None
    try:
        if not ready.wait(60):
            raise RuntimeError("benchmark writer did not start")
        daemon, port, gport = _gateway_daemon(shm, *extra, context=context)
        yield daemon, port, gport, shm
    finally:
        if daemon is not None:
            fleet.stop_daemon(daemon)
        stop.set()
        writer.join(10)
        if writer.is_alive():
            writer.kill()
        shutil.rmtree(shm, ignore_errors=True)


def _gateway_poll(front: ModuleType, port: int) -> tuple[bool, float]:
    return front._probe(port, "/metrics", None, timeout=1.0)  # the picker's 1 s poll timeout


def under_attack(quick: bool, front: ModuleType) -> dict[str, Any]:
    """The gateway polled at 20/s (each poll a new connection: the worst case for the
    server) beside frontmix and then scrapeflood on the main port; and with nothing.
    ``front``: the checkout's tests/attacks/hostile_front (`checkout.load`)."""
    sample, _summary = front.sample, front._summary

    seconds = 8.0 if quick else 30.0
    slow_readers = 300 if quick else 1200
    front._raise_nofile(slow_readers + 512)  # type: ignore[attr-defined]
    out: dict[str, Any] = {"seconds": seconds, "timeout_s": 1.0}
    with tempfile.TemporaryDirectory(prefix="kvsidecar-bench-") as tmp:
        cert, key = front.rsa_self_signed(tmp)
        config = front.web_config_for(tmp, cert, key)
        ctx = front.ssl.create_default_context(cafile=cert)
        with _writer_and_daemon("--web.config.file", config, context=ctx) as (
            daemon,
            port,
            gport,
            _,
        ):
            out["quiet"] = _summary(sample(lambda: _gateway_poll(front, gport), seconds / 2, 0.05))
            attacks = [
                front.Pipeliners(port, 20, ctx),
                front.SlowReaders(port, slow_readers, ctx),
                front.HelloReplay(port, front.canned_client_hello(ctx)),
            ]
            for a in attacks:
                a.start()
            time.sleep(3.0)
            cpu0, t0 = fleet.proc_stat(daemon.pid)[1], time.monotonic()
            polls = sample(lambda: _gateway_poll(front, gport), seconds, 0.05)
            main = sample(lambda: front._probe(port, "/-/healthy", ctx, timeout=5.0), 2.0, 0.2)  # type: ignore[attr-defined]
            out["frontmix_daemon_cpu_pct"] = (
                100 * (fleet.proc_stat(daemon.pid)[1] - cpu0) / (time.monotonic() - t0)
            )
            for a in attacks:
                a.stop()
            out["frontmix"] = _summary(polls)
            out["frontmix_main_probes"] = _summary(main)
    with _writer_and_daemon() as (daemon, port, gport, _):
        flood = front.KeepAliveScrapers(port, 40).start()
        time.sleep(2.0)
        polls = sample(lambda: _gateway_poll(front, gport), seconds, 0.05)
        flood.stop()
        out["scrapeflood"] = _summary(polls)
    for k in ("quiet", "frontmix", "scrapeflood"):
        s = out[k]
        s["answered_fraction"] = s["ok"] / max(1, s["requests"])
    return out


# A flood of the gateway port from 127.0.0.2..: MODE idle (connections held, nothing sent,
# reopened when closed) or pipeline (CLIENTS connections, each sending 64 polls at a time
# and reading the 64 answers). Runs until killed.
_FLOOD = r"""
import selectors, socket, sys
port, mode, clients = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
sel = selectors.DefaultSelector()
REQ = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
def dial(i):
    s = socket.socket()
    s.setblocking(False)
    s.bind(("127.0.0.%d" % (2 + i % 200), 0))
    try:
        s.connect(("127.0.0.1", port))
    except BlockingIOError:
        pass
    except OSError:
        s.close()
        return
    st = {"i": i, "got": 0}
    sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE, st)
for i in range(clients):
    dial(i)
while True:
    for key, mask in sel.select(1.0):
        s, st = key.fileobj, key.data
        if mask & selectors.EVENT_WRITE:
            sel.modify(s, selectors.EVENT_READ, st)
            if mode == "pipeline":
                try:
                    s.send(REQ * 64)
                except OSError:
                    pass
            continue
        try:
            data = s.recv(65536)
        except OSError:
            data = b""
        if not data:
            sel.unregister(s)
            s.close()
            dial(st["i"])
            continue
        if mode == "pipeline":
            st["got"] += data.count(b"HTTP/1.1 ")
            if st["got"] >= 64:
                st["got"] -= 64
                try:
                    s.send(REQ * 64)
                except OSError:
                    pass
"""
FLOODS = {"idleflood": ("idle", 1000), "pipeline": ("pipeline", 16)}


def _kept_alive_picker(port: int, seconds: float, hz: float = 20.0) -> dict[str, Any]:
    """4 kept-alive connections polled round robin at `hz`, 1 s timeout, a redial after a
    failure: answered share and latency percentiles."""
    import http.client

    conns: list[http.client.HTTPConnection | None] = [None] * 4
    lat, ok, n, i = [], 0, 0, 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        t0 = time.monotonic()
        n += 1
        try:
            c = conns[i] or http.client.HTTPConnection("127.0.0.1", port, timeout=1.0)
            conns[i] = c
            c.request("GET", "/metrics")
            r = c.getresponse()
            r.read()
            ok += r.status == 200
        except (OSError, http.client.HTTPException):
            if conns[i] is not None:
                conns[i].close()  # type: ignore[union-attr]
            conns[i] = None
        lat.append(1000 * (time.monotonic() - t0))
        i = (i + 1) % len(conns)
        time.sleep(max(0.0, t0 + 1 / hz - time.monotonic()))
    for c in conns:
        if c is not None:
            c.close()
    lat.sort()
    return {
        "requests": n,
        "ok": ok,
        "answered_fraction": ok / max(1, n),
        "p50_ms": lat[len(lat) // 2],
        "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))],
        "max_ms": lat[-1],
    }


def flooded(quick: bool) -> dict[str, Any]:
    """The gateway port flooded (`FLOODS`) beside a picker; and quiet."""
    import resource

    seconds = 10.0 if quick else 30.0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4096)), hard))
    out: dict[str, Any] = {"seconds": seconds}
    with _writer_and_daemon() as (daemon, _port, gport, _):
        out["quiet"] = _kept_alive_picker(gport, seconds / 2)
        for name, (mode, clients) in FLOODS.items():
            flood = subprocess.Popen([sys.executable, "-c", _FLOOD, str(gport), mode, str(clients)])
            try:
                time.sleep(2.0)
                cpu0, t0 = fleet.proc_stat(daemon.pid)[1], time.monotonic()
                out[name] = _kept_alive_picker(gport, seconds)
                cpu = fleet.proc_stat(daemon.pid)[1] - cpu0
                out[name]["daemon_core_fraction"] = cpu / (time.monotonic() - t0)
            finally:
                flood.kill()
                flood.wait()
            time.sleep(1.0)
    return out


def run(quick: bool = False, vllm: bool = False) -> dict[str, Any]:
    front = checkout.load("hostile_front")  # first: without a checkout, nothing runs
    out: dict[str, Any] = {"quick": quick, "pickers": PICKERS, "rates": list(RATES)}
    out["demo"] = bench_demo(rounds=3 if quick else 8, steps=300 if quick else 1500)
    if vllm:
        out["vllm"] = bench_vllm(*((2, 8, 16) if quick else (6, 16, 32)))
    out["attack"] = under_attack(quick, front)
    out["flooded"] = flooded(quick)
    return out


def _cell(m: dict[str, Any] | None, fmt: str = "{:.3f}") -> str:
    return "-" if m is None else cost._cell(m, fmt=fmt)  # type: ignore[attr-defined]


def tables(r: dict[str, Any]) -> list[tuple[str, list[str], list[list[Any]]]]:
    out = []
    for key in ("demo", "vllm"):
        part = r.get(key)
        if not part or "skipped" in part:
            continue
        rows = []
        for cond, m in part["conditions"].items():
            target, _, hz = cond.partition("@")
            if not hz or hz == "0":
                continue
            side = "kvsidecar gateway" if target == "kvsidecar" else "engine /metrics"
            daemon_ms = m.get("daemon_cpu_ms_per_poll") if target == "kvsidecar" else None
            fresh = m.get("fresh_fraction")
            rows.append([
                side, hz, f"{m['polls_per_s']:.0f}",
                _cell(m.get("cpu_ms_per_scrape")),
                _cell(m.get("syscalls_per_scrape"), "{:.1f}"),
                _cell(m.get("ctxt_per_scrape"), "{:.2f}"),
                _cell(daemon_ms, "{:.4f}"),
                f"{m['bytes_per_poll']:.0f}",
                "-" if fresh is None else f"{fresh:.2%}",
            ])  # fmt: skip
        out.append((
            f"gateway polls, {part['engine']} engine ({part['rounds']} rounds; per poll "
            "answered, mean [95 % CI] against the unpolled round)",
            ["polled", "offered/s", "answered/s", "engine CPU ms", "engine syscalls",
             "engine ctxt", "daemon CPU ms", "bytes", "fresh"],
            rows,
        ))  # fmt: skip
    a = r["attack"]
    out.append((
        f"gateway polls (20/s, new connection each, 1 s timeout) while the main port is "
        f"attacked, {a['seconds']:.0f} s",
        ["main port", "polls", "answered", "p50 ms", "p99 ms", "max ms"],
        [[k, a[k]["requests"], f"{a[k]['answered_fraction']:.1%}", f"{a[k]['p50_ms']:.1f}",
          f"{a[k]['p99_ms']:.1f}", f"{a[k]['max_ms']:.1f}"]
         for k in ("quiet", "frontmix", "scrapeflood")],
    ))  # fmt: skip
    f = r.get("flooded")
    if f:
        out.append((
            f"gateway polls (20/s, 4 kept-alive connections, 1 s timeout) while the gateway "
            f"port is flooded from other addresses, {f['seconds']:.0f} s",
            ["gateway port", "polls", "answered", "p50 ms", "p99 ms", "max ms", "daemon core"],
            [[k, f[k]["requests"], f"{f[k]['answered_fraction']:.1%}", f"{f[k]['p50_ms']:.1f}",
              f"{f[k]['p99_ms']:.1f}", f"{f[k]['max_ms']:.1f}",
              "-" if "daemon_core_fraction" not in f[k] else f"{f[k]['daemon_core_fraction']:.2f}"]
             for k in ("quiet", *FLOODS)],
        ))  # fmt: skip
    return out
