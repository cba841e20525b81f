"""A real SGLang 0.5.23 server on CPU for the tests (tests/engines/test_sglang_server.py).

How to start it (command, environment, the test-only `sgl_kernel` stand-in) is shared with
the benchmarks: `kvsidecar.bench.sglang`. Here: reading both sides' metrics, comparing them,
and the server's processes. kvsidecar's plugin is found by its entry point alone.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvsidecar.bench import vllm as vb
from kvsidecar.bench.sglang import STANDIN
from kvsidecar.protocol.reader import Reading, SegmentReader


def standin_problem(python: str) -> str | None:
    """Why the stand-in must go, or None: a real CPU `sgl_kernel` in the env makes it moot."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    probe = "import sgl_kernel; print(getattr(sgl_kernel, 'STANDIN', False))"
    proc = subprocess.run(
        [python, "-c", probe], env=env, capture_output=True, text=True, timeout=120, cwd="/"
    )
    if proc.returncode != 0:
        return None  # not importable: the stand-in is still needed
    return (
        "a real sgl_kernel is importable in the SGLang env: remove the test-only stand-in "
        f"({STANDIN}) and run the server on the real kernel"
    )


def post(port: int, path: str, body: dict) -> bytes:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return r.read()


def abort(port: int, rid: str) -> None:
    post(port, "/abort_request", {"rid": rid})


def sglang_live(port: int) -> dict[str, Any]:
    """SGLang's /v1/loads: the last load snapshot its scheduler published, not a reading
    taken when asked. SGLang 0.5.23 writes one to shared memory (``publish_load_snapshot``)
    after every prefill batch, every 15th decode batch (``--load-snapshot-publish-interval``),
    from ``on_idle`` at most every 0.05 s while work waits, and once fully idle; so it can
    lag the scheduler's state like the gauges do, and while paused it is the last one."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/loads", timeout=30) as r:
        (load,) = json.loads(r.read())["loads"]  # one scheduler
    return load


def _counter(m: dict, name: str, **labels: str) -> float:
    """A counter's value; 0 when SGLang has not created the series yet (it creates a
    labelled series at its first increment, and skips increments of 0)."""
    try:
        return vb.value(m, name, **labels)
    except KeyError:
        return 0.0


def sglang_values(port: int) -> dict[str, float]:
    """SGLang's own gauges (one scheduler: tp_rank 0) and the counters we mirror."""
    m = vb.scrape(f"http://127.0.0.1:{port}/metrics")
    names = (
        "num_used_tokens", "kv_used_tokens", "kv_available_tokens", "kv_evictable_tokens",
        "token_usage", "num_running_reqs", "num_queue_reqs", "max_total_num_tokens",
    )  # fmt: skip
    out = {n: vb.value(m, f"sglang:{n}", tp_rank="0") for n in names}
    # Counted by the scheduler at every prefill batch / retraction, no sampling lag.
    tokens = "sglang:realtime_tokens_total"
    out["prefill_cache"] = _counter(m, tokens, tp_rank="0", mode="prefill_cache")
    out["prefill_compute"] = _counter(m, tokens, tp_rank="0", mode="prefill_compute")
    out["retracted"] = _counter(m, "sglang:num_retracted_requests_total", tp_rank="0")
    # The P/D gauges: 0 on a unified server (no deferred release, no transfer queue).
    for n in ("num_decode_deferred_kv_release_reqs", "num_decode_transfer_queue_reqs"):
        out[n] = _counter(m, f"sglang:{n}", tp_rank="0")
    return out


