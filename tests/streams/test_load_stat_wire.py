"""kvsidecar's LoadStat against SGLang 0.5.23's own class, in SGLang's environment: the same
bytes for the same values (every field, None and 0 and large counts), the same topic, and
SGLang's decoder reads ours. Skips without the SGLang env (`bash .ci/engine-env sglang`)."""

from __future__ import annotations

import json
import os
import subprocess

import msgspec
import pytest

from kvsidecar.protocol.schema import KVCachePoolSnapshot, RuntimeSnapshot, Snapshot
from kvsidecar.streams.load_stat_wire import LOAD_TOPIC, LoadStat, encode, load_stat
from tests.engines.envs import engine_python

pytestmark = pytest.mark.timeout(300)

FIELDS = list(LoadStat.__struct_fields__)
CASES = [
    [0, 0, 0, 0, None, 0, 0, 0, 0, 0],
    [1, 2, 3, 4, 0, 0, 0, 0, 0, 0],
    [7, 130, 65_535, 2**31, 3, 11, 4_000_000_000, 256, 2**40, 2**62],
]

_SGLANG = """
import json, sys, msgspec
from sglang.srt.managers.scheduler_components.load_publisher import LoadStat, _encoder
from sglang.srt.disaggregation.kv_events import LOAD_TOPIC
fields, cases, ours = json.loads(sys.stdin.read())
out = {"topic": LOAD_TOPIC, "fields": list(LoadStat.__struct_fields__), "bytes": [],
       "decoded": []}
for case in cases:
    out["bytes"].append(_encoder.encode(LoadStat(**dict(zip(fields, case)))).hex())
dec = msgspec.msgpack.Decoder(LoadStat)
for payload in ours:
    s = dec.decode(bytes.fromhex(payload))
    out["decoded"].append([getattr(s, f) for f in fields])
print(json.dumps(out))
"""


def test_same_bytes_as_sglangs_own_publisher():
    python = engine_python("sglang", runs_checkout=False)
    ours = [encode(LoadStat(**dict(zip(FIELDS, case)))).hex() for case in CASES]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run(
        [python, "-c", _SGLANG],
        input=json.dumps([FIELDS, CASES, ours]),
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        cwd="/",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert theirs["fields"] == FIELDS
    assert theirs["topic"].encode() == LOAD_TOPIC
    assert theirs["bytes"] == ours
    assert theirs["decoded"] == CASES


def _snapshot(engine: str, pools: list[tuple[int, int, int]]) -> Snapshot:
    return Snapshot(
        runtime=RuntimeSnapshot(engine=engine, dp_rank=2, requests_running=5, requests_waiting=6),
        pools=[
            KVCachePoolSnapshot(
                block_size_tokens=bs,
                total_blocks=total,
                allocated_blocks=used,
                available_blocks=total - used,
            )
            for total, used, bs in pools
        ],
    )


def test_from_a_snapshot_per_engine():
    one = [(1000, 250, 16)]
    for engine in ("vllm", "sglang", "atom", "kvsidecar-demo"):
        s = load_stat(_snapshot(engine, one))
        assert (s.num_running_reqs, s.num_waiting_reqs, s.attn_dp_rank) == (5, 6, 2)
        assert (s.num_tokens, s.max_total_num_tokens) == (4000, 16000)
    # SGLang's fullest pool (get_kv_token_stats: max of its full and SWA pools); vLLM's
    # pools summed (one BlockPool).
    two = [(1000, 100, 1), (200, 150, 1)]
    s = load_stat(_snapshot("sglang", two))
    assert (s.num_tokens, s.max_total_num_tokens) == (150, 200)
    s = load_stat(_snapshot("vllm", two))
    assert (s.num_tokens, s.max_total_num_tokens) == (250, 1200)
    # No pool with a size: capacity 0 (SGLang's "unknown"); a picker then skips the usage.
    s = load_stat(_snapshot("vllm", []))
    assert (s.num_tokens, s.max_total_num_tokens) == (0, 0)
    assert msgspec.msgpack.decode(encode(s))[:5] == ["LoadStat", 5, 6, 0, 0]
