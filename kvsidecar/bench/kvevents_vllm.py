"""``bench kvevents --vllm``: what KV events cost the real vLLM 0.32 server's engine core.

Three server starts in one run, the same workload in each (`workload`: prefix-heavy,
three shared 96-token prefixes, a 64-token suffix of its own per request, 128 tokens
generated, 8 at a time, on a 96-block pool of 32 tokens that evicts all the time):

* ``none``: no KV events (neither vLLM's nor ours);
* ``publisher``: vLLM's own publisher (``--kv-events-config``: zmq, with replay), one
  subscriber reading;
* ``kvsidecar``: ``KVSIDECAR_KV_EVENTS=1`` (vLLM's publisher off), ``kvsidecar serve
  --kv-events.endpoint`` publishing, one subscriber reading.

The daemon runs in every start (the same processes around the engine). In each start,
``rounds`` rounds of the workload, alternating (order drawn per pair) with a round that
adds a stalled subscriber (a SUB that never reads and a replay DEALER asking for a replay
from 0 every 20 ms, never reading: `kvevents.Stalled`) where there are events.

Figures, per round: the engine core's CPU by thread (``/proc/<pid>/task/*/schedstat``, ns; the
threads named by a ``sitecustomize`` on the engine's path that writes each Python thread's
name to its ``comm``): its main thread (the scheduler, where both vLLM's events and our
records are built; it spins in ``sched_yield`` while it waits for the model, so the
whole process's CPU does not resolve small costs), vLLM's ``zmq-publisher`` thread, ZMQ's
I/O threads, the rest; and the engine's worker processes, if any. CPU per 1,000 block
changes (blocks stored + removed, counted by the subscriber) over the same round number
of ``none`` (the server starts cannot be interleaved: rounds are paired by number), with
95 % intervals (`stats.mean_interval`); requests/s; changes/s. System calls per step on
the engine core's main thread: ``strace -c`` on that thread alone over one extra round,
the steps from vLLM's ``vllm:iteration_tokens_total`` count; also without ``sched_yield``
(the spin while the engine waits for its worker, which moves with timing).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import zmq

from kvsidecar import settings
from kvsidecar.bench import fleet, proccount, stats
from kvsidecar.bench import kvevents as kb
from kvsidecar.bench import vllm as vb

MODES = ("none", "publisher", "kvsidecar")
THREADNAMES = Path(__file__).resolve().parent / "threadnames"
PREFIX = 96
BLOCKS = 96
SETTLE_S = 0.5
ROLES = ("main", "publisher", "zmq_io", "other", "workers", "process")


def prompts(round_: int, n: int) -> list[list[int]]:
    """Three shared 96-token prefixes, a 64-token suffix of its own per request and round."""
    out = []
    for i in range(n):
        prefix = [(37 * (i % 3) + j) % 400 + 1 for j in range(PREFIX)]
        out.append(prefix + [(11 * i + 7 * round_ + 13 * j) % 450 + 20 for j in range(64)])
    return out


def workload(port: int, round_: int, requests: int, max_tokens: int) -> float:
    """``requests`` completions, 8 at a time; returns the wall time."""

    def one(p: list[int]) -> None:
        with urllib.request.urlopen(vb.complete(port, p, max_tokens), timeout=300) as r:
            r.read()

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        list(ex.map(one, prompts(round_, requests)))
    return time.monotonic() - t0


def engine_core(server_pid: int) -> int:
    """The engine core process: the API server's descendant named EngineCore."""
    for pid in proccount.tree(server_pid)[1:]:
        for what in ("cmdline", "comm"):  # vLLM sets both titles
            try:
                with open(f"/proc/{pid}/{what}", "rb") as f:
                    if b"EngineCore" in f.read():
                        return pid
            except OSError:
                break
    raise RuntimeError(f"no EngineCore process under {server_pid}")


def _ns(path: str) -> int:
    """A task's time on the CPU so far (``schedstat``'s first field, ns: finer than
    ``stat``'s clock ticks)."""
    with open(path) as f:
        return int(f.read().split()[0])


