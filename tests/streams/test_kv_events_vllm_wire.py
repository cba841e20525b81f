"""The sidecar's KV-event payloads decoded by vLLM's own msgspec classes (vLLM 0.32 and
0.33, the engine environments .ci/run builds), and re-encoded by vLLM's encoder to the
same bytes: what the sidecar sends is what vLLM's own publisher would send for the same
events. Payloads come from the real publisher path (RankPublisher over a real KV-event
segment written by the agent's recorder)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

pytest.importorskip("zmq", reason="pyzmq (the kvevents extra, in the dev set) is missing")

import zmq

from kvsidecar.agent.kv_events import KVEventsRecorder
from kvsidecar.daemon.config import KVEventsOptions
from kvsidecar.protocol.kv_events_writer import KVEventsWriter
from kvsidecar.streams.kv_events_zmq import RankPublisher
from tests.engines.envs import ROOT, engine_python

NAME = "kvevents.vllm.dp0.tp0.pp0"


def payloads(shm_dir: str) -> list[bytes]:
    writer = KVEventsWriter(NAME, n_slots=16, block_size=4, dp_rank=3, shm_dir=shm_dir)
    rec = KVEventsRecorder(writer)
    rec.stored(1, 11, None, [1, 2, 3, 4])  # before the publisher: the full state
    ctx = zmq.Context()
    pub = RankPublisher(NAME, shm_dir, KVEventsOptions("inproc://kv", topic="kv@p@m"), ctx)
    try:
        pub.poll_once()
        rec.stored(2, 12, 11, [5, 6, 7, 8])
        rec.stored(3, (1 << 64) - 5, 12, [9, 10, 11, 12], first=False)  # one event, 2 blocks
        rec.stored(4, 14, None, [1, 1], lora_id=7, lora_name="adapter-a", medium="CPU", group_idx=1)
        rec.removed(2, 12)
        pub.poll_once()
        rec.cleared()
        pub.poll_once()
        pub._publish([], heartbeat=True)
        return [p for _, p in pub._buffer]
    finally:
        pub._close()
        rec.close()
        ctx.term()


@pytest.mark.parametrize("engine", ["vllm", "vllm033"])
def test_vllm_decodes_the_sidecars_stream(shm_dir: str, engine: str) -> None:
    sent = payloads(shm_dir)
    proc = decode_in(engine, sent)
    assert proc["same_value"] == [True] * len(sent)
    if engine == "vllm":  # 0.32, the wire kvsidecar mirrors: byte for byte
        assert proc["same_bytes"] == [True] * len(sent)
    batches = proc["batches"]
    assert [b[0] for b in batches] == [3] * len(sent)  # data_parallel_rank
    events = [e for b in batches for e in b[1]]
    assert [e[0] for e in events] == [
        "AllBlocksCleared", "BlockStored", "BlockStored", "BlockStored", "BlockRemoved",
        "AllBlocksCleared",
    ]  # fmt: skip
    full, run, lora, removed = (e[1] for e in events[1:5])
    assert full["block_hashes"] == [11] and full["parent_block_hash"] is None
    assert full["token_ids"] == [1, 2, 3, 4] and full["block_size"] == 4
    assert run["block_hashes"] == [12, (1 << 64) - 5] and run["parent_block_hash"] == 11
    assert run["token_ids"] == [5, 6, 7, 8, 9, 10, 11, 12] and run["extra_keys"] == [None, None]
    assert run["medium"] == "GPU" and run["group_idx"] == 0 and run["lora_id"] is None
    assert lora["lora_name"] == "adapter-a" and lora["lora_id"] == 7 and lora["medium"] == "CPU"
    assert lora["extra_keys"] == [["adapter-a"]] and lora["block_size"] == 2
    assert lora["group_idx"] == 1
    assert removed == {
        "type": "BlockRemoved",
        "block_hashes": [12],
        "medium": "GPU",
        "group_idx": 0,
    }
    assert batches[-1][1] == []  # the idle heartbeat: an empty batch


def decode_in(engine: str, sent: list[bytes]) -> dict:
    """tests/streams/vllm_decode.py in the engine's environment, the payloads on stdin."""
    env = {**os.environ}
    env.pop("VIRTUAL_ENV", None)
    proc = subprocess.run(
        [engine_python(engine), "tests/streams/vllm_decode.py"],
        input=json.dumps([p.hex() for p in sent]),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
