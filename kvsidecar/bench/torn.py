"""Torn-read stress: a writer publishing at full speed against reader processes.

Every field of snapshot k is derived from k, so a reader can tell a mix of two
snapshots apart from a whole one *without* the CRC: `check_snapshot` recomputes
the expected snapshot from one field and compares all of them. Used by the
stress test (short) and ``kvsidecar bench torn`` (long).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

from kvsidecar.protocol.reader import Reading, SegmentReader
from kvsidecar.protocol.schema import KVCachePoolSnapshot, RuntimeSnapshot, Snapshot
from kvsidecar.protocol.writer import SegmentWriter

N_POOLS = 4


def make_snapshot(k: int) -> Snapshot:
    """Snapshot number k; every numeric field a distinct function of k."""
    runtime = RuntimeSnapshot(
        engine="stress",
        model_name=f"m{k % 7}",
        step=k,
        requests_running=k % 1000,
        requests_waiting=(k * 3) % 997,
        requests_deferred_free=(k * 7) % 991,
        device_total_bytes=k * 11,
        device_free_bytes=k * 5,
        publish_errors_total=k // 3,
        last_publish_duration_ns=k % 4099,
    )
    pools = [
        KVCachePoolSnapshot(
            pool_name=f"pool{i}",
            total_blocks=k + i,
            allocated_blocks=(k * 13 + i) % 100003,
            reserved_blocks=(k + 2 * i) % 17,
            available_blocks=(k * 17 + i) % 100019,
            cached_blocks=(k + i) % 4093,
            allocated_bytes=k * 4096 + i,
            deferred_free_requests=(k + i) % 31,
            deferred_free_blocks=(k * 5 + i) % 1021,
            tokens_used=k * 16 + i,
            allocs_total=k * 2 + i,
            frees_total=k * 2 - 1 + i,
            in_shrink=bool((k + i) & 1),
        )
        for i in range(N_POOLS)
    ]
    return Snapshot(runtime=runtime, pools=pools)


def check_snapshot(snapshot: Snapshot) -> bool:
    """True iff the snapshot is exactly make_snapshot(step): no field from another step."""
    return snapshot == make_snapshot(snapshot.runtime.step)


# Startup allowance on top of the stress time: spawning a process that imports the
# protocol takes well under a second, ~10 s on a loaded CI machine.
START_TIMEOUT = 30.0


def writer_main(
    name: str, shm_dir: str, seconds: float, ready: Any = None, done: Any = None
) -> int:
    """Publish as fast as possible until `done` is set (or for `seconds` without one);
    returns the number of publishes.

    Payloads are pre-encoded (a ring of 4096 distinct snapshots) so the loop
    is nothing but the latch: the writer laps readers as often as it can. The writer
    outlives the readers (the parent sets `done` once they reported): a writer that left
    on its own clock could go before a slow-starting reader attached, and that reader
    would wait for a segment that never comes back.
    """
    from kvsidecar.protocol.schema import encode_snapshot

    ring = [encode_snapshot(make_snapshot(k)) for k in range(1, 4097)]
    with SegmentWriter(name, shm_dir=shm_dir) as writer:
        publish = writer.publish_bytes
        publish(ring[0])
        if ready is not None:
            ready.set()
        deadline = time.monotonic() + seconds
        n = 1
        while time.monotonic() < deadline and not (done is not None and done.is_set()):
            for payload in ring:
                publish(payload)
            n += len(ring)
        return n


def reader_main(name: str, shm_dir: str, seconds: float, queue: Any) -> None:
    reads = retries = torn = errors = 0
    last_seq = 0
    reader = SegmentReader(name, shm_dir=shm_dir)
    give_up = time.monotonic() + START_TIMEOUT
    while reader.attach() is not None:
        if time.monotonic() > give_up:  # bounded: never wait forever for the segment
            queue.put({"error": f"reader could not attach to {name} in {START_TIMEOUT:g}s"})
            return
        time.sleep(0.001)
    deadline = time.monotonic() + seconds
    while True:  # at least one batch, however short `seconds` is
        for _ in range(64):
            result = reader.read()
            if isinstance(result, Reading):
                reads += 1
                retries += result.attempts - 1
                if not check_snapshot(result.snapshot) or result.seq < last_seq:
                    torn += 1
                last_seq = result.seq
            else:
                errors += 1
        if time.monotonic() >= deadline:
            break
    reader.close()
    queue.put({"reads": reads, "retries": retries, "torn_accepted": torn, "errors": errors})


def run(seconds: float = 5.0, readers: int = 2, shm_dir: str = "/dev/shm") -> dict[str, Any]:
    """Run one writer and `readers` reader processes; return aggregate counts.

    Ends within ``seconds + 2 * START_TIMEOUT`` whatever happens: every wait is bounded,
    and a process that overran is killed. Raises RuntimeError when a process failed.
    """
    ctx = mp.get_context("spawn")
    name = f"kvsidecar.torn.{os.getpid()}.{time.monotonic_ns() % 100000}"
    ready, done = ctx.Event(), ctx.Event()
    queue = ctx.Queue()
    # The writer's own clock is only a backstop for a parent that died.
    cap = seconds + 4 * START_TIMEOUT
    writer = ctx.Process(target=writer_main, args=(name, shm_dir, cap, ready, done))
    procs: list[Any] = []
    try:
        writer.start()
        # The readers start now too (each waits, bounded, for the segment): their start-up,
        # a spawned interpreter's imports, overlaps the writer's instead of following it.
        procs = [
            ctx.Process(target=reader_main, args=(name, shm_dir, seconds, queue))
            for _ in range(readers)
        ]
        for p in procs:
            p.start()
        if not ready.wait(START_TIMEOUT):
            raise RuntimeError("stress writer did not start")
        end = time.monotonic() + seconds + START_TIMEOUT
        results = []
        for _ in procs:
            try:
                results.append(queue.get(timeout=max(0.1, end - time.monotonic())))
            except Exception as e:  # queue.Empty: a reader hung or died
                raise RuntimeError("a stress reader did not report in time") from e
        failed = [r["error"] for r in results if "error" in r]
        if failed:
            raise RuntimeError(failed[0])
    finally:
        done.set()
        for p in [*procs, writer]:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    total = {k: sum(r[k] for r in results) for k in results[0]}
    total.update(seconds=seconds, readers=readers)
    return total
