"""The gateway's KV-cache usage and block count over our own pool's states (issue 41 item 6).

docs/gateway.md and docs/metrics.md define, for every source served in vLLM's names,
``usage = 1 - available_blocks / total_blocks`` and ``num_gpu_blocks = total_blocks + 1``
(vLLM's ``BlockPool.get_usage()`` and label), so that ``usage = 1 - free / (num_gpu_blocks
- 1)`` holds bit for bit. Our `KVBlockPool` is where that differs from allocated / total:
reserved blocks are allocated but available, a pending shrink keeps ``total_blocks`` while
``available_blocks`` counts only up to its target, and a resize leaves ``virtual_blocks``
(the storage) apart from the capacity. A real pool is driven through random operations
(those included) with a real agent publishing each state; after each, the gateway body
(the in-process `Gateway`, read as the picker reads it) is compared with the formula
computed by brute force from the pool's own block tables, and with the daemon's /metrics.
"""

from __future__ import annotations

import random

from prometheus_client.parser import text_string_to_metric_families

from kvsidecar.agent.agent import KVSidecarAgent
from kvsidecar.agent.pool import KVBlockPool
from kvsidecar.daemon.app import Daemon
from kvsidecar.daemon.config import Discovery, Polling
from kvsidecar.daemon.gateway import Gateway
from kvsidecar.daemon.targets import TargetSet
from tests.support import picker

BLOCKS = 24
STATES = 700


def brute_force(pool: KVBlockPool) -> tuple[int, int, int]:
    """(total, allocated, available) recounted from the pool's tables, by agent/pool.py's
    definitions: allocated = blocks with a holder + the reserve ledger; available = the
    ledger + what the capacity (the shrink's target while one is pending) leaves free."""
    held = sum(1 for rc in pool._refcount[1:] if rc > 0)
    reserved = len(pool._reserve)
    allocated = held + reserved
    cap = pool._target if pool._in_shrink else pool._total
    return pool._total, allocated, reserved + max(0, cap - allocated)


def metrics_values(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("kvsidecar_kv_pool_") and sample.labels.get("pool"):
                out[sample.name] = sample.value
    return out


def operate(pool: KVBlockPool, rng: random.Random, live: list[str], deferred: list[str]) -> str:
    """One random operation; refused ones (no room) are operations too."""
    ops = ["admit"] * 4 + ["append", "finish", "finish", "release"]
    ops += ["reserve"] * 3 + ["unreserve"]
    if pool._in_shrink:  # nothing is admitted: drain, so that the shrink completes
        ops = ["finish", "release", "release", "append", "reserve", "unreserve"]
    op = rng.choice([*ops, "resize"])
    if op == "admit":
        rid = f"r{rng.randrange(10**9)}"
        prefix = [rng.choice((1, 2))] * rng.choice((0, 8, 16))
        tokens = prefix + [rng.randrange(100, 999)] * rng.randrange(1, 40)
        if pool.allocate_prompt(rid, tokens) is not None:  # the cached tokens: 0 is admitted
            live.append(rid)
    elif op == "append" and live:
        pool.append_slots(rng.choice(live), rng.randrange(1, 12))
    elif op == "finish" and live:
        rid = live.pop(rng.randrange(len(live)))
        if rng.random() < 0.5:
            pool.finish(rid, connectors=("pd",))
            deferred.append(rid)
        else:
            pool.finish(rid)
    elif op == "release" and deferred:
        pool.release(deferred.pop(0), "pd")
    elif op == "reserve":
        pool.try_to_reserve(rng.randrange(1, 6))
    elif op == "unreserve":
        pool.release_reserved(rng.randrange(1, 6))
    elif op == "resize":
        # Mostly around the start size: shrinks below what is held stay pending.
        pool.resize(rng.randrange(BLOCKS // 2, BLOCKS * 2))
    return op


def test_gateway_usage_and_block_count_are_the_documented_formula(shm_dir: str) -> None:
    rng = random.Random(41)
    pool = KVBlockPool(BLOCKS, 4, num_layers=1, kv_heads=1, head_dim=2, device="cpu")
    agent = KVSidecarAgent("kvsidecar-demo", "m", shm_dir=shm_dir, device="cpu")
    agent.register_pool(pool)
    targets = TargetSet(Discovery(shm_dir), polling=Polling(poll_interval=3600))
    daemon, gateway = Daemon(targets), Gateway(targets)
    live: list[str] = []
    deferred: list[str] = []
    seen = {"reserved": 0, "in_shrink": 0, "resized": 0, "allocated != total - available": 0}
    try:
        for state in range(STATES):
            op = operate(pool, rng, live, deferred)
            agent.step(len(live), 0)
            targets.poll_all()
            total, allocated, available = brute_force(pool)
            status, body, _, _ = gateway.answer(0)
            assert status == 200, body
            got = picker.extract(body.decode(), "vllm")
            where = f"state {state} after {op}: total {total}, allocated {allocated}, "
            where += f"available {available}, {pool.stats}"
            # The documented formula, from the pool's tables.
            assert got["usage"] == 1.0 - available / total, where
            assert got["num_blocks"] == total + 1, where
            assert got["usage"] == 1.0 - available / (got["num_blocks"] - 1), where
            # The same numbers from /metrics' own series.
            m = metrics_values(daemon.metrics("")[0].decode())
            assert m["kvsidecar_kv_pool_total_blocks"] == total, where
            assert m["kvsidecar_kv_pool_available_blocks"] == available, where
            assert got["usage"] == 1.0 - (
                m["kvsidecar_kv_pool_available_blocks"] / m["kvsidecar_kv_pool_total_blocks"]
            ), where
            # /metrics' block occupancy is the other definition (docs/metrics.md).
            assert m["kvsidecar_kv_pool_block_usage_ratio"] == allocated / total, where
            seen["reserved"] += len(pool._reserve) > 0
            seen["in_shrink"] += pool._in_shrink
            seen["resized"] += pool.stats.virtual_blocks != total + 1
            seen["allocated != total - available"] += allocated != total - available
    finally:
        targets.stop()
        agent.close()
    print(f"\n{STATES} states: {seen}")
    # The states where the definitions part were reached, each many times.
    assert all(n >= 20 for n in seen.values()), seen