def role(tid: int, pid: int, comm: str) -> str:
    """The engine core thread's role, from its id and name."""
    if tid == pid:
        return "main"
    if comm.startswith("zmq-publisher"):
        return "publisher"
    if comm.startswith("ZMQbg/"):
        return "zmq_io"
    return "other"


def cpu_by_role(pid: int) -> dict[str, float]:
    """The engine core's CPU (ms) so far by thread role, its worker processes', the whole."""
    out = dict.fromkeys(ROLES, 0.0)
    for tid in os.listdir(f"/proc/{pid}/task"):
        base = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{base}/comm") as f:
                comm = f.read().strip()
            ms = _ns(f"{base}/schedstat") / 1e6
        except OSError:  # the thread ended
            continue
        out[role(int(tid), pid, comm)] += ms
        out["process"] += ms
    for child in proccount.tree(pid)[1:]:
        try:
            tids = os.listdir(f"/proc/{child}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                out["workers"] += _ns(f"/proc/{child}/task/{tid}/schedstat") / 1e6
            except OSError:
                continue
    return out


def _steps(port: int) -> float:
    m = vb.scrape(f"http://127.0.0.1:{port}/metrics")
    return sum(v for _, v in m.get("vllm:iteration_tokens_total_count", []))


class Server:
    """One server start of a mode, with the daemon and the mode's sockets."""

    def __init__(self, mode: str, tmp: str, python: Path, model: str) -> None:
        self.mode = mode
        d = os.path.join(tmp, mode)
        os.makedirs(d)
        shm = os.path.join(d, "shm")
        os.mkdir(shm)
        self.port, v_pub, v_replay, s_pub, s_replay = range(fleet.free_port_run(5), 0x10000)[:5]
        env = vb.engine_env(
            cache_root=os.path.join(tmp, "vllm-cache"),
            extra_path=os.pathsep.join((str(THREADNAMES), str(vb.HELPERS))),
        )
        env[settings.SHM_DIR.name] = shm
        extra: tuple[str, ...] = ("--max-model-len", "512")
        if mode == "publisher":
            config = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{v_pub}",
                "replay_endpoint": f"tcp://*:{v_replay}",
                "topic": "vllm",
            }
            extra += ("--kv-events-config", json.dumps(config))
        if mode == "kvsidecar":
            env[settings.KV_EVENTS.name] = "1"
        self.pub, self.replay = (v_pub, v_replay) if mode == "publisher" else (s_pub, s_replay)
        self.daemon, _ = fleet.start_daemon(
            shm,
            "--kv-events.endpoint", f"tcp://127.0.0.1:{s_pub}",
            "--kv-events.replay-endpoint", f"tcp://127.0.0.1:{s_replay}",
            wait_for_source=False,
            timeout=60,
            stderr=open(os.path.join(d, "daemon.log"), "wb"),
        )  # fmt: skip
        self.server = None
        cmd = vb.server_command(python, model, self.port, num_gpu_blocks=BLOCKS, extra=extra)
        self.server = vb.start_server(cmd, env, os.path.join(d, "server.log"), timeout=300)
        self.pid = engine_core(self.server.pid)
        self.ctx = zmq.Context()

    def round(self, i: int, stalled: bool, requests: int, max_tokens: int) -> dict[str, Any]:
        sub = kb.Subscriber(self.ctx, self.pub) if self.mode != "none" else None
        bad = kb.Stalled(self.ctx, self.pub, self.replay) if stalled else None
        time.sleep(SETTLE_S)  # connected before the first event
        c0, s0 = cpu_by_role(self.pid), _steps(self.port)
        wall = workload(self.port, i, requests, max_tokens)
        c1, s1 = cpu_by_role(self.pid), _steps(self.port)
        time.sleep(SETTLE_S)  # the last events reach the subscriber
        changes = sub.close() if sub else 0
        if bad:
            bad.close()
        return {
            **{f"{k}_ms": c1[k] - c0[k] for k in ROLES},
            "wall_s": wall,
            "requests": requests,
            "steps": s1 - s0,
            "changes": changes,
        }

    def strace(self, i: int, requests: int, max_tokens: int, tmp: str) -> dict[str, Any] | None:
        """System calls of the engine core's main thread alone over one round, per step."""
        if shutil.which("strace") is None:
            return None
        path = os.path.join(tmp, f"strace-{self.mode}.txt")
        sub = kb.Subscriber(self.ctx, self.pub) if self.mode != "none" else None
        tracer = subprocess.Popen(
            ["strace", "-c", "-o", path, "-p", str(self.pid)], stderr=subprocess.DEVNULL
        )
        try:
            time.sleep(1.0)
            s0 = _steps(self.port)
            workload(self.port, i, requests, max_tokens)
            steps = _steps(self.port) - s0
        finally:
            tracer.send_signal(2)
            tracer.wait(30)
            if sub:
                sub.close()
        calls = parse_strace_c(Path(path).read_text())
        total = sum(calls.values())
        spin = calls.get("sched_yield", 0)  # waiting for the worker: moves with timing
        return {
            "steps": steps,
            "per_step": total / steps if steps else float("nan"),
            "per_step_without_sched_yield": (total - spin) / steps if steps else float("nan"),
            "calls_per_step": {k: round(v / steps, 2) for k, v in calls.items()} if steps else {},
        }

    def close(self) -> None:
        if self.server is not None:
            vb.stop_server(self.server)
        fleet.stop_daemon(self.daemon)
        self.ctx.term()