def kvsidecar_values(url: str) -> dict[str, float]:
    """kvsidecar's fields for the same quantities, in SGLang's units (page size 1)."""
    m = vb.scrape(f"{url}/metrics")

    def pool(name: str) -> float:
        return vb.value(m, f"kvsidecar_kv_pool_{name}", pool="mha")

    return {
        "total": pool("total_blocks"),
        "allocated": pool("allocated_blocks"),
        "available": pool("available_blocks"),
        "cached": pool("cached_blocks"),
        "protected": pool("protected_blocks"),
        "tokens_used": pool("tokens_used"),
        "usage": pool("block_usage_ratio"),
        "running": vb.value(m, "kvsidecar_requests_running"),
        "waiting": vb.value(m, "kvsidecar_requests_waiting"),
        "preemptions": vb.value(m, "kvsidecar_preemptions_total"),
        "prefix_query": pool("prefix_query_tokens_total"),
        "prefix_hit": pool("prefix_hit_tokens_total"),
        # Deferred release (SGLang's P/D gauges' quantity): null for SGLang, so no series.
        "deferred_series": float(
            len(m.get("kvsidecar_requests_deferred_free", []))
            + len(m.get("kvsidecar_kv_pool_deferred_free_requests", []))
        ),
    }


def counter_pairs(theirs: dict[str, float], ours: dict[str, float]) -> list[tuple]:
    """(SGLang's name, SGLang's value, ours) for the counters: prefix-cache tokens matched
    (``prefill_cache``) and looked up (matched + computed: SGLang's ``prefill_compute``,
    which would add SWA replays: none on this model), and retracted requests."""
    query = theirs["prefill_cache"] + theirs["prefill_compute"]
    return [
        ("realtime_tokens_total{prefill_cache}", theirs["prefill_cache"], ours["prefix_hit"]),
        ("realtime_tokens_total{prefill_cache+prefill_compute}", query, ours["prefix_query"]),
        ("num_retracted_requests_total", theirs["retracted"], ours["preemptions"]),
    ]


def mismatches(theirs: dict[str, float], ours: dict[str, float]) -> list[str]:
    """Every kvsidecar field against SGLang's series; [] when all agree exactly."""
    pairs = [
        ("max_total_num_tokens", theirs["max_total_num_tokens"], ours["total"]),
        ("num_used_tokens", theirs["num_used_tokens"], ours["allocated"]),
        ("kv_used_tokens", theirs["kv_used_tokens"], ours["allocated"]),
        ("num_used_tokens/tokens_used", theirs["num_used_tokens"], ours["tokens_used"]),
        ("kv_evictable_tokens", theirs["kv_evictable_tokens"], ours["cached"]),
        ("kv_available_tokens", theirs["kv_available_tokens"], ours["available"] - ours["cached"]),
        ("num_running_reqs", theirs["num_running_reqs"], ours["running"]),
        ("num_queue_reqs", theirs["num_queue_reqs"], ours["waiting"]),
        # SGLang rounds token_usage to 2 decimals.
        ("token_usage", theirs["token_usage"], round(ours["usage"], 2)),
        *counter_pairs(theirs, ours),
    ]
    return [f"{n}: sglang {a} kvsidecar {b}" for n, a, b in pairs if a != b]


