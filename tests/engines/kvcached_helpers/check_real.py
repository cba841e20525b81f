"""Run in the kvcached environment: kvcached 0.1.6's real snapshot builder vs our adapter.

Builds pool snapshots with kvcached's own ``build_kv_cache_pool_snapshot`` from duck-typed
managers (as kvcached's tests/test_observability.py does: kvcached's ``KVCacheManager``
needs CUDA), in many random states, converts each with our ``from_kvcached_dict`` under
kvcached's real ``get_capabilities()``, publishes it through the agent and reads it back
from shared memory. Every kvcached field must be equal to ours, or be one of the documented
differences in ``EXPLAINED``; every kvcached pool field must be listed in one of the two.
Prints one JSON line of counts; exits 1 on any mismatch.

    python check_real.py SHM_DIR [--cases N] [--seed S] [--broken-cases M] [--own-tests]

``--broken-cases M`` reruns the check over an adapter that drops effective_free_pages
(reported under "broken": it must mismatch); ``--own-tests`` then runs kvcached's own
tests/test_observability.py on the same source (its pytest rc as "own_tests_rc").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from typing import Any

from kvcached.observability import (
    SCHEMA_VERSION,
    build_kv_cache_pool_snapshot,
    get_capabilities,
)
from kvcached.utils import PAGE_SIZE

from kvsidecar.agent import KVSidecarAgent
from kvsidecar.agent.engines import kvcached as adapter
from kvsidecar.protocol.reader import Reading, SegmentReader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fields import EQUAL

MIB = 1 << 20

# kvcached field -> why ours differs (docs/kvcached.md); each is checked below.
EXPLAINED = {
    "schema_version": "ours is kvsidecar.snapshot.v1.x, carried once per segment",
    "total_blocks": "kvcached's initial num_blocks -> our virtual_blocks; our total_blocks "
    "is the current capacity without the null block",
    "allocated_blocks": "null block excluded",
    "allocated_bytes": "null block excluded",
    "shrink_target_blocks": "null block excluded",
    "resize_target_bytes": "kvcached's -1 (no target) -> null",
}


class PageAllocator:
    """Duck-typed kvcached PageAllocator (kvcached's test does the same)."""

    def __init__(self, rng: random.Random, legacy: bool) -> None:
        total = rng.randint(1, 200)
        free = rng.randint(0, total)
        self.state = {
            "total_pages": total,
            "free_pages": free,
            # #443: inuse can go negative mid-expansion; we clamp it.
            "inuse_pages": total - free if rng.random() > 0.05 else -1,
            "reserved_pages": rng.randint(0, min(free, 10)),
        }
        self.avail = rng.randint(0, 300)
        self.target = rng.choice([-1, -1, 0, rng.randint(1, 64) * 2 * MIB])
        if not legacy:  # only the new extension has the locked snapshot
            self.get_page_state = lambda: dict(self.state)

    def get_num_total_pages(self) -> int:
        return self.state["total_pages"]

    def get_num_free_pages(self) -> int:
        return self.state["free_pages"]

    def get_num_inuse_pages(self) -> int:
        return self.state["inuse_pages"]

    def get_num_reserved_pages(self) -> int:
        return self.state["reserved_pages"]

    def get_avail_physical_pages(self) -> int:
        return self.avail

    def get_resize_target(self) -> int:
        return self.target


class Manager:
    """Duck-typed kvcached KVCacheManager: the attributes the builder reads."""

    def __init__(self, rng: random.Random) -> None:
        self.page_allocator = PageAllocator(rng, legacy=rng.random() < 0.2)
        self.num_layers = rng.randint(1, 64)
        self.num_kv_buffers = rng.choice([1, 2])
        self.group_id = rng.randint(0, 3)
        self.pool_name = rng.choice(["block_pool", "mha", "mla", None])
        self.page_size = rng.choice([2, 4, 8]) * MIB
        # Blocks that divide a page, and some that do not.
        self.block_mem_size = rng.choice([16 * 1024, 32 * 1024, 96 * 1024, 3 * MIB])
        self.num_blocks = rng.randint(1, 20_000)
        self.mem_size = self.num_blocks * self.block_mem_size
        self.reserved_blocks = list(range(rng.randint(0, 8)))
        self.null_block = [0] if rng.random() < 0.8 else None
        self.in_shrink = rng.random() < 0.2
        self.target_num_blocks = rng.randint(1, self.num_blocks) if self.in_shrink else None
        self._avail = rng.randint(-130, self.num_blocks)  # #436: -127 was seen
        self._alloced = rng.randint(-1, self.num_blocks)

    def available_size(self) -> int:
        return self._avail

    def _get_num_alloced_blocks(self) -> int:
        return self._alloced

    def get_mapped_memory_size(self, unit: str = "bytes") -> int:
        inuse = max(self.page_allocator.state["inuse_pages"], 0)
        return inuse * self.page_size * self.num_layers * self.num_kv_buffers


def expected_different(k: dict[str, Any], name: str) -> Any:
    """Our value for a field in EXPLAINED, from the documented rule (not the adapter)."""
    null = 1 if k["null_block_reserved"] else 0
    if name == "total_blocks":
        cap = k["total_blocks"]
        pages, page, block = k["total_pages"], k["page_size_bytes"], k["block_size_bytes"]
        if pages is not None and block and page >= block:
            cap = min(cap, max(pages, 0) * (page // block))
        return max(cap - null, 0)
    if name == "allocated_blocks":
        return max(k["allocated_blocks"] - null, 0)
    if name == "allocated_bytes":
        unit = k["block_size_bytes"] * k["num_layers"] * k["num_kv_buffers"]
        return max(k["allocated_blocks"] - null, 0) * unit
    if name == "shrink_target_blocks":
        t = k["shrink_target_blocks"]
        return None if t is None else max(t - null, 0)
    if name == "resize_target_bytes":
        t = k["resize_target_bytes"]
        return None if t is None or t < 0 else t
    raise KeyError(name)


def check(cases: int, seed: int, shm_dir: str, name: str) -> dict[str, Any]:
    """`cases` random pools through kvcached's builder, our adapter, the agent and back."""
    caps = get_capabilities()
    problems: list[str] = []
    fields = caps["pool_snapshot_fields"]
    unexplained = [f for f in fields if f not in EQUAL and f not in EXPLAINED]
    problems += [f"kvcached field {f} neither mapped nor explained" for f in unexplained]
    if caps["features"].get("operation_counters") is not False:
        problems.append("kvcached 0.1.6 should report operation_counters: False")

    rng = random.Random(seed)
    agent = KVSidecarAgent("kvcached-check", shm_dir=shm_dir, segment_name=name, device="cpu")
    current: dict[str, Any] = {}
    agent.register_pool(
        adapter.KvcachedDictAdapter(lambda: current, capabilities=caps, pool_name="block_pool")
    )
    reader = SegmentReader(name, shm_dir=shm_dir)
    if reader.attach() is not None:
        problems.append("cannot attach to the agent's segment")
    checks = mismatches = 0
    for case in range(cases):
        manager = Manager(rng)
        integration = rng.choice(["vllm", "sglang", None])
        k = build_kv_cache_pool_snapshot(manager, integration=integration).to_dict()
        current.clear()
        current.update(k)
        agent.step()
        got = reader.read()
        if not isinstance(got, Reading):
            problems.append(f"case {case}: read failed: {got}")
            break
        ours = got.snapshot.pools[0]
        for name in fields:
            if name == "schema_version":
                ok = k[name] == SCHEMA_VERSION
                want: Any = SCHEMA_VERSION
                have: Any = k[name]
            elif name in EQUAL:
                want = k[name]
                if name == "pool_name" and want is None:
                    want = "block_pool"  # the adapter's default name
                elif isinstance(want, int) and not isinstance(want, bool):
                    want = max(want, 0)
                have = getattr(ours, name)
                ok = have == want
            else:
                want = expected_different(k, name)
                have = getattr(ours, name)
                ok = have == want
            checks += 1
            if not ok:
                mismatches += 1
                if len(problems) < 20:
                    problems.append(f"case {case}: {name}: kvcached {k[name]!r}, ours {have!r}")
        # kvcached's total_blocks travels as virtual_blocks.
        checks += 1
        if ours.virtual_blocks != k["total_blocks"]:
            mismatches += 1
            problems.append(f"case {case}: virtual_blocks {ours.virtual_blocks}")
        # What kvcached does not have stays "unsupported", never a fake 0.
        for name in (
            "cached_blocks",
            "deferred_free_blocks",
            "tokens_used",
            "protected_blocks",
            "allocs_total",
            "frees_total",
            "evictions_total",
            "alloc_failures_total",
        ):
            checks += 1
            if getattr(ours, name) is not None:
                mismatches += 1
                problems.append(f"case {case}: {name} should be null")
        # The vLLM plugin's helper reads the same builder through a manager.
        pf = adapter.page_fields(manager, integration=integration)
        checks += 1
        if any(pf[n] != getattr(ours, n) for n in adapter.PAGE_FIELDS):
            mismatches += 1
            problems.append(f"case {case}: page_fields differ")
    agent.close()
    reader.close()
    return {
        "kvcached_schema": SCHEMA_VERSION,
        "page_size_default": PAGE_SIZE,
        "cases": cases,
        "checks": checks,
        "mismatches": mismatches,
        "kvcached_fields": len(fields),
        "equal": len(EQUAL),
        "explained": sorted(EXPLAINED),
        "operation_counters": caps["features"].get("operation_counters"),
        "problems": problems,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("shm_dir")
    ap.add_argument("--cases", type=int, default=500)
    ap.add_argument("--seed", type=int, default=385)
    ap.add_argument("--broken-cases", type=int, default=0)
    ap.add_argument("--own-tests", action="store_true")
    args = ap.parse_args()
    out = check(args.cases, args.seed, args.shm_dir, "kvcached-check")
    if args.broken_cases:  # the same check over an adapter that drops a field must fail
        kept = adapter._OPTIONAL_INT_FIELDS
        adapter._OPTIONAL_INT_FIELDS = tuple(f for f in kept if f != "effective_free_pages")
        try:
            out["broken"] = check(args.broken_cases, args.seed, args.shm_dir, "kvcached-broken")
        finally:
            adapter._OPTIONAL_INT_FIELDS = kept
    if args.own_tests:  # kvcached's own tests/test_observability.py on this very source
        import kvcached
        import pytest

        src = os.path.dirname(kvcached.__path__[0])
        with open(os.path.join(src, "PKG-INFO")) as f:
            out["kvcached_version"] = next(
                (ln.split()[1] for ln in f if ln.startswith("Version:")), None
            )
        test = os.path.join(src, "tests", "test_observability.py")
        out["own_tests_rc"] = int(pytest.main(["-q", "-p", "no:cacheprovider", test]))
    print(json.dumps(out))
    bad = out["problems"] or out["mismatches"] or out.get("own_tests_rc", 0)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
