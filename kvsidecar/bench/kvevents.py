"""``kvsidecar bench kvevents``: what KV events cost the engine, in-engine vs from the sidecar.

Side by side in one run, on a prefix-heavy workload with evictions (the demo engine,
`agent/bench/kvevents_engine.py`: our `KVBlockPool`, 4 requests a step over shared
prefixes on a pool that fills up), in interleaved rounds (order shuffled per round, the
same workload for every condition of a round):

* ``none``: no events;
* ``publisher``: vLLM 0.32's own publisher design inside the engine (events built on the
  engine thread, a blocking put per step, a publisher thread that encodes, sends and
  serves replay), one subscriber reading;
* ``kvsidecar``: the agent's recorder into shared memory and ``kvsidecar serve
  --kv-events.*`` publishing from another process, one subscriber reading;
* ``... +stalled``: the same plus a SUB that never reads and a replay DEALER that asks
  for a replay every 20 ms and never reads the answers;
* ``kvsidecar+nosub``: no subscriber at all.

Figures: the engine's CPU per 1,000 block-level changes (blocks stored + removed +
clears) over the same round's ``none``, per thread (the engine thread; the publisher's
threads) and for the whole process, with 95 % intervals over rounds (`stats.mean_interval`);
system calls per step (``strace -f`` on the engine in a pass of its own, the engine
thread's calls counted between two marker calls around the steps); steps/s and changes/s
(medians, ratios to ``none``); the daemon's CPU per 1,000 changes and its RSS; the
KV-event segment's size per 1M blocks; and the full-state snapshot (what a new writer
incarnation or an old replay gets) for 100K (and 1M, without ``--quick``) blocks, the
bulk path (`kv_events_state`) against the per-block path it replaced, checked to give
the same bytes.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import msgspec
import zmq

from kvsidecar.bench import stats
from kvsidecar.bench.cost import LineDriven
from kvsidecar.bench.fleet import free_port, start_daemon, stop_daemon
from kvsidecar.protocol import kv_events_layout as kvl
from kvsidecar.protocol.kv_events_reader import KVEventsReader
from kvsidecar.protocol.kv_events_writer import KVEventsWriter
from kvsidecar.streams import kv_events_state
from kvsidecar.streams.kv_events_wire import AllBlocksCleared, EventBatch, KVEventBatch
from kvsidecar.streams.kv_events_zmq import MAX_EVENTS_PER_BATCH, parents_first, stored_event

CONDITIONS = (
    "none",
    "publisher",
    "publisher+stalled",
    "kvsidecar",
    "kvsidecar+stalled",
    "kvsidecar+nosub",
)
STRACE_MODES = ("none", "kvsidecar", "publisher")
SETTLE_S = 0.3
REPLAY_EVERY_S = 0.02


# -- the full-state snapshot ---------------------------------------------------------


def _fill(writer: KVEventsWriter, n: int, block_size: int) -> None:
    """n cached blocks in chains of 8 (each block the previous one's child), slots in a
    shuffled order so that the parents-first order has work to do."""
    rng = random.Random(n)
    slots = list(range(n))
    rng.shuffle(slots)
    parent = None
    for i, slot in enumerate(slots):
        h = rng.getrandbits(64)
        first = i % 8 == 0
        writer.stored(
            slot, h, None if first else parent, [(i + j) % 50_000 for j in range(block_size)],
            first=first,
        )  # fmt: skip
        parent = h


def old_full_state(reader: KVEventsReader, enc: msgspec.msgpack.Encoder) -> list[bytes]:
    """The per-block path (before kv_events_state): a Block per slot, parents_first on
    them, a BlockStored per block, batches encoded from the objects."""
    _head, _epoch, blocks = reader.cached_blocks()
    events: list[object] = [AllBlocksCleared()]
    events.extend(stored_event(reader, [b]) for b in parents_first(blocks))
    return [
        enc.encode(EventBatch(ts=0.0, events=events[i : i + MAX_EVENTS_PER_BATCH]))
        for i in range(0, len(events), MAX_EVENTS_PER_BATCH)
    ]


def new_full_state(reader: KVEventsReader, enc: msgspec.msgpack.Encoder) -> list[bytes]:
    _head, _rows, events = kv_events_state.full_state(reader)
    return [
        kv_events_state.encode_batch(enc, 0.0, events[i : i + MAX_EVENTS_PER_BATCH], None)
        for i in range(0, len(events), MAX_EVENTS_PER_BATCH)
    ]


def _timed(fn: Any, *args: Any) -> tuple[float, float, Any]:
    w0, c0 = time.perf_counter(), time.thread_time()
    out = fn(*args)
    return time.perf_counter() - w0, time.thread_time() - c0, out


def bench_snapshot(sizes: tuple[int, ...], repeats: int, block_size: int = 16) -> dict[str, Any]:
    out: dict[str, Any] = {}
    enc = msgspec.msgpack.Encoder()
    for n in sizes:
        tmp = tempfile.mkdtemp(prefix="kvsidecar-kvb-", dir="/dev/shm")
        writer = KVEventsWriter("kvevents.snap", n_slots=n, block_size=block_size, shm_dir=tmp)
        reader = KVEventsReader("kvevents.snap", shm_dir=tmp)
        try:
            _fill(writer, n, block_size)
            assert reader.attach() is None
            runs: dict[str, list[tuple[float, float]]] = {"old": [], "new": []}
            payloads = {}
            for r in range(repeats):
                for path, fn in (("old", old_full_state), ("new", new_full_state)):
                    if path == "old" and r and n > 200_000:
                        continue  # 1M on the old path: once is enough (many seconds)
                    wall, cpu, payloads[path] = _timed(fn, reader, enc)
                    runs[path].append((wall, cpu))
            out[str(n)] = {
                "blocks": n,
                "bytes": sum(map(len, payloads["new"])),
                "batches": len(payloads["new"]),
                "same_bytes": payloads["old"] == payloads["new"],
                **{
                    f"{path}_{k}": statistics.median(x[i] for x in v)
                    for path, v in runs.items()
                    for i, k in enumerate(("wall_s", "cpu_s"))
                },
                "runs": {k: len(v) for k, v in runs.items()},
            }
            out[str(n)]["speedup_cpu"] = out[str(n)]["old_cpu_s"] / out[str(n)]["new_cpu_s"]
        finally:
            reader.close()
            writer.close()
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def segment_size(blocks: int, block_size: int = 16) -> int:
    return kvl.Geometry(blocks, block_size, kvl.DEFAULT_RING_CAP, kvl.DEFAULT_NAMES).total_size


# -- the engine, its subscribers -------------------------------------------------------


class Engine(LineDriven):
    """The engine process, driven over stdin (one JSON answer a command)."""

    def __init__(self, shm: str, pub_port: int, replay_port: int) -> None:
        cmd = [sys.executable, "-m", "kvsidecar.agent.bench.kvevents_engine", shm]
        super().__init__([*cmd, str(pub_port), str(replay_port)], "kvevents engine")

    def run(self, mode: str, steps: int, seed: int) -> dict[str, Any]:
        return self.ask(f"{mode} {steps} {seed}")


def _changes(batch: KVEventBatch) -> int:
    """Blocks stored and removed (an AllBlocksCleared, the kvsidecar rounds' reset of the
    recorder before the round, is not a change of the round's workload)."""
    return sum(len(getattr(e, "block_hashes", ())) for e in batch.events)


class Subscriber:
    """One SUB that reads and decodes everything (a consumer keeping up)."""

    def __init__(self, ctx: zmq.Context, port: int) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.subscribe(b"")
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.changes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        dec = msgspec.msgpack.Decoder(KVEventBatch)
        while not self._stop.is_set():
            if self.sock.poll(50):
                self.changes += _changes(dec.decode(self.sock.recv_multipart()[2]))

    def close(self) -> int:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()
        return self.changes


class Stalled:
    """A SUB that never reads and a DEALER that asks for a replay from 0 every 20 ms and
    never reads the answers."""

    def __init__(self, ctx: zmq.Context, port: int, replay_port: int) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.subscribe(b"")
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        self.asked = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(REPLAY_EVERY_S):
            try:
                self.dealer.send_multipart((b"", (0).to_bytes(8, "big")), flags=zmq.NOBLOCK)
                self.asked += 1
            except zmq.Again:
                pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sub.close()
        self.dealer.close()


def _cpu_ms(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000.0 / os.sysconf("SC_CLK_TCK")


def _status_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _thread_split(threads_ns: dict[str, int]) -> dict[str, float]:
    """Thread CPU (ms) by role: the publisher thread, ZMQ's own threads, the rest."""
    out = {"publisher_ms": 0.0, "zmq_io_ms": 0.0, "process_ms": 0.0}
    for name, ns in threads_ns.items():
        ms = ns / 1e6
        out["process_ms"] += ms
        if name.startswith("kv-publisher/"):
            out["publisher_ms"] += ms
        elif name.startswith("ZMQbg/"):
            out["zmq_io_ms"] += ms
    return out


class Setup:
    """The engine, the daemon publishing its segment, and the sockets the conditions use."""

    def __init__(self, tmp: str) -> None:
        self.shm = os.path.join(tmp, "shm")
        os.mkdir(self.shm)
        self.ports = {k: free_port() for k in ("engine", "engine_replay", "sidecar", "replay")}
        self.ctx = zmq.Context()
        self.engine = Engine(self.shm, self.ports["engine"], self.ports["engine_replay"])
        self.daemon, _url = start_daemon(
            self.shm,
            "--kv-events.endpoint",
            f"tcp://127.0.0.1:{self.ports['sidecar']}",
            "--kv-events.replay-endpoint",
            f"tcp://127.0.0.1:{self.ports['replay']}",
            wait_for_source=False,
        )

    def round(self, cond: str, steps: int, seed: int) -> dict[str, float]:
        mode = cond.split("+")[0]
        pub, replay = (
            (self.ports["engine"], self.ports["engine_replay"])
            if mode == "publisher"
            else (self.ports["sidecar"], self.ports["replay"])
        )
        sub = Subscriber(self.ctx, pub) if mode != "none" and "nosub" not in cond else None
        stalled = Stalled(self.ctx, pub, replay) if "stalled" in cond else None
        time.sleep(SETTLE_S)  # connected before the first event
        d0 = _cpu_ms(self.daemon.pid)
        r = self.engine.run(mode, steps, seed)
        time.sleep(SETTLE_S)  # the daemon's last read of the ring
        d1 = _cpu_ms(self.daemon.pid)
        received = sub.close() if sub else 0
        if stalled:
            stalled.close()
        return {
            "engine_thread_ms": r["engine_thread_ns"] / 1e6,
            **_thread_split(r["threads_ns"]),
            "wall_s": r["wall_s"],
            "steps": r["steps"],
            "changes": r["changes"],
            "received": received,
            "daemon_ms": d1 - d0,
            "window_s": r["wall_s"] + SETTLE_S,
        }

    def strace(self, mode: str, steps: int, seed: int, tmp: str) -> dict[str, float] | None:
        """System calls of the engine's threads over ``steps`` steps of ``mode`` (with a
        subscriber reading where there are events): the engine thread's between the
        marker calls, the other threads' over the whole pass."""
        if shutil.which("strace") is None:
            return None
        path = os.path.join(tmp, f"strace-{mode}.txt")
        pub = self.ports["engine" if mode == "publisher" else "sidecar"]
        sub = Subscriber(self.ctx, pub) if mode != "none" else None
        tracer = subprocess.Popen(
            ["strace", "-f", "-qq", "-o", path, "-p", str(self.engine.pid)],
            stderr=subprocess.DEVNULL,
        )
        try:
            time.sleep(1.0)  # attached to every thread
            self.engine.run(mode, steps, seed)
        finally:
            tracer.send_signal(signal.SIGINT)
            tracer.wait(30)
            if sub:
                sub.close()
        return count_syscalls(path, int(self.engine.hello["tid"]), steps)

    def close(self) -> None:
        stop_daemon(self.daemon)
        self.engine.close()
        self.ctx.term()


_LINE = re.compile(r"^(\d+)\s+(?:<\.\.\. (\w+) resumed>|(\w+)\()")


def count_syscalls(path: str, engine_tid: int, steps: int) -> dict[str, float]:
    """From an ``strace -f`` log: the engine thread's calls between its two ``getpgid``
    markers (the markers left out), the other threads' calls, per step."""
    inside, engine, others = False, 0, 0
    names: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            m = _LINE.match(line)
            if m is None or m.group(2):  # a resumed call was counted when it started
                continue
            tid, name = int(m.group(1)), m.group(3)
            if tid == engine_tid:
                if name == "getpgid":
                    inside = not inside
                elif inside:
                    engine += 1
                    names[name] = names.get(name, 0) + 1
            else:
                others += 1
    return {
        "engine_thread_per_step": engine / steps,
        "other_threads_per_step": others / steps,
        "engine_thread_calls": dict(sorted(names.items(), key=lambda kv: -kv[1])),
    }


# -- summaries -------------------------------------------------------------------------


def summarize(per_round: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for cond in CONDITIONS:
        rows = [(r["none"], r[cond]) for r in per_round]
        changes = [max(x["changes"] for x in r.values()) for r in per_round]
        v: dict[str, Any] = {
            "changes_per_round": statistics.median(changes),
            "steps_per_s": statistics.median(c["steps"] / c["wall_s"] for _, c in rows),
            "changes_per_s": statistics.median(n / c["wall_s"] for n, (_, c) in zip(changes, rows)),
            "throughput_vs_none": stats.mean_interval(
                [none["wall_s"] / c["wall_s"] for none, c in rows]
            ),
            "received_fraction": statistics.median(
                c["received"] / n if n else 0.0 for n, (_, c) in zip(changes, rows)
            ),
        }
        if cond != "none":
            for key in ("engine_thread_ms", "publisher_ms", "zmq_io_ms", "process_ms"):
                v[f"{key}_per_1k"] = stats.mean_interval(
                    [1000 * (c[key] - none[key]) / n for n, (none, c) in zip(changes, rows) if n]
                )
        if cond.startswith("kvsidecar"):
            v["daemon_ms_per_1k"] = stats.mean_interval(
                [1000 * c["daemon_ms"] / n for n, (_, c) in zip(changes, rows) if n]
            )
            v["daemon_ms_per_s"] = statistics.median(
                c["daemon_ms"] / c["window_s"] for _, c in rows
            )
        out[cond] = v
    for mode in ("publisher", "kvsidecar"):  # what the stalled clients add, paired
        stalled = [(r[mode], r[f"{mode}+stalled"]) for r in per_round]
        out[f"{mode}+stalled"]["stalled_minus_live_process_ms_per_round"] = stats.mean_interval(
            [s["process_ms"] - live["process_ms"] for live, s in stalled]
        )
    return out


def bench_engine(rounds: int, steps: int, strace_steps: int) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="kvsidecar-kvb-", dir="/dev/shm")
    setup = None
    try:
        setup = Setup(tmp)
        setup.engine.run("kvsidecar", steps, 0)  # warm-up (imports, caches), not counted
        setup.engine.run("publisher", steps, 0)
        rng = random.Random(0)
        per_round = []
        for i in range(rounds):
            order = list(CONDITIONS)
            rng.shuffle(order)
            per_round.append({c: setup.round(c, steps, i + 1) for c in order})
        syscalls = {m: setup.strace(m, strace_steps, 1, tmp) for m in STRACE_MODES}
        daemon = {
            "rss_kib": _status_kib(setup.daemon.pid, "VmRSS"),
            "peak_rss_kib": _status_kib(setup.daemon.pid, "VmHWM"),
        }
    finally:
        if setup is not None:
            setup.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "rounds": rounds,
        "steps_per_round": steps,
        "conditions": summarize(per_round),
        "syscalls": syscalls,
        "daemon": daemon,
        "raw": per_round,
    }


def run(
    quick: bool = False,
    vllm: bool = False,
    rounds: int | None = None,
    steps: int | None = None,
    snapshot_blocks: tuple[int, ...] | None = None,
    vllm_rounds: int | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {"quick": quick, "host": host_conditions()}
    sizes = snapshot_blocks or ((100_000,) if quick else (100_000, 1_000_000))
    out["snapshot"] = bench_snapshot(sizes, 1 if quick else 3)
    out["segment_bytes_per_1m_blocks"] = segment_size(1_000_000)
    out["engine"] = bench_engine(
        rounds=rounds or (3 if quick else 10),
        steps=steps or (150 if quick else 600),
        strace_steps=50 if quick else 200,
    )
    if vllm:  # the real server: three starts (kvevents_vllm.py)
        from kvsidecar.bench import kvevents_vllm

        out["vllm"] = kvevents_vllm.run(quick=quick, rounds=vllm_rounds)
    out["host_after"] = host_conditions()
    return out


def host_conditions() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()]}


# -- tables ------------------------------------------------------------------------------


def _ci(m: dict[str, Any], fmt: str = "{:.2f}") -> str:
    lo, hi = m["ci95"]
    return f"{fmt.format(m['mean'])} [{fmt.format(lo)}, {fmt.format(hi)}]"


def _calls(names: dict[str, int]) -> str:
    return ", ".join(f"{k} {n}" for k, n in list(names.items())[:4]) or "none"


def tables(r: dict[str, Any]) -> list[tuple[str, list[str], list[list[Any]]]]:
    out = []
    e = r["engine"]
    rows = []
    keys = ("engine_thread_ms", "publisher_ms", "zmq_io_ms", "process_ms")
    for cond, v in e["conditions"].items():
        cells = ["-"] * 4 if cond == "none" else [_ci(v[f"{k}_per_1k"]) for k in keys]
        rows.append(
            [cond, *cells, round(v["steps_per_s"], 1), _ci(v["throughput_vs_none"], "{:.3f}"),
             round(v["changes_per_s"]), round(v["received_fraction"], 3),
             _ci(v["daemon_ms_per_1k"]) if "daemon_ms_per_1k" in v else "-"]
        )  # fmt: skip
    out.append(
        (
            f"engine CPU ms per 1,000 block changes over the same round's none, 95% CI "
            f"({e['rounds']} interleaved rounds x {e['steps_per_round']} steps; demo engine, "
            f"{round(e['conditions']['none']['changes_per_round'])} changes a round)",
            ["condition", "engine thread", "publisher thread", "ZMQ threads", "whole process",
             "steps/s (median)", "throughput vs none", "changes/s", "received", "daemon ms/1k"],
            rows,
        )
    )  # fmt: skip
    sc = e["syscalls"]
    out.append(
        (
            "system calls per engine step (strace -f; the engine thread between markers)",
            ["mode", "engine thread", "other threads", "engine thread's calls"],
            [
                [m, "-", "-", "strace not found"] if v is None else
                [m, round(v["engine_thread_per_step"], 3), round(v["other_threads_per_step"], 2),
                 _calls(v["engine_thread_calls"])]
                for m, v in sc.items()
            ],
        )
    )  # fmt: skip
    out.append(
        (
            "full state (snapshot) in the daemon: bulk path vs the per-block path (medians)",
            ["blocks", "MB", "batches", "old wall s", "old CPU s", "new wall s", "new CPU s",
             "CPU speed-up", "same bytes"],
            [[v["blocks"], round(v["bytes"] / 1e6, 1), v["batches"], round(v["old_wall_s"], 3),
              round(v["old_cpu_s"], 3), round(v["new_wall_s"], 4), round(v["new_cpu_s"], 4),
              round(v["speedup_cpu"], 1), v["same_bytes"]] for v in r["snapshot"].values()],
        )
    )  # fmt: skip
    d = e["daemon"]
    out.append(
        (
            "daemon and segment",
            ["daemon RSS MiB", "daemon peak RSS MiB", "segment MiB per 1M blocks (16 tokens)",
             "host CPUs", "load average"],
            [[round(d["rss_kib"] / 1024, 1), round(d["peak_rss_kib"] / 1024, 1),
              round(r["segment_bytes_per_1m_blocks"] / 2**20, 1), r["host"]["cpus"],
              " ".join(map(str, r["host"]["load_average"]))]],
        )
    )  # fmt: skip
    if (v := r.get("vllm")) and "skipped" not in v:
        from kvsidecar.bench import kvevents_vllm

        out += kvevents_vllm.tables(v)
    return out
