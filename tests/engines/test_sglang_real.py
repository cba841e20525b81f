"""Our SGLang PoolSource against SGLang 0.5.23's real memory classes on CPU (its own env).

The helper (sglang_helpers/oracle.py) runs a randomized scheduler-like sequence over
SGLang's allocator, req-to-token pool and radix cache, and after every operation compares
what we published (read back from shared memory) with SGLang's own counters and its
token_usage formula. Built by ``bash .ci/engine-env sglang``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from kvsidecar.bench.fleet import free_port_run
from tests.engines.envs import ROOT, engine_python, run_json_helper
from tests.support import picker
from tests.support.procs import start_daemon, wait_for
from tests.support.scrape import fetch

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


# -- the gateway, as docs/gateway.md and docs/metrics.md say it serves SGLang ----------------

WRITER = str(Path(__file__).parent / "sglang_helpers" / "gateway_writer.py")


def doc_columns(path: Path, heading: str) -> list[dict[str, str]]:
    """The rows of the first table after `heading`, each {column name: cell}."""
    lines = path.read_text().split(heading, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        table.append([c.strip() for c in line.strip("|").split("|")])
    head, rows = table[0], table[2:]
    return [dict(zip(head, row)) for row in rows]


def family_names(cell: str) -> set[str]:
    """`vllm:cache_config_info{block_size,num_gpu_blocks}` -> {"vllm:cache_config_info"}."""
    return {n.split("{")[0] for n in re.findall(r"`([^`]+)`", cell)}


def test_the_gateway_serves_sglang_as_the_docs_say(tmp_path: Path) -> None:
    """A rank whose record is our SGLang source's over SGLang's real allocator, engine
    ``sglang``: the gateway body has exactly the families the docs' SGLang column names, and
    none of those they say are not served (docs/gateway.md said the held-KV lines were
    served for SGLang; SGLang's record has no deferral, so they never were)."""
    python = engine_python("sglang")
    shm = tempfile.mkdtemp(prefix="kvsidecar-sglang-gw-", dir="/dev/shm")
    name = "kvsidecar.sglang.dp0.tp0.pp0"
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    writer = subprocess.Popen(
        [python, WRITER, shm, name], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    daemon = None
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        port = free_port_run(1)
        daemon, _ = start_daemon(shm, "--gateway.listen-address", f"127.0.0.1:{port}")
        url = f"http://127.0.0.1:{port}/metrics"
        assert wait_for(lambda: fetch(url)[0] == 200)
        body = fetch(url)[2]
        served = set(picker.parse(body))
        docs = ROOT / "docs"
        for path, heading, column in (
            (docs / "gateway.md", "## What is served", "SGLang"),
            (docs / "metrics.md", "## Gateway endpoint", "SGLang"),
        ):
            rows = doc_columns(path, heading)
            for r in rows:  # "same": the names of the vLLM column
                r[column] = r["vLLM"] if r[column] == "same" else r[column]
            said = set().union(*(family_names(r[column]) for r in rows))
            unserved = [r for r in rows if r[column].startswith("not served")]
            absent = set().union(*(family_names(r["vLLM"]) for r in unserved))
            assert served == said, f"{path.name}: served {sorted(served)}, says {sorted(said)}"
            assert unserved and absent, f"{path.name}: no row says what SGLang lacks"
            assert not served & absent, f"{path.name} says not served: {served & absent}"
        # And it reads as SGLang's own: the picker's built-in sglang names, SGLang's usage.
        got = picker.extract(body, "sglang")
        assert got["block_size"] == 1 and got["num_blocks"] == 256 and got["usage"] > 0
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(30)
        writer.terminate()
        writer.wait(60)
        shutil.rmtree(shm, ignore_errors=True)
