"""In-engine halves of ``kvsidecar bench vllm`` (run inside the vLLM env, by
kvsidecar/bench/vllm.py; this is the only bench module that imports vLLM).

``python -m kvsidecar.agent.bench.vllm engine --model-dir D``: an in-process `LLM` with the
plugin that runs one workload per ``round on|off`` line on stdin (the plugin switched on or
off in between, `PluginSwitch`) and prints one JSON line per round (tokens/s, per-step wall
time). One process for both conditions: same memory, same CPU placement, interleaved.

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


class PluginSwitch:
    """Turn the plugin off and on again inside one engine, for a same-process comparison:
    off = vLLM's own scheduler class and the pool's/manager's own methods (our instance
    wrappers removed); on = ours again. Only for benchmarks: counts go stale while off."""

    def __init__(self, sched: Any) -> None:
        self.sched = sched
        self.ours = type(sched)
        self.vllms = next(c for c in self.ours.__mro__[1:] if not c.__name__.startswith("KVS"))
        mgr = sched.kv_cache_manager
        self.saved = [
            (obj, {k: v for k, v in vars(obj).items() if callable(v) and hasattr(type(obj), k)})
            for obj in (mgr, mgr.block_pool)
        ]

    def set(self, on: bool) -> None:
        self.sched.__class__ = self.ours if on else self.vllms
        for obj, wrappers in self.saved:
            for name, fn in wrappers.items():
                if on:
                    setattr(obj, name, fn)
                else:
                    vars(obj).pop(name, None)


def engine_main(model_dir: str, requests: int, prompt_len: int, max_tokens: int) -> int:
    from vllm import LLM, SamplingParams

    from kvsidecar.bench.vllm import llm_kwargs

    llm = LLM(**llm_kwargs(model_dir, num_gpu_blocks_override=512, max_num_seqs=requests, seed=0))
    engine = llm.llm_engine
    sched = engine.engine_core.engine_core.scheduler
    plugin = getattr(sched, "_kvsidecar", None) is not None
    switch = PluginSwitch(sched) if plugin else None
    wrapped = sum(len(w) for _, w in switch.saved) if switch else 0
    print(json.dumps({"ready": True, "plugin": plugin, "wrapped_methods": wrapped}))
    sys.stdout.flush()
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    n = 0
    for line in sys.stdin:
        if not line.startswith("round"):
            break
        on = line.split()[1:] == ["on"]
        if switch is not None:
            switch.set(on)
        # Distinct prompts per round: no prefix hits between rounds, the same work each time.
        for i in range(requests):
            base = 3 + (n * requests + i) * 7 % 900
            prompt = [(base + j * 13) % 997 + 3 for j in range(prompt_len)]
            engine.add_request(f"b{n}-{i}", {"prompt_token_ids": prompt}, params)
        n += 1
        src = sched._kvsidecar.sources[0] if switch is not None else None
        ops0 = src.stats.allocs_total + src.stats.frees_total if src is not None else 0
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
                    "plugin": on and switch is not None,
                    # block allocs + frees our hooks saw this round (only meaningful when on)
                    "block_ops": (src.stats.allocs_total + src.stats.frees_total - ops0)
                    if src is not None
                    else 0,
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
