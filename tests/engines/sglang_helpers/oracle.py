"""Run in the SGLang environment: our SGLang PoolSource vs SGLang's own counters, on CPU.

Real SGLang 0.5.23 classes (``MHATokenToKVPool``, ``TokenToKVPoolAllocator`` /
``PagedTokenToKVPoolAllocator``, ``ReqToTokenPool``, ``RadixCache``) driven the way the
scheduler drives them: admit (match a prefix, lock it, allocate the rest, write the
request's row), decode (one more slot, a page at a boundary), finish (insert into the radix
tree, free the duplicate and tail slots, unlock, free the row), abort, match, extra
lock/unlock, evict. After every operation the agent publishes and we read the record back
from shared memory; it must equal SGLang's ``available_size()``, ``evictable_size()``,
``protected_size()`` and what SGLang's own ``SchedulerPoolStatsObserver._get_token_info``
computes (``num_used = max_total - (available + evictable)``, ``token_usage``). Prints one
JSON line of counts; exits 1 on any mismatch.

    python oracle.py SHM_DIR [--ops N] [--seed S] [--broken-ops M]

``--broken-ops M`` also runs M operations against a deliberately broken adapter (evictable
slots left out of available_blocks), reported under "broken": that run must mismatch.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from array import array
from typing import Any

import torch
from sglang.srt.managers.scheduler_components.pool_stats_observer import (
    SchedulerPoolStatsObserver,
)
from sglang.srt.mem_cache.allocator import (
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import (
    MHATokenToKVPool,
    MLATokenToKVPool,
    ReqToTokenPool,
)
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

from kvsidecar.agent import KVSidecarAgent
from kvsidecar.agent.engines.sglang import SGLangPoolSource
from kvsidecar.protocol.reader import Reading, SegmentReader

BASES = [list(range(100, 164)), list(range(200, 264)), [7] * 64]


def key(tokens: list[int]) -> RadixKey:
    return RadixKey(array("q", tokens))


class Sim:
    """A miniature SGLang scheduler over the real memory classes."""

    def __init__(self, page: int, size: int, rng: random.Random, mla: bool = False) -> None:
        self.page, self.size, self.rng, self.mla = page, size, rng, mla
        if mla:  # one combined buffer per layer (DeepSeek-style latent KV)
            self.kv: Any = MLATokenToKVPool(
                size=size,
                page_size=page,
                dtype=torch.bfloat16,
                kv_lora_rank=8,
                qk_rope_head_dim=4,
                layer_num=2,
                device="cpu",
                enable_memory_saver=False,
            )
        else:
            self.kv = MHATokenToKVPool(
                size=size,
                page_size=page,
                dtype=torch.float16,
                head_num=2,
                head_dim=4,
                layer_num=3,
                device="cpu",
                enable_memory_saver=False,
                enable_alt_stream=False,
            )
        if page == 1:
            self.alloc = TokenToKVPoolAllocator(size, torch.float16, "cpu", self.kv, False)
        else:
            self.alloc = PagedTokenToKVPoolAllocator(
                size, page, torch.float16, "cpu", self.kv, True
            )
        self.r2t = ReqToTokenPool(
            size=12, max_context_len=256, device="cpu", enable_memory_saver=False
        )
        self.tree = RadixCache(
            CacheInitParams(
                disable=False,
                req_to_token_pool=self.r2t,
                token_to_kv_pool_allocator=self.alloc,
                page_size=page,
            )
        )
        # SGLang's own usage computation (what feeds sglang:token_usage / num_used_tokens).
        self.observer = SchedulerPoolStatsObserver(
            tree_cache=self.tree,
            token_to_kv_pool_allocator=self.alloc,
            req_to_token_pool=self.r2t,
            session_controller=None,
            hisparse_coordinator=None,
            is_hybrid_swa=False,
            is_hybrid_ssm=False,
            enable_hisparse=False,
            full_tokens_per_layer=None,
            swa_tokens_per_layer=None,
            max_total_num_tokens=size,
        )
        self.reqs: dict[int, dict[str, Any]] = {}
        self.extra_locks: list[Any] = []
        self.next_id = 0
        self.failed_allocs = 0

    def _alloc(self, n: int) -> torch.Tensor | None:
        out = self.alloc.alloc(n)
        if out is None:  # the scheduler evicts unlocked cache, then retries
            self.tree.evict(EvictParams(num_tokens=n))
            out = self.alloc.alloc(n)
        if out is None:
            self.failed_allocs += 1
        return out

    def _tokens(self) -> list[int]:
        rng = self.rng
        base = rng.choice(BASES)[: rng.randint(0, 48)]
        return base + [rng.randint(1000, 1003) for _ in range(rng.randint(1, 12))]

    def admit(self) -> None:
        if self.r2t.available_size() == 0:
            return self.finish()
        tokens = self._tokens()
        m = self.tree.match_prefix(MatchPrefixParams(key=key(tokens)))
        prefix = m.device_prefix_len
        prefix_idx = self.tree.path_device_indices(m.last_device_node)
        lock = self.tree.lock(m.last_device_node)  # locked before allocating, as SGLang does
        need = -(-(len(tokens) - prefix) // self.page) * self.page
        new = self._alloc(need) if need else torch.empty(0, dtype=torch.int64)
        if new is None:
            self.tree.unlock(lock)
            return None
        row = self.r2t.alloc_rows(1)[0]
        slots = torch.cat((prefix_idx.to(torch.int64), new.to(torch.int64)))
        self.r2t.write((row, slice(0, len(slots))), slots.to(torch.int32))
        self.reqs[self.next_id] = {
            "row": row,
            "tokens": tokens,
            "slots": len(slots),
            "prefix": prefix,
            "lock": lock,
        }
        self.next_id += 1
        return None

    def decode(self) -> None:
        if not self.reqs:
            return self.admit()
        r = self.reqs[self.rng.choice(list(self.reqs))]
        if len(r["tokens"]) + 1 > self.r2t.max_context_len:
            return None
        if len(r["tokens"]) == r["slots"]:  # no free slot left in its last page
            new = self._alloc(self.page)
            if new is None:
                return None
            self.r2t.write(
                (r["row"], slice(r["slots"], r["slots"] + self.page)), new.to(torch.int32)
            )
            r["slots"] += self.page
        r["tokens"].append(self.rng.randint(1000, 1003))
        return None

    def _row(self, r: dict[str, Any]) -> torch.Tensor:
        return self.r2t.req_to_token[r["row"], : r["slots"]].to(torch.int64)

    def finish(self) -> None:
        """cache_finished_req: the tree takes the aligned prefix, duplicates and tail freed."""
        if not self.reqs:
            return None
        r = self.reqs.pop(self.rng.choice(list(self.reqs)))
        slots = self._row(r)
        aligned = len(r["tokens"]) // self.page * self.page
        res = self.tree.insert(
            InsertParams(key=key(r["tokens"][:aligned]), value=slots[:aligned].clone())
        )
        self.alloc.free(slots[r["prefix"] : res.prefix_len])  # already cached by someone
        self.alloc.free(slots[aligned:])  # the partial last page is not cached
        self.tree.unlock(r["lock"])
        self.r2t.free_rows([r["row"]])
        return None

    def abort(self) -> None:
        if not self.reqs:
            return None
        r = self.reqs.pop(self.rng.choice(list(self.reqs)))
        self.alloc.free(self._row(r)[r["prefix"] :])
        self.tree.unlock(r["lock"])
        self.r2t.free_rows([r["row"]])
        return None

    def match(self) -> None:
        self.tree.match_prefix(MatchPrefixParams(key=key(self._tokens())))

    def lock(self) -> None:
        m = self.tree.match_prefix(MatchPrefixParams(key=key(self._tokens())))
        self.extra_locks.append(self.tree.lock(m.last_device_node))

    def unlock(self) -> None:
        if self.extra_locks:
            self.tree.unlock(self.extra_locks.pop(self.rng.randrange(len(self.extra_locks))))

    def evict(self) -> None:
        self.tree.evict(EvictParams(num_tokens=self.rng.randint(1, 24)))

    def private_slots(self) -> int:
        return sum(r["slots"] - r["prefix"] for r in self.reqs.values())


OPS = {
    "admit": 6,
    "decode": 8,
    "finish": 4,
    "abort": 1,
    "match": 2,
    "lock": 1,
    "unlock": 1,
    "evict": 2,
}


def run(
    page: int, size: int, n_ops: int, seed: int, shm_dir: str, broken: bool, mla: bool = False
) -> dict:
    rng = random.Random(seed)
    sim = Sim(page, size, rng, mla)
    source = SGLangPoolSource(sim.alloc, sim.tree, max_total_num_tokens=size)
    if broken:  # a plausible bug: evictable slots left out of "available"
        real = source.snapshot

        def snapshot() -> Any:
            s = real()
            s.available_blocks -= s.cached_blocks
            return s

        source.snapshot = snapshot  # type: ignore[method-assign]
    name = f"sglang-oracle-p{page}" + ("-mla" if mla else "") + ("-broken" if broken else "")
    agent = KVSidecarAgent("sglang", "oracle", shm_dir=shm_dir, segment_name=name, device="cpu")
    agent.register_pool(source)
    reader = SegmentReader(name, shm_dir=shm_dir)
    agent.step()
    assert reader.attach() is None
    # Geometry against SGLang's real buffers: the reservation is every byte it preallocated.
    first = reader.read()
    assert isinstance(first, Reading)
    g = first.snapshot.pools[0]
    buffers = sim.kv.kv_buffer if mla else [*sim.kv.k_buffer, *sim.kv.v_buffer]
    storage = sum(t.nbytes for t in buffers)
    geometry = {
        "virtual_total_bytes": (g.virtual_total_bytes, storage),
        "mapped_bytes": (g.mapped_bytes, storage),
        "num_layers": (g.num_layers, sim.kv.layer_num),
        "num_kv_buffers": (g.num_kv_buffers, 1 if mla else 2),
        "block_size_bytes": (g.block_size_bytes, buffers[0][0].nbytes * page),
        "pool_name": (g.pool_name, "mla" if mla else "mha"),
    }
    problems_geo = [f"{k}: ours {a}, SGLang {b}" for k, (a, b) in geometry.items() if a != b]
    names, weights = list(OPS), list(OPS.values())
    counts = dict.fromkeys(OPS, 0)
    checks = mismatches = sim_errors = 0
    problems: list[str] = list(problems_geo)
    max_used = max_evictable = max_protected = 0
    t0 = time.perf_counter()
    for i in range(n_ops):
        op = rng.choices(names, weights)[0]
        getattr(sim, op)()
        counts[op] += 1
        agent.step(len(sim.reqs), 0)
        got = reader.read()
        if not isinstance(got, Reading):
            problems.append(f"op {i}: read failed: {got}")
            break
        p = got.snapshot.pools[0]
        free = sim.alloc.available_size()
        evictable = sim.tree.evictable_size()
        protected = sim.tree.protected_size()
        stats = sim.observer.get_pool_stats()
        want = {
            "free slots (available_size)": (
                (p.available_blocks - p.cached_blocks) * page,
                free,
            ),
            "evictable_size": (p.cached_blocks * page, evictable),
            "protected_size": (p.protected_blocks * page, protected),
            "num_used": (p.allocated_blocks * page, stats.full_num_used),
            "available + evictable": (
                p.available_blocks * page,
                stats.full_available_size + stats.full_evictable_size,
            ),
            "capacity": (p.total_blocks * page, stats.full_capacity),
            "token_usage": (p.allocated_blocks / p.total_blocks, stats.full_token_usage),
        }
        if page == 1:
            want["tokens_used"] = (p.tokens_used, stats.full_num_used)
        for what, (ours, theirs) in want.items():
            checks += 1
            if ours != theirs:
                mismatches += 1
                if len(problems) < 10:
                    problems.append(
                        f"page {page} op {i} ({op}): {what}: ours {ours}, SGLang {theirs}"
                    )
        # The simulation itself: used slots are exactly the locked tree slots plus what the
        # live requests hold privately (their req_to_token rows past the matched prefix).
        if stats.full_num_used != protected + sim.private_slots():
            sim_errors += 1
        max_used = max(max_used, stats.full_num_used)
        max_evictable = max(max_evictable, evictable)
        max_protected = max(max_protected, protected)
    elapsed = time.perf_counter() - t0
    agent.close()
    reader.close()
    return {
        "page_size": page,
        "pool": g.pool_name,
        "max_total_num_tokens": size,
        "ops": sum(counts.values()),
        "by_op": counts,
        "checks": checks,
        "mismatches": mismatches,
        "sim_errors": sim_errors,
        "failed_allocs": sim.failed_allocs,
        "max_used": max_used,
        "max_evictable": max_evictable,
        "max_protected": max_protected,
        "seconds": round(elapsed, 2),
        "problems": problems,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("shm_dir")
    ap.add_argument("--ops", type=int, default=1200)
    ap.add_argument("--seed", type=int, default=523)
    ap.add_argument("--broken-ops", type=int, default=0)
    args = ap.parse_args()
    # (page size, slots, seed, MLA): token allocator, paged allocator, paged MLA pool.
    configs = [(1, 160, args.seed, False), (4, 256, args.seed + 1, False)]
    configs.append((2, 128, args.seed + 2, True))
    results = [run(p, n, args.ops, s, args.shm_dir, False, m) for p, n, s, m in configs]
    broken = [
        run(p, n, args.broken_ops, s, args.shm_dir, True, m)
        for p, n, s, m in configs
        if args.broken_ops
    ]
    import sglang

    out = {"sglang": sglang.__version__, "torch": torch.__version__, "runs": results}
    out["broken"] = broken
    print(json.dumps(out))
    bad = any(r["mismatches"] or r["sim_errors"] or r["problems"] for r in results)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