_STRACE_ROW = re.compile(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$")


def parse_strace_c(text: str) -> dict[str, int]:
    """``strace -c``'s table: calls by system call name (the total row left out)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = _STRACE_ROW.match(line)
        if m and m.group(2) != "total":
            out[m.group(2)] = int(m.group(1))
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def summarize(per_mode: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per mode and kind of round: CPU per 1,000 changes by role over ``none``'s round of
    the same number, requests/s and changes/s (medians), throughput against ``none``."""
    none = per_mode["none"]["live"]
    out: dict[str, Any] = {}
    for mode, kinds in per_mode.items():
        for kind, rows in kinds.items():
            key = mode if kind == "live" else f"{mode}+stalled"
            pairs = list(zip(none, rows))
            v: dict[str, Any] = {
                "rounds": len(rows),
                "requests_per_s": statistics.median(r["requests"] / r["wall_s"] for r in rows),
                "changes_per_round": statistics.median(r["changes"] for r in rows),
                "changes_per_s": statistics.median(r["changes"] / r["wall_s"] for r in rows),
                "throughput_vs_none": stats.mean_interval(
                    [n["wall_s"] / r["wall_s"] for n, r in pairs]
                ),
                "ms_per_round": {k: statistics.median(r[f"{k}_ms"] for r in rows) for k in ROLES},
            }
            if mode != "none":
                for k in ROLES:
                    v[f"{k}_per_1k"] = stats.mean_interval(
                        [1000 * r[f"{k}_ms"] / r["changes"] for r in rows if r["changes"]]
                    )
                    v[f"{k}_over_none_per_1k"] = stats.mean_interval(
                        [
                            1000 * (r[f"{k}_ms"] - n[f"{k}_ms"]) / r["changes"]
                            for n, r in pairs
                            if r["changes"]
                        ]
                    )
            out[key] = v
    for mode in ("publisher", "kvsidecar"):  # what the stalled clients add, paired
        live, bad = per_mode[mode]["live"], per_mode[mode].get("stalled", [])
        if bad:
            out[f"{mode}+stalled"]["vs_live"] = {
                "throughput": stats.mean_interval(
                    [a["wall_s"] / b["wall_s"] for a, b in zip(live, bad)]
                ),
                **{
                    f"{k}_ms_per_round": stats.mean_interval(
                        [b[f"{k}_ms"] - a[f"{k}_ms"] for a, b in zip(live, bad)]
                    )
                    for k in ("main", "publisher", "zmq_io", "process")
                },
            }
    return out


def run(quick: bool = False, rounds: int | None = None) -> dict[str, Any]:
    python = vb.vllm_python()
    if python is None:
        return {"skipped": "no vLLM environment (build it: bash .ci/engine-env vllm)"}
    rounds = rounds or (3 if quick else 6)
    requests, max_tokens = 48, 128
    tmp = tempfile.mkdtemp(prefix="kvsidecar-kvv-")
    per_mode: dict[str, dict[str, list[dict[str, Any]]]] = {}
    syscalls: dict[str, Any] = {}
    rng = random.Random(0)
    try:
        model = vb.write_model(os.path.join(tmp, "model"))
        for mode in MODES:
            srv = Server(mode, tmp, python, model)
            try:
                workload(srv.port, 0, 8, 8)  # warm-up, not counted
                live: list[dict[str, Any]] = []
                bad: list[dict[str, Any]] = []
                for i in range(1, rounds + 1):
                    kinds = ["live"] + (["stalled"] if mode != "none" else [])
                    rng.shuffle(kinds)
                    for kind in kinds:
                        row = srv.round(i, kind == "stalled", requests, max_tokens)
                        (live if kind == "live" else bad).append(row)
                per_mode[mode] = {"live": live, **({"stalled": bad} if bad else {})}
                syscalls[mode] = srv.strace(rounds + 1, requests, max_tokens, tmp)
            finally:
                srv.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "rounds": rounds,
        "requests_per_round": requests,
        "max_tokens": max_tokens,
        "blocks": BLOCKS,
        "conditions": summarize(per_mode),
        "syscalls": syscalls,
        "raw": per_mode,
    }


