"""Allocator micro-benchmark: the cost per block of alloc and free, counters included."""

from __future__ import annotations

import statistics
import time

import torch

from kvsidecar.agent.pool import KVBlockPool


def bench_alloc_free(n_blocks: int = 1024, iters: int = 200) -> dict[str, float | int]:
    """Median (and p90) ns per block of `alloc_blocks(n_blocks)` / `free_blocks`.

    Each round allocates n_blocks as one call and frees them as one call, so the numbers
    include the per-call snapshot publish amortised over n_blocks. Storage is tiny (one
    layer, head_dim 1, CPU): this measures the allocator, not memory bandwidth.
    """
    if n_blocks <= 0 or iters <= 0:
        raise ValueError("n_blocks and iters must be positive")
    pool = KVBlockPool(
        n_blocks, 1, num_layers=1, kv_heads=1, head_dim=1, dtype=torch.float16, device="cpu"
    )
    clock = time.perf_counter_ns
    alloc_ns: list[float] = []
    free_ns: list[float] = []
    for _ in range(iters + 3):  # the first rounds warm caches up and are dropped
        t0 = clock()
        ids = pool.alloc_blocks(n_blocks)
        t1 = clock()
        assert ids is not None
        pool.free_blocks(ids)
        t2 = clock()
        alloc_ns.append((t1 - t0) / n_blocks)
        free_ns.append((t2 - t1) / n_blocks)
    alloc_ns, free_ns = alloc_ns[3:], free_ns[3:]
    return {
        "n_blocks": n_blocks,
        "iters": iters,
        "alloc_ns_per_block_median": statistics.median(alloc_ns),
        "free_ns_per_block_median": statistics.median(free_ns),
        "alloc_ns_per_block_p90": _p90(alloc_ns),
        "free_ns_per_block_p90": _p90(free_ns),
        "snapshot_ns_median": _snapshot_ns(pool),
    }


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def _snapshot_ns(pool: KVBlockPool, reps: int = 1000) -> float:
    clock = time.perf_counter_ns
    samples = []
    for _ in range(reps):
        t0 = clock()
        pool.snapshot()
        samples.append(clock() - t0)
    return statistics.median(samples)


if __name__ == "__main__":
    print(bench_alloc_free())
