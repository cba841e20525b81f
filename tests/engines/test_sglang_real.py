"""Our SGLang PoolSource against SGLang 0.5.23's real memory classes on CPU (its own env).

The helper (sglang_helpers/oracle.py) runs a randomized scheduler-like sequence over
SGLang's allocator, req-to-token pool and radix cache, and after every operation compares
what we published (read back from shared memory) with SGLang's own counters and its
token_usage formula. Built by ``bash .ci/engine-env sglang``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engines.envs import run_json_helper

HELPER = str(Path(__file__).parent / "sglang_helpers" / "oracle.py")
IDENTITY = str(Path(__file__).parent / "sglang_helpers" / "identity.py")


@pytest.fixture(scope="module")
def oracle() -> dict:
    # One interpreter for both tests: importing SGLang is most of the cost (~15 s).
    return run_json_helper("sglang", HELPER, ["--ops", "1200", "--broken-ops", "100"], timeout=300)


def test_published_values_equal_sglang_counters_after_every_operation(oracle):
    out = oracle
    for r in out["runs"]:
        print(
            f"\nsglang {out['sglang']} {r['pool']} page_size={r['page_size']}: {r['ops']} ops "
            f"({', '.join(f'{k} {v}' for k, v in r['by_op'].items())}), {r['checks']} checks, "
            f"{r['mismatches']} mismatches; peak used/evictable/protected "
            f"{r['max_used']}/{r['max_evictable']}/{r['max_protected']} of "
            f"{r['max_total_num_tokens']} slots, {r['failed_allocs']} allocations refused"
        )
    assert out["rc"] == 0, out
    assert out["sglang"] == "0.5.23"
    for r in out["runs"]:
        assert r["ops"] >= 1000 and r["mismatches"] == 0 and r["sim_errors"] == 0
        assert r["problems"] == []
        # The sequence reached the interesting states: a full pool, cache both evictable
        # and protected, evictions forced by allocation.
        assert r["max_used"] == r["max_total_num_tokens"]
        assert r["max_evictable"] > 0 and r["max_protected"] > 0 and r["failed_allocs"] > 0
        assert all(n > 0 for n in r["by_op"].values())
    assert [(r["pool"], r["page_size"]) for r in out["runs"]] == [
        ("mha", 1),
        ("mha", 4),
        ("mla", 2),
    ]


def test_the_oracle_catches_a_broken_adapter(oracle):
    # Evictable slots dropped from available_blocks: the same comparison must fail.
    broken = oracle["broken"]
    assert len(broken) == 3 and all(r["mismatches"] > 0 for r in broken)
    assert any("available_size" in p for r in broken for p in r["problems"])


def test_model_name_is_sglangs_own_label():
    """Issue 41 item 8c: without ``--served-model-name`` SGLang 0.5.23 keeps the field None
    on its ServerArgs record and resolves it to the model path (its metrics' ``model_name``
    label); we published the string "None". Against SGLang's real ServerArgs, resolved and
    published as its processes do, and its own label function."""
    out = run_json_helper("sglang", IDENTITY, [], timeout=300)
    assert out["rc"] == 0, out["stdout"][-3000:]
    assert out["sglang"] == "0.5.23"
    cases = {c["case"]: c for c in out["cases"]}
    for c in out["cases"]:
        print(f"sglang identity {c['case']!r}: label {c['sglang_label']!r}, ours {c['ours']!r}")
        assert c["ours"] == c["sglang_label"], c
        assert c["our_device"] == c["sglang_device"] == "cpu", c
    unnamed = cases["no --served-model-name"]
    # The record keeps the raw None; SGLang's label is the model path.
    assert unnamed["raw_served_model_name"] is None
    assert unnamed["ours"] == unnamed["model_path"] != "None"
    assert cases["--served-model-name"]["ours"] == "served-llama"
    assert cases["--device cpu:0"]["raw_device"] == "cpu:0"  # SGLang strips the index
