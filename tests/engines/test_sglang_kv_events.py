"""KV events from the sidecar against SGLang's own publisher, on the real SGLang 0.5.23 server.

One server (CPU, dummy weights, pages of 16 tokens, 768 token slots) runs with BOTH
streams: SGLang's own ZMQ publisher (``--kv-events-config``, the reference) and the agent's
KV-event segment (``KVSIDECAR_KV_EVENTS=1``, the radix cache's recorder hooked by
agent/engines/sglang_kv_events.py) published by ``kvsidecar serve --kv-events.*``. A
prefix-heavy workload (three shared 96-token prefixes, a suffix per prompt) caches more than
the pool holds, so the radix cache evicts; one ``/flush_cache`` resets it. Then:

* both streams, decoded with SGLang's own msgspec classes (sglang_helpers/kv_decode.py in
  the SGLang env), carry the same blocks with equal fields in the same order: each
  BlockStored block (hash, parent, its page's token ids, block_size, lora_id, medium,
  lora_name, cache_salt, session_id), each removed hash, each AllBlocksCleared. Compared
  block by block: the documented differences (docs/kv-events.md) are batch boundaries,
  how blocks group into events, and ``ts``; the hashes are SGLang's signed form on both;
* a consumer applying the sidecar's stream (tests/support/kv_consumer.py, joined before
  the workload) and one joining late hold exactly the hashes SGLang's stream says are
  cached.

SGLang runs its Python tree core (``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python``): its
default Rust core queues its events inside Rust, where no hook reaches. With the hook broken
on purpose (``SGLangKVEvents.removed`` returning at once) this test fails: the sidecar's
stream never carries SGLang's blocks (checked by hand, 2026-12-06). One server start (20-90
s on a 2-core host); the whole test about 3-4 minutes there.
"""

from __future__ import annotations

import json

import pytest

from kvsidecar.bench import fleet
from kvsidecar.bench import sglang as sb
from kvsidecar.bench import vllm as vb
from tests.engines import sglang_server as ss
from tests.engines.envs import ROOT, engine_python
from tests.engines.test_vllm_kv_events import (
    applied,
    kinds,
    late_joiner,
    prompts,
    replay,
    run_pumping,
    start_kv_daemon,
    stop_all,
)
from tests.engines.test_vllm_kv_events import decode as vllm_decode
from tests.support.kv_consumer import Consumer
from tests.support.procs import wait_for

pytestmark = pytest.mark.timeout(900)

DECODE = ROOT / "tests" / "engines" / "sglang_helpers" / "kv_decode.py"
PAGE = 16
MAX_TOTAL = 768  # 48 pages: the rounds below cache more, so the radix cache evicts
# SGLang's Python tree core: the Rust one (SGLang's default) queues its events inside
# Rust, where no hook reaches (docs/kv-events.md, Limits).
PYTHON_TREE = {"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python"}


def decode(python: str, payloads: list[bytes]) -> list[list]:
    """The events of these batches, in order, as SGLang's own classes decode them."""
    return vllm_decode(python, payloads, DECODE)


def per_block(events: list[list]) -> list[tuple]:
    """The events one block at a time, every field SGLang's classes decode but the
    grouping: ("stored", hash, parent, token ids, block_size, lora_id, medium, lora_name,
    cache_salt, session_id), ("removed", hash, medium), ("cleared",)."""
    out: list[tuple] = []
    for kind, f in events:
        if kind == "BlockStored":
            n, parent = f["block_size"], f.get("parent_block_hash")
            for i, h in enumerate(f["block_hashes"]):
                tokens = f["token_ids"][i * n : (i + 1) * n]
                rest = tuple(f.get(k) for k in ("lora_id", "medium", "lora_name"))
                salt = (f.get("cache_salt"), f.get("session_id"))
                out.append(("stored", h, parent, tokens, n, *rest, *salt))
                parent = h
        elif kind == "BlockRemoved":
            out.extend(("removed", h, f.get("medium")) for h in f["block_hashes"])
        else:
            out.append(("cleared",))
    return out


