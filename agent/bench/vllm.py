"""In-engine halves of ``kvsidecar bench vllm`` (run inside the vLLM env, by
kvsidecar/bench/vllm.py; this is the only bench module that imports vLLM).

``python -m kvsidecar.agent.bench.vllm engine --model-dir D``: an in-process `LLM` (plugin
on, or off with KVSIDECAR_DISABLE=1) that runs one workload per ``round`` line on stdin and
prints one JSON line per round (tokens/s, per-step wall time). Two of these, one with and
one without the plugin, are driven alternately so host noise hits both alike.

``python -m kvsidecar.agent.bench.vllm adapter``: snapshot()+publish cost per step of the
adapter over real vLLM ``BlockPool`` objects of 64 and 100,001 blocks, and the per-block
cost of the mutation hooks (``get_new_blocks``/``free_blocks`` with vs without them).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def engine_main(model_dir: str, requests: int, prompt_len: int, max_tokens: int) -> int:
    from vllm import LLM, SamplingParams

    from kvsidecar.bench.vllm import llm_kwargs

    llm = LLM(**llm_kwargs(model_dir, num_gpu_blocks_override=512, max_num_seqs=requests, seed=0))
    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    plugin = getattr(sched, "_kvsidecar", None) is not None
    print(json.dumps({"ready": True, "plugin": plugin, "scheduler": type(sched).__name__}))
    sys.stdout.flush()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    n = 0
    for line in sys.stdin:
        if not line.startswith("round"):
            break
        # Distinct prompts per round: no prefix hits between rounds, the same work each time.
        for i in range(requests):
            base = 3 + (n * requests + i) * 7 % 900
            prompt = [(base + j * 13) % 997 + 3 for j in range(prompt_len)]
            engine.add_request(f"b{n}-{i}", {"prompt_token_ids": prompt}, params)
        n += 1
        steps: list[float] = []
        tokens = 0
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            s0 = time.perf_counter_ns()
            outs = engine.step()
            steps.append(time.perf_counter_ns() - s0)
            for o in outs:
                if o.finished:
                    tokens += len(o.outputs[0].token_ids)
        wall = time.perf_counter() - t0
        print(
            json.dumps(
                {
                    "tok_s": tokens / wall,
                    "tokens": tokens,
                    "wall_s": wall,
                    "steps": len(steps),
                    "step_ms_median": statistics.median(steps) / 1e6,
                }
            )
        )
        sys.stdout.flush()
    return 0


def _per_call_ns(fn: Any, n: int) -> list[float]:
    clock = time.perf_counter_ns
    out = []
    for _ in range(n):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return out


def adapter_main(sizes: list[int], calls: int) -> int:
    from vllm.v1.core.block_pool import BlockPool

    from kvsidecar.agent.agent import KVSidecarAgent
    from kvsidecar.agent.engines.vllm import VllmPoolSource

    class _Spec:  # geometry only: the cost measured here does not depend on it
        block_size = 32
        page_size_bytes = 2 * 32 * 8 * 128 * 2

    def source(pool: Any, layers: int) -> Any:
        return VllmPoolSource(
            pool,
            group_id=0,
            pool_name="block_pool",
            specs=[_Spec()],
            num_layers=layers,
            mapped_bytes=0,
            manager=None,
            managers=[],
        )

    shm = tempfile.mkdtemp(prefix="kvsidecar-bench-vllm-", dir="/dev/shm")
    result: dict[str, Any] = {"sizes": {}}
    try:
        for size in sizes:
            pool = BlockPool(size, enable_caching=True, hash_block_size=32)
            src = source(pool, 32)
            # A busy pool: half the blocks held, a quarter of those freed back.
            held = pool.get_new_blocks((size - 1) // 2)
            pool.free_blocks(held[: len(held) // 4])
            agent = KVSidecarAgent(
                "vllm-bench", "bench", shm_dir=shm, segment_name=f"kvsidecar.bench.vllm{size}"
            )
            agent.register_pool(src)
            for _ in range(2000):
                agent.step(1, 0)
            samples: list[float] = []
            for _ in range(5):  # rounds, so one noisy moment does not decide
                samples += _per_call_ns(lambda a=agent: a.step(8, 2), calls // 5)
            samples.sort()
            snap = sorted(_per_call_ns(src.snapshot, calls))
            result["sizes"][str(size)] = {
                "blocks": size - 1,
                "publish_median_ns": samples[len(samples) // 2],
                "publish_p99_ns": samples[int(len(samples) * 0.99)],
                "snapshot_median_ns": snap[len(snap) // 2],
                "allocated_blocks": src.snapshot().allocated_blocks,
            }
            agent.close()
        # Hook cost per block: the same get/free on a pool with and without our wrappers.
        hooks: dict[str, list[float]] = {"plain": [], "hooked": []}
        pools = {"plain": BlockPool(4097, True, 32), "hooked": BlockPool(4097, True, 32)}
        source(pools["hooked"], 1)
        for _ in range(60):
            for name in ("plain", "hooked"):
                p = pools[name]
                t0 = time.perf_counter_ns()
                blocks = p.get_new_blocks(1024)
                p.free_blocks(reversed(blocks))
                hooks[name].append((time.perf_counter_ns() - t0) / 1024)
        result["hook_ns_per_block"] = {k: statistics.median(v) for k, v in hooks.items()}
    finally:
        import shutil

        shutil.rmtree(shm, ignore_errors=True)
    print(json.dumps(result))
    return 0


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="kvsidecar.agent.bench.vllm")
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("engine")
    e.add_argument("--model-dir", required=True)
    e.add_argument("--requests", type=int, default=8)
    e.add_argument("--prompt-len", type=int, default=64)
    e.add_argument("--max-tokens", type=int, default=128)
    a = sub.add_parser("adapter")
    a.add_argument("--sizes", default="65,100001")
    a.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args(argv)
    if args.cmd == "engine":
        return engine_main(args.model_dir, args.requests, args.prompt_len, args.max_tokens)
    return adapter_main([int(x) for x in args.sizes.split(",")], args.calls)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
