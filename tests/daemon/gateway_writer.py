"""A real writer process for the gateway tests: every value is a function of the step.

Run as ``python -m tests.daemon.gateway_writer NAME SHM_DIR ENGINE DP_RANK ROLE PERIOD``.
It prints "ready <incarnation>" after its first publish, then publishes step 2, 3, ...
every PERIOD seconds (0: as fast as it can; ``idle:SEC``: none, only the agent's idle
heartbeat every SEC seconds). `expected(engine, step)` says what a picker
must read for a step, so a test can check a body against the step the gateway says it
served (its Kvsidecar-Step header).
"""

from __future__ import annotations

import signal
import sys
import time

from kvsidecar.agent.heartbeat import IdleHeartbeat
from kvsidecar.protocol.schema import KVCachePoolSnapshot, RuntimeSnapshot, Snapshot
from kvsidecar.protocol.writer import SegmentWriter

MODEL = "meta-llama/Llama-3.1-70B-Instruct-FP8-dynamic"  # a long, real-looking name
TOTAL = 999  # usable blocks (the null block is the 1,000th)
BLOCK = 16


def _allocated(step: int) -> int:
    return (step * 37) % (TOTAL + 1)


def build(engine: str, dp: int, role: str, step: int) -> Snapshot:
    return Snapshot(
        runtime=RuntimeSnapshot(
            engine=engine,
            model_name=MODEL,
            role=role,
            dp_rank=dp,
            dp_size=2,
            initialized=True,
            step=step,
            requests_running=step % 7,
            requests_waiting=step % 5,
        ),
        pools=[
            KVCachePoolSnapshot(
                pool_name="block_pool",
                num_layers=4,
                block_size_tokens=BLOCK,
                block_size_bytes=4096,
                total_blocks=TOTAL,
                virtual_blocks=TOTAL + 1,
                null_block_reserved=True,
                allocated_blocks=_allocated(step),
                available_blocks=TOTAL - _allocated(step),
                deferred_free_requests=step % 3,
                deferred_free_blocks=step % 3,
                oldest_deferred_free_mono_ns=0,
            )
        ],
    )


def expected(engine: str, step: int) -> dict[str, float]:
    """The picker's reading of step `step` (tests/support/picker.py `extract`)."""
    used = _allocated(step) / TOTAL
    sglang = engine == "sglang"
    # vLLM's get_usage() is 1 - free / total, which can differ from used / total in the
    # last bit: the gateway computes each engine's value as the engine does.
    usage = (
        round(used, 2)
        if sglang
        else used
        if engine == "atom"
        else 1.0 - (TOTAL - _allocated(step)) / TOTAL
    )
    return {
        "waiting": float(step % 5),
        "running": float(step % 7),
        "usage": usage,
        "block_size": float(BLOCK),
        "num_blocks": float(TOTAL if sglang else TOTAL + 1),
    }


def main() -> None:
    name, shm_dir, engine, dp, role, period = sys.argv[1:7]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with SegmentWriter(name, shm_dir=shm_dir) as w:
        step = 1
        if period.startswith("idle:"):
            # An idle engine: one step, then only the agent's own idle heartbeat thread.
            interval = float(period.removeprefix("idle:"))
            beat = IdleHeartbeat(w, interval)
            time.sleep(interval / 10)  # the engine's one step comes a while after its start
            beat.last_step_ns = time.perf_counter_ns()  # as KVSidecarAgent.step() stores it
            w.publish(build(engine, int(dp), role, step))
            print("ready", w.incarnation, flush=True)
            try:
                signal.pause()
            finally:
                beat.stop()
        w.publish(build(engine, int(dp), role, step))
        print("ready", w.incarnation, flush=True)
        while True:
            step += 1
            w.publish(build(engine, int(dp), role, step))
            if float(period) > 0:
                time.sleep(float(period))


if __name__ == "__main__":
    main()
