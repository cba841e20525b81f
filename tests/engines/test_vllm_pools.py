"""Each vLLM ``BlockPool``'s bytes are its own (issue 41 item 7), on KV-cache configs vLLM's
own planner builds, in each vLLM env (tests/engines/vllm_helpers/pools_driver.py).

vLLM 0.32/0.33 build one pool per engine core for every model but HiSparse: a hybrid model's
KV-cache groups (full + sliding window) share it and overlay one backing allocation, which
the config lists once per group (``KVCacheTensor.size`` repeated). HiSparse adds a host
pool of its own, backed by the host-resident tensors. Before: the hybrid pool published
3x its storage (mapped and virtual 1,179,648 for 393,216), the HiSparse device pool mapped
786,432 > virtual_total_bytes 393,216 and the host pool 0.
"""

from __future__ import annotations

import json

import pytest

from tests.engines.envs import ROOT, run_json_helper
from tests.engines.test_vllm_scheduler import ENVS

DRIVER = str(ROOT / "tests" / "engines" / "vllm_helpers" / "pools_driver.py")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("env", sorted(ENVS))
def test_each_pool_publishes_its_own_storage(env):
    out = run_json_helper(env, DRIVER, [], timeout=380)
    runs = [
        json.loads(ln[len("RESULT ") :])
        for ln in out["stdout"].splitlines()
        if ln.startswith("RESULT ")
    ]
    assert out["rc"] == 0 and len(runs) == 4, out["stdout"][-3000:]
    by = {r["config"]: r for r in runs}
    for r in runs:
        print(f"vllm pools [{env}]:", json.dumps(r))  # the figures, for the record (-s)
        where = r["config"]
        assert r["vllm"] == ENVS[env], where
        assert r["scheduled"] == 3, where
        pools = r["pools"]
        assert r["pool_records"] == len(pools), where
        for p in pools:
            at = (where, p["pool_name"])
            # schema.md: never more than the storage; here they are the storage.
            assert p["mapped_bytes"] <= p["virtual_total_bytes"], at
            assert p["mapped_bytes"] == p["virtual_total_bytes"] == p["backing_bytes"], at
            assert p["virtual_blocks"] == p["num_gpu_blocks"] == p["total_blocks"] + 1, at
            assert p["virtual_total_bytes"] == p["virtual_per_layer_bytes"] * p["num_layers"]
            # One block's bytes are vLLM's: the backing over the pool's blocks.
            unit = p["backing_bytes"] // p["num_gpu_blocks"]
            assert p["allocated_blocks"] == p["allocated_in_vllm"] > 0, at
            assert p["allocated_bytes"] == p["allocated_blocks"] * unit, at
            assert p["allocated_bytes"] + p["available_bytes"] == p["total_blocks"] * unit, at
            # vLLM's own counters (prefix, alloc failures) sit on the manager's pool.
            assert (p["prefix_query_tokens_total"] is not None) == p["manager_pool"], at
        assert pools[0]["manager_pool"] and pools[0]["pool_name"] == "block_pool", where
        # The pools' bytes add up to the KV allocations, each counted once.
        assert sum(p["mapped_bytes"] for p in pools) == sum(r["backings"].values()), where
    # vLLM's real layouts: one pool for the hybrid models (the groups overlay one
    # backing, listed once per group), two for HiSparse.
    assert by["hybrid"]["kv_cache_groups"] == 3 and by["hybrid-1-5"]["kv_cache_groups"] == 6
    for name in ("plain", "hybrid", "hybrid-1-5"):
        assert by[name]["pool_records"] == 1, name
    for name in ("hybrid", "hybrid-1-5"):
        r = by[name]
        assert r["tensor_sizes_summed"] == r["kv_cache_groups"] * r["pools"][0]["mapped_bytes"]
    assert [p["num_layers"] for p in by["hybrid"]["pools"]] == [2]  # layers a block holds
    hs = by["hisparse"]
    assert [p["host"] for p in hs["pools"]] == [False, True]
    assert hs["pools"][1]["mapped_bytes"] == hs["backings"]["True"] > 0
    assert hs["pools"][0]["mapped_bytes"] == hs["backings"]["False"] > 0
