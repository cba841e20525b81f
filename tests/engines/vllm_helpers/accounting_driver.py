"""Drive an in-process vLLM `LLM` through a randomized workload and, after every engine step
(and every abort), compare what kvsidecar published -- read back from the shared-memory
segment with our SegmentReader -- with a brute-force recount over ``BlockPool.blocks`` and
``Scheduler.requests``. Prints one JSON line: steps checked, mismatches, what happened.

Run inside the vLLM env by tests/engines/test_vllm_accounting.py:
    python accounting_driver.py --model-dir D --steps N --seed S
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import TINY_LLAMA, engine_env, llm_kwargs, recount_pool, write_model

BLOCK = 32
NUM_GPU_BLOCKS = 64


def recount(sched) -> dict:
    """Every published pool/runtime field, recounted from vLLM's own objects."""
    fields, deferred, blocks_of = recount_pool(sched, sched.kv_cache_manager.block_pool)
    running, waiting = sched.get_request_counts()
    return {
        **fields,
        # A deferred request counts only while it holds a block (issue 30 item 3).
        "runtime.requests_deferred_free": len(blocks_of),
        "runtime.requests_running": running,
        "runtime.requests_waiting": waiting,
        "_deferred_ids": [r.request_id for r in deferred],
        "_blocks_of": blocks_of,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    os.environ.update(engine_env())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process

    import kvsidecar_hold_connector as hold
    from vllm import LLM, SamplingParams

    from kvsidecar.protocol.reader import ReadError, SegmentReader

    rng = random.Random(args.seed)
    t_start = time.monotonic()
    llm = LLM(
        **llm_kwargs(
            write_model(args.model_dir),
            num_gpu_blocks_override=NUM_GPU_BLOCKS,
            max_num_seqs=8,
            max_num_batched_tokens=512,
            disable_log_stats=False,  # vLLM's own prefix counters, to compare ours with
            seed=args.seed,
            kv_transfer_config={
                "kv_connector": "HoldConnector",
                "kv_connector_module_path": "kvsidecar_hold_connector",
                "kv_role": "kv_producer",
            },
        )
    )
    ready_s = time.monotonic() - t_start
    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    sidecar = getattr(sched, "_kvsidecar", None)
    if sidecar is None:
        print(json.dumps({"error": f"plugin not active: scheduler is {type(sched).__name__}"}))
        return 2
    reader = SegmentReader(path=sidecar.agent.segment_path)
    err = reader.attach()
    if err is not None:
        print(json.dumps({"error": f"attach: {err}"}))
        return 2

    cfg = TINY_LLAMA
    block_bytes = BLOCK * cfg["num_key_value_heads"] * cfg["head_dim"] * 4  # fp32
    static = {
        "pool_name": "block_pool",
        "group_id": 0,
        "num_layers": cfg["num_hidden_layers"],
        "num_kv_buffers": 2,
        "block_size_tokens": BLOCK,
        "block_size_bytes": block_bytes,
        "total_blocks": NUM_GPU_BLOCKS - 1,
        # The storage, null block included (schema.md), not the capacity.
        "virtual_blocks": NUM_GPU_BLOCKS,
        "virtual_per_layer_bytes": NUM_GPU_BLOCKS * block_bytes * 2,
        "virtual_total_bytes": NUM_GPU_BLOCKS * block_bytes * 2 * cfg["num_hidden_layers"],
        "tokens_used": None,  # not exact in O(1) for vLLM: unsupported, not a fake 0
        "prefix_queries_total": None,  # vLLM counts tokens, not blocks
        "prefix_hits_total": None,
        "reserved_blocks": 0,
    }
    unit = block_bytes * cfg["num_hidden_layers"] * 2
    mismatches: list[str] = []
    deferred_window: dict[str, tuple[int, int]] = {}  # id -> (before, after) of its deferral
    # Deferrals that ended (a request holding blocks left the deferred set) and their blocks.
    holding_blocks: dict[str, int] = {}
    ended = {"deferred_free_ended_total": 0, "deferred_free_ended_blocks_total": 0}
    held_ns = [0, 0]  # bounds of their summed hold times
    checks = steps = 0
    last_step = -1
    seen = {
        "max_deferred_requests": 0,
        "max_deferred_blocks": 0,
        "max_cached": 0,
        "shared_deferred_blocks": 0,
        "aborts": 0,
        "releases": 0,
        "added": 0,
    }

    def check(where: str, t0: int, t1: int, engine_step: bool | None) -> None:
        nonlocal checks, last_step
        r = reader.read()
        if isinstance(r, ReadError):
            mismatches.append(f"{where}: read failed: {r}")
            return
        snap = r.snapshot
        rt, (p,) = snap.runtime, snap.pools
        want = recount(sched)
        for rid in want["_deferred_ids"]:
            deferred_window.setdefault(rid, (t0, t1))
        for rid in list(holding_blocks):
            if rid not in want["_blocks_of"]:
                ended["deferred_free_ended_total"] += 1
                ended["deferred_free_ended_blocks_total"] += holding_blocks.pop(rid)
                # Its hold began inside the window it was first seen in, ended inside this one.
                began = deferred_window[rid]
                held_ns[0] += t0 - began[1]
                held_ns[1] += t1 - began[0]
        for rid in list(deferred_window):
            if rid not in want["_deferred_ids"]:
                del deferred_window[rid]
        holding_blocks.update(want["_blocks_of"])
        want.update(ended)
        # The hold connector reports no lease expiry: the expiry fields are unsupported.
        for k in ("total", "blocks_total", "ns_total"):
            want[f"deferred_free_expired_{k}"] = None
        ns = p.deferred_free_ended_ns_total
        if ns is None or not held_ns[0] <= ns <= held_ns[1]:
            mismatches.append(f"{where}: ended_ns_total {ns} outside {held_ns}")
        got = {k: getattr(p, k) for k in want if not k.startswith(("_", "runtime."))}
        got.update({k: getattr(rt, k.split(".", 1)[1]) for k in want if k.startswith("runtime.")})
        got.update({k: getattr(p, k) for k in static})
        want.update(static)
        want["allocated_bytes"] = want["allocated_blocks"] * unit
        want["available_bytes"] = want["available_blocks"] * unit
        got["allocated_bytes"], got["available_bytes"] = p.allocated_bytes, p.available_bytes
        # Counters: allocs - frees is exactly the allocated set; vLLM's own prefix counters.
        want["allocs-frees"] = want["allocated_blocks"]
        got["allocs-frees"] = p.allocs_total - p.frees_total
        metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
        want["prefix_query_tokens_total"] = int(metrics.get("vllm:prefix_cache_queries", -1))
        want["prefix_hit_tokens_total"] = int(metrics.get("vllm:prefix_cache_hits", -1))
        got["prefix_query_tokens_total"] = p.prefix_query_tokens_total
        got["prefix_hit_tokens_total"] = p.prefix_hit_tokens_total
        want["usage"] = round(sched.kv_cache_manager.usage, 12)
        got["usage"] = round(p.allocated_blocks / p.total_blocks, 12)
        for k, v in want.items():
            if not k.startswith("_") and got.get(k) != v:
                mismatches.append(f"{where}: {k} published {got.get(k)!r}, recount {v!r}")
        # schema.md: mapped_bytes never exceeds the reservation (here they are one storage).
        if p.mapped_bytes != p.virtual_total_bytes:
            mismatches.append(
                f"{where}: mapped_bytes {p.mapped_bytes} != virtual_total_bytes "
                f"{p.virtual_total_bytes}"
            )
        # The oldest deferral: 0 when none, else inside the oldest request's window.
        oldest = p.oldest_deferred_free_mono_ns
        wins = [deferred_window[i] for i in want["_deferred_ids"] if i in deferred_window]
        if want["deferred_free_requests"] == 0 and oldest != 0:
            mismatches.append(f"{where}: oldest_deferred_free_mono_ns {oldest} with none deferred")
        holding = [
            deferred_window[i]
            for i in want["_deferred_ids"]
            if i in deferred_window and _holds(sched, i)
        ]
        if holding:
            lo, hi = min(w[0] for w in holding), min(w[1] for w in holding)
            if not lo <= oldest <= hi:
                mismatches.append(f"{where}: oldest {oldest} outside [{lo}, {hi}]")
        del wins
        # An engine step publishes once (vLLM skips the step when it has no requests);
        # a between-step publish (abort) keeps the step number.
        expect = last_step + (1 if engine_step else 0)
        if last_step >= 0 and rt.step != expect:
            mismatches.append(f"{where}: step {rt.step}, expected {expect}")
        last_step = rt.step
        seen["max_deferred_requests"] = max(
            seen["max_deferred_requests"], want["deferred_free_requests"]
        )
        seen["max_deferred_blocks"] = max(seen["max_deferred_blocks"], want["deferred_free_blocks"])
        seen["max_cached"] = max(seen["max_cached"], want["cached_blocks"])
        shared = sum(
            b.ref_cnt > 1
            for b in sched.kv_cache_manager.block_pool.blocks
            if not b.is_null and b.block_id in _deferred_block_ids(sched)
        )
        seen["shared_deferred_blocks"] = max(seen["shared_deferred_blocks"], shared)
        checks += 1

    # Shared prefixes (prefix hits, blocks shared by live and deferred requests); enough
    # distinct content that the 63-block pool must evict cached blocks and preempt.
    prefixes = [[rng.randrange(3, 1000) for _ in range(n)] for n in (64, 96, 40, 128, 72, 100)]
    live: list[str] = []
    next_id = 0
    draining = False
    t0 = time.monotonic_ns()
    check("start", t0, time.monotonic_ns(), engine_step=False)
    while True:
        if steps >= args.steps and not draining:
            draining = True
        if not draining and rng.random() < 0.5 and len(live) < 16:
            n = rng.randint(1, 2)
            for _ in range(n):
                prompt = list(rng.choice(prefixes)) if rng.random() < 0.8 else []
                prompt += [rng.randrange(3, 1000) for _ in range(rng.randint(1, 110))]
                rid = f"r{next_id}"
                next_id += 1
                params = SamplingParams(
                    max_tokens=rng.randint(1, 64), ignore_eos=True, detokenize=False
                )
                engine.add_request(rid, {"prompt_token_ids": prompt}, params)
                live.append(rid)
                seen["added"] += 1
        if not draining and live and rng.random() < 0.08:
            rid = live.pop(rng.randrange(len(live)))
            t0 = time.monotonic_ns()
            engine.abort_request([rid])
            seen["aborts"] += 1
            check(f"abort {rid}", t0, time.monotonic_ns(), engine_step=False)
        deferred = [r.request_id for r in sched.requests.values() if r.is_finished()]
        if deferred and (draining or rng.random() < 0.25):
            rng.shuffle(deferred)
            k = len(deferred) if draining else rng.randint(1, len(deferred))
            hold.RELEASE.update(deferred[:k])
            seen["releases"] += k
        if draining and not sched.requests:
            break
        had_requests = sched.has_requests()
        t0 = time.monotonic_ns()
        outs = engine.step()
        steps += 1
        check(f"step {steps}", t0, time.monotonic_ns(), engine_step=had_requests)
        for o in outs:
            if o.finished and o.request_id in live:
                live.remove(o.request_id)
        if steps > args.steps * 4:
            mismatches.append("workload did not drain")
            break
    final = reader.read()
    p = final.snapshot.pools[0]
    result = {
        "steps": steps,
        "checks": checks,
        "mismatches": len(mismatches),
        "first_mismatches": mismatches[:20],
        "ready_s": round(ready_s, 1),
        "run_s": round(time.monotonic() - t_start, 1),
        "scheduler_class": type(sched).__name__,
        "role": final.snapshot.runtime.role,
        "engine": final.snapshot.runtime.engine,
        "engine_version": final.snapshot.runtime.engine_version,
        "model_name": final.snapshot.runtime.model_name,
        "evictions_total": p.evictions_total,
        "alloc_failures_total": p.alloc_failures_total,
        "allocs_total": p.allocs_total,
        "prefix_query_tokens_total": p.prefix_query_tokens_total,
        "prefix_hit_tokens_total": p.prefix_hit_tokens_total,
        "mapped_bytes": p.mapped_bytes,
        **seen,
    }
    print("RESULT " + json.dumps(result), flush=True)
    reader.close()
    return 0


def _blocks_of(sched, rid: str) -> list:
    manager = sched.kv_cache_manager
    return [
        b
        for m in manager.coordinator.single_type_managers
        for b in m.req_to_blocks.get(rid, ())
        if not b.is_null
    ]


def _holds(sched, rid: str) -> bool:
    return bool(_blocks_of(sched, rid))


def _deferred_block_ids(sched) -> set[int]:
    return {
        b.block_id
        for r in sched.requests.values()
        if r.is_finished()
        for b in _blocks_of(sched, r.request_id)
    }


if __name__ == "__main__":
    sys.exit(main())