def scheduler_pids(server_pid: int) -> list[int]:
    """The server's scheduler processes (SGLang titles them ``sglang::scheduler``)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == server_pid and "scheduler" in cmd:
            out.append(int(d.name))
    return out


def model_dir(directory: Path) -> str:
    return vb.write_model(directory)


def stop(proc: subprocess.Popen) -> None:
    vb.stop_server(proc, timeout=60)


# Under load: SGLang's gauge -> kvsidecar's field, both in SGLang's units (page size 1).
LAGGED = (
    ("num_used_tokens", "allocated"),
    ("kv_evictable_tokens", "cached"),
    ("num_running_reqs", "running"),
    ("num_queue_reqs", "waiting"),
)


def _log_states(shm_dir: str, name: str, stop: Any, conn: Any) -> None:
    """`StateLog`'s reader, in its own process: the test's threads (a scrape of SGLang's
    70 KB /metrics is parsed in Python) hold the GIL for milliseconds, time in which a
    reader thread missed one-step states (seen: SGLang reported used 996 while the log had
    992 and 1000)."""
    reader = SegmentReader(name, shm_dir=shm_dir)
    assert reader.attach() is None
    states: list[list[Any]] = []
    full: list[list[Any]] = []
    while not stop.is_set():
        r = reader.read()
        if isinstance(r, Reading):
            p, rt = r.snapshot.pools[0], r.snapshot.runtime
            key = (p.allocated_blocks, p.cached_blocks, rt.requests_running, rt.requests_waiting)
            now = time.monotonic()  # CLOCK_MONOTONIC: the same clock in every process
            if states and states[-1][0] == key:
                states[-1][2] = now
            else:
                states.append([key, now, now])
            # Every field SGLang's gauges are compared with (`classify_pairs`).
            # With the record's step counter: a step gap between two entries means states
            # this log never saw (`classify_pairs` then cannot tell).
            whole = (*key, p.available_blocks, p.tokens_used, p.total_blocks)
            step = rt.step
            if full and full[-1][0] == whole and step <= full[-1][4] + 1:
                full[-1][2], full[-1][4] = now, step
            else:
                full.append([whole, now, now, step, step])
        time.sleep(0.0005)
    reader.close()
    conn.send((states, full))
    conn.close()


class StateLog:
    """Every distinct state kvsidecar's record went through, read straight from the segment
    about 1,000 times a second by a process of its own (a scheduler step takes milliseconds
    here, so no state is missed for long): ``states``: [(used, evictable, running, queued),
    first seen, last seen]; ``full``: the same with (..., available, tokens_used, total).
    Filled when the block ends. The daemon's /metrics serves the same record; a 20 Hz scrape
    of it would see only some of the states, too few to hold SGLang's reports against."""

    def __init__(self, shm_dir: Path, name: str) -> None:
        self.states: list[list[Any]] = []
        self.full: list[list[Any]] = []
        ctx = multiprocessing.get_context("fork")
        self._stop = ctx.Event()
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=_log_states, args=(str(shm_dir), name, self._stop, send), daemon=True
        )
        self._send = send

    def __enter__(self) -> StateLog:
        self._proc.start()
        self._send.close()
        time.sleep(0.2)  # attached before the block's load starts
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._recv.poll(30):
            self.states, self.full = self._recv.recv()
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()


def unexplained_reports(
    states: list[list[Any]], sglang: list[tuple[float, float, dict]], slack: float = 0.25
) -> tuple[list[str], int, float]:
    """SGLang's reports that kvsidecar's record never showed when SGLang made them.

    SGLang's gauges lag: a report is the state at one step (a prefill, or every 40th decode
    step) and stays on /metrics until the next. So each new report seen in SGLang's series
    (scrapes as (start, end, values)), its four values together, must equal one state of
    kvsidecar's record (`StateLog`) that was current between the start of SGLang's previous
    scrape, which did not show it yet, and the end of the one that did; ``slack`` covers the
    threads' scheduling on a loaded host. Returns the reports that match no such state, how
    many reports there were, and SGLang's longest gap between reports (its sampling lag)."""
    bad, reports, lag = [], 0, 0.0
    last_change = sglang[0][1] if sglang else 0.0
    for (s0, _, a), (_, u, b) in itertools.pairwise(sglang):
        key = tuple(b[n] for n, _ in LAGGED)
        if key == tuple(a[n] for n, _ in LAGGED):
            continue
        reports += 1
        lag, last_change = max(lag, u - last_change), u
        lo, hi = s0 - slack, u + slack
        if not any(k == key and first <= hi and last >= lo for k, first, last in states):
            near = [(k, round(f - s0, 2), round(e - s0, 2)) for k, f, e in states if k == key]
            bad.append(f"SGLang {key} between {s0:.2f} and {u:.2f}: kvsidecar's at {near}")
    return bad, reports, lag


