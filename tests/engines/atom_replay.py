"""Replays a trace recorded from ATOM's real ``EngineCore.busy_loop`` through the adapter.

A trace (``atom_traces/*.json.gz``, our own data, recorded as docs/atom.md says) is the list
of what happened, in order:

* ``set`` / ``pop``: a change of ATOM's ``Scheduler.deferred_free_blocks`` (key, and the
  request's block table at insert);
* ``publish`` with ``tag`` ``step`` (after ``postprocess``) or ``xfer`` (after
  ``_update_from_kv_xfer_finished``): ATOM's scheduler state then (pool counters, cached
  blocks recounted by brute force, running/waiting, preemptions, prefix-cache totals) and
  the deferred counts by PR #3238's method (``len`` + a block mask) and by a brute-force set;
* ``publish`` with ``tag`` ``push``: ATOM's own ``collect_metrics()`` values at a metrics push,
  which the segment (last published before it) must equal.

The replay drives `DeferredFrees` with the same operations, a stand-in scheduler with the
recorded counters, and the real agent, segment and reader; it returns every mismatch.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvsidecar.agent.agent import KVSidecarAgent
from kvsidecar.agent.engines.atom import AtomPoolSource, AtomSidecar, DeferredFrees
from kvsidecar.protocol.reader import SegmentReader

TRACES = Path(__file__).parent / "atom_traces"


def load(name: str) -> list[dict[str, Any]]:
    with gzip.open(TRACES / f"{name}.json.gz", "rt") as f:
        return json.load(f)


def trace_names() -> list[str]:
    return sorted(p.name.removesuffix(".json.gz") for p in TRACES.glob("*.json.gz"))


class _Scheduler:
    """The attributes of ATOM's Scheduler the adapter reads, set from the trace."""

    def __init__(self, block_size: int, clock: Any) -> None:
        self.block_manager = SimpleNamespace(
            kv=SimpleNamespace(num_used=0, num_free=0, num_blocks=0, _cached={})
        )
        self.deferred_free_blocks = DeferredFrees(clock=clock)
        self.cache_stats = SimpleNamespace(total_full_tokens=0, total_cached_tokens=0)
        self.config = SimpleNamespace(kv_cache_block_size=block_size)
        self.counts = (0, 0)
        self.total_preemptions = 0

    def get_request_counts(self) -> tuple[int, int]:
        return self.counts

    def set_state(self, e: dict[str, Any]) -> None:
        kv = self.block_manager.kv
        kv.num_used, kv.num_free = e["kv"]["num_used"], e["kv"]["num_free"]
        kv.num_blocks = e["kv"]["num_blocks"]
        kv._cached = dict.fromkeys(range(e["kv"]["cached"]))
        self.cache_stats.total_full_tokens = e["cache"]["full_tokens"]
        self.cache_stats.total_cached_tokens = e["cache"]["cached_tokens"]
        self.counts = (e["running"], e["waiting"])
        self.total_preemptions = e["preemptions"]


def replay(trace: list[dict[str, Any]], shm_dir: str) -> tuple[list[str], dict[str, int]]:
    """(mismatches, counts) of replaying `trace` through the adapter into a real segment."""
    meta = trace[0]
    now = [0]  # the index of the current operation: our clock, and the expected ages' too
    sched = _Scheduler(meta["block_size"], clock=lambda: now[0])
    agent = KVSidecarAgent("atom", "trace", shm_dir=shm_dir, segment_name="kvsidecar.atom.replay")
    source = AtomPoolSource(sched)
    assert agent.register_pool(source)
    sidecar = AtomSidecar(agent, source)
    reader = SegmentReader(path=agent.segment_path)
    assert reader.attach() is None
    # As AtomSidecar.attach: one publish when the scheduler is built (the first record's state).
    sched.set_state(next(e for e in trace if e["op"] == "publish"))
    sidecar.publish(sched, engine_step=False)
    since: dict[Any, int] = {}  # key -> when it began deferring, kept independently
    mismatches: list[str] = []
    counts = {"sets": 0, "pops": 0, "publishes": 0, "pushes": 0, "compared": 0}
    try:
        for i, e in enumerate(trace[1:], 1):
            now[0] = i
            op = e["op"]
            if op == "set":
                sched.deferred_free_blocks[e["key"]] = SimpleNamespace(block_table=e["blocks"])
                since.setdefault(e["key"], i)
                counts["sets"] += 1
                continue
            if op == "pop":
                sched.deferred_free_blocks.pop(e["key"], None)
                since.pop(e["key"], None)
                counts["pops"] += 1
                continue
            if e["tag"] != "push":
                sched.set_state(e)
                sidecar.publish(sched, engine_step=e["tag"] == "step")
                counts["publishes"] += 1
            else:
                counts["pushes"] += e.get("repeat", 1)  # identical pushes in a row: one record
            oldest = min(since.values()) if since else 0
            for problem in _compare(reader, e, oldest):
                mismatches.append(f"#{i} {e['tag']} step {e['step']}: {problem}")
            counts["compared"] += 1
    finally:
        reader.close()
        agent.close()
    return mismatches, counts


def _compare(reader: SegmentReader, e: dict[str, Any], oldest: int) -> list[str]:
    r = reader.read()
    if not hasattr(r, "snapshot"):
        return [f"read failed: {r}"]
    pool, rt = r.snapshot.pools[0], r.snapshot.runtime
    want = {
        "pool.allocated_blocks": e["kv"]["num_used"],
        "pool.available_blocks": e["kv"]["num_free"],
        "pool.total_blocks": e["kv"]["num_blocks"],
        "pool.cached_blocks": e["kv"]["cached"],
        "pool.deferred_free_requests": e["expect"]["requests"],
        "pool.deferred_free_blocks": e["expect"]["blocks_pr3238"],
        "pool.oldest_deferred_free_mono_ns": oldest,
        "pool.prefix_query_tokens_total": e["cache"]["full_tokens"],
        "pool.prefix_hit_tokens_total": e["cache"]["cached_tokens"],
        "runtime.requests_running": e["running"],
        "runtime.requests_waiting": e["waiting"],
        "runtime.requests_deferred_free_distinct": e["expect"]["requests"],
        "runtime.preemptions_total": e["preemptions"],
    }
    atom = e.get("atom")
    if atom is not None:  # ATOM's own collect_metrics() at this push
        want["pool.allocated_blocks"] = atom["kv_blocks_used"]
        want["pool.available_blocks"] = atom["kv_blocks_free"]
        want["pool.total_blocks"] = atom["kv_blocks_total"]
        want["runtime.requests_running"] = atom["requests_running"]
        want["runtime.requests_waiting"] = atom["requests_waiting"]
        want["runtime.preemptions_total"] = atom["preemptions"]
    problems = []
    if e["expect"]["blocks_brute"] != e["expect"]["blocks_pr3238"]:
        problems.append("recorded brute-force and PR #3238 counts differ")
    for name, value in want.items():
        ours = getattr(pool if name.startswith("pool.") else rt, name.partition(".")[2])
        if ours != value:
            problems.append(f"{name} published {ours}, expected {value}")
    return problems
