"""``kvsidecar bench cost``: what a scrape costs the engine's own processes, counted.

Wall-clock ratios cannot settle the observer claim on a host whose cores the daemon,
the scraper and other tenants share; work counters can (`proccount`). A fixed workload
runs under each condition in interleaved rounds (order shuffled per round), and the
engine's process tree is counted before and after each: CPU, context switches,
read/write syscalls, sockets. Per round, each condition's counts minus the same round's
``none`` are divided by the scrapes answered in it; the mean over rounds carries a
bootstrap 95 % interval (`stats.mean_interval`).

* demo engine (`agent/bench/cost_engine.py`, its own process): N steps of
  `observer.Engine` under none, kvsidecar at 20 and 50 Hz (agent publishing each step,
  daemon scraped from another process), the in-process prometheus_client exporter at
  20 and 50 Hz, and the kvcached-style locked snapshot at 20 Hz;
* daemon: its CPU per scrape over 1 rank x 4 pools and 8 ranks x 4 pools (scrape
  windows paired with idle windows of the same length), and the core budget at 20 and
  50 Hz that follows;
* ``--vllm`` (needs the vLLM env): the real server (API server, EngineCore) answering a
  fixed set of completions (fixed prompt, max_tokens, ignore_eos) under none,
  kvsidecar at 20/50 Hz and vLLM's own /metrics at 20/50 Hz (`cost_vllm`, `cost_server`);
* ``--sglang`` (needs the SGLang env and a checkout): the same against a real SGLang
  server, plus its /health and /health_generate latency in every round (`cost_sglang`).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

from kvsidecar.bench import health_probe, stats
from kvsidecar.bench.fleet import fleet, start_daemon, stop_daemon
from kvsidecar.bench.rounds import (
    SETTLE_S,
    Scraper,
    counted_round,
    interleaved_rounds,
    summarize,
)

DEMO_CONDITIONS = (
    "none",
    "kvsidecar@0",
    "kvsidecar@20",
    "kvsidecar@50",
    "prometheus_client@0",
    "prometheus_client@20",
    "prometheus_client@50",
    "locked_snapshot@20",
)


class LineDriven:
    """A bench engine process driven over stdin: one command a line, one JSON line back."""

    def __init__(self, cmd: list[str], what: str) -> None:
        self.what = what
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.hello = self._reply()
        self.pid = self.proc.pid

    def _reply(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"{self.what} exited (code {self.proc.wait()})")
        return json.loads(line)

    def ask(self, command: str) -> dict[str, Any]:
        self.proc.stdin.write(command + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return self._reply()

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class EngineProc(LineDriven):
    """The demo engine process (`kvsidecar.agent.bench.cost_engine`), driven over stdin."""

    def __init__(self, shm_dir: str, exporter: bool, device: str = "cpu") -> None:
        cmd = [sys.executable, "-m", "kvsidecar.agent.bench.cost_engine", shm_dir]
        cmd += ["--device", device]
        super().__init__(cmd + (["--exporter"] if exporter else []), "cost engine")

    def run(self, cond: str, steps: int, hz: float = 20.0) -> dict[str, Any]:
        return self.ask(f"{cond} {steps} {hz:g}")


def bench_demo(rounds: int, steps: int, device: str = "cpu") -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="kvsidecar-cost-", dir="/dev/shm")
    shm = os.path.join(tmp, "shm")
    os.mkdir(shm)
    engine = daemon = None
    scrapers: dict[str, Scraper] = {}
    try:
        engine = EngineProc(shm, exporter=True, device=device)
        daemon, url = start_daemon(shm)
        dport, eport = int(url.rsplit(":", 1)[1]), engine.hello["exporter_port"]
        for cond in DEMO_CONDITIONS:
            target, _, hz = cond.partition("@")
            if target in ("kvsidecar", "prometheus_client") and hz != "0":
                port = dport if target == "kvsidecar" else eport
                scrapers[cond] = Scraper(port, "/metrics", float(hz), tmp)
        per_round = interleaved_rounds(
            rounds,
            DEMO_CONDITIONS,
            lambda cond: _demo_round(engine, cond, steps, scrapers.get(cond)),
        )
    finally:
        for s in scrapers.values():
            s.close()
        if daemon is not None:
            stop_daemon(daemon)
        if engine is not None:
            engine.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "device": device,
        "rounds": rounds,
        "steps_per_round": steps,
        "conditions": summarize(per_round, DEMO_CONDITIONS),
    }


def _demo_round(
    engine: EngineProc, cond: str, steps: int, scraper: Scraper | None
) -> dict[str, float]:
    target, _, hz = cond.partition("@")

    def work() -> int | None:
        r = engine.run(target, steps, float(hz or 20))
        return r["snapshots"] if target == "locked_snapshot" else None

    return counted_round(engine.pid, work, scraper)


class Spinners:
    """Processes that spin on every core while resumed: the host under load, a control."""

    def __init__(self, n: int | None = None) -> None:
        self.procs = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(n or os.cpu_count() or 1)
        ]
        self.pause()

    def resume(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGCONT)

    def pause(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGSTOP)

    def close(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait()


def _daemon_cell(
    f: dict[str, Any], scraper: Scraper, window_s: float, spin: Spinners | None
) -> tuple[dict[str, float], dict[str, float]]:
    """One idle window and one 50 Hz scrape window of a daemon, the spinners (if any)
    running through both: the pair whose difference is the scrapes alone."""
    if spin:
        spin.resume()
    try:
        idle = counted_round(f["daemon_pid"], lambda: time.sleep(window_s), None)
        busy = counted_round(f["daemon_pid"], lambda: time.sleep(window_s), scraper)
    finally:
        if spin:
            spin.pause()
    return idle, busy


def bench_daemon(
    rounds: int, window_s: float, vs: str | None = None, host_load: bool = False
) -> dict[str, Any]:
    """The daemon's CPU per scrape (1 and 8 writer ranks x 4 pools at 100 Hz), and its idle
    cost. ``vs``: also the daemon of that source tree (`fleet.daemon_command`), both up at
    once and their windows interleaved, so host drift hits both alike. ``host_load``: each
    also with every core spun by other processes (`Spinners`) through both windows: what
    the host, not the code, does to the figure."""
    trees = {"this": None, **({"vs": vs} if vs else {})}
    loads = (False, True) if host_load else (False,)
    out: dict[str, Any] = {}
    spin = Spinners() if host_load else None
    try:
        for ranks in (1, 8):
            with contextlib.ExitStack() as stack:
                fleets = {
                    k: stack.enter_context(fleet(ranks, 4, 100.0, c)) for k, c in trees.items()
                }
                tmp = stack.enter_context(tempfile.TemporaryDirectory(dir="/dev/shm"))
                bodies, scrapers = {}, {}
                for k, f in fleets.items():
                    bodies[k] = urllib.request.urlopen(f["url"] + "/metrics").read()
                    scrapers[k] = Scraper(f["port"], "/metrics", 50.0, tmp)
                    stack.callback(scrapers[k].close)
                cells = [(k, load) for k in trees for load in loads]
                per: dict[tuple[str, bool], list] = {c: [] for c in cells}
                rng = random.Random(ranks)
                for _ in range(rounds):
                    rng.shuffle(cells)
                    for k, load in cells:
                        cell = _daemon_cell(
                            fleets[k], scrapers[k], window_s, spin if load else None
                        )
                        per[(k, load)].append(cell)
            for (k, load), pairs in per.items():
                name = f"{ranks}x4" + ("" if k == "this" else f" {k}") + (" loaded" if load else "")
                out[name] = _daemon_row(ranks, len(bodies[k]), pairs, window_s, trees[k], load)
    finally:
        if spin:
            spin.close()
    return out


def _daemon_row(
    ranks: int, body: int, per: list, window_s: float, tree: str | None, loaded: bool
) -> dict[str, Any]:
    ms = stats.mean_interval(
        [(b["cpu_ms"] - i["cpu_ms"]) / b["scrapes"] for i, b in per if b["scrapes"]]
    )
    idle_ms_s = statistics.fmean(i["cpu_ms"] for i, _ in per) / (window_s + SETTLE_S)
    return {
        "ranks": ranks,
        "pools": 4,
        "tree": tree or "this install",
        "host_load": "every core spun" if loaded else "none added",
        "body_bytes": body,
        "cpu_ms_per_scrape": ms,
        "syscalls_per_scrape": stats.mean_interval(
            [(b["syscalls"] - i["syscalls"]) / b["scrapes"] for i, b in per if b["scrapes"]]
        ),
        "idle_cpu_ms_per_s": idle_ms_s,
        # % of one core = (idle poll ms/s + Hz x ms/scrape) / 10, the upper bound used
        "core_pct": {hz: (idle_ms_s + hz * ms["ci95"][1]) / 10 for hz in (20, 50)},
    }


def run(
    quick: bool = False,
    vllm: bool = False,
    device: str = "cpu",
    vs: str | None = None,
    sglang: bool = False,
    engines_only: bool = False,
) -> dict[str, Any]:
    out: dict[str, Any] = {"quick": quick}
    if not engines_only:  # the demo engine and the daemon alone take ~5 min in full
        out["demo"] = bench_demo(
            rounds=3 if quick else 10, steps=300 if quick else 1000, device=device
        )
        out["daemon"] = bench_daemon(
            rounds=2 if quick else 6, window_s=2.0 if quick else 5.0, vs=vs, host_load=not quick
        )
    if vllm:
        from kvsidecar.bench import cost_vllm

        out["vllm"] = cost_vllm.run(quick=quick)
    if sglang:
        from kvsidecar.bench import cost_sglang

        out["sglang"] = cost_sglang.run(quick=quick)
    return out


def _cell(m: dict[str, Any], scale: float = 1.0, fmt: str = "{:.3f}") -> str:
    lo, hi = m["ci95"]
    return f"{fmt.format(m['mean'] * scale)} [{fmt.format(lo * scale)}, {fmt.format(hi * scale)}]"


ENGINE_HEADERS = [
    "condition",
    "vs",
    "scrapes/round",
    "engine CPU ms/scrape [95% CI]",
    "of it, first process (vLLM: API server)",
    "syscalls/scrape (read/write) [95% CI]",
    "ctx switches/scrape [95% CI]",
    "of them voluntary",
    "sockets",
    "processes",
]
_COLUMNS = (("cpu_ms", "{:.3f}"), ("root_cpu_ms", "{:.3f}"), ("syscalls", "{:.2f}"),
            ("ctxt", "{:.2f}"), ("voluntary_ctxt", "{:.2f}"))  # fmt: skip


def engine_rows(conditions: dict[str, Any]) -> list[list[Any]]:
    """One row per condition; an unscraped ``X@0`` row gives its cost per round instead."""
    rows = []
    for cond, v in conditions.items():
        row: list[Any] = [cond, "-" if cond == "none" else v["baseline"]]
        row.append(round(v["scrapes_per_round"], 1))
        for key, fmt in _COLUMNS:
            if cond == "none":
                row.append("-")
            elif v["scrapes_per_round"] > 0:
                row.append(_cell(v[f"{key}_per_scrape"], fmt=fmt))
            else:
                row.append(f"per round: {_cell(v[f'{key}_per_round'], fmt='{:.0f}')}")
        rows.append([*row, int(v["sockets"]), int(v["processes"])])
    return rows


def tables(r: dict[str, Any]) -> list[tuple[str, list[str], list[list[Any]]]]:
    out = []
    if d := r.get("demo"):
        out.append(
            (
                f"cost to the demo engine process ({d['device']}) per scrape answered "
                f"({d['rounds']} interleaved rounds x {d['steps_per_round']} steps; paired "
                "deltas vs the same round's none; the engine also hosts the exporter's "
                "listening socket in every condition)",
                ENGINE_HEADERS,
                engine_rows(d["conditions"]),
            )
        )
    out.extend(_daemon_table(r["daemon"]) if "daemon" in r else [])
    out.extend(_engine_tables(r))
    return out


def _daemon_table(daemon: dict[str, Any]) -> list[tuple[str, list[str], list[list[Any]]]]:
    return [
        (
            "daemon CPU per scrape (50 Hz scrape windows paired with idle windows) and the "
            "core budget (idle poll + Hz x CI upper bound)",
            ["ranks x pools", "daemon code", "host load", "body bytes", "CPU ms/scrape [95% CI]",
             "syscalls/scrape", "idle ms/s", "% core at 20 Hz", "% core at 50 Hz"],
            [
                [k.split()[0], v["tree"], v["host_load"], v["body_bytes"],
                 _cell(v["cpu_ms_per_scrape"]),
                 _cell(v["syscalls_per_scrape"], fmt="{:.1f}"), round(v["idle_cpu_ms_per_s"], 2),
                 round(v["core_pct"][20], 2), round(v["core_pct"][50], 2)]
                for k, v in daemon.items()
            ],
        )
    ]  # fmt: skip


def _engine_tables(r: dict[str, Any]) -> list[tuple[str, list[str], list[list[Any]]]]:
    out = []
    if (v := r.get("vllm")) and "skipped" not in v:
        out.append(
            (
                f"cost to vLLM's processes (API server, EngineCore) per scrape answered "
                f"({v['rounds']} rounds x {v['requests']} completions of {v['max_tokens']} "
                "tokens; paired deltas vs the same round's none)",
                ENGINE_HEADERS,
                engine_rows(v["conditions"]),
            )
        )
    if (s := r.get("sglang")) and "skipped" not in s:
        out.append(
            (
                f"cost to SGLang's processes (API server, scheduler, detokenizer) per scrape "
                f"answered ({s['rounds']} rounds x {s['requests']} generations of "
                f"{s['max_tokens']} tokens; paired deltas vs the same round's none)",
                ENGINE_HEADERS,
                engine_rows(s["conditions"]),
            )
        )
        out.append(
            (
                "SGLang health-check latency through the same rounds (/health at 20 Hz, "
                "/health_generate back to back, a new connection each; ratios paired with "
                "the same round's none)",
                health_probe.HEADERS,
                health_probe.rows(s["health"]),
            )
        )
    return out
