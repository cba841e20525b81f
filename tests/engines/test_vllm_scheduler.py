"""vLLM's real scheduler code, driven directly (no model): every published field equals a
brute-force recount after every step, on each vLLM version we claim (TESTED_VERSIONS), and a
sabotaged hook is caught.

The driver (tests/engines/vllm_helpers/scheduler_driver.py) builds vLLM's ``Scheduler`` and
``AsyncScheduler`` the way vLLM's own unit tests do and runs randomized workloads: prefix
sharing with partial and full hits, preemption and eviction in a tiny KV, aborts between
steps, n>1, chunked prefill, a connector that holds frees (blocks shared with live requests)
and one whose frees vLLM fences under async scheduling, and a hybrid sliding-window + full
attention config (two KV-cache groups, one pool, one record). One subprocess per version,
about 20-90 s on a loaded 2-core host (mostly importing vLLM; the 2,000-step runs take 1-5 s).
"""

from __future__ import annotations

import json
import re

import pytest

from tests.engines.envs import ROOT, run_json_helper

DRIVER = str(ROOT / "tests" / "engines" / "vllm_helpers" / "scheduler_driver.py")
SABOTAGE = ("touch", "free_blocks", "remove_hash", "defer", "release")


def vllm_envs() -> dict[str, str]:
    """Every vLLM engine env (.ci/locks/vllm*.txt) -> the vLLM version its lock pins. A new
    release is checked by adding its lock (docs/vllm.md, "Checking a new vLLM release")."""
    envs = {}
    for lock in sorted((ROOT / ".ci" / "locks").glob("vllm*.txt")):
        pin = re.search(r"^vllm(?:-cpu)?==(\S+)$", lock.read_text(), re.M)
        if re.fullmatch(r"vllm\d*", lock.stem) and pin:
            envs[lock.stem] = pin.group(1).split("+")[0]
    return envs


ENVS = vllm_envs()


def test_every_vllm_env_is_a_tested_version():
    from kvsidecar.agent.engines.vllm import TESTED_VERSIONS

    assert {"vllm", "vllm033"} <= set(ENVS), ENVS
    # TESTED_VERSIONS names exactly the versions CI checks (a lock, passing the driver).
    assert sorted(set(ENVS.values())) == sorted(TESTED_VERSIONS), (ENVS, TESTED_VERSIONS)


def _results(env: str, args: list[str]) -> list[dict]:
    out = run_json_helper(env, DRIVER, args, timeout=540)
    runs = [
        json.loads(ln[len("RESULT ") :])
        for ln in out["stdout"].splitlines()
        if ln.startswith("RESULT ")
    ]
    assert out["rc"] == 0 and runs, out["stdout"][-3000:]
    return runs


@pytest.mark.timeout(600)
@pytest.mark.parametrize("env", sorted(ENVS))
def test_scheduler_published_fields_equal_recount_and_sabotage_is_caught(env):
    runs = _results(env, ["--steps", "2000", "--sabotage", *SABOTAGE])
    clean = [r for r in runs if r["sabotage"] is None]
    for r in runs:  # the figures, for the record (-s)
        shown = {k: v for k, v in r.items() if k != "first_mismatches"}
        print(f"vllm scheduler [{env}]:", json.dumps(shown))
    assert {r["vllm"] for r in runs} == {ENVS[env]}
    assert len(clean) == 8
    for r in clean:
        where = f"{r['config']} seed {r['seed']}"
        assert r["mismatches"] == 0, (where, r["first_mismatches"])
        assert r["steps"] >= 2000 and r["checks"] > r["steps"], where
        # The workload really exercised what the recount checks.
        assert r["aborts"] > 0 and r["n_gt_1"] > 0 and r["preemptions"] > 0, where
        assert r["alloc_failures_total"] > 0, where
        assert r["pool_records"] == r["distinct_pools"] == 1, where
        want_cls = "AsyncScheduler" if "async" in r["config"] else "Scheduler"
        assert r["scheduler_class"] == f"KVSidecar{want_cls}", where
    by = {(r["config"], r["seed"]): r for r in clean}
    for key in (("sync", 1), ("async", 1), ("hybrid", 1)):
        r = by[key]
        assert r["releases"] > 0 and r["max_deferred"] >= 2 and r["shared_deferred"] > 0, key
        assert r["evictions_total"] > 0 and r["prefix_hit_tokens_total"] > 0, key
    assert by[("sync", 1)]["chunked"] > 0
    assert by[("no-prefix-cache", 1)]["prefix_hit_tokens_total"] == 0
    # A consumer under async scheduling: vLLM fences frees behind in-flight steps (0.33.0
    # holds some back at a check; 0.32.0 drains them within the same step here).
    assert [r["config"] for r in clean if r["fencing"]] == ["consumer-async"]
    assert by[("hybrid", 1)]["kv_cache_groups"] == by[("hybrid-async", 2)]["kv_cache_groups"] == 2
    # The mutation: each sabotaged hook makes the recount disagree.
    caught = {r["sabotage"]: r["mismatches"] for r in runs if r["sabotage"] is not None}
    assert set(caught) == set(SABOTAGE)
    assert all(n > 0 for n in caught.values()), caught