def tables(r: dict[str, Any]) -> list[tuple[str, list[str], list[list[Any]]]]:
    c = r["conditions"]
    rows = []
    for cond, v in c.items():
        if cond.split("+")[0] == "none":
            cells = ["-"] * 5
        else:
            cells = [kb._ci(v[f"{k}_per_1k"]) for k in ("main", "publisher", "zmq_io")] + [
                kb._ci(v["main_over_none_per_1k"]),
                kb._ci(v["process_over_none_per_1k"]),
            ]
        rows.append(
            [cond, *cells, round(v["requests_per_s"], 2), kb._ci(v["throughput_vs_none"], "{:.3f}"),
             round(v["changes_per_s"]), round(v["changes_per_round"])]
        )  # fmt: skip
    out = [
        (
            f"vLLM 0.32 (CPU) engine core: CPU ms per 1,000 block changes, 95% CI "
            f"({r['rounds']} rounds x {r['requests_per_round']} requests a start; rounds "
            "paired by number across the three starts)",
            ["condition", "main thread", "zmq-publisher thread", "ZMQ I/O threads",
             "main over none", "process over none", "requests/s", "throughput vs none",
             "changes/s", "changes/round"],
            rows,
        )
    ]  # fmt: skip
    st = []
    for mode in ("publisher", "kvsidecar"):
        s = c.get(f"{mode}+stalled", {}).get("vs_live")
        if s:
            st.append(
                [mode, kb._ci(s["throughput"], "{:.3f}"), kb._ci(s["main_ms_per_round"]),
                 kb._ci(s["publisher_ms_per_round"]), kb._ci(s["process_ms_per_round"])]
            )  # fmt: skip
    out.append(
        (
            "a stalled SUB + a replay DEALER that never reads, against the same start's live "
            "rounds (paired)",
            ["mode", "live/stalled wall", "main thread +ms/round", "publisher +ms/round",
             "process +ms/round"],
            st,
        )
    )  # fmt: skip
    out.append(
        (
            "system calls per step on the engine core's main thread (strace -c on it alone)",
            ["mode", "steps", "per step", "without sched_yield", "top calls per step"],
            [
                [m, "-", "-", "-", "strace not found"] if v is None else
                [m, round(v["steps"]), round(v["per_step"], 2),
                 round(v["per_step_without_sched_yield"], 2),
                 ", ".join(f"{k} {n}" for k, n in list(v["calls_per_step"].items())[:4])]
                for m, v in r["syscalls"].items()
            ],
        )
    )  # fmt: skip
    return out