# Every SGLang gauge compared under load: (SGLang's name, kvsidecar's value from a daemon
# scrape, the same field of a `StateLog.full` state: (used, evictable, running, queued,
# available, tokens_used, total), all as kvsidecar's record held them, page size 1).
FIELDS: list[tuple[str, Any, Any]] = [
    ("max_total_num_tokens", lambda o: o["total"], lambda k: k[6]),
    ("num_used_tokens", lambda o: o["allocated"], lambda k: k[0]),
    ("kv_used_tokens", lambda o: o["allocated"], lambda k: k[0]),
    ("num_used_tokens/tokens_used", lambda o: o["tokens_used"], lambda k: k[5]),
    ("kv_evictable_tokens", lambda o: o["cached"], lambda k: k[1]),
    ("kv_available_tokens", lambda o: o["available"] - o["cached"], lambda k: k[4] - k[1]),
    # SGLang rounds token_usage to 2 decimals; the daemon's ratio is used / total.
    ("token_usage", lambda o: round(o["usage"], 2), lambda k: round(k[0] / k[6], 2)),
    ("num_running_reqs", lambda o: o["running"], lambda k: k[2]),
    ("num_queue_reqs", lambda o: o["waiting"], lambda k: k[3]),
]


def classify_pairs(
    states: list[list[Any]],
    pairs: list[tuple[float, float, dict, dict]],
    slack: float = 0.25,
) -> dict[str, Any]:
    """Each (SGLang scrape, kvsidecar scrape) pair taken together, field by field: ``exact``
    (kvsidecar's /metrics shows SGLang's value), ``lag`` (it does not, but kvsidecar's record
    held SGLang's value within SGLang's sampling period: while SGLang made the report on
    show, i.e. between the start of the last scrape before the report appeared and the end
    of the first scrape that showed it, ``slack`` for thread scheduling),
    ``unobserved`` (not that, but `StateLog` missed steps in the window: on this loaded
    2-core host its reader is sometimes not scheduled for a few scheduler steps, so SGLang's
    value may be one of the unseen states), or ``unexplained`` (every step in the window
    seen, none held SGLang's value). ``pairs``: (start, end, SGLang's `sglang_values`,
    `kvsidecar_values`), in time order; ``states``: `StateLog.full`."""
    fields = FIELDS
    counts = {n: {"exact": 0, "lag": 0, "unobserved": 0, "unexplained": 0} for n, _, _ in fields}
    whole = {"exact": 0, "lag": 0, "unobserved": 0, "unexplained": 0}
    bad: list[str] = []
    report_key, lo, hi = None, float("-inf"), 0.0
    prev_start = float("-inf")
    for s0, u, theirs, ours in pairs:
        key = tuple(theirs[n.split("/")[0]] for n, _, _ in fields)
        if key != report_key:  # a new SGLang report: made since the previous scrape began
            report_key, lo, hi = key, prev_start, u
        prev_start = s0
        near = [e for e in states if e[1] <= hi + slack and e[2] >= lo - slack]
        window = [e[0] for e in near]
        # Every step in the window seen? (each entry starts one step after the last ended)
        complete = all(b[3] <= a[4] + 1 for a, b in itertools.pairwise(near))
        all_exact = True
        for name, from_ours, from_state in fields:
            want = theirs[name.split("/")[0]]  # "a/b": SGLang's a against our b
            if from_ours(ours) == want:
                counts[name]["exact"] += 1
            elif any(from_state(k) == want for k in window):
                counts[name]["lag"] += 1
                all_exact = False
            elif not complete:  # SGLang's value may be one of the steps the log missed
                counts[name]["unobserved"] += 1
                all_exact = False
            else:
                counts[name]["unexplained"] += 1
                all_exact = False
                if len(bad) < 10:
                    seen = sorted({from_state(k) for k in window})[:20]
                    bad.append(
                        f"{name}: sglang {want} kvsidecar {from_ours(ours)}; kvsidecar's "
                        f"states in [{lo:.2f}, {hi:.2f}]: {seen}"
                    )
        if all_exact:
            whole["exact"] += 1
        else:
            ok = all(
                from_ours(ours) == w or any(from_state(k) == w for k in window)
                for w, (_, from_ours, from_state) in zip(key, fields, strict=True)
            )
            whole["lag" if ok else "unobserved" if not complete else "unexplained"] += 1
    return {"scrapes": len(pairs), "all_fields": whole, "fields": counts, "problems": bad}