def settled(python: str, sglang_replay: int, side_replay: int, dump):
    """Both streams once neither changed between two reads a second apart (the sidecar
    reads the segment every 10 ms): (SGLang's events, the sidecar's); written to ``dump``."""
    got: dict[str, list] = {}

    def steady() -> bool:
        theirs, ours = replay(sglang_replay), replay(side_replay)
        if theirs is None or ours is None:
            return False
        now = {"sglang": decode(python, theirs), "side": decode(python, ours)}
        same = now == got
        got.update(now)
        return same and len(per_block(now["side"])) >= len(per_block(now["sglang"]))

    ok = wait_for(steady, 120, 1.0)
    dump.write_text(json.dumps(got))
    assert ok, {k: len(v) for k, v in got.items()}
    return got["sglang"], got["side"]


def test_sidecar_stream_equals_sglangs_own_publisher_and_its_consumers_hold_sglangs_blocks(
    tmp_path,
):
    python = engine_python("sglang")
    if (problem := ss.standin_problem(python)) is not None:
        pytest.fail(problem)
    shm = tmp_path / "shm"
    shm.mkdir()
    port, g_pub, g_replay, s_pub, s_replay = range(fleet.free_port_run(5), 0x10000)[:5]
    kv_config = {
        "publisher": "zmq",
        "endpoint": f"tcp://*:{g_pub}",
        "replay_endpoint": f"tcp://*:{g_replay}",
        "topic": "sglang",
    }
    cmd = sb.server_command(python, ss.model_dir(tmp_path / "model"), port, MAX_TOTAL)
    cmd[cmd.index("--page-size") + 1] = str(PAGE)
    cmd += ["--kv-events-config", json.dumps(kv_config)]
    daemon = start_kv_daemon(shm, s_pub, s_replay, tmp_path / "daemon.log")
    server = None
    consumers: list[Consumer] = []
    try:
        env = sb.server_env(shm, KVSIDECAR_KV_EVENTS="1", **PYTHON_TREE)
        server = vb.start_server(cmd, env, tmp_path / "server.log", timeout=420)
        assert wait_for(lambda: replay(s_replay, wait_s=2.0) is not None, 60, 0.5)
        live = Consumer(s_pub, s_replay)
        consumers.append(live)
        live.join()

        for round_ in range(4):
            run_pumping([live], sb.generate, port, prompts(round_, 8), 8)
            if round_ == 0:  # idle now: SGLang's flush resets the radix cache
                ss.post(port, "/flush_cache", {})

        theirs, ours = settled(python, g_replay, s_replay, tmp_path / "streams.json")
        counts = kinds(theirs)
        print("SGLang's events:", counts, "sidecar's:", kinds(ours))
        a, b = per_block(theirs), per_block(ours)
        stored = sum(1 for e in a if e[0] == "stored")
        removed = sum(1 for e in a if e[0] == "removed")
        assert stored >= MAX_TOTAL // PAGE + 10 and removed >= 10, (stored, removed)  # evicted
        # SGLang's stream starts with its radix cache's reset at start-up, the sidecar's
        # with its state when it attached (empty): both one AllBlocksCleared; then the
        # flush's. Block by block: equal fields, the same order.
        assert a[0] == b[0] == ("cleared",) and a.count(("cleared",)) == 2
        for i, (x, y) in enumerate(zip(b, a)):
            assert x == y, (i, x, y)
        assert b == a
        # Batches differ: SGLang sends one BlockRemoved per evicted node (several pages),
        # coalesced with the next; the sidecar one per page.
        assert kinds(ours)["BlockRemoved"] == removed > kinds(theirs)["BlockRemoved"]
        # SGLang's hash form (signed 64-bit) on both: about half the hashes are negative.
        assert any(e[1] < 0 for e in a if e[0] == "stored")
        truth = applied(theirs)
        assert truth, "blocks stay cached after the workload"

        late_joiner(live, consumers, s_pub, s_replay, truth)
    finally:
        stop_all(consumers, server, daemon, ss.stop)
